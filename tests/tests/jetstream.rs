//! JetStream delivery against a real nats-server each test starts on a free port: deduplication,
//! per-key order with random latency, a broker outage, permanent failures with their reasons, stream
//! provisioning, connection errors, and the shared handler conformance suite.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::conformance::{Received, Target};
use common::nats::{NatsServer, free_port};
use common::*;
use outbox_core::{Handler, HandlerError, Handlers, NewRecord, Record, Route, fallback_fn, handler_fn};
use outbox_nats::{Auth, Error as NatsError, JetStreamHandler, NatsConfig, StreamSettings, ensure_stream};
use rand::RngExt;
use sqlx::PgPool;
use tokio::sync::Semaphore;

const LONG: Duration = Duration::from_secs(60);

fn config(server: &NatsServer) -> NatsConfig {
    NatsConfig { servers: vec![server.url()], ..NatsConfig::default() }
}

async fn jetstream(server: &NatsServer) -> (async_nats::Client, JetStreamHandler, NatsConfig) {
    let config = config(server);
    let client = outbox_nats::connect(&config).await.unwrap();
    ensure_stream(&client, &config.stream).await.unwrap();
    let handler = JetStreamHandler::new(client.clone(), &config).unwrap();
    (client, handler, config)
}

/// Every message of the stream, in stream order.
async fn read_stream(client: &async_nats::Client, stream: &str) -> Vec<Received> {
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = js.get_stream(stream).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        if state.messages == 0 {
            break;
        }
        let message = stream.get_raw_message(seq).await.unwrap();
        let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_string());
        let headers: BTreeMap<String, String> =
            message.headers.iter().map(|(k, v)| (k.to_string(), v[0].as_str().to_string())).collect();
        out.push(Received {
            id: header("Nats-Msg-Id").unwrap().parse().unwrap(),
            key: header("Outbox-Key").unwrap(),
            seq: header("Outbox-Seq").unwrap().parse().unwrap(),
            payload: message.payload.to_vec(),
            headers,
        });
    }
    out
}

struct JetStreamTarget {
    client: async_nats::Client,
    handler: JetStreamHandler,
}

impl Target for JetStreamTarget {
    type H = JetStreamHandler;
    fn handler(&self) -> JetStreamHandler {
        self.handler.clone()
    }
    fn dedupes(&self) -> bool {
        true
    }

    async fn received(&self) -> Vec<Received> {
        read_stream(&self.client, "OUTBOX").await
    }
}

#[sqlx::test(migrations = false)]
async fn the_jetstream_handler_passes_the_handler_conformance_suite(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let server = NatsServer::start();
    let (client, handler, _) = jetstream(&server).await;
    let outbox = outbox(&db, |_| {}).await;
    common::conformance::run(&outbox, &db, &JetStreamTarget { client, handler }).await;
}

/// Published, then the worker dies before completing: the next owner publishes again, and the stream
/// keeps one copy (the ack says duplicate, which counts as delivered).
#[sqlx::test(migrations = false)]
async fn a_record_published_twice_after_a_crash_is_stored_once(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let server = NatsServer::start();
    let (client, handler, _) = jetstream(&server).await;
    let outbox = outbox(&db, |_| {}).await;
    commit(&outbox, &db, (0..30).map(|k| NewRecord::new(format!("k{k}"), "t", format!("{k}"))).collect()).await;

    let (published, never) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let (h, p, n) = (handler.clone(), published.clone(), never.clone());
    let hangs_after_publish = handler_fn(move |r| {
        let (h, p, n) = (h.clone(), p.clone(), n.clone());
        async move {
            h.handle(&r).await?;
            p.add_permits(1);
            let _ = n.acquire().await;
            Ok::<(), HandlerError>(())
        }
    });
    let first = start(&outbox, &db, Handlers::new().default_route(Route::new(hangs_after_publish))).await;
    published.acquire_many(30).await.unwrap().forget();
    first.kill();
    assert_eq!(pending(&db).await, 30, "nothing was completed");

    let second = start(&outbox, &db, Handlers::new().default_route(Route::new(handler.clone()))).await;
    drained(&db, LONG).await;
    second.shutdown().await.unwrap();
    let stored = read_stream(&client, "OUTBOX").await;
    assert_eq!(stored.len(), 30, "redeliveries were deduplicated by Nats-Msg-Id");
}

#[sqlx::test(migrations = false)]
async fn each_keys_records_are_in_sequence_order_in_the_stream(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let server = NatsServer::start();
    let (client, handler, _) = jetstream(&server).await;
    let outbox = outbox(&db, |c| c.concurrency = 32).await;
    let keys = 40;
    for _ in 0..10 {
        commit(&outbox, &db, (0..keys).map(|k| NewRecord::new(format!("key-{k}"), "order.event", "{}")).collect())
            .await;
    }
    let h = handler.clone();
    let jittery = handler_fn(move |r| {
        let h = h.clone();
        async move {
            let delay = rand::rng().random_range(0..5);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            h.handle(&r).await
        }
    });
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(jittery))).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    let stored = read_stream(&client, "OUTBOX").await;
    assert_eq!(stored.len(), keys * 10);
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in stored {
        per_key.entry(r.key).or_default().push(r.seq);
    }
    for (key, seqs) in per_key {
        assert_eq!(ranks(&seqs), (1..=10).collect::<Vec<_>>(), "{key}: {seqs:?}");
    }
}

/// Commits one record of each of 20 keys `k0`..`k19`, with `round` as its payload.
async fn produce(outbox: &outbox_core::Outbox, db: &TestDb, round: usize) {
    commit(outbox, db, (0..20).map(|k| NewRecord::new(format!("k{k}"), "t", format!("{round}"))).collect()).await;
}

/// The broker goes away mid-run while the service keeps writing; when it is back, everything arrives,
/// in per-key order, and nothing went to FAILED (the outage is shorter than the retry budget).
#[sqlx::test(migrations = false)]
async fn a_broker_outage_delays_but_loses_nothing(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let mut server = NatsServer::start();
    let (client, handler, _) = jetstream(&server).await;
    let outbox = outbox(&db, |_| {}).await;
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(handler))).await;
    for round in 0..3 {
        produce(&outbox, &db, round).await;
    }
    drained(&db, LONG).await;
    server.stop();
    for round in 3..8 {
        produce(&outbox, &db, round).await;
    }
    // While the broker is down, deliveries fail and wait for their retries.
    wait_for("a failed publish recorded", LONG, || async {
        count(&db, "SELECT count(*) FROM outbox.records WHERE attempts > 0").await > 0
    })
    .await;
    server.restart();
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(failed_count(&db).await, 0);
    let stored = read_stream(&client, "OUTBOX").await;
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &stored {
        per_key.entry(r.key.clone()).or_default().push(r.seq);
    }
    assert_eq!(per_key.len(), 20);
    // Once each, in order: a publish the server stored but whose ack the outage lost is published
    // again and dropped by the stream as a duplicate.
    for (key, seqs) in per_key {
        assert_eq!(ranks(&seqs), (1..=8).collect::<Vec<_>>(), "{key}: {seqs:?}");
    }
}

/// The stream deleted and made again while records are being written (an operator changing its storage,
/// or restoring it): publishes meanwhile fail with "no responders" and are tried again, so everything
/// arrives once the stream is back and nothing goes to FAILED. Before, each was failed permanently as
/// a subject that no stream captures.
#[sqlx::test(migrations = false)]
async fn a_stream_deleted_and_made_again_loses_nothing(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let server = NatsServer::start();
    let (client, handler, config) = jetstream(&server).await;
    let outbox = outbox(&db, |_| {}).await;
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(handler))).await;
    produce(&outbox, &db, 0).await;
    drained(&db, LONG).await;
    async_nats::jetstream::new(client.clone()).delete_stream("OUTBOX").await.unwrap();
    produce(&outbox, &db, 1).await;
    wait_for("a failed publish recorded", LONG, || async {
        count(&db, "SELECT count(*) FROM outbox.records WHERE attempts > 0").await > 0
    })
    .await;
    ensure_stream(&client, &config.stream).await.unwrap();
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    assert_eq!(failed_count(&db).await, 0);
    let stored = read_stream(&client, "OUTBOX").await;
    assert_eq!(stored.len(), 20, "the second round, in the stream made again");
}

/// A server of a cluster that stops answering without closing its connections (a frozen host, a
/// network that drops everything) is left for another in time: every record written meanwhile is
/// delivered with the default retries (82-102 s), none FAILED. The client took a server for dead after
/// three unanswered pings a minute apart; until then every publish waited out its ack timeout.
#[sqlx::test(migrations = false)]
async fn a_server_that_stops_answering_is_left_for_another_of_its_cluster(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let servers = NatsServer::cluster(3);
    let stream = StreamSettings { replicas: 3, ..StreamSettings::default() };
    let config = NatsConfig { servers: servers.iter().map(|s| s.url()).collect(), stream, ..NatsConfig::default() };
    let client = outbox_nats::connect(&config).await.unwrap();
    // The cluster elects its JetStream leader after the servers start.
    let mut ready = Err(NatsError::Config("not tried".into()));
    for _ in 0..60 {
        ready = ensure_stream(&client, &config.stream).await.map(|_| ());
        if ready.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    ready.unwrap();
    let handler = JetStreamHandler::new(client.clone(), &config).unwrap();
    let outbox = outbox(&db, |_| {}).await;
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(handler))).await;
    produce(&outbox, &db, 0).await;
    drained(&db, LONG).await;
    let port = client.server_info().port;
    let frozen = servers.iter().find(|s| s.port == port).expect("connected to one of the cluster");
    frozen.signal("STOP");
    for round in 1..4 {
        produce(&outbox, &db, round).await;
    }
    wait_for("every record delivered", Duration::from_secs(150), || async { pending(&db).await == 0 }).await;
    node.shutdown().await.unwrap();
    assert_ne!(client.server_info().port, port, "the client moved to another server");
    frozen.signal("CONT");
}

/// A payload over the server's max_payload or over its stream's largest message, and a subject no stream
/// captures, are permanent: the record goes to its fallback, or to FAILED with the reason stored.
#[sqlx::test(migrations = false)]
async fn oversized_payloads_and_missing_streams_fail_permanently_with_the_reason(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let server = NatsServer::start_with("max_payload: 4096");
    let config = NatsConfig {
        servers: vec![server.url()],
        subject: "{event_type}".into(),
        stream: StreamSettings { subjects: vec!["orders.>".into()], ..StreamSettings::default() },
        ..NatsConfig::default()
    };
    let client = outbox_nats::connect(&config).await.unwrap();
    ensure_stream(&client, &config.stream).await.unwrap();
    // A stream of the operator's own, whose messages may not be larger than 1 KiB.
    let capped = async_nats::jetstream::stream::Config {
        name: "CAPPED".into(),
        subjects: vec!["billing.capped".into()],
        max_message_size: 1024,
        ..Default::default()
    };
    async_nats::jetstream::new(client.clone()).create_stream(capped).await.unwrap();
    let handler = JetStreamHandler::new(client.clone(), &config).unwrap();
    let outbox = outbox(&db, |_| {}).await;
    let archived = Sink::new();
    let a = archived.clone();
    let handlers = Handlers::new()
        .route("orders.created", Route::new(handler.clone()))
        .route(
            "orders.archived",
            Route::new(handler.clone()).fallback(fallback_fn(move |r, _| {
                let a = a.clone();
                async move {
                    a.record(&r);
                    Ok(())
                }
            })),
        )
        .route("billing.charged", Route::new(handler.clone()))
        .route("billing.capped", Route::new(handler));
    commit(
        &outbox,
        &db,
        vec![
            NewRecord::new("big", "orders.created", vec![7u8; 8192]),
            NewRecord::new("big-with-fallback", "orders.archived", vec![7u8; 8192]),
            NewRecord::new("nowhere", "billing.charged", "{}"),
            NewRecord::new("over-the-stream", "billing.capped", vec![7u8; 2048]),
            NewRecord::new("fine", "orders.created", "{}"),
        ],
    )
    .await;
    let node = start(&outbox, &db, handlers).await;
    wait_failed(&db, 3).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();

    let failed = outbox.failed(&db, &Default::default()).await.unwrap();
    let reason = |key: &str| failed.iter().find(|f| f.key == key).unwrap().last_error.clone().unwrap();
    let big = reason("big");
    assert!(big.starts_with("permanent") && big.contains("max_payload") && big.contains("\"big\""), "{big}");
    let nowhere = reason("nowhere");
    assert!(nowhere.starts_with("permanent") && nowhere.contains("no JetStream stream captures"), "{nowhere}");
    let over = reason("over-the-stream");
    assert!(over.starts_with("permanent") && over.contains("max_msg_size"), "{over}");
    assert_eq!(failed.iter().map(|f| f.attempts).collect::<Vec<_>>(), [1, 1, 1], "permanent errors are not retried");
    assert_eq!(archived.of_key("big-with-fallback").len(), 1);
    let stored = read_stream(&client, "OUTBOX").await;
    assert_eq!(stored.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), ["fine"]);
}

/// A configuration that names a certificate authority asks for TLS: a server that does not offer it is
/// refused, where the client connected in clear (credentials and all) to a server that allowed it.
#[tokio::test]
async fn a_configured_certificate_authority_refuses_a_server_without_tls() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
    let made = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=outbox-test-ca"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let config = NatsConfig { tls: outbox_nats::Tls { ca_file: Some(cert), ..Default::default() }, ..config(&server) };
    let refused = outbox_nats::connect(&config).await;
    assert!(matches!(refused, Err(NatsError::Connect { .. })), "{refused:?}");
    let refused = refused.unwrap_err();
    assert!(!refused.is_transient(), "no retry makes the server offer TLS: {refused:?}");
}

#[tokio::test]
async fn stream_provisioning_creates_checks_and_explains_mismatches() {
    let server = NatsServer::start();
    let config = config(&server);
    let client = outbox_nats::connect(&config).await.unwrap();
    let created = ensure_stream(&client, &config.stream).await.unwrap();
    assert_eq!(created.config.duplicate_window, config.stream.duplicate_window);
    ensure_stream(&client, &config.stream).await.unwrap();
    let different = StreamSettings {
        subjects: vec!["other.>".into()],
        duplicate_window: Duration::from_secs(60),
        ..config.stream.clone()
    };
    match ensure_stream(&client, &different).await {
        Err(NatsError::StreamMismatch { differences, .. }) => {
            assert_eq!(differences.len(), 2, "{differences:?}");
            assert!(differences[0].contains("subjects") && differences[1].contains("duplicate_window"));
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

/// Workers started together all provision the stream: one creates it, and the others, whose create
/// lost the race (nats-server 2.9 answers it with a subject overlap, 10065), find it and check it.
#[tokio::test]
async fn workers_starting_together_all_find_the_stream_one_of_them_created() {
    let server = NatsServer::start();
    let config = config(&server);
    let mut clients = Vec::new();
    for _ in 0..6 {
        clients.push(outbox_nats::connect(&config).await.unwrap());
    }
    for round in 0..200 {
        let settings = StreamSettings {
            name: format!("TOGETHER{round}"),
            subjects: vec![format!("together{round}.>")],
            ..config.stream.clone()
        };
        let tries = clients.iter().map(|client| ensure_stream(client, &settings));
        for result in futures::future::join_all(tries).await {
            let info = result.unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(info.config.name, settings.name);
        }
    }
}

/// Stream settings the server refuses for good are not worth retrying: subjects another stream
/// captures (10065), replicas on a server that is not clustered (10074). A start-up loop that retries
/// what `is_transient` says retried them for ever. A broker out of reach still is worth retrying.
#[tokio::test]
async fn stream_settings_the_server_refuses_are_not_worth_retrying() {
    let server = NatsServer::start();
    let config = config(&server);
    let client = outbox_nats::connect(&config).await.unwrap();
    ensure_stream(&client, &config.stream).await.unwrap();
    let overlapping = StreamSettings { name: "ANOTHER".into(), ..config.stream.clone() };
    let replicated = StreamSettings {
        name: "REPLICATED".into(),
        subjects: vec!["else.>".into()],
        replicas: 3,
        ..config.stream.clone()
    };
    for refused in [overlapping, replicated] {
        let err = ensure_stream(&client, &refused).await.unwrap_err();
        assert!(matches!(err, NatsError::Stream { .. }), "{err:?}");
        assert!(!err.is_transient(), "{err}");
    }
    let mut stopped = server;
    stopped.stop();
    let unanswered = StreamSettings { name: "LATER".into(), subjects: vec!["later.>".into()], ..config.stream.clone() };
    let err = ensure_stream(&client, &unanswered).await.unwrap_err();
    assert!(err.is_transient(), "{err:?}");
}

/// Errors a consumer's message stream reads on after (the broker out of reach) are worth retrying when
/// `apply_once` returns them after a minute in a row; those that end the stream are not.
#[test]
fn message_stream_errors_are_transient_where_they_pass() {
    use async_nats::jetstream::consumer::pull::{MessagesError, MessagesErrorKind as Kind};
    for (kind, transient) in [
        (Kind::MissingHeartbeat, true),
        (Kind::NoResponders, true),
        (Kind::Pull, true),
        (Kind::ConsumerDeleted, false),
        (Kind::PushBasedConsumer, false),
        (Kind::RequestLimitExceeded, false),
    ] {
        assert_eq!(NatsError::Messages(MessagesError::new(kind)).is_transient(), transient, "{kind:?}");
    }
}

#[tokio::test]
async fn connection_errors_are_typed_and_auth_works() {
    let nobody = NatsConfig { servers: vec![format!("nats://127.0.0.1:{}", free_port())], ..NatsConfig::default() };
    match outbox_nats::connect(&nobody).await {
        Err(e @ NatsError::Connect { .. }) => {
            assert!(e.is_transient());
            assert!(e.to_string().contains("cannot connect to NATS at nats://127.0.0.1:"), "{e}");
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
    let server = NatsServer::start_with("authorization { token: \"s3cret\" }");
    let good = NatsConfig { auth: Auth::Token { token: "s3cret".into() }, ..config(&server) };
    let client = outbox_nats::connect(&good).await.unwrap();
    ensure_stream(&client, &good.stream).await.unwrap();
    let wrong = NatsConfig { auth: Auth::Token { token: "guess".into() }, ..config(&server) };
    let err = outbox_nats::connect(&wrong).await.unwrap_err();
    assert!(matches!(err, NatsError::Connect { .. }), "{err:?}");
    assert!(!err.is_transient(), "a refused token is refused again: {err:?}");
    assert!(!format!("{err:?}{err}").contains("guess"), "the token is not shown");
}

#[tokio::test]
async fn published_messages_carry_the_record_headers_and_the_payload_unchanged() {
    let server = NatsServer::start();
    let (client, handler, _) = jetstream(&server).await;
    let record = Record {
        id: uuid::Uuid::now_v7(),
        partition: 9,
        key: "o-1".into(),
        seq: 3,
        event_type: "order.paid".into(),
        payload: bytes::Bytes::from_static(b"\x00\x01binary"),
        headers: [("traceparent".to_string(), "00-abc-def-01".to_string())].into(),
        attempts: 0,
        created_at: chrono::Utc::now(),
        deliver_at: None,
        epoch: outbox_core::Epoch(4),
    };
    handler.handle(&record).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let message = js.get_stream("OUTBOX").await.unwrap().get_raw_message(1).await.unwrap();
    assert_eq!(message.subject.as_str(), "outbox.order.paid");
    assert_eq!(message.payload.as_ref(), b"\x00\x01binary");
    let h = |name: &str| message.headers.get(name).unwrap().as_str().to_string();
    assert_eq!(h("Nats-Msg-Id"), record.id.to_string());
    assert_eq!(
        [
            h("Outbox-Key"),
            h("Outbox-Partition"),
            h("Outbox-Seq"),
            h("Outbox-Event-Type"),
            h("Outbox-Epoch"),
            h("traceparent")
        ],
        ["o-1", "9", "3", "order.paid", "4", "00-abc-def-01"]
    );
}

fn record(key: &str, payload: Vec<u8>) -> Record {
    Record {
        id: uuid::Uuid::now_v7(),
        partition: 1,
        key: key.into(),
        seq: 1,
        event_type: "order.paid".into(),
        payload: payload.into(),
        headers: Default::default(),
        attempts: 0,
        created_at: chrono::Utc::now(),
        deliver_at: None,
        epoch: outbox_core::Epoch(1),
    }
}

/// Deliveries of many keys publish through one sending task: each call still gets its own answer,
/// also with more publishes waiting for acks than the JetStream context has ack permits (5,000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_of_many_keys_at_once_each_get_their_own_answer() {
    let server = NatsServer::start_with("max_payload: 4096");
    let (client, handler, _) = jetstream(&server).await;
    let calls = (0..6_000).map(|i| {
        let oversized = i % 3 == 0;
        let record = record(&format!("k-{i}"), vec![7; if oversized { 8192 } else { 16 }]);
        let handler = handler.clone();
        tokio::spawn(async move { (record.id, oversized, handler.handle(&record).await) })
    });
    let answers = tokio::time::timeout(LONG, futures::future::join_all(calls)).await.expect("every call answered");
    let mut published = Vec::new();
    for answer in answers {
        let (id, oversized, result) = answer.unwrap();
        match result {
            Ok(()) if !oversized => published.push(id),
            Err(e) if oversized => assert!(e.to_string().contains("max_payload"), "{id}: {e}"),
            other => panic!("record {id} (oversized: {oversized}) got {other:?}"),
        }
    }
    let mut stored: Vec<_> = read_stream(&client, "OUTBOX").await.into_iter().map(|r| r.id).collect();
    stored.sort();
    published.sort();
    assert_eq!(stored, published);
}

/// The sending task runs on the runtime of the first publish; a handler used again after that runtime
/// shut down starts another.
#[tokio::test]
async fn the_handler_publishes_again_after_the_runtime_of_its_first_publish_stopped() {
    let server = NatsServer::start();
    let (client, handler, _) = jetstream(&server).await;
    let first = record("k", b"first".to_vec());
    let other = handler.clone();
    // On a thread of its own, while this runtime drives the client's connection.
    let (id, result) = tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let result = runtime.block_on(other.handle(&first));
        (first.id, result)
    })
    .await
    .unwrap();
    result.unwrap();
    let second = record("k", b"second".to_vec());
    tokio::time::timeout(LONG, handler.handle(&second)).await.expect("answered").unwrap();
    let stored: Vec<_> = read_stream(&client, "OUTBOX").await.into_iter().map(|r| r.id).collect();
    assert_eq!(stored, [id, second.id]);
}

/// A delivery dropped (its partition fenced) before the sending task sent its message never publishes
/// it later.
#[tokio::test]
async fn a_publish_dropped_before_it_was_sent_is_never_sent() {
    let server = NatsServer::start();
    let (client, handler, _) = jetstream(&server).await;
    let dropped = record("k", b"dropped".to_vec());
    {
        // Queued for the sending task, which has not run yet on this single-threaded runtime.
        let mut call = std::pin::pin!(handler.handle(&dropped));
        assert!(futures::poll!(call.as_mut()).is_pending());
    }
    let sent = record("k", b"sent".to_vec());
    tokio::time::timeout(LONG, handler.handle(&sent)).await.expect("answered").unwrap();
    let stored: Vec<_> = read_stream(&client, "OUTBOX").await.into_iter().map(|r| r.id).collect();
    assert_eq!(stored, [sent.id]);
}

/// A handler with `config` whose connection goes through a link to `server`, once the link is cut and
/// its client sees the connection down; the link, the client and the handler.
async fn cut_off(
    server: &NatsServer,
    config: &NatsConfig,
) -> (outbox_tests::proxy::DelayProxy, async_nats::Client, JetStreamHandler) {
    let link = outbox_tests::proxy::DelayProxy::start(server.port, Duration::ZERO).await;
    let far = NatsConfig { servers: vec![format!("nats://127.0.0.1:{}", link.port)], ..config.clone() };
    let client = outbox_nats::connect(&far).await.unwrap();
    let handler = JetStreamHandler::new(client.clone(), &far).unwrap();
    link.cut();
    wait_for("the connection to be seen down", LONG, || async {
        client.connection_state() != async_nats::connection::State::Connected
    })
    .await;
    (link, client, handler)
}

/// A publish made while the handler's connection is down for less than the publish timeout (a server of
/// the cluster restarted) waits for it and is sent once it is back: no retry is spent. It failed at
/// once, and a reconnect of a second cost every key in flight a few of its retries.
#[tokio::test]
async fn a_publish_made_while_the_connection_is_briefly_down_goes_out_when_it_is_back() {
    let server = NatsServer::start();
    let (client, _, config) = jetstream(&server).await;
    let config = NatsConfig { publish_timeout: Duration::from_secs(20), ..config };
    let (link, _, handler) = cut_off(&server, &config).await;
    let waiting = record("k", b"1".to_vec());
    let publish = tokio::spawn({
        let (handler, waiting) = (handler.clone(), waiting.clone());
        async move { handler.handle(&waiting).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!publish.is_finished(), "the publish waits for the connection: {:?}", publish.await);
    link.mend();
    tokio::time::timeout(LONG, publish).await.expect("answered").unwrap().unwrap();
    let stored: Vec<_> = read_stream(&client, "OUTBOX").await.into_iter().map(|r| r.id).collect();
    assert_eq!(stored, [waiting.id]);
}

/// A publish made while the handler's connection is down, and still down after the publish timeout,
/// fails and is never sent: queued in the client, it would reach the stream when the connection came
/// back, after the record had been published by the partition's next owner and the duplicate window
/// had passed, as a second copy behind its key's later records.
#[tokio::test]
async fn a_publish_made_while_disconnected_never_reaches_the_stream_later() {
    let server = NatsServer::start();
    let window = Duration::from_secs(1);
    let direct = NatsConfig {
        stream: StreamSettings { duplicate_window: window, ..StreamSettings::default() },
        publish_timeout: Duration::from_secs(2),
        ..config(&server)
    };
    let client = outbox_nats::connect(&direct).await.unwrap();
    ensure_stream(&client, &direct.stream).await.unwrap();
    let next_owner = JetStreamHandler::new(client.clone(), &direct).unwrap();
    let (link, cut_off_client, cut_off) = cut_off(&server, &direct).await;
    let (first, second) = (record("k", b"1".to_vec()), record("k", b"2".to_vec()));
    assert!(cut_off.handle(&first).await.is_err(), "no publish without a connection");
    next_owner.handle(&first).await.unwrap();
    next_owner.handle(&second).await.unwrap();
    tokio::time::sleep(window + Duration::from_millis(500)).await;
    link.mend();
    wait_for("the connection to be back", LONG, || async {
        cut_off_client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    // Whatever the client had queued went out before the answer to this round trip.
    cut_off_client.flush().await.unwrap();
    let stored: Vec<_> = read_stream(&client, "OUTBOX").await.into_iter().map(|r| r.id).collect();
    assert_eq!(stored, [first.id, second.id]);
}

/// A message JetStream refuses for its headers, whatever the attempt (over its 64 KiB of headers, or
/// with a `Nats-Expected-*` header of the record's that the stream does not meet), fails permanently
/// at its first attempt with the server's reason, where it was retried for the whole retry budget.
#[sqlx::test(migrations = false)]
async fn messages_the_stream_refuses_for_their_headers_fail_permanently(pool: PgPool) {
    let db = TestDb::postgres(pool.clone());
    let server = NatsServer::start();
    let (_client, handler, _) = jetstream(&server).await;
    let outbox = outbox(&db, |_| {}).await;
    let big =
        NewRecord::new("big-headers", "t", "{}").header("Big", "v".repeat(60_000)).header("More", "v".repeat(5_500));
    let expecting = NewRecord::new("expecting", "t", "{}").header("Nats-Expected-Last-Sequence", "999");
    commit(&outbox, &db, vec![big, expecting, NewRecord::new("fine", "t", "{}")]).await;
    let node = start(&outbox, &db, Handlers::new().default_route(Route::new(handler))).await;
    wait_failed(&db, 2).await;
    drained(&db, LONG).await;
    node.shutdown().await.unwrap();
    let failed = outbox.failed(&db, &Default::default()).await.unwrap();
    let reason = |key: &str| {
        let f = failed.iter().find(|f| f.key == key).unwrap();
        (f.attempts, f.last_error.clone().unwrap())
    };
    let (attempts, big) = reason("big-headers");
    assert!(attempts == 1 && big.starts_with("permanent") && big.contains("header size"), "{attempts}: {big}");
    let (attempts, expecting) = reason("expecting");
    assert!(
        attempts == 1 && expecting.starts_with("permanent") && expecting.contains("last sequence"),
        "{attempts}: {expecting}"
    );
}

/// What the server refuses on a connection without closing it (a publish its permissions deny) reaches
/// the client only as an asynchronous `-ERR`, and the publish waits out its ack. The error is logged as
/// a warning of this crate's, naming the connection, where it was an info line of the client's own.
#[tokio::test]
async fn errors_the_server_reports_on_a_connection_are_logged_as_warnings() {
    let server = NatsServer::start_with(
        "authorization { users: [ { user: \"app\", password: \"pw\", permissions: { publish: { deny: [\"forbidden.>\"] } } } ] }",
    );
    let logs = Captured::start("outbox_nats=warn");
    let config = NatsConfig {
        auth: Auth::UserPassword { user: "app".into(), password: "pw".into() },
        connection_name: "orders-outbox".into(),
        ..config(&server)
    };
    let client = outbox_nats::connect(&config).await.unwrap();
    client.publish("forbidden.x", "".into()).await.unwrap();
    client.flush().await.unwrap();
    wait_for("the refusal to be logged", LONG, || async { logs.text().contains("Permissions Violation") }).await;
    let line = logs.text();
    assert!(line.contains("WARN") && line.contains("forbidden.x") && line.contains("orders-outbox"), "{line}");
}
