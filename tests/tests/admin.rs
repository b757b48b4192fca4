//! The operator page's JSON API on every backend: what it shows of a running cluster, paging through
//! FAILED records, payloads only when enabled, and who may requeue, skip and purge.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use common::*;
use outbox_cluster::admin::{Admin, AdminConfig, FailedPage, PartitionView, StatusView};
use outbox_core::operator::FAILED_PAGE_PAYLOAD_BYTES;
use outbox_core::{HandlerError, Handlers, NewRecord, Route, handler_fn};
use serde_json::Value;
use tower::ServiceExt;

every_backend!(
    the_page_shows_the_cluster_its_backlog_and_delivered_counts,
    failed_records_page_by_position_without_gaps_or_repeats,
    payloads_are_listed_only_when_enabled,
    mutations_need_a_configured_token_and_act,
    a_change_that_fails_is_logged_with_who_asked_for_what,
    without_tokens_the_page_is_read_only,
    the_router_serves_under_a_path_of_the_service,
    an_instance_registered_again_counts_its_deliveries_from_zero,
);

// Table locks: a server's.
on_backends!(
    [postgres, mysql]
    a_backlog_read_given_up_is_not_started_again_at_once,
);

const TOKEN: &str = "ops-token-0123456789";

fn with_token() -> AdminConfig {
    AdminConfig { tokens: BTreeMap::from([("ops".into(), TOKEN.into())]), ..AdminConfig::default() }
}

fn router(outbox: &outbox_core::Outbox, db: &TestDb, config: AdminConfig) -> Router {
    Admin::new(outbox.clone(), db, config).unwrap().router()
}

/// One request through the router; the status and the JSON body (`Null` when not JSON).
async fn call(
    router: &Router,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let body = match body {
        Some(json) => {
            request = request.header(header::CONTENT_TYPE, "application/json");
            Body::from(json.to_string())
        }
        None => Body::empty(),
    };
    let response = router.clone().oneshot(request.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

async fn get<T: serde::de::DeserializeOwned>(router: &Router, uri: &str) -> T {
    let (status, body) = call(router, "GET", uri, None, None).await;
    assert_eq!(status, StatusCode::OK, "GET {uri}: {body}");
    serde_json::from_value(body).unwrap()
}

/// `n` records of keys `bad-0…`, marked FAILED by hand (no processor runs), with payloads "payload of bad-i".
async fn failed_records(outbox: &outbox_core::Outbox, db: &TestDb, n: usize) {
    failed_records_over(outbox, db, n, n).await;
}

/// `n` records over `keys` keys `bad-0…` (record i of key `bad-{i % keys}`), marked FAILED.
async fn failed_records_over(outbox: &outbox_core::Outbox, db: &TestDb, n: usize, keys: usize) {
    let record = |i: usize| {
        let key = format!("bad-{}", i % keys);
        NewRecord::new(key.clone(), "order.paid", format!("payload of {key}"))
    };
    commit(outbox, db, (0..n).map(record).collect()).await;
    exec!(db, "UPDATE {s}records SET failed_at = {now}, last_error = 'broker said no' WHERE key LIKE 'bad-%'");
}

async fn the_page_shows_the_cluster_its_backlog_and_delivered_counts(db: TestDb) {
    let outbox = outbox(&db, |c| c.retry.max_retries = 0).await;
    let fail_bad = handler_fn(|record| async move {
        if record.key.starts_with("bad") { Err(HandlerError::permanent("refused")) } else { Ok(()) }
    });
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(fail_bad))).await;
    let mut records: Vec<NewRecord> = (0..20).map(|i| NewRecord::new(format!("good-{i}"), "t", "")).collect();
    records.extend((0..3).map(|i| NewRecord::new(format!("bad-{i}"), "t", "")));
    commit(&outbox, &db, records).await;
    wait_failed(&db, 3).await;
    drained(&db, LONG).await;

    let admin = router(&outbox, &db, AdminConfig::default());
    // The instance reports its deliveries with its next heartbeat; the page reads at most once a second.
    wait_for("the heartbeat reports 20 deliveries", LONG, || async {
        let status: StatusView = get(&admin, "/api/status").await;
        status.instances.first().is_some_and(|i| i.instance.delivered == 20)
    })
    .await;
    let status: StatusView = get(&admin, "/api/status").await;
    assert!(status.read_only);
    assert_eq!(status.instances.len(), 1);
    let me = &status.instances[0].instance;
    assert_eq!((me.id, me.name.as_str(), me.live, me.draining, me.partitions), (node.id(), "test", true, false, 256));
    assert!((0..60_000).contains(&me.heartbeat_age_ms), "{me:?}");
    assert_eq!((status.backlog.pending, status.backlog.failed), (0, 3));
    assert!(!status.history.is_empty());

    let partitions: Vec<PartitionView> = get(&admin, "/api/partitions").await;
    assert_eq!(partitions.len(), 256);
    assert!(partitions.iter().enumerate().all(|(i, p)| usize::from(p.partition) == i));
    assert!(partitions.iter().all(|p| p.owner == Some(node.id()) && p.owner_name.as_deref() == Some("test")));
    assert_eq!(partitions.iter().map(|p| p.failed).sum::<i64>(), 3);
    let bad0 = &partitions[usize::from(outbox_core::partition_of("bad-0"))];
    assert!(bad0.failed >= 1);

    // A backlog shows per partition, with its age (no node left to deliver it).
    node.kill();
    exec!(db, "UPDATE {s}records SET failed_at = NULL, created_at = {ago:120} WHERE key = 'bad-0'");
    let admin = router(&outbox, &db, AdminConfig::default());
    let partitions: Vec<PartitionView> = get(&admin, "/api/partitions").await;
    let bad0 = &partitions[usize::from(outbox_core::partition_of("bad-0"))];
    assert!(bad0.pending >= 1 && bad0.oldest_pending_ms.unwrap() >= 120_000, "{bad0:?}");
    assert!(partitions.iter().all(|p| p.quiet_ms.is_none()), "none taken over");

    // A partition in its quiet period shows what is left of it.
    exec!(db, "UPDATE {s}partitions SET quiet_until = {ago:-60} WHERE partition = 7");
    let admin = router(&outbox, &db, AdminConfig::default());
    let partitions: Vec<PartitionView> = get(&admin, "/api/partitions").await;
    let quiet: Vec<(u8, bool)> =
        partitions.iter().filter_map(|p| Some((p.partition, (50_000..=60_000).contains(&p.quiet_ms?)))).collect();
    assert_eq!(quiet, [(7, true)]);
}

async fn failed_records_page_by_position_without_gaps_or_repeats(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    // Keys of 4 or 5 records: pages of 7 end inside a key, so the position's seq matters.
    failed_records_over(&outbox, &db, 25, 6).await;
    let admin = router(&outbox, &db, AdminConfig::default());
    let mut seen = Vec::new();
    let mut uri = "/api/failed?limit=7".to_string();
    loop {
        let page: FailedPage = get(&admin, &uri).await;
        assert!(page.records.len() <= 7);
        assert!(page.records.iter().all(|r| r.payload.is_none() && r.payload_base64.is_none()));
        seen.extend(page.records.iter().map(|r| (r.record.partition, r.record.key.clone(), r.record.seq)));
        let Some(next) = page.next else { break };
        // Records before the page resolved meanwhile must not shift what comes next.
        let first = &page.records[0].record;
        outbox.skip(&db, first.id).await.unwrap();
        uri = format!(
            "/api/failed?limit=7&after_partition={}&after_key={}&after_seq={}",
            next.partition, next.key, next.seq
        );
    }
    assert_eq!(seen.len(), 25);
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(seen, sorted, "in (partition, key, seq) order, each once");
    assert_eq!(failed_count(&db).await, 25 - 3, "one skipped per page but the last");

    let page: FailedPage = get(&admin, "/api/failed?key=bad-5").await;
    let seqs: Vec<i64> = page.records.iter().map(|r| r.record.seq).collect();
    assert!(page.records.iter().all(|r| r.record.key == "bad-5") && seqs.len() >= 3, "{page:?}");
    assert!(seqs.is_sorted(), "{seqs:?}");
    assert_eq!(page.records[0].record.last_error.as_deref(), Some("broker said no"));
    let p = outbox_core::partition_of("bad-5");
    let page: FailedPage = get(&admin, &format!("/api/failed?partition={p}")).await;
    assert!(page.records.iter().all(|r| r.record.partition == p) && !page.records.is_empty());

    for bad in [
        "/api/failed?limit=0",
        "/api/failed?limit=1001",
        "/api/failed?after_partition=3",
        "/api/failed?after_partition=0&after_key=%00&after_seq=0",
        "/api/failed?after_partition=0&after_key=&after_seq=0",
        "/api/failed?limit=abc",
        "/api/failed?partition=300",
    ] {
        let (status, body) = call(&admin, "GET", bad, None, None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
        assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()), "{bad}: {body}");
    }
}

/// Payloads are listed only when enabled, and then only to a request with a token that asks for them:
/// an open page refreshes its FAILED records every 2 s, and with a token typed in it read (and logged
/// the read of) a page of payloads at each refresh.
async fn payloads_are_listed_only_when_enabled(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    failed_records(&outbox, &db, 2).await;
    commit(&outbox, &db, vec![NewRecord::new("bin", "t", vec![0xff_u8, 0x00, 0xfe])]).await;
    exec!(db, "UPDATE {s}records SET failed_at = {now} WHERE key = 'bin'");
    let read_only = router(&outbox, &db, AdminConfig::default());
    let hidden: FailedPage = get(&read_only, "/api/failed").await;
    assert_eq!(hidden.records.len(), 3);
    let (status, body) = call(&read_only, "GET", "/api/failed", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::OK, "a read-only page ignores a token a browser kept: {body}");
    assert!(hidden.records.iter().all(|r| r.payload.is_none() && r.payload_base64.is_none()));
    let shown = router(&outbox, &db, AdminConfig { show_payloads: true, ..with_token() });
    let status: StatusView = get(&shown, "/api/status").await;
    assert!(status.show_payloads);
    let anyone: FailedPage = get(&shown, "/api/failed").await;
    assert_eq!(anyone.records.len(), 3);
    assert!(
        anyone.records.iter().all(|r| r.payload.is_none() && r.payload_base64.is_none()),
        "payloads go only to a request with a token"
    );
    let (status, body) = call(&shown, "GET", "/api/failed", Some("ops-token-0123456780"), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "a token that is not configured is refused: {body}");
    let (status, body) = call(&shown, "GET", "/api/failed", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let unasked: FailedPage = serde_json::from_value(body).unwrap();
    assert_eq!(unasked.records.len(), 3);
    assert!(
        unasked.records.iter().all(|r| r.payload.is_none() && r.payload_base64.is_none()),
        "payloads go only to a request that asks for them"
    );
    let anyone: FailedPage = get(&shown, "/api/failed?payloads=true").await;
    assert!(anyone.records.iter().all(|r| r.payload.is_none()), "asking is not enough without a token");
    let request = Request::get("/api/failed?payloads=true").header(header::AUTHORIZATION, format!("Bearer {TOKEN}"));
    let response = shown.clone().oneshot(request.body(Body::empty()).unwrap()).await.unwrap();
    let cache = response.headers().get(header::CACHE_CONTROL).map(|v| v.to_str().unwrap().to_string());
    assert_eq!(cache.as_deref(), Some("no-store"), "payloads stay out of the browser's cache");
    let (status, body) = call(&shown, "GET", "/api/failed?payloads=true", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let page: FailedPage = serde_json::from_value(body).unwrap();
    assert_eq!(page.records.len(), 3);
    for r in &page.records {
        if r.record.key == "bin" {
            assert_eq!((r.payload.as_deref(), r.payload_base64.as_deref()), (None, Some("/wD+")), "not UTF-8: base64");
        } else {
            assert_eq!(r.payload.as_deref(), Some(format!("payload of {}", r.record.key).as_str()));
            assert!(!format!("{r:?}").contains("payload of"), "Debug leaves the payload out");
        }
    }

    // A page of payloads ends at their byte budget, and says where the next one starts.
    let mib = vec![b'x'; 1024 * 1024];
    commit(&outbox, &db, (0..5).map(|_| NewRecord::new("large", "t", mib.clone())).collect()).await;
    exec!(db, "UPDATE {s}records SET failed_at = {now} WHERE key = 'large'");
    let (mut seen, mut uri, mut pages) = (0, "/api/failed?key=large&payloads=true".to_string(), Vec::new());
    loop {
        let (status, body) = call(&shown, "GET", &uri, Some(TOKEN), None).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let page: FailedPage = serde_json::from_value(body).unwrap();
        let bytes: usize = page.records.iter().map(|r| r.payload.as_ref().map_or(0, String::len)).sum();
        assert!(bytes <= FAILED_PAGE_PAYLOAD_BYTES, "{bytes}");
        seen += page.records.len();
        pages.push(page.records.len());
        let Some(next) = page.next else { break };
        uri = format!(
            "/api/failed?key=large&payloads=true&after_partition={}&after_key=large&after_seq={}",
            next.partition, next.seq
        );
    }
    assert_eq!((seen, pages), (5, vec![4, 1]), "every record once, four MiB to a page");
}

async fn mutations_need_a_configured_token_and_act(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    failed_records(&outbox, &db, 4).await;
    let admin = router(&outbox, &db, with_token());
    let page: FailedPage = get(&admin, "/api/failed").await;
    let (first, second) = (&page.records[0].record, &page.records[1].record);
    let requeue = format!("/api/failed/{}/requeue", first.id);

    let (status, body) = call(&admin, "POST", &requeue, None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "no token: {body}");
    let (status, body) = call(&admin, "POST", &requeue, Some(""), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "an empty token is none: {body}");
    let (status, body) = call(&admin, "POST", &requeue, Some("ops-token-0123456780"), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "wrong token: {body}");
    // What axum cannot read is refused in the API's JSON too, with axum's status.
    for (uri, body, expected) in [
        (format!("/api/failed/{}/delete", first.id), None, StatusCode::BAD_REQUEST),
        ("/api/failed/not-a-uuid/requeue".into(), None, StatusCode::BAD_REQUEST),
        ("/api/requeue".into(), Some(serde_json::json!({ "key": 5 })), StatusCode::UNPROCESSABLE_ENTITY),
        ("/api/requeue".into(), Some(serde_json::json!({ "keys": ["a"] })), StatusCode::UNPROCESSABLE_ENTITY),
        ("/api/requeue".into(), None, StatusCode::UNSUPPORTED_MEDIA_TYPE),
    ] {
        let (status, answer) = call(&admin, "POST", &uri, Some(TOKEN), body).await;
        assert_eq!(status, expected, "{uri}: {answer}");
        assert!(answer["error"].as_str().is_some_and(|e| !e.is_empty()), "{uri}: {answer}");
    }
    assert_eq!(failed_count(&db).await, 4, "refused requests change nothing");

    let (status, body) = call(&admin, "POST", &requeue, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(failed_count(&db).await, 3);
    let (status, body) = call(&admin, "POST", &requeue, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "no longer FAILED: {body}");

    let (status, body) = call(&admin, "POST", &format!("/api/failed/{}/skip", second.id), Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(count(&db, &format!("SELECT count(*) FROM {{s}}records WHERE key = '{}'", second.key)).await, 0);

    let key = page.records[2].record.key.clone();
    let (status, body) =
        call(&admin, "POST", "/api/requeue", Some(TOKEN), Some(serde_json::json!({ "key": key }))).await;
    assert_eq!((status, body["requeued"].as_u64()), (StatusCode::OK, Some(1)), "{body}");
    assert_eq!(failed_count(&db).await, 1);
    for bad in
        [serde_json::json!({}), serde_json::json!({ "key": "bad-3", "all": true }), serde_json::json!({ "key": "" })]
    {
        let (status, body) = call(&admin, "POST", "/api/requeue", Some(TOKEN), Some(bad.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    assert_eq!(failed_count(&db).await, 1);
    exec!(db, "UPDATE {s}records SET failed_at = {now}");
    let (status, body) =
        call(&admin, "POST", "/api/requeue", Some(TOKEN), Some(serde_json::json!({ "all": true }))).await;
    assert_eq!((status, body["requeued"].as_u64()), (StatusCode::OK, Some(3)), "every FAILED one: {body}");
    assert_eq!(failed_count(&db).await, 0);

    let (status, body) =
        call(&admin, "POST", "/api/purge", Some(TOKEN), Some(serde_json::json!({ "older_than": "soon" }))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let (status, body) =
        call(&admin, "POST", "/api/purge", Some(TOKEN), Some(serde_json::json!({ "older_than": "200y" }))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "an age past the limit is the request's fault: {body}");
    assert!(body["error"].as_str().unwrap().contains("100 years"), "{body}");
    let (status, body) =
        call(&admin, "POST", "/api/purge", Some(TOKEN), Some(serde_json::json!({ "older_than": "1h" }))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["purged"].as_u64(), Some(0), "the skipped record is younger than an hour: {body}");
    exec!(db, "UPDATE {s}completed SET completed_at = {ago:7200}");
    let (status, body) =
        call(&admin, "POST", "/api/purge", Some(TOKEN), Some(serde_json::json!({ "older_than": "1h" }))).await;
    assert_eq!((status, body["purged"].as_u64()), (StatusCode::OK, Some(1)), "two hours old: {body}");
    assert_eq!(count(&db, "SELECT count(*) FROM {s}completed").await, 0);
}

/// A change the database fails answers 503 without the detail, which the log gives: the token's
/// name and the record or key asked for, beside the database's error.
async fn a_change_that_fails_is_logged_with_who_asked_for_what(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    failed_records(&outbox, &db, 1).await;
    let admin = router(&outbox, &db, with_token());
    let page: FailedPage = get(&admin, "/api/failed").await;
    let record = &page.records[0].record;
    let gone = if db.db.backend() == "postgres" { "records_gone" } else { "outbox_records_gone" };
    db.exec(&format!("ALTER TABLE {{s}}records RENAME TO {gone}"), &[]).await;
    let logs = Captured::start("outbox_cluster=warn");

    let (status, body) = call(&admin, "POST", &format!("/api/failed/{}/skip", record.id), Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let requeue = serde_json::json!({ "key": record.key });
    let (status, body) = call(&admin, "POST", "/api/requeue", Some(TOKEN), Some(requeue)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let logged = logs.text();
    let lines: Vec<&str> = logged.lines().filter(|l| l.contains("admin request failed")).collect();
    assert_eq!(lines.len(), 2, "{logged}");
    assert!(lines[0].contains("token ops") && lines[0].contains(&record.id.to_string()), "{logged}");
    assert!(lines[1].contains("token ops") && lines[1].contains(&format!("{:?}", record.key)), "{logged}");
    assert!(!body.to_string().contains("ops"), "the detail stays in the log: {body}");
}

async fn without_tokens_the_page_is_read_only(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    failed_records(&outbox, &db, 1).await;
    let admin = router(&outbox, &db, AdminConfig::default());
    let page: FailedPage = get(&admin, "/api/failed").await;
    for (uri, body) in [
        (format!("/api/failed/{}/requeue", page.records[0].record.id), None),
        (format!("/api/failed/{}/skip", page.records[0].record.id), None),
        ("/api/requeue".into(), Some(serde_json::json!({ "key": "bad-0" }))),
        ("/api/purge".into(), Some(serde_json::json!({ "older_than": "0s" }))),
    ] {
        let (status, reply) = call(&admin, "POST", &uri, Some(TOKEN), body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{uri}: {reply}");
        assert!(reply["error"].as_str().unwrap().contains("read-only"), "{uri}: {reply}");
    }
    assert_eq!(failed_count(&db).await, 1);
    let (status, _) = call(&admin, "GET", "/", None, None).await;
    assert_eq!(status, StatusCode::OK);
}

/// A service mounts the page under its own path; the page and its API answer there (the page addresses
/// the API relative to itself).
async fn the_router_serves_under_a_path_of_the_service(db: TestDb) {
    let outbox = outbox(&db, hourly).await;
    failed_records(&outbox, &db, 1).await;
    let service = Router::new().nest("/ops/outbox", router(&outbox, &db, with_token()));
    let (status, _) = call(&service, "GET", "/ops/outbox", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let status: StatusView = get(&service, "/ops/outbox/api/status").await;
    assert_eq!((status.read_only, status.backlog.failed), (false, 1));
    let page: FailedPage = get(&service, "/ops/outbox/api/failed").await;
    let skip = format!("/ops/outbox/api/failed/{}/skip", page.records[0].record.id);
    assert_eq!(call(&service, "POST", &skip, Some(TOKEN), None).await.0, StatusCode::OK);
    assert_eq!(failed_count(&db).await, 0);
    assert_eq!(call(&service, "GET", "/api/status", None, None).await.0, StatusCode::NOT_FOUND, "only under its path");
}

/// The delivered count is per instance id: one declared dead and registered again must not report the
/// process's earlier deliveries under its new id (the page would show them as a burst of delivered/s).
async fn an_instance_registered_again_counts_its_deliveries_from_zero(db: TestDb) {
    let outbox = outbox(&db, |_| {}).await;
    let ok = handler_fn(|_| async { Ok::<(), HandlerError>(()) });
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(ok))).await;
    commit(&outbox, &db, (0..10).map(|i| NewRecord::new(format!("k{i}"), "t", "")).collect()).await;
    drained(&db, LONG).await;
    let instance = |id| {
        let (outbox, db) = (outbox.clone(), db.clone());
        async move {
            let status = outbox_cluster::status(&db, &outbox).await.unwrap();
            status.instances.into_iter().find(|i| i.id == id)
        }
    };
    let first = node.id();
    wait_for("10 deliveries reported", LONG, || async { instance(first).await.is_some_and(|i| i.delivered == 10) })
        .await;
    exec!(db, "UPDATE {s}instances SET expires_at = {ago:1} WHERE id = $1", first);
    wait_for("registered again under a new id", LONG, || async { node.id() != first }).await;
    let again = node.id();
    let registered = instance(again).await.unwrap().heartbeat_at;
    wait_for("a heartbeat under the new id", LONG, || async {
        instance(again).await.is_some_and(|i| i.heartbeat_at > registered)
    })
    .await;
    assert_eq!(instance(again).await.unwrap().delivered, 0);
    node.shutdown().await.unwrap();
}

/// A page reached by a host name it does not know answers nothing (DNS rebinding: another site's name
/// pointed at 127.0.0.1 would let that site read the API from the operator's browser).
#[tokio::test]
async fn only_known_host_names_reach_the_page() {
    let db = TestDb::sqlite().await;
    let outbox = outbox(&db, hourly).await;
    let config = AdminConfig { hosts: vec!["ops.internal".into()], ..AdminConfig::default() };
    let admin = router(&outbox, &db, config);
    let with_host = |host: &'static str| {
        let admin = admin.clone();
        async move {
            let request = Request::get("/api/status").header(header::HOST, host).body(Body::empty()).unwrap();
            admin.oneshot(request).await.unwrap().status()
        }
    };
    for known in
        ["127.0.0.1:9188", "[::1]:9188", "localhost:9188", "LOCALHOST", "ops.internal:80", "ops.internal.", "10.1.2.3"]
    {
        assert_eq!(with_host(known).await, StatusCode::OK, "{known}");
    }
    for unknown in ["attacker.example", "attacker.example:9188", "ops.internal.attacker.example"] {
        assert_eq!(with_host(unknown).await, StatusCode::FORBIDDEN, "{unknown}");
    }
}

#[test]
fn bad_admin_configuration_is_a_typed_error() {
    let config = |name: &str, token: &str| AdminConfig {
        tokens: BTreeMap::from([(name.to_string(), token.to_string())]),
        ..AdminConfig::default()
    };
    let payloads_to_no_one = AdminConfig { show_payloads: true, ..AdminConfig::default() };
    for bad in [
        config("ops", "short"),
        config(" ", TOKEN),
        config("ops", " ops-token-0123456789"),
        config("ops", &"é".repeat(16)),
        payloads_to_no_one,
    ] {
        let e = bad.validate().unwrap_err();
        assert!(matches!(e, outbox_cluster::Error::Config(_)), "{e}");
    }
    let twice = AdminConfig {
        tokens: BTreeMap::from([("a".into(), TOKEN.into()), ("b".into(), TOKEN.into())]),
        ..AdminConfig::default()
    };
    assert!(twice.validate().is_err());
    // A host is a bare name: with a port, a scheme or a path it would never match a request.
    for host in ["ops.example.com:9188", "http://ops.example.com", "ops.example.com/", "", "ops example"] {
        let e = AdminConfig { hosts: vec![host.into()], ..AdminConfig::default() }.validate().unwrap_err();
        assert!(matches!(&e, outbox_cluster::Error::Config(m) if m.contains("hosts")), "{host:?}: {e}");
    }
    AdminConfig {
        hosts: vec!["ops.example.com".into(), "OPS.internal.".into(), "compose_service".into()],
        ..AdminConfig::default()
    }
    .validate()
    .unwrap();
    assert!(with_token().validate().is_ok());
    assert!(!format!("{:?}", with_token()).contains(TOKEN), "Debug hides tokens");
}

const LONG: Duration = Duration::from_secs(60);

/// A backlog read given up at the page's time limit (10 s) goes on in the database, which has no limit
/// of its own for it (it counts every record). The next requests do not start another at once: each
/// piled a count of the whole table onto a database already too slow for one. Here the records table
/// is locked, so the read waits for it.
async fn a_backlog_read_given_up_is_not_started_again_at_once(db: TestDb) {
    let outbox = outbox(&db, |c| {
        hourly(c);
        c.query_timeout = Duration::from_secs(120);
    })
    .await;
    let admin = router(&outbox, &db, AdminConfig::default());
    let lock = db.lock_table("records").await;
    let (status, body) = call(&admin, "GET", "/api/status", None, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(db.table_lock_waiters().await, 1, "the read given up waits on in the database");
    for path in ["/api/status", "/api/partitions"] {
        let (status, body) = call(&admin, "GET", path, None, None).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body["error"].as_str().is_some_and(|e| e.contains("the next is tried in")), "{path}: {body}");
    }
    assert_eq!(db.table_lock_waiters().await, 1, "no second read started");
    lock.release().await;
}
