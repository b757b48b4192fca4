//! The JSON API: what the page reads, and the operator's actions on FAILED records. The rows' times
//! are RFC 3339 (`started_at`, `heartbeat_at`, `created_at`, `failed_at`); the history's `at_ms` is
//! milliseconds since the Unix epoch, and every `…_ms` age or duration milliseconds.

use std::collections::HashMap;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use base64::Engine;
use outbox_core::operator::{FAILED_PAGE_PAYLOAD_BYTES, FailedFilter, FailedPosition, FailedRecord};
use outbox_core::{Epoch, InstanceId, Partition};
use serde::{Deserialize, Serialize};
use tracing::info;
use uuid::Uuid;

use super::Admin;
use super::auth::Operator;
use super::error::ApiError;
use crate::status::InstanceInfo;

/// The most FAILED records one page lists.
pub const MAX_PAGE: i64 = 1000;

/// `GET /api/status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusView {
    /// No token is configured: requeue, skip and purge are refused.
    pub read_only: bool,
    /// FAILED records' payloads are shown.
    pub show_payloads: bool,
    /// Registered instances, oldest first.
    pub instances: Vec<InstanceView>,
    /// The whole backlog.
    pub backlog: Backlog,
    /// Records delivered per second by all live instances, as their last heartbeats reported.
    pub delivered_per_s: f64,
    /// Samples over the last minutes, oldest first.
    pub history: Vec<Sample>,
}

/// One instance: its row, and what the admin derives from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstanceView {
    /// The instance as registered.
    #[serde(flatten)]
    pub instance: InstanceInfo,
    /// Its delivered/s between its last two reporting heartbeats.
    pub delivered_per_s: f64,
}

/// Backlog totals.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Backlog {
    /// Records waiting for delivery.
    pub pending: i64,
    /// Records scheduled for later.
    pub scheduled: i64,
    /// FAILED records.
    pub failed: i64,
    /// Age of the oldest pending record.
    pub oldest_pending_ms: Option<i64>,
}

/// One point of the history.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    /// When.
    pub at_ms: i64,
    /// Pending records.
    pub pending: i64,
    /// FAILED records.
    pub failed: i64,
    /// Delivered per second.
    pub delivered_per_s: f64,
}

/// `GET /api/partitions`: one of the 256.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartitionView {
    /// Partition.
    pub partition: Partition,
    /// Owner, if any.
    pub owner: Option<InstanceId>,
    /// The owner's name, if it is registered.
    pub owner_name: Option<String>,
    /// Fencing epoch.
    pub epoch: Epoch,
    /// Where the rebalancer wants it.
    pub target: Option<InstanceId>,
    /// Records waiting for delivery.
    pub pending: i64,
    /// Records scheduled for later.
    pub scheduled: i64,
    /// FAILED records.
    pub failed: i64,
    /// Age of the oldest pending record.
    pub oldest_pending_ms: Option<i64>,
    /// What is left of its quiet period, if it is in one: taken from an owner whose lease ran out, it is
    /// delivered by nobody until then.
    pub quiet_ms: Option<i64>,
}

/// `GET /api/failed`: a page of FAILED records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailedPage {
    /// In (partition, key, seq) order.
    pub records: Vec<FailedView>,
    /// Where the next page starts (`after_partition`, `after_key`, `after_seq`), if there may be one.
    pub next: Option<FailedPosition>,
}

/// One FAILED record, with its payload when payloads are shown.
#[derive(Clone, Serialize, Deserialize)]
pub struct FailedView {
    /// The record.
    #[serde(flatten)]
    pub record: FailedRecord,
    /// The payload as text, when it is UTF-8.
    pub payload: Option<String>,
    /// The payload in base64, when it is not UTF-8.
    pub payload_base64: Option<String>,
}

/// The record's own `Debug`, and the payload's length only: never its text in a log.
impl std::fmt::Debug for FailedView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = self.payload.as_ref().map(String::len).or(self.payload_base64.as_ref().map(String::len));
        f.debug_struct("FailedView").field("record", &self.record).field("payload_chars", &shown).finish()
    }
}

impl From<FailedRecord> for FailedView {
    fn from(mut record: FailedRecord) -> Self {
        let (payload, payload_base64) = match record.payload.take().map(String::from_utf8) {
            None => (None, None),
            Some(Ok(text)) => (Some(text), None),
            Some(Err(e)) => (None, Some(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()))),
        };
        FailedView { record, payload, payload_base64 }
    }
}

type ApiResult<T> = Result<Json<T>, ApiError>;

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(super) async fn status(State(admin): State<Admin>) -> ApiResult<StatusView> {
    let inner = &admin.inner;
    let snapshot = inner.snapshots.get(&inner.outbox, &inner.db).await?;
    let instances = snapshot
        .cluster
        .instances
        .iter()
        .map(|i| InstanceView {
            instance: i.clone(),
            delivered_per_s: snapshot.rates.get(&i.id).copied().unwrap_or(0.0),
        })
        .collect();
    let totals = &snapshot.totals;
    Ok(Json(StatusView {
        read_only: inner.config.read_only(),
        show_payloads: inner.config.show_payloads,
        instances,
        backlog: Backlog {
            pending: totals.pending,
            scheduled: totals.scheduled,
            failed: totals.failed,
            oldest_pending_ms: totals.oldest_pending.map(millis),
        },
        delivered_per_s: snapshot.rates.values().sum(),
        history: snapshot.history.clone(),
    }))
}

pub(super) async fn partitions(State(admin): State<Admin>) -> ApiResult<Vec<PartitionView>> {
    let inner = &admin.inner;
    let snapshot = inner.snapshots.get(&inner.outbox, &inner.db).await?;
    let names: HashMap<InstanceId, &str> = snapshot.cluster.instances.iter().map(|i| (i.id, i.name.as_str())).collect();
    let stats: HashMap<Partition, _> = snapshot.stats.iter().map(|s| (s.partition, s)).collect();
    Ok(Json(
        snapshot
            .cluster
            .partitions
            .iter()
            .map(|p| {
                let s = stats.get(&p.partition);
                PartitionView {
                    partition: p.partition,
                    owner: p.owner,
                    owner_name: p.owner.and_then(|o| names.get(&o)).map(|n| n.to_string()),
                    epoch: p.epoch,
                    target: p.target,
                    pending: s.map_or(0, |s| s.pending),
                    scheduled: s.map_or(0, |s| s.scheduled),
                    failed: s.map_or(0, |s| s.failed),
                    oldest_pending_ms: s.and_then(|s| s.oldest_pending).map(millis),
                    quiet_ms: p.quiet.map(millis),
                }
            })
            .collect(),
    ))
}

/// `GET /api/failed` parameters.
#[derive(Debug, Deserialize)]
pub(super) struct FailedQuery {
    key: Option<String>,
    partition: Option<Partition>,
    limit: Option<i64>,
    after_partition: Option<Partition>,
    after_key: Option<String>,
    after_seq: Option<i64>,
    /// Whether to list payloads (shown at all, and to a request with a token): asked for, not at every
    /// refresh of an open page.
    #[serde(default)]
    payloads: bool,
}

/// Payloads (when shown at all) go only to a request with a token that asks for them, and each such
/// read is logged.
pub(super) async fn failed(
    State(admin): State<Admin>,
    reader: Option<Operator>,
    query: Result<Query<FailedQuery>, QueryRejection>,
) -> ApiResult<FailedPage> {
    let Query(q) = query?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::BadRequest(format!("limit must be 1..={MAX_PAGE}, not {limit}")));
    }
    let after = match (q.after_partition, q.after_key, q.after_seq) {
        (None, None, None) => None,
        (Some(partition), Some(key), Some(seq)) => Some(FailedPosition { partition, key, seq }),
        _ => return Err(ApiError::BadRequest("after_partition, after_key and after_seq go together".into())),
    };
    let payloads = admin.inner.config.show_payloads && q.payloads && reader.is_some();
    let filter = FailedFilter {
        key: q.key.filter(|k| !k.is_empty()),
        partition: q.partition,
        limit: Some(limit),
        after,
        payloads,
    };
    let records = admin.inner.outbox.failed(admin.inner.db.clone(), &filter).await?;
    if let Some(Operator(token)) = reader.filter(|_| payloads && !records.is_empty()) {
        let (first, last) = (records.first().map(|r| r.id), records.last().map(|r| r.id));
        info!(token = %token, records = records.len(), ?first, ?last, "admin: payloads of FAILED records read");
    }
    // A page ends at its limit or, with payloads, at their byte budget: either way more may follow.
    let bytes: usize = records.iter().filter_map(|r| r.payload.as_ref()).map(Vec::len).sum();
    let more = records.len() as i64 == limit || bytes >= FAILED_PAGE_PAYLOAD_BYTES;
    let next = more.then(|| records.last().map(FailedRecord::position)).flatten();
    Ok(Json(FailedPage { records: records.into_iter().map(FailedView::from).collect(), next }))
}

/// What `POST /api/failed/{id}/{action}` does to one FAILED record.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Resolve {
    /// Back to pending with a fresh retry budget.
    Requeue,
    /// Marked handled without delivery; the key's next record proceeds.
    Skip,
}

pub(super) async fn resolve(
    State(admin): State<Admin>,
    Operator(who): Operator,
    path: Result<Path<(Uuid, Resolve)>, PathRejection>,
) -> ApiResult<serde_json::Value> {
    let Path((id, action)) = path?;
    let (outbox, db) = (&admin.inner.outbox, admin.inner.db.clone());
    let done = match action {
        Resolve::Requeue => outbox.requeue(db, id).await,
        Resolve::Skip => outbox.skip(db, id).await,
    };
    done.map_err(|e| ApiError::from(e).of_change(|| format!("token {who}: {action:?} of FAILED record {id}")))?;
    info!(token = %who, record = %id, ?action, "admin: resolved a FAILED record");
    Ok(Json(serde_json::json!({ "resolved": 1 })))
}

/// `POST /api/requeue` body: `{"key": …}` for a key's FAILED records, `{"all": true}` for every one.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RequeueMany {
    key: Option<String>,
    #[serde(default)]
    all: bool,
}

pub(super) async fn requeue_many(
    State(admin): State<Admin>,
    Operator(who): Operator,
    body: Result<Json<RequeueMany>, JsonRejection>,
) -> ApiResult<serde_json::Value> {
    let Json(body) = body?;
    let (outbox, db) = (&admin.inner.outbox, admin.inner.db.clone());
    let n = match (body.key.as_deref(), body.all) {
        (Some(key), false) if !key.is_empty() => outbox.requeue_key(db, key).await,
        (None, true) => outbox.requeue_all(db).await,
        _ => return Err(ApiError::BadRequest("give a non-empty key, or all: true".into())),
    };
    let n = n.map_err(|e| {
        ApiError::from(e).of_change(|| match &body.key {
            Some(key) => format!("token {who}: requeue of key {key:?}'s FAILED records"),
            None => format!("token {who}: requeue of every FAILED record"),
        })
    })?;
    info!(token = %who, key = ?body.key, all = body.all, requeued = n, "admin: requeued FAILED records");
    Ok(Json(serde_json::json!({ "requeued": n })))
}

/// `POST /api/purge` body.
#[derive(Debug, Deserialize)]
pub(super) struct Purge {
    /// Completed records older than this go, e.g. "1h".
    older_than: String,
}

pub(super) async fn purge(
    State(admin): State<Admin>,
    Operator(who): Operator,
    body: Result<Json<Purge>, JsonRejection>,
) -> ApiResult<serde_json::Value> {
    let Json(body) = body?;
    let older_than = humantime::parse_duration(&body.older_than)
        .map_err(|e| ApiError::BadRequest(format!("older_than {:?}: {e}", body.older_than)))?;
    let (outbox, db) = (&admin.inner.outbox, &admin.inner.db);
    let batch = outbox.config().purge_batch_size;
    let purge = || format!("token {who}: purge of completed records older than {}", body.older_than);
    let purged =
        outbox.purge_completed(db.clone(), older_than, batch).await.map_err(|e| ApiError::from(e).of_change(purge))?;
    let pruned = outbox
        .prune_keys(db.clone(), batch)
        .await
        .map_err(|e| ApiError::from(e).of_change(|| format!("{}: {purged} purged, then pruning keys", purge())))?;
    info!(token = %who, older_than = %body.older_than, purged, pruned_keys = pruned, "admin: purged completed records");
    Ok(Json(serde_json::json!({ "purged": purged, "pruned_keys": pruned })))
}
