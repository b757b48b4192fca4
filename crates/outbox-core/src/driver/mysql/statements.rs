//! MySQL's statements, written with `{s}` for the table prefix, and built once per
//! [`Outbox`](crate::Outbox). Lists travel as one JSON argument each, opened with `JSON_TABLE`; keys in
//! them are `VARBINARY`, so every comparison with a key is byte for byte, but for the bounds of the
//! fetch's index ranges: those are utf8mb4 text, which an index range needs, compared in the column's
//! binary collation (which wins over the list's default one). `key` and `partition` are
//! reserved words, always quoted. A list joined with a table comes first (`STRAIGHT_JOIN`) and finds
//! each row by primary key (`FORCE INDEX`): on a table its statistics call small, MariaDB would rather
//! scan it, and a scan in a locking statement locks every row, which deadlocks two workers' completions.

use std::sync::Arc;
use std::time::Duration;

use crate::driver::unfinished;

/// The server's clock, UTC, as the tables store times.
pub const NOW: &str = "UTC_TIMESTAMP(6)";

pub(super) const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS {s}_schema_migrations (
    version    BIGINT       NOT NULL PRIMARY KEY,
    name       VARCHAR(256) NOT NULL,
    checksum   BIGINT       NOT NULL,
    applied_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6))
) ENGINE = InnoDB";

/// Upserts the lock rows of the keys in `?` (JSON `[[key, partition], …]`, sorted, so two writers take
/// their locks in one order): each row stays locked until the caller's transaction ends.
const LOCK_KEYS: &str = "INSERT INTO {s}_keys (`key`, `partition`)
SELECT j.k, j.p FROM JSON_TABLE(?, '$[*]' COLUMNS (
    k VARCHAR(512) CHARACTER SET utf8mb4 PATH '$[0]', p SMALLINT PATH '$[1]')) j
ON DUPLICATE KEY UPDATE `partition` = {s}_keys.`partition`";

/// Inserts the records of `?` (JSON `[[hex id, partition, key, type, base64 payload, headers, delivery
/// time, delay in ms], …]`) in batch order, so the table's AUTO_INCREMENT numbers them in that order. A
/// record to deliver later is due then (`next_attempt_at`), if that is later than now.
const INSERT: &str =
    "INSERT INTO {s}_records (id, `partition`, `key`, event_type, payload, headers, deliver_at, next_attempt_at)
SELECT UNHEX(j.id), j.p, j.k, j.t, FROM_BASE64(j.payload), j.h, {deliver_at}, {deliver_at}
FROM JSON_TABLE(?, '$[*]' COLUMNS (
    ord FOR ORDINALITY, id CHAR(32) PATH '$[0]', p SMALLINT PATH '$[1]',
    k VARCHAR(512) CHARACTER SET utf8mb4 PATH '$[2]', t VARCHAR(256) CHARACTER SET utf8mb4 PATH '$[3]',
    payload LONGTEXT PATH '$[4]', h LONGTEXT CHARACTER SET utf8mb4 PATH '$[5]', at DATETIME(6) PATH '$[6]',
    after_ms BIGINT PATH '$[7]')) j
ORDER BY j.ord";

/// When a record of `j` is due, if later than now.
const DELIVER_AT: &str =
    "IF(COALESCE(j.at, UTC_TIMESTAMP(6) + INTERVAL (j.after_ms * 1000) MICROSECOND) > UTC_TIMESTAMP(6),
    COALESCE(j.at, UTC_TIMESTAMP(6) + INTERVAL (j.after_ms * 1000) MICROSECOND), NULL)";

/// The numbers the records of `?` (JSON array of hex ids) were given.
const NUMBERS: &str = "SELECT r.id, r.seq FROM JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(32) PATH '$')) j
STRAIGHT_JOIN {s}_records r FORCE INDEX (PRIMARY) ON r.id = UNHEX(j.id)";

const COLS: &str =
    "r.id, r.`partition`, r.`key`, r.seq, r.event_type, r.payload, r.headers, r.attempts, r.requeues, r.created_at,
    r.deliver_at, {unfinished} AS unfinished";

const DUE: &str = "(r.failed_at IS NULL AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= UTC_TIMESTAMP(6)))";

/// The fetch (see `Db::fetch`): `?` the walk's segments (JSON `[[partition, epoch, keys after, keys up
/// to or null], …]` in walk order: each partition's keys after its start key, then, if it has one, those
/// up to it), `?` `?` the instance (fence and lease), `?` index entries the walk reads at most, `?` keys
/// in flight (JSON), `?` heads at most, `?` followers per head, `?` payload bytes per run (a head always
/// comes). The runs' payloads are measured in a derived table without them, and only those within the
/// budget are sent: the client cut the runs alone before, after every follower's payload had come over
/// the wire (32 times what it kept, for runs of large payloads).
///
/// The walk reads the (partition, key, seq) index segment after segment and stops at its `LIMIT`, so a
/// fetch reads as much of a backlog of 100,000 keys as of 1,000 (grouping every key of the partitions
/// first, it took 30 s at 100,000 keys, past any time limit). MariaDB has no lateral join; its "range
/// checked for each record" gives each segment its own index range, which it takes only for a partition
/// bounded on both sides (`>=` and `<=`: for `=` it reads the partition from its start) and keys compared
/// as characters (as bytes, not at all), each bounded (an `OR IS NULL` reads to the partition's end).
/// That costs a few microseconds per segment, so segments of partitions without records are passed
/// over first, by one index probe each (a scalar subquery: as `EXISTS`, MariaDB read every record's
/// partition to build a set of them). The walk's order is the join's, segment by segment in index
/// order (a `LIMIT` with an `ORDER BY` would read everything to sort it; the plan is pinned by a test),
/// and a head is served only if the index shows it is its key's first record. It is referenced once (each
/// reference to a CTE walks again), so the last key of a walk that read all it may is marked in the
/// same pass (`stop`), and served only if it is a head.
/// Each head's followers are a chain of index probes, each from the key's start (followers² index
/// entries per head), the `ORDER BY seq LIMIT 1` probes naming their index (on a table just refilled,
/// MariaDB walked the whole `seq` index for each follower). The keys in flight are a derived table joined
/// once (as `NOT IN`, a dependent subquery read the list again for every candidate key).
const FETCH: &str = "WITH RECURSIVE walked AS (
    SELECT a.i, r.`partition`, r.`key`, r.seq
    FROM JSON_TABLE(?, '$[*]' COLUMNS (i FOR ORDINALITY, part SMALLINT PATH '$[0]', epoch BIGINT PATH '$[1]',
        lo VARCHAR(512) CHARACTER SET utf8mb4 PATH '$[2]', hi VARCHAR(512) CHARACTER SET utf8mb4 PATH '$[3]')) a
    STRAIGHT_JOIN {s}_partitions p FORCE INDEX (PRIMARY)
        ON p.`partition` = a.part AND p.epoch = a.epoch AND p.owner = ?
    STRAIGHT_JOIN {s}_records r FORCE INDEX ({s}_records_partition_key_seq)
        ON r.`partition` >= a.part AND r.`partition` <= a.part
        AND r.`key` > a.lo AND r.`key` <= COALESCE(a.hi, {greatest_key})
    WHERE EXISTS (SELECT 1 FROM {s}_instances l WHERE l.id = ? AND l.expires_at > UTC_TIMESTAMP(6))
        AND (SELECT 1 FROM {s}_records e FORCE INDEX ({s}_records_partition_key_seq)
            WHERE e.`partition` = a.part LIMIT 1) IS NOT NULL
    LIMIT ?
), keyed AS (
    SELECT w.`partition`, w.`key`, MIN(w.seq) AS seq,
        CAST(ROW_NUMBER() OVER (ORDER BY MIN(w.i), w.`key`) AS SIGNED) AS walk,
        COUNT(*) OVER () AS `keys`, SUM(COUNT(*)) OVER () AS entries
    FROM walked w GROUP BY w.`partition`, w.`key`
), marked AS (
    SELECT k.`partition`, k.`key`, k.seq, k.walk, busy.k IS NULL AND {serve} AS serve,
        k.walk = k.`keys` AND k.entries >= ? AS stop
    FROM keyed k
    LEFT JOIN (SELECT DISTINCT x.k FROM JSON_TABLE(?, '$[*]' COLUMNS (k VARBINARY(2048) PATH '$')) x) busy
        ON busy.k = k.`key`
), heads AS (
    SELECT k.`partition`, k.`key`, IF(k.serve, {head_seq}, k.seq) AS seq, k.walk, k.serve, k.stop
    FROM marked k WHERE k.serve OR k.stop
    ORDER BY k.walk LIMIT ?
), chain AS (
    SELECT heads.`partition`, heads.`key`, heads.seq, heads.walk, heads.serve, heads.stop, 0 AS depth FROM heads
    UNION ALL
    SELECT c.`partition`, c.`key`, (SELECT x.seq FROM {s}_records x FORCE INDEX ({s}_records_partition_key_seq)
        WHERE x.`partition` = c.`partition` AND x.`key` = c.`key` AND x.seq > c.seq ORDER BY x.seq LIMIT 1),
        c.walk, c.serve, FALSE, c.depth + 1
    FROM chain c WHERE c.seq IS NOT NULL AND c.serve AND c.depth < ?
), bounded AS (
    SELECT c.`partition`, c.`key`, c.seq, c.walk, c.serve, c.stop, c.depth,
        SUM(LENGTH(x.payload)) OVER (PARTITION BY c.`partition`, c.`key` ORDER BY c.seq) AS run_bytes
    FROM chain c JOIN {s}_records x ON x.`partition` = c.`partition` AND x.`key` = c.`key` AND x.seq = c.seq
)
SELECT {cols}, {due} AND (b.depth > 0 OR b.serve) AS due, IF(b.depth = 0, b.walk, NULL) AS walk,
    b.stop = 1 AS stop
FROM bounded b JOIN {s}_records r ON r.`partition` = b.`partition` AND r.`key` = b.`key` AND r.seq = b.seq
WHERE b.depth = 0 OR b.run_bytes <= ?";

/// Greater than or equal to every key a `VARCHAR(512)` holds, in the keys' collation (byte order): 512
/// times the highest code point.
const GREATEST_KEY: &str = "CONVERT(REPEAT(x'F48FBFBF', 512) USING utf8mb4)";

/// With stop-on-first-failure, a key's head is its lowest sequence, served if due. The lowest the walk
/// read is checked against the index, one probe as the due check alone was: a server walking in
/// another order than the index's could stop past a key's first record, and serve a later one first.
const HEAD_LOWEST: &str = "k.seq";
const SERVE_HEAD_DUE: &str = "COALESCE((SELECT r.seq = k.seq AND {due}
    FROM {s}_records r FORCE INDEX ({s}_records_partition_key_seq)
    WHERE r.`partition` = k.`partition` AND r.`key` = k.`key` ORDER BY r.seq LIMIT 1), FALSE)";

/// Without, its lowest due sequence, served if there is one.
const HEAD_LOWEST_DUE: &str = "(SELECT r.seq FROM {s}_records r FORCE INDEX ({s}_records_partition_key_seq)
    WHERE r.`partition` = k.`partition` AND r.`key` = k.`key` AND {due} ORDER BY r.seq LIMIT 1)";
const SERVE_ANY_DUE: &str = "EXISTS (SELECT 1 FROM {s}_records r
    WHERE r.`partition` = k.`partition` AND r.`key` = k.`key` AND {due})";

/// The fence: the grants of `?` (JSON `[[partition, hex owner, epoch], …]`) the partitions' rows still
/// show, locked against change until commit.
const FENCE: &str = "SELECT p.`partition`, p.owner, p.epoch
FROM JSON_TABLE(?, '$[*]' COLUMNS (part SMALLINT PATH '$[0]', owner CHAR(32) PATH '$[1]', epoch BIGINT PATH '$[2]')) g
STRAIGHT_JOIN {s}_partitions p FORCE INDEX (PRIMARY)
    ON p.`partition` = g.part AND p.owner = UNHEX(g.owner) AND p.epoch = g.epoch
LOCK IN SHARE MODE";

/// The completed records of `?` (JSON `[[hex id, attempts, outcome], …]`) still there, locked.
const LOCK_DONE: &str = "SELECT r.id FROM JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(32) PATH '$[0]')) j
STRAIGHT_JOIN {s}_records r FORCE INDEX (PRIMARY) ON r.id = UNHEX(j.id)
FOR UPDATE";

const KEEP: &str =
    "INSERT INTO {s}_completed (id, `partition`, `key`, seq, event_type, payload, headers, created_at, attempts, outcome)
SELECT r.id, r.`partition`, r.`key`, r.seq, r.event_type, r.payload, r.headers, r.created_at, j.attempts, j.outcome
FROM JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(32) PATH '$[0]', attempts INT PATH '$[1]', outcome VARCHAR(16) PATH '$[2]')) j
STRAIGHT_JOIN {s}_records r FORCE INDEX (PRIMARY) ON r.id = UNHEX(j.id)";

/// A join, so each record is found by its primary key (`id IN (SELECT …)` read, and locked, every record).
const DELETE: &str = "DELETE r FROM JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(32) PATH '$[0]')) j
STRAIGHT_JOIN {s}_records r FORCE INDEX (PRIMARY) ON r.id = UNHEX(j.id)";

/// The failed deliveries of `?` (JSON `[[hex id, requeues, attempts, error, failed 0/1, delay ms], …]`).
const FAILURES: &str = "JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(32) PATH '$[0]', requeues INT PATH '$[1]',
    attempts INT PATH '$[2]', err VARCHAR(4096) CHARACTER SET utf8mb4 PATH '$[3]', failed INT PATH '$[4]',
    delay_ms BIGINT PATH '$[5]')) j
STRAIGHT_JOIN {s}_records r FORCE INDEX (PRIMARY) ON r.id = UNHEX(j.id)";

/// A record of [`FAILURES`] still pending and not requeued since it was fetched.
const STILL_FAILING: &str = "r.failed_at IS NULL AND r.requeues = j.requeues";

/// The records [`FAIL`] writes, locked (MySQL's `UPDATE` returns no rows).
const LOCK_FAILING: &str = "SELECT r.id FROM {failures} WHERE {still_failing} FOR UPDATE";

/// A retry at now + the delay, or FAILED, of each record of [`FAILURES`] still pending and not requeued
/// since it was fetched: a late retry of this write never undoes an operator's requeue. One statement
/// for the whole batch: a statement for each record took a batch of failures (an outage fails every
/// key) past `query_timeout` a few milliseconds from the database.
const FAIL: &str = "UPDATE {failures}
SET r.attempts = j.attempts, r.last_error = j.err,
    r.next_attempt_at = IF(j.failed, NULL, UTC_TIMESTAMP(6) + INTERVAL (j.delay_ms * 1000) MICROSECOND),
    r.failed_at = IF(j.failed, UTC_TIMESTAMP(6), NULL)
WHERE {still_failing}";

/// Lists FAILED records as PostgreSQL's statement does, but InnoDB reads each candidate's payload to
/// measure it (only those listed are sent). Binds: payloads, key, key, partition,
/// partition, after partition, after partition, after key, after seq, limit, payload bytes, payloads.
const LIST_FAILED: &str = "WITH page AS (
    SELECT id, `partition`, `key`, seq, CASE WHEN ? THEN LENGTH(payload) ELSE 0 END AS bytes
    FROM {s}_records
    WHERE failed_at IS NOT NULL AND (? IS NULL OR `key` = ?) AND (? IS NULL OR `partition` = ?)
        AND (? IS NULL OR (`partition`, `key`, seq) > (?, ?, ?))
    ORDER BY `partition`, `key`, seq LIMIT ?
), listed AS (
    SELECT id FROM (SELECT id, SUM(bytes) OVER (ORDER BY `partition`, `key`, seq) - bytes AS bytes_before FROM page) w
    WHERE bytes_before < ?
)
SELECT id, `partition`, `key`, seq, event_type, attempts, requeues, last_error, created_at, failed_at,
    CASE WHEN ? THEN payload END AS payload
FROM listed JOIN {s}_records USING (id)
ORDER BY `partition`, `key`, seq";

/// Binds: id, key.
const REQUEUE: &str =
    "UPDATE {s}_records SET failed_at = NULL, attempts = 0, next_attempt_at = NULL, requeues = requeues + 1
WHERE failed_at IS NOT NULL AND (id = ? OR `key` = ?)";

/// The next `?` FAILED records after (partition, key, seq) `?`, in that order, locked: their ids and
/// places (see `Db::requeue`). Walked in the index's order (a sort would read, and lock, every FAILED
/// record first), the place spelled out, which MySQL reads through the index where it does not a row
/// comparison.
const REQUEUE_NEXT: &str =
    "SELECT id, `partition`, `key`, seq FROM {s}_records FORCE INDEX ({s}_records_partition_key_seq)
WHERE failed_at IS NOT NULL
  AND (`partition` > ? OR (`partition` = ? AND (`key` > ? OR (`key` = ? AND seq > ?))))
ORDER BY `partition`, `key`, seq LIMIT ? FOR UPDATE";

/// Requeues the records of `?` (JSON `[hex id, …]`), each found by its primary key.
const REQUEUE_LISTED: &str = "UPDATE JSON_TABLE(?, '$[*]' COLUMNS (id CHAR(32) PATH '$')) j
STRAIGHT_JOIN {s}_records r FORCE INDEX (PRIMARY) ON r.id = UNHEX(j.id)
SET r.failed_at = NULL, r.attempts = 0, r.next_attempt_at = NULL, r.requeues = r.requeues + 1
WHERE r.failed_at IS NOT NULL";

/// Locks a FAILED record for its skip, reading it as a concurrent requeue left it: the copy below reads
/// without locks (READ COMMITTED), so without this it copied a record a requeue was making pending.
const SKIP_LOCK: &str = "SELECT 1 FROM {s}_records WHERE id = ? AND failed_at IS NOT NULL FOR UPDATE";

const SKIP_KEEP: &str =
    "INSERT INTO {s}_completed (id, `partition`, `key`, seq, event_type, payload, headers, created_at, attempts, outcome)
SELECT id, `partition`, `key`, seq, event_type, payload, headers, created_at, attempts, 'skipped'
FROM {s}_records WHERE id = ? AND failed_at IS NOT NULL";

const SKIP_DELETE: &str = "DELETE FROM {s}_records WHERE id = ? AND failed_at IS NOT NULL";

/// Per partition: pending (due by their delivery time), scheduled for later, FAILED, and how long the
/// oldest pending record has been due.
const STATS: &str = "SELECT `partition`,
    CAST(SUM(failed_at IS NULL AND COALESCE(deliver_at, created_at) <= UTC_TIMESTAMP(6)) AS SIGNED) AS pending,
    CAST(SUM(failed_at IS NULL AND COALESCE(deliver_at > UTC_TIMESTAMP(6), FALSE)) AS SIGNED) AS scheduled,
    CAST(SUM(failed_at IS NOT NULL) AS SIGNED) AS failed,
    TIMESTAMPDIFF(MICROSECOND, MIN(IF(failed_at IS NULL AND COALESCE(deliver_at, created_at) <= UTC_TIMESTAMP(6),
        COALESCE(deliver_at, created_at), NULL)), UTC_TIMESTAMP(6)) / 1e6 AS oldest_pending_secs
FROM {s}_records GROUP BY `partition` ORDER BY `partition`";

/// Binds: retention ms, limit.
const PURGE: &str = "DELETE FROM {s}_completed WHERE completed_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND
ORDER BY completed_at LIMIT ?";

/// Records message `?` (second) of source `?` as applied, unless it is already (see `Conn::accept`).
/// `IGNORE` passes over only the duplicate here: the lengths are checked before.
const ACCEPT: &str = "INSERT IGNORE INTO {s}_inbox (source, message_id) VALUES (?, ?)";

/// The key's row of a source (`?` source, key, and a seq just before the event's), inserted if it is
/// new, and locked for the update below either way: `INSERT IGNORE` locked an existing row shared, so two
/// consumers of one key each held it and waited for the other to write (a deadlock).
const LOCK_INBOX_KEY: &str = "INSERT INTO {s}_inbox_keys (source, `key`, last_seq) VALUES (?, ?, ?)
ON DUPLICATE KEY UPDATE last_seq = last_seq";

/// Moves the key on to the event (`?` seq, source, key, seq again) if it is later than the last
/// applied, or than the one before it that [`LOCK_INBOX_KEY`] gave a new key. The server counts matched rows
/// (sqlx asks for found rows), so this matches only then.
const ACCEPT_LATER_OF_KEY: &str =
    "UPDATE {s}_inbox_keys SET last_seq = ? WHERE source = ? AND `key` = ? AND last_seq < ?";

/// Binds: retention ms, limit.
const PURGE_INBOX: &str = "DELETE FROM {s}_inbox WHERE accepted_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND
ORDER BY accepted_at LIMIT ?";

/// At most `?` key lock rows whose key has no record left, skipping those a writer holds; locked.
/// Up to `?` key rows after key `?`, in key order, locked (skipping those a writer holds), each with
/// whether its key has no record left. A pass goes on from the last, so it reads each key row once,
/// as many a statement as the batch's size whatever their records.
const PRUNABLE_KEYS: &str = "SELECT k.`key`,
    NOT EXISTS (SELECT 1 FROM {s}_records r WHERE r.`partition` = k.`partition` AND r.`key` = k.`key`) AS unused
FROM {s}_keys k WHERE k.`key` > ?
ORDER BY k.`key` LIMIT ? FOR UPDATE SKIP LOCKED";

/// A statement on the failed deliveries of one completion batch.
fn failing(text: &str) -> String {
    text.replace("{failures}", FAILURES).replace("{still_failing}", STILL_FAILING)
}

/// Key rows deleted by one statement (see [`MySqlStatements::delete_keys`]).
pub(super) const DELETE_KEYS_AT_ONCE: usize = 100;

/// [`DELETE_KEYS_AT_ONCE`] keys by primary key, the list bound (a short one padded with repeats): one
/// statement text, prepared once. Not a join with a JSON list, whose column's collation is not the
/// key's, so it may read (and lock) every key row; and not one key a round trip, which at a few
/// milliseconds each takes a batch past `query_timeout`.
fn delete_keys() -> String {
    let list = vec!["?"; DELETE_KEYS_AT_ONCE].join(", ");
    format!("DELETE FROM {{s}}_keys WHERE `key` IN ({list})")
}

/// `limit` as MySQL's session time limits (`wait_timeout`, `innodb_lock_wait_timeout`) take it: whole
/// seconds, rounded up, from one to a year.
pub fn session_seconds(limit: Duration) -> u64 {
    (limit.as_secs() + u64::from(limit.subsec_nanos() > 0)).clamp(1, 31_536_000)
}

/// The statement that begins one of the outbox's own transactions ([`transaction`](super::transaction)) for an outbox
/// whose `query_timeout` is `limit`.
pub fn begin_statement(limit: Duration) -> Arc<str> {
    let secs = session_seconds(limit);
    format!(
        "SET @outbox_wait_timeout = @@SESSION.wait_timeout, SESSION wait_timeout = {secs},
             @outbox_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = {secs};
         SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION"
    )
    .into()
}

/// MySQL's statements, built for one table prefix and mode.
#[derive(Debug)]
pub struct MySqlStatements {
    pub(super) schema: String,
    pub(super) begin: Arc<str>,
    pub(super) lock_keys: Arc<str>,
    pub(super) insert: Arc<str>,
    pub(super) numbers: Arc<str>,
    pub(super) fetch: Arc<str>,
    pub(super) fence: Arc<str>,
    pub(super) lock_done: Arc<str>,
    pub(super) keep: Option<Arc<str>>,
    pub(super) delete: Arc<str>,
    pub(super) lock_failing: Arc<str>,
    pub(super) fail: Arc<str>,
    pub(super) list_failed: Arc<str>,
    pub(super) requeue: Arc<str>,
    pub(super) requeue_next: Arc<str>,
    pub(super) requeue_listed: Arc<str>,
    pub(super) skip_lock: Arc<str>,
    pub(super) skip_keep: Arc<str>,
    pub(super) skip_delete: Arc<str>,
    pub(super) stats: Arc<str>,
    pub(super) purge: Arc<str>,
    pub(super) accept: Arc<str>,
    pub(super) lock_inbox_key: Arc<str>,
    pub(super) accept_later_of_key: Arc<str>,
    pub(super) purge_inbox: Arc<str>,
    pub(super) prunable_keys: Arc<str>,
    pub(super) delete_keys: Arc<str>,
}

/// Renders a MySQL statement: `{s}` becomes the table prefix (the configured schema name), `{now}` the
/// server's clock as the tables store it, `{cols}` the record columns, `{due}` the due test of `r`. For
/// crates that add statements over the outbox tables (`outbox-cluster`).
pub fn render(text: &str, schema: &str) -> String {
    text.replace("{cols}", COLS)
        .replace("{unfinished}", &unfinished())
        .replace("{due}", DUE)
        .replace("{now}", NOW)
        .replace("{s}", schema)
}

impl MySqlStatements {
    /// `schema` must already be validated as an identifier.
    pub(crate) fn new(
        schema: &str,
        stop_on_first_failure: bool,
        keep_completed: bool,
        query_timeout: Duration,
    ) -> Self {
        let build = |text: &str| -> Arc<str> { render(text, schema).into() };
        let (head_seq, serve) =
            if stop_on_first_failure { (HEAD_LOWEST, SERVE_HEAD_DUE) } else { (HEAD_LOWEST_DUE, SERVE_ANY_DUE) };
        let fetch =
            FETCH.replace("{head_seq}", head_seq).replace("{serve}", serve).replace("{greatest_key}", GREATEST_KEY);
        Self {
            schema: schema.to_string(),
            begin: begin_statement(query_timeout),
            lock_keys: build(LOCK_KEYS),
            insert: build(&INSERT.replace("{deliver_at}", DELIVER_AT)),
            numbers: build(NUMBERS),
            fetch: build(&fetch),
            fence: build(FENCE),
            lock_done: build(LOCK_DONE),
            keep: keep_completed.then(|| build(KEEP)),
            delete: build(DELETE),
            lock_failing: build(&failing(LOCK_FAILING)),
            fail: build(&failing(FAIL)),
            list_failed: build(LIST_FAILED),
            requeue: build(REQUEUE),
            requeue_next: build(REQUEUE_NEXT),
            requeue_listed: build(REQUEUE_LISTED),
            skip_lock: build(SKIP_LOCK),
            skip_keep: build(SKIP_KEEP),
            skip_delete: build(SKIP_DELETE),
            stats: build(STATS),
            purge: build(PURGE),
            accept: build(ACCEPT),
            lock_inbox_key: build(LOCK_INBOX_KEY),
            accept_later_of_key: build(ACCEPT_LATER_OF_KEY),
            purge_inbox: build(PURGE_INBOX),
            prunable_keys: build(PRUNABLE_KEYS),
            delete_keys: build(&delete_keys()),
        }
    }
}
