//! PostgreSQL's statements, written with a `{s}` placeholder for the configured schema and built once per
//! [`Outbox`](crate::Outbox) (the schema name is validated as a plain identifier, so splicing it is safe;
//! it is spliced quoted, so a reserved word such as `user` names a schema too).

use std::sync::Arc;
use std::time::Duration;

use crate::driver::unfinished;
use crate::notice::Channel;

/// The fence: lock the partition rows this worker believes it owns, under the instance ids and at the
/// epochs it believes it holds them, `FOR SHARE`. An epoch bump (release, steal) waits for the share
/// lock, and a zombie's statement that races a bump re-checks the row after the bump commits and
/// matches nothing. `FOR KEY SHARE` would not block the bump. `$1` partitions, `$2` owners, `$3` epochs.
const FENCE: &str = "fence AS MATERIALIZED (
    SELECT p.partition, p.owner, p.epoch FROM {s}.partitions p
    JOIN unnest($1::smallint[], $2::uuid[], $3::bigint[]) AS o(partition, owner, epoch)
      ON o.partition = p.partition AND o.owner = p.owner AND o.epoch = p.epoch
    FOR SHARE OF p)";

/// The end of a fenced write: the ids it wrote, then the (partition, owner, epoch) its fence held, so
/// the processor can tell an outcome that was fenced out from one whose record was already settled.
const WRITTEN_AND_HELD: &str =
    "SELECT id, NULL::smallint AS partition, NULL::uuid AS owner, NULL::bigint AS epoch FROM written
UNION ALL
SELECT NULL, partition, owner, epoch FROM fence";

/// A record's partition is in the fence: a filter on rows found by id, exact because a completion
/// batch holds one grant per partition (see `start_completion`). The cast keeps the planner off
/// the (partition, key, seq) index, which for many ids it would pick to read the fenced partitions whole.
const FENCED: &str = "r.partition::int = ANY(ARRAY(SELECT partition::int FROM fence))";

/// Schedules records inside the caller's transaction. Upserting each key's lock row takes its row lock
/// until commit, so writers of one key serialise; only once every key of the batch is locked (the
/// one-time filter on `locked`) are sequence numbers drawn, so a key's numbers grow in commit order.
/// Drawn numbers are handed out in input order, so a key's records in one batch are numbered as listed.
/// Keys are locked in sorted order so two multi-key batches cannot deadlock.
const SCHEDULE: &str = "WITH input AS (
    SELECT t.*, {deliver_at} AS deliver_at
    FROM unnest($1::uuid[], $2::smallint[], $3::text[], $4::text[], $5::bytea[], $6::text[], $7::timestamptz[],
                $8::bigint[])
        WITH ORDINALITY AS t(id, partition, key, event_type, payload, headers, at, after_ms, ord)
), locked AS (
    INSERT INTO {s}.keys AS k (key, partition)
    SELECT DISTINCT ON (key) key, partition FROM input ORDER BY key
    ON CONFLICT (key) DO UPDATE SET partition = EXCLUDED.partition
    RETURNING k.key
), drawn AS (
    SELECT nextval('{s}.record_seq') AS seq FROM input WHERE (SELECT count(*) FROM locked) > 0
), numbered AS (
    SELECT seq, row_number() OVER (ORDER BY seq) AS ord FROM drawn
)
INSERT INTO {s}.records (id, partition, key, seq, event_type, payload, headers, deliver_at, next_attempt_at)
SELECT i.id, i.partition, i.key, n.seq, i.event_type, i.payload, i.headers::jsonb, i.deliver_at, i.deliver_at
FROM input i JOIN numbered n ON n.ord = i.ord
RETURNING id, seq";

/// When a record asked to be delivered at `at`, or `after_ms` after the statement, is due, if later
/// than the statement. The statement's time, not the caller's transaction's start (`now()`): a delay
/// counts from the call that schedules it, as on the other backends, however long the transaction ran.
const DELIVER_AT: &str = "(SELECT CASE WHEN d > statement_timestamp() THEN d END
    FROM (SELECT coalesce(at, statement_timestamp() + after_ms * interval '1 millisecond') AS d) due)";

/// One record, without the arrays: the key's lock row first (the insert reads from it, so it runs first),
/// then the record with a number drawn under that lock. `$1` id, `$2` partition, `$3` key, `$4` type,
/// `$5` payload, `$6` headers, `$7` and `$8` its delivery time or delay.
const SCHEDULE_ONE: &str = "WITH locked AS (
    INSERT INTO {s}.keys AS k (key, partition) VALUES ($3, $2)
    ON CONFLICT (key) DO UPDATE SET partition = EXCLUDED.partition
    RETURNING k.key
), input AS (
    SELECT {deliver_at} AS deliver_at FROM (SELECT $7::timestamptz AS at, $8::bigint AS after_ms) t
)
INSERT INTO {s}.records (id, partition, key, seq, event_type, payload, headers, deliver_at, next_attempt_at)
SELECT $1, $2, l.key, nextval('{s}.record_seq'), $4, $5, $6::jsonb, i.deliver_at, i.deliver_at
FROM locked l, input i
RETURNING id, seq";

/// Deletes at most `$1` key lock rows whose key has no record left (skipping those a writer holds).
/// Reads up to `$1` key rows after key `$2`, in key order, and deletes those of keys with no record
/// left: rows read, the last of them (where the next batch goes on), rows deleted. A statement reads
/// as many key rows as the batch's size, whatever their records: probed one by one in key order (a
/// subquery with a limit), where `NOT EXISTS` may become a hash anti-join that reads every record.
const PRUNE_KEYS: &str = "WITH walked AS MATERIALIZED (
    SELECT k.key, (SELECT 1 FROM {s}.records r WHERE r.partition = k.partition AND r.key = k.key LIMIT 1) IS NULL AS unused
    FROM {s}.keys k WHERE k.key > $2 ORDER BY k.key LIMIT $1),
pruned AS (DELETE FROM {s}.keys WHERE key = ANY(ARRAY(
    SELECT k.key FROM {s}.keys k WHERE k.key = ANY(ARRAY(SELECT key FROM walked WHERE unused))
    FOR UPDATE SKIP LOCKED)) RETURNING 1)
SELECT (SELECT count(*) FROM walked), (SELECT max(key) FROM walked), (SELECT count(*) FROM pruned)";

const RECORD_COLUMNS: &str = "r.id, r.partition, r.key, r.seq, r.event_type, r.payload, r.headers, r.attempts, r.requeues, r.created_at, r.deliver_at, {unfinished} AS unfinished, r.failed_at, r.next_attempt_at";

/// No record of the key before `{t}` is held back (FAILED, or waiting for a time): with
/// stop-on-first-failure any such one would come first; without, only one whose time came
/// (`{earlier}`). A probe of `records_held`, which holds only such records.
const NONE_HELD_BEFORE: &str = "NOT EXISTS (SELECT 1 FROM {s}.records x
    WHERE x.partition = {t}.partition AND x.key = {t}.key AND x.seq < {t}.seq
      AND (x.failed_at IS NOT NULL OR x.next_attempt_at IS NOT NULL) {earlier})";

/// No record of the key before `r` is due at once (a probe of `records_ready`).
const NONE_READY_BEFORE: &str = "NOT EXISTS (SELECT 1 FROM {s}.records x
    WHERE x.partition = r.partition AND x.key = r.key AND x.seq < r.seq
      AND x.failed_at IS NULL AND x.next_attempt_at IS NULL)";

/// A record that waited for a time (a retry's, or its delivery time) and is now due.
const CAME_DUE: &str = "r.failed_at IS NULL AND r.next_attempt_at IS NOT NULL AND r.next_attempt_at <= now()";

/// A record due at once: in the `records_ready` index.
const READY: &str = "r.failed_at IS NULL AND r.next_attempt_at IS NULL";

/// A record held back, FAILED or waiting for a time: in the `records_held` index.
const HELD: &str = "(r.failed_at IS NOT NULL OR r.next_attempt_at IS NOT NULL)";

/// The fetch (see `Db::fetch`): `$1` partitions, `$2` epochs, `$3` start keys, `$4` instance, `$5` keys
/// in flight, `$6` heads at most, `$7` followers per head, `$8` bytes per run. Per partition, first the
/// records that waited for a time and came due (in that order, taking up to half the batch so a storm
/// of retries leaves room for the rest), then a loose index scan of the keys with a record due at once
/// (one probe per key, so the cost grows with those keys, not records, and not at all with keys whose
/// records all wait; it stops when the batch is full), from the partition's start key and wrapping
/// around; each only where it is its key's next record. Then up to `$7` records after each head, from
/// both indexes in sequence order. The fetch reads `records_ready` and `records_held` only (the first
/// the size of the backlog, the second of what is held back), never `records_partition_key_seq`.
const FETCH: &str = "WITH served AS MATERIALIZED (
    SELECT a.partition, coalesce(a.after, '') AS after, a.after IS NOT NULL AS wraps
    FROM unnest($1::smallint[], $2::bigint[], $3::text[]) WITH ORDINALITY AS a(partition, epoch, after, ord)
    JOIN {s}.partitions p ON p.partition = a.partition AND p.epoch = a.epoch AND p.owner = $4
    WHERE EXISTS (SELECT 1 FROM {s}.instances i WHERE i.id = $4 AND i.expires_at > now())
    ORDER BY a.ord
), heads AS MATERIALIZED (
    SELECT h.id, h.partition, h.key, h.seq, h.event_type, h.payload, h.headers, h.attempts, h.requeues, h.created_at,
           h.deliver_at, h.unfinished
    FROM served s CROSS JOIN LATERAL (
        SELECT * FROM (
            SELECT {cols} FROM {s}.records r
            WHERE r.partition = s.partition AND {came_due} AND {none_ready_before} AND {none_held_before_r}
            ORDER BY r.next_attempt_at LIMIT ($6 + 1) / 2
        ) came_due
        UNION ALL
        SELECT * FROM (
            WITH RECURSIVE walk AS (
                (SELECT {cols} FROM {s}.records r WHERE r.partition = s.partition AND r.key > s.after AND {ready}
                 ORDER BY r.key, r.seq LIMIT 1)
                UNION ALL
                SELECT n.* FROM walk w CROSS JOIN LATERAL (
                    SELECT {cols} FROM {s}.records r WHERE r.partition = w.partition AND r.key > w.key AND {ready}
                    ORDER BY r.key, r.seq LIMIT 1) n
            )
            SELECT * FROM walk
        ) tail
        WHERE {none_held_before_tail}
        UNION ALL
        SELECT * FROM (
            WITH RECURSIVE walk AS (
                (SELECT {cols} FROM {s}.records r
                 WHERE s.wraps AND r.partition = s.partition AND r.key <= s.after AND {ready}
                 ORDER BY r.key, r.seq LIMIT 1)
                UNION ALL
                SELECT n.* FROM walk w CROSS JOIN LATERAL (
                    SELECT {cols} FROM {s}.records r
                    WHERE r.partition = w.partition AND r.key > w.key AND r.key <= s.after AND {ready}
                    ORDER BY r.key, r.seq LIMIT 1) n
            )
            SELECT * FROM walk
        ) wrapped
        WHERE {none_held_before_wrapped}
    ) h
    WHERE h.key <> ALL($5::text[])
    LIMIT $6
), numbered AS (
    SELECT heads.*, row_number() OVER () AS walk FROM heads
)
SELECT numbered.*, true AS due FROM numbered
UNION ALL
SELECT f.id, f.partition, f.key, f.seq, f.event_type, f.payload, f.headers, f.attempts, f.requeues, f.created_at,
       f.deliver_at, f.unfinished, NULL, f.failed_at IS NULL AND (f.next_attempt_at IS NULL OR f.next_attempt_at <= now()) AS due
FROM numbered heads CROSS JOIN LATERAL (
    SELECT u.*, sum(octet_length(u.payload)) OVER (ORDER BY u.seq) AS run_bytes FROM (
        (SELECT {cols} FROM {s}.records r
         WHERE r.partition = heads.partition AND r.key = heads.key AND r.seq > heads.seq AND {ready}
         ORDER BY r.seq LIMIT $7)
        UNION ALL
        (SELECT {cols} FROM {s}.records r
         WHERE r.partition = heads.partition AND r.key = heads.key AND r.seq > heads.seq AND {held}
         ORDER BY r.seq LIMIT $7)
    ) u ORDER BY u.seq LIMIT $7) f
WHERE octet_length(heads.payload) + f.run_bytes <= $8";

/// Completes delivered records (fenced): delete, and copy to `completed` when keeping them. `$4` ids,
/// `$5` outcomes, `$6` attempts. Rows are found by `id = ANY($4)`, the fence only a filter: joined
/// through `unnest`, the planner read every record of the fenced partitions instead.
const COMPLETE_KEEP: &str = "WITH {fence}, done AS (
    DELETE FROM {s}.records r
    WHERE r.id = ANY($4::uuid[]) AND {fenced}
    RETURNING r.id, r.partition, r.key, r.seq, r.event_type, r.payload, r.headers, r.created_at
), written AS (
    INSERT INTO {s}.completed (id, partition, key, seq, event_type, payload, headers, created_at, attempts, outcome)
    SELECT done.id, done.partition, done.key, done.seq, done.event_type, done.payload, done.headers, done.created_at,
           d.attempts, d.outcome
    FROM done JOIN unnest($4::uuid[], $5::text[], $6::int[]) AS d(id, outcome, attempts) ON d.id = done.id
    RETURNING id
)
{written_and_held}";

/// The same, deleting only (`$5` and `$6` are bound alike and unused: sqlx declares every bound
/// parameter's type when it prepares the statement).
const COMPLETE_DELETE: &str = "WITH {fence}, written AS (
    DELETE FROM {s}.records r
    WHERE r.id = ANY($4::uuid[]) AND {fenced}
    RETURNING r.id
)
{written_and_held}";

/// Records failed deliveries (fenced): a retry at `now() + delay` (database time), or FAILED. Only a
/// pending record that has not been requeued since it was fetched is written, so a late retry of this
/// statement never undoes an operator's requeue. `$4` ids; `$5` a JSON object giving, by id,
/// `[attempts, requeues when fetched, error, delay in ms, failed]`. Rows are found by `id = ANY($4)` and
/// their values looked up by id: joined to `unnest`ed values instead, a generic plan compared every row
/// with every value (1.3 s for 2,550 rows), and a custom plan without `id = ANY` read the whole table.
const FAIL: &str = "WITH {fence}, written AS (
    UPDATE {s}.records r SET
        attempts = ($5::jsonb -> r.id::text ->> 0)::int,
        last_error = $5::jsonb -> r.id::text ->> 2,
        next_attempt_at = CASE WHEN ($5::jsonb -> r.id::text ->> 4)::bool THEN NULL
            ELSE now() + ($5::jsonb -> r.id::text ->> 3)::bigint * interval '1 millisecond' END,
        failed_at = CASE WHEN ($5::jsonb -> r.id::text ->> 4)::bool THEN now() END
    WHERE r.id = ANY($4::uuid[]) AND r.failed_at IS NULL AND r.requeues = ($5::jsonb -> r.id::text ->> 1)::int
      AND {fenced}
    RETURNING r.id
)
{written_and_held}";

const FAILED_COLUMNS: &str =
    "id, partition, key, seq, event_type, attempts, requeues, last_error, created_at, failed_at";

/// Lists FAILED records, optionally of one key (`$1`) or partition (`$2`), at most `$3`, after the
/// (partition, key, seq) `($4, $5, $6)` if given, with their payloads if `$7`, and then only up to the
/// one that takes their bytes to `$8` (the payloads' lengths come from their TOAST headers; only the
/// payloads listed are read).
const LIST_FAILED: &str = "WITH page AS (
    SELECT id, partition, key, seq, CASE WHEN $7 THEN octet_length(payload) ELSE 0 END AS bytes
    FROM {s}.records
    WHERE failed_at IS NOT NULL AND ($1::text IS NULL OR key = $1) AND ($2::smallint IS NULL OR partition = $2)
        AND ($4::smallint IS NULL OR (partition, key, seq) > ($4, $5::text, $6::bigint))
    ORDER BY partition, key, seq LIMIT $3
), listed AS (
    SELECT id FROM (SELECT id, sum(bytes) OVER (ORDER BY partition, key, seq) - bytes AS bytes_before FROM page) w
    WHERE bytes_before < $8::bigint
)
SELECT {failed_cols}, CASE WHEN $7 THEN payload END AS payload FROM listed JOIN {s}.records USING (id)
ORDER BY partition, key, seq";

/// Requeues FAILED records (one id `$1`, or all of key `$2`) with a fresh retry budget, counting the
/// requeue. Not fenced: owners never write FAILED rows (nor rows requeued since they fetched them), so
/// operator and owner cannot race on them.
const REQUEUE: &str =
    "UPDATE {s}.records SET failed_at = NULL, attempts = 0, next_attempt_at = NULL, requeues = requeues + 1
WHERE failed_at IS NOT NULL AND (id = $1 OR key = $2)
RETURNING id";

/// The next `$4` FAILED records after (`$1` partition, `$2` key, `$3` seq), in that order (the
/// index of held records), requeued, each found by its id (a join read every FAILED record each
/// batch): how many were read, the place of the last, how many requeued (one resolved meanwhile is
/// not). See `Db::requeue`.
const REQUEUE_ALL: &str = "WITH batch AS MATERIALIZED (
    SELECT id, partition, key, seq FROM {s}.records
    WHERE failed_at IS NOT NULL AND (partition, key, seq) > ($1, $2, $3)
    ORDER BY partition, key, seq LIMIT $4),
done AS (
    UPDATE {s}.records r SET failed_at = NULL, attempts = 0, next_attempt_at = NULL, requeues = r.requeues + 1
    WHERE r.id = ANY(ARRAY(SELECT id FROM batch)) AND r.failed_at IS NOT NULL RETURNING 1)
SELECT (SELECT count(*) FROM batch), b.partition, b.key, b.seq, (SELECT count(*) FROM done)
FROM batch b ORDER BY b.partition DESC, b.key DESC, b.seq DESC LIMIT 1";

/// Skips a FAILED record: it leaves the queue, and the `completed` table keeps it as `skipped`.
const SKIP: &str = "WITH d AS (
    DELETE FROM {s}.records WHERE id = $1 AND failed_at IS NOT NULL
    RETURNING id, partition, key, seq, event_type, payload, headers, created_at, attempts
)
INSERT INTO {s}.completed (id, partition, key, seq, event_type, payload, headers, created_at, attempts, outcome)
SELECT *, 'skipped' FROM d
RETURNING id";

/// Per-partition counts and the oldest pending record's age (database time).
/// Per partition: pending (due by their delivery time), scheduled for later, FAILED, and how long the
/// oldest pending record has been due.
const STATS: &str = "SELECT partition,
    count(*) FILTER (WHERE failed_at IS NULL AND coalesce(deliver_at, created_at) <= now()) AS pending,
    count(*) FILTER (WHERE failed_at IS NULL AND deliver_at > now()) AS scheduled,
    count(*) FILTER (WHERE failed_at IS NOT NULL) AS failed,
    EXTRACT(EPOCH FROM now() - min(coalesce(deliver_at, created_at))
        FILTER (WHERE failed_at IS NULL AND coalesce(deliver_at, created_at) <= now()))::float8 AS oldest_pending_secs
FROM {s}.records GROUP BY partition ORDER BY partition";

/// Deletes at most `$2` completed records older than `$1` ms. `= ANY(ARRAY(…))` evaluates the limited
/// subquery once (an `IN (… LIMIT)` may be re-planned to delete more).
const PURGE: &str = "DELETE FROM {s}.completed WHERE id = ANY(ARRAY(
    SELECT id FROM {s}.completed WHERE completed_at < now() - $1 * interval '1 millisecond'
    ORDER BY completed_at LIMIT $2))";

/// Records message `$2` of source `$1` as applied, unless it is already (see `Conn::accept`).
const ACCEPT: &str = "INSERT INTO {s}.inbox (source, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";

/// Records event `$3` of key `$2` of source `$1` as the key's last applied, if later than the last.
const ACCEPT_IN_ORDER: &str = "INSERT INTO {s}.inbox_keys AS k (source, key, last_seq) VALUES ($1, $2, $3)
ON CONFLICT (source, key) DO UPDATE SET last_seq = EXCLUDED.last_seq WHERE k.last_seq < EXCLUDED.last_seq";

/// Deletes at most `$2` inbox rows older than `$1` ms.
const PURGE_INBOX: &str = "DELETE FROM {s}.inbox WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {s}.inbox WHERE accepted_at < now() - $1 * interval '1 millisecond'
    ORDER BY accepted_at LIMIT $2))";

/// Tracking table of the library's own migrations (never the host's `_sqlx_migrations`).
const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
    version    bigint      PRIMARY KEY,
    name       text        NOT NULL,
    checksum   bigint      NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())";

/// Wakes the listeners of channel `$1` with payload `$2` (see `wake.rs`).
pub(crate) const NOTIFY: &str = "SELECT pg_notify($1, $2)";

/// `schema` as a quoted identifier to splice into a statement (this crate's and `outbox-cluster`'s):
/// validated names hold no `"`, and quoting lets reserved words through.
pub fn quoted(schema: &str) -> String {
    format!("\"{schema}\"")
}

/// PostgreSQL's statements, built for one schema and mode.
#[derive(Debug)]
pub struct PgStatements {
    schema: String,
    /// The schema's channels, `<schema>.wake` and `<schema>.nudge` (no schema name holds a dot, so none
    /// collide).
    wake_channel: String,
    nudge_channel: String,
    pub(crate) schedule: Arc<str>,
    pub(crate) schedule_one: Arc<str>,
    pub(crate) prune_keys: Arc<str>,
    pub(crate) fetch: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) fail: Arc<str>,
    pub(crate) list_failed: Arc<str>,
    pub(crate) requeue: Arc<str>,
    pub(crate) requeue_all: Arc<str>,
    pub(crate) skip: Arc<str>,
    pub(crate) stats: Arc<str>,
    pub(crate) purge: Arc<str>,
    pub(crate) accept: Arc<str>,
    pub(crate) accept_in_order: Arc<str>,
    pub(crate) purge_inbox: Arc<str>,
    pub(crate) migrations_table: Arc<str>,
    /// Begins a transaction of the library's own (see `postgres::begin`).
    pub(crate) begin: Arc<str>,
    /// Begins an operator call's transaction: as `begin`, but a statement may run as long as it needs
    /// (a count over a large backlog, a requeue of everything); only its lock waits are bounded.
    pub(crate) begin_operator: Arc<str>,
}

impl PgStatements {
    /// `schema` must already be validated as an identifier.
    pub(crate) fn new(
        schema: &str,
        stop_on_first_failure: bool,
        keep_completed: bool,
        query_timeout: Duration,
    ) -> Self {
        let quoted = quoted(schema);
        let build = |text: &str| -> Arc<str> {
            text.replace("{written_and_held}", WRITTEN_AND_HELD)
                .replace("{deliver_at}", DELIVER_AT)
                .replace("{fence}", FENCE)
                .replace("{fenced}", FENCED)
                .replace("{cols}", RECORD_COLUMNS)
                .replace("{unfinished}", &unfinished())
                .replace("{failed_cols}", FAILED_COLUMNS)
                .replace("{s}", &quoted)
                .into()
        };
        let earlier = if stop_on_first_failure { "" } else { "AND x.failed_at IS NULL AND x.next_attempt_at <= now()" };
        let none_held_before = |t: &str| NONE_HELD_BEFORE.replace("{t}", t).replace("{earlier}", earlier);
        let fetch = FETCH
            .replace("{came_due}", CAME_DUE)
            .replace("{none_ready_before}", NONE_READY_BEFORE)
            .replace("{none_held_before_r}", &none_held_before("r"))
            .replace("{none_held_before_tail}", &none_held_before("tail"))
            .replace("{none_held_before_wrapped}", &none_held_before("wrapped"))
            .replace("{ready}", READY)
            .replace("{held}", HELD);
        Self {
            schema: schema.to_string(),
            wake_channel: format!("{schema}.wake"),
            nudge_channel: format!("{schema}.nudge"),
            schedule: build(SCHEDULE),
            schedule_one: build(SCHEDULE_ONE),
            prune_keys: build(PRUNE_KEYS),
            fetch: build(&fetch),
            complete: build(if keep_completed { COMPLETE_KEEP } else { COMPLETE_DELETE }),
            fail: build(FAIL),
            list_failed: build(LIST_FAILED),
            requeue: build(REQUEUE),
            requeue_all: build(REQUEUE_ALL),
            skip: build(SKIP),
            stats: build(STATS),
            purge: build(PURGE),
            accept: build(ACCEPT),
            accept_in_order: build(ACCEPT_IN_ORDER),
            purge_inbox: build(PURGE_INBOX),
            migrations_table: build(MIGRATIONS_TABLE),
            begin: {
                let ms = query_timeout.as_millis().max(1);
                format!(
                    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL jit = off; SET LOCAL idle_in_transaction_session_timeout = {ms};
                     SET LOCAL lock_timeout = {ms}; SET LOCAL statement_timeout = {ms}"
                )
                .into()
            },
            begin_operator: {
                let ms = query_timeout.as_millis().max(1);
                format!(
                    "BEGIN ISOLATION LEVEL READ COMMITTED;
                     SET LOCAL idle_in_transaction_session_timeout = {ms}; SET LOCAL lock_timeout = {ms}"
                )
                .into()
            },
        }
    }

    /// The name of `channel` for this schema.
    pub(crate) fn channel(&self, channel: Channel) -> &str {
        match channel {
            Channel::Wake => &self.wake_channel,
            Channel::Nudge => &self.nudge_channel,
        }
    }

    pub(crate) fn schema(&self) -> &str {
        &self.schema
    }

    /// The schema as an identifier to splice into a statement.
    pub(crate) fn schema_ident(&self) -> String {
        quoted(&self.schema)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::PgPool;

    use crate::{Config, Outbox};

    /// `text` (the fetch, or a statement around it) with the fetch's arguments bound: `partitions` at
    /// epoch 1 from `cursors`, for `instance`, no key in flight, 100 heads, 7 records after each, 64 KiB
    /// a run.
    fn fetch_bound<'q, O>(
        text: String,
        partitions: &'q [i16],
        cursors: Vec<Option<&'q str>>,
        instance: uuid::Uuid,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
    where
        O: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
    {
        sqlx::query_as(sqlx::AssertSqlSafe(text))
            .bind(partitions)
            .bind(vec![1_i64; partitions.len()])
            .bind(cursors)
            .bind(instance)
            .bind(Vec::<String>::new())
            .bind(100_i64)
            .bind(7_i64)
            .bind(65_536_i64)
    }

    async fn plan(pool: &PgPool, sql: &str, partitions: &[i16]) -> String {
        let explain = format!("EXPLAIN (FORMAT TEXT) {sql}");
        let cursors = partitions.iter().map(|&p| (p % 2 == 1).then_some("key-500")).collect();
        let rows: Vec<(String,)> =
            fetch_bound(explain, partitions, cursors, uuid::Uuid::now_v7()).fetch_all(pool).await.unwrap();
        rows.into_iter().map(|(line,)| line).collect::<Vec<_>>().join("\n")
    }

    /// What a fetch reads does not grow with the backlog: the same fetch (every partition, 100 heads
    /// and 7 records after each) on 10 and on 100 records per key of 2,000 keys returns the same rows
    /// and reads about as many buffers (`EXPLAIN (ANALYZE, BUFFERS)`).
    #[sqlx::test(migrations = false)]
    async fn a_fetch_reads_as_much_from_a_large_backlog_as_from_a_small_one(pool: PgPool) {
        let (small_rows, small, _) = fetch_read(&pool, 10, 0).await;
        let (large_rows, large, _) = fetch_read(&pool, 100, 0).await;
        assert_eq!((small_rows, large_rows), (800, 800), "100 heads and 7 records after each");
        assert!(large * 2 <= small * 3, "buffers read: {small} with 10 records per key, {large} with 100");
    }

    /// Keys whose head is scheduled for later (1,900 of the 2,000) never take a place in a batch: the
    /// fetch passes over them to fill its 100 heads from the others, and reads one index entry per key
    /// passed over whatever its backlog (as buffers read with 10 and 100 records per key show).
    #[sqlx::test(migrations = false)]
    async fn records_not_yet_due_never_fill_a_batch(pool: PgPool) {
        let (small_rows, small, small_keys) = fetch_read(&pool, 10, 1_900).await;
        let (large_rows, large, large_keys) = fetch_read(&pool, 100, 1_900).await;
        assert_eq!((small_rows, large_rows), (800, 800), "100 heads and 7 records after each");
        assert!(small_keys.iter().chain(&large_keys).all(|&k| k > 1_900), "a head not yet due was fetched");
        assert!(large * 2 <= small * 3, "buffers read: {small} with 10 records per key, {large} with 100");
    }

    /// Keys whose every record waits (here one each, scheduled an hour from now or FAILED: reminders, or
    /// what a broker's outage left) cost the fetch nothing: beside 20,000 of them it reads about as many
    /// buffers as without, and serves the same heads. Walking every key, it read each of them on every
    /// poll (5 s a poll beside a million).
    #[sqlx::test(migrations = false)]
    async fn keys_whose_records_all_wait_cost_the_fetch_nothing(pool: PgPool) {
        let instance = fill(&pool, 10, 0).await;
        let (alone_rows, alone, alone_keys) = fetch_once(&pool, instance).await;
        insert_waiting_keys(&pool, 20_000).await;
        let (beside_rows, beside, beside_keys) = fetch_once(&pool, instance).await;
        assert_eq!((alone_rows, beside_rows), (800, 800), "100 heads and 7 records after each");
        assert_eq!(alone_keys, beside_keys);
        assert!(beside * 2 <= alone * 3, "buffers read: {alone} alone, {beside} beside 20,000 waiting keys");
    }

    /// Records whose retry came due take at most half a fetch's batch in a partition: 200 keys retrying
    /// beside 200 keys due at once, in one partition, fill a batch of 100 half and half. Taken first
    /// and without a bound, a storm of retries held back the partition's other keys for as long as it
    /// lasted.
    #[sqlx::test(migrations = false)]
    async fn retries_that_came_due_leave_half_the_batch_to_the_rest(pool: PgPool) {
        let instance = fill(&pool, 0, 0).await;
        sqlx::query(
            "INSERT INTO outbox.records (id, partition, key, seq, event_type, payload, attempts, next_attempt_at)
             SELECT gen_random_uuid(), 0, 'key-' || k, 1, 't', '\\x00', 1,
                    CASE WHEN k % 2 = 0 THEN now() - interval '1 minute' END
             FROM generate_series(1, 400) k",
        )
        .execute(&pool)
        .await
        .unwrap();
        let sql = super::PgStatements::new("outbox", true, true, Duration::from_secs(10));
        let heads = format!(
            "SELECT r.next_attempt_at IS NOT NULL FROM ({}) f JOIN outbox.records r USING (id) WHERE f.walk IS NOT NULL",
            sql.fetch
        );
        let retried: Vec<(bool,)> = fetch_bound(heads, &[0], vec![None], instance).fetch_all(&pool).await.unwrap();
        let came_due = retried.iter().filter(|(r,)| *r).count();
        assert_eq!((came_due, retried.len()), (50, 100), "heads that came due, heads");
    }

    /// Fills the table with `per_key` records for each of 2,000 keys, of which keys 1..=`later` have
    /// their head scheduled an hour from now, and runs one fetch (stop-on-first-failure) of every
    /// partition under `EXPLAIN (ANALYZE, BUFFERS)`: rows returned, buffers read, the keys fetched.
    async fn fetch_read(pool: &PgPool, per_key: i32, later: i32) -> (i64, i64, Vec<i32>) {
        let instance = fill(pool, per_key, later).await;
        fetch_once(pool, instance).await
    }

    /// The table as `fetch_read` reads it, every partition owned by the instance returned.
    async fn fill(pool: &PgPool, per_key: i32, later: i32) -> uuid::Uuid {
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(pool).await.unwrap();
        let instance = uuid::Uuid::now_v7();
        sqlx::query(
            "INSERT INTO outbox.instances (id, name, expires_at) VALUES ($1, 'test', now() + interval '1 day')",
        )
        .bind(instance)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("UPDATE outbox.partitions SET owner = $1, epoch = 1").bind(instance).execute(pool).await.unwrap();
        sqlx::query("TRUNCATE outbox.records").execute(pool).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox.records (id, partition, key, seq, event_type, payload, deliver_at, next_attempt_at)
             SELECT gen_random_uuid(), k % 256, 'key-' || k, s, 't', '\\x00', d.at, d.at
             FROM generate_series(1, 2000) k, generate_series(1, $1) s,
                  LATERAL (SELECT CASE WHEN k <= $2 AND s = 1 THEN now() + interval '1 hour' END AS at) d",
        )
        .bind(per_key)
        .bind(later)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("VACUUM ANALYZE outbox.records").execute(pool).await.unwrap();
        instance
    }

    /// Adds `n` keys of one record each, every other one scheduled an hour from now, the rest FAILED.
    async fn insert_waiting_keys(pool: &PgPool, n: i32) {
        sqlx::query(
            "INSERT INTO outbox.records (id, partition, key, seq, event_type, payload, deliver_at, next_attempt_at, failed_at)
             SELECT gen_random_uuid(), k % 256, 'held-' || k, 1, 't', '\\x00', d.at, d.at,
                    CASE WHEN d.at IS NULL THEN now() END
             FROM generate_series(1, $1) k,
                  LATERAL (SELECT CASE WHEN k % 2 = 0 THEN now() + interval '1 hour' END AS at) d",
        )
        .bind(n)
        .execute(pool)
        .await
        .unwrap();
        sqlx::query("VACUUM ANALYZE outbox.records").execute(pool).await.unwrap();
    }

    /// One fetch as `fetch_read` describes it, of the table as it is.
    async fn fetch_once(pool: &PgPool, instance: uuid::Uuid) -> (i64, i64, Vec<i32>) {
        let sql = super::PgStatements::new("outbox", true, true, Duration::from_secs(10));
        let partitions: Vec<i16> = (0..256).collect();
        let explain = format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}", sql.fetch);
        let (plan,): (serde_json::Value,) =
            fetch_bound(explain, &partitions, vec![None; 256], instance).fetch_one(pool).await.unwrap();
        let served = format!("SELECT DISTINCT key FROM ({}) f", sql.fetch);
        let keys: Vec<(String,)> =
            fetch_bound(served, &partitions, vec![None; 256], instance).fetch_all(pool).await.unwrap();
        let mut keys: Vec<i32> = keys
            .iter()
            .map(|(k,)| k.strip_prefix("key-").unwrap_or_else(|| panic!("{k} fetched")).parse().unwrap())
            .collect();
        keys.sort_unstable();
        let top = &plan[0]["Plan"];
        let blocks = |name: &str| top[name].as_i64().unwrap();
        (top["Actual Rows"].as_i64().unwrap(), blocks("Shared Hit Blocks") + blocks("Shared Read Blocks"), keys)
    }

    /// The fetch must probe `records_ready` once per key, never scan the table, in both
    /// stop-on-first-failure modes, on a table big enough for the planner to care: at 40,000 rows a
    /// completion of 1,000 ids was near the point where a scan costs as much, and one ANALYZE sample in
    /// six or so tipped its plan to one. It reads nothing of `records_partition_key_seq`, which only
    /// libraries before migration 9 read: a later migration can drop it.
    #[sqlx::test(migrations = false)]
    async fn fetch_walks_the_index_without_scanning_records(pool: PgPool) {
        let outbox = Outbox::new(Config::default()).unwrap();
        outbox.migrate(&pool).await.unwrap();
        sqlx::query(
            "INSERT INTO outbox.records (id, partition, key, seq, event_type, payload)
             SELECT gen_random_uuid(), k % 256, 'key-' || k, s, 't', '\\x00'
             FROM generate_series(1, 5000) k, generate_series(1, 20) s",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("ANALYZE outbox.records").execute(&pool).await.unwrap();
        for stop_on_first_failure in [true, false] {
            let sql = super::PgStatements::new("outbox", stop_on_first_failure, true, Duration::from_secs(10));
            let plan = plan(&pool, &sql.fetch, &[0, 1, 2]).await;
            assert!(plan.contains("Index Scan using records_ready"), "{plan}");
            assert!(plan.contains("using records_held"), "{plan}");
            assert!(plan.contains("Index Scan using records_waiting"), "{plan}");
            assert!(!plan.contains("records_partition_key_seq"), "{plan}");
            assert!(!plan.contains("Seq Scan on records"), "{plan}");
            assert!(plan.contains("Recursive Union"), "{plan}");
        }
        // Fenced completion and failure updates find records by primary key, never by reading the fenced
        // partitions, even for a flush-sized batch of ids on a large backlog (generic plans, as sqlx
        // prepares them); failures look their values up by id, without a join.
        sqlx::query("UPDATE outbox.partitions SET epoch = 1").execute(&pool).await.unwrap();
        let ids: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM outbox.records WHERE seq = 1 LIMIT 1000")
            .fetch_all(&pool)
            .await
            .unwrap();
        let partitions: Vec<i16> = (0..256).collect();
        let n = ids.len();
        for keep_completed in [true, false] {
            let sql = super::PgStatements::new("outbox", true, keep_completed, Duration::from_secs(10));
            for (name, text) in [("complete", &sql.complete), ("fail", &sql.fail)] {
                let mut conn = pool.acquire().await.unwrap();
                sqlx::query("SET plan_cache_mode = force_generic_plan").execute(&mut *conn).await.unwrap();
                let explain = format!("EXPLAIN (FORMAT TEXT) {text}");
                let mut query = sqlx::query_as::<_, (String,)>(sqlx::AssertSqlSafe(explain))
                    .bind(&partitions)
                    .bind(vec![uuid::Uuid::now_v7(); 256])
                    .bind(vec![1_i64; 256])
                    .bind(&ids);
                query = if name == "complete" {
                    query.bind(vec!["delivered"; n]).bind(vec![0_i32; n])
                } else {
                    let values: serde_json::Map<String, serde_json::Value> =
                        ids.iter().map(|id| (id.to_string(), serde_json::json!([1, 0, "e", 10, false]))).collect();
                    query.bind(sqlx::types::Json(values))
                };
                let plan: Vec<(String,)> = query.fetch_all(&mut *conn).await.unwrap();
                let plan = plan.into_iter().map(|(l,)| l).collect::<Vec<_>>().join("\n");
                assert!(plan.contains("records_pkey"), "{name}: {plan}");
                assert!(!plan.contains("records_partition_key_seq"), "{name} reads whole partitions: {plan}");
                assert!(!plan.contains("Seq Scan on records"), "{name}: {plan}");
                if name == "fail" {
                    // Joined to its per-row values, each row was compared with every value.
                    assert!(!plan.contains("Nested Loop"), "{name} joins rows to values: {plan}");
                }
            }
        }
    }
}
