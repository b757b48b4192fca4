//! SQLite's statements, written with `{s}` for the table prefix and `{now}` for SQLite's clock, and built
//! once per [`Outbox`](crate::Outbox).

use std::sync::Arc;

use crate::driver::unfinished;

/// SQLite's clock in milliseconds since the Unix epoch; the same value throughout one statement.
pub const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

pub(super) const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS {s}_schema_migrations (
    version    INTEGER PRIMARY KEY,
    name       TEXT    NOT NULL,
    checksum   INTEGER NOT NULL,
    applied_at INTEGER NOT NULL DEFAULT ({now}))";

/// One record; SQLite numbers it (its AUTOINCREMENT rowid, migration 7), and the statement's result
/// carries the number as the last inserted rowid. `$7` and `$8`: its delivery time or delay (ms).
const INSERT: &str =
    "INSERT INTO {s}_records (id, partition, key, event_type, payload, headers, deliver_at, next_attempt_at)
VALUES ($1, $2, $3, $4, $5, $6, {deliver_at}, {deliver_at})";

/// The records of `$1` (JSON `[[hex id, partition, key, type, hex payload, headers, delivery time,
/// delay], …]`) in one statement, inserted (and so numbered) in list order.
const INSERT_MANY: &str =
    "INSERT INTO {s}_records (id, partition, key, event_type, payload, headers, deliver_at, next_attempt_at)
SELECT unhex(j.value ->> 0), j.value ->> 1, j.value ->> 2, j.value ->> 3, unhex(j.value ->> 4), j.value ->> 5,
    {deliver_at}, {deliver_at}
FROM json_each($1) j ORDER BY j.key";

/// When a record asked to be delivered at `{at}` (ms), or `{after}` ms from now, is due, if later than now.
/// `{now}` is cut down to the millisecond, so a delay gets one more: never due before it ran out.
const DELIVER_AT: &str = "(SELECT CASE WHEN due > {now} THEN due END
    FROM (SELECT coalesce({at}, {now} + {after} + ({after} > 0)) AS due))";

/// Renders a stored time (milliseconds since the Unix epoch) as RFC 3339 text, which sqlx decodes into
/// a `DateTime<Utc>` as it does PostgreSQL's `timestamptz`, so both backends share their row types.
const TEXT_TIME: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', {} / 1000.0, 'unixepoch')";

const COLS: &str = "r.id, r.partition, r.key, r.seq, r.event_type, r.payload, r.headers, r.attempts, r.requeues, {time:r.created_at} AS created_at, {time:r.deliver_at} AS deliver_at, {unfinished} AS unfinished";

const DUE: &str = "(r.failed_at IS NULL AND (r.next_attempt_at IS NULL OR r.next_attempt_at <= {now}))";

/// The fetch (see `Db::fetch`): `$1` a JSON array of `[partition, epoch, start key or null]`, `$2` keys
/// in flight (JSON), `$3` heads at most, `$4` followers per head, `$5` the instance. Two kinds of head:
/// - Records that waited for a time and came due (`records_waiting`, partition by partition in
///   `served`'s order, each in its time's order).
/// - Keys with a record due at once, from a loose index scan of `records_ready` written as a recursive
///   walk: partition `i` of `served` (those held and holding records, in order), its keys one index
///   seek apart, first after the start key, then (`wrapped`) from the lowest up to it; a row with no key
///   moves on. `found` counts the heads taken (`{serve}`), so a key costs a few seeks however many
///   records it has, and a key whose records all wait costs nothing.
///
/// Each head only where it is its key's next record: nothing held back before it (`records_held`). The
/// walk leaves the batch's room but what came due takes of its first half, so a storm of retries leaves
/// room for the rest, and what came due takes the room the walk left. Only the walk's heads are numbered
/// (`walk`): they alone say where it stopped. Then up to `$4` records after each head.
const FETCH: &str = "WITH RECURSIVE served(list, n) AS MATERIALIZED (
    SELECT json_group_array(json_array(a.value ->> 0, a.value ->> 2) ORDER BY a.key), count(*)
    FROM json_each($1) a
    JOIN {s}_partitions p ON p.partition = a.value ->> 0 AND p.epoch = a.value ->> 1 AND p.owner = $5
    WHERE EXISTS (SELECT 1 FROM {s}_records e WHERE e.partition = a.value ->> 0)
      AND EXISTS (SELECT 1 FROM {s}_instances l WHERE l.id = $5 AND l.expires_at > {now})
),
came_due AS MATERIALIZED (
    SELECT c.partition, c.key, c.seq FROM json_each((SELECT list FROM served)) s
    CROSS JOIN {s}_records c INDEXED BY {s}_records_waiting ON c.partition = s.value ->> 0
        AND c.failed_at IS NULL AND c.next_attempt_at IS NOT NULL AND c.next_attempt_at <= {now}
    WHERE c.key NOT IN (SELECT value FROM json_each($2))
      AND NOT EXISTS (SELECT 1 FROM {s}_records x INDEXED BY {s}_records_ready
                      WHERE x.partition = c.partition AND x.key = c.key AND x.seq < c.seq AND {ready_x})
      AND NOT EXISTS (SELECT 1 FROM {s}_records x INDEXED BY {s}_records_held
                      WHERE x.partition = c.partition AND x.key = c.key AND x.seq < c.seq AND {held_x})
    LIMIT $3
),
walk(i, partition, after, key, wrapped, found) AS (
    SELECT -1, NULL, NULL, NULL, 1, min((SELECT count(*) FROM came_due), ($3 + 1) / 2)
    UNION ALL
    SELECT CASE WHEN {next} THEN w.i + 1 ELSE w.i END,
        CASE WHEN {next} THEN {next_partition} ELSE w.partition END,
        CASE WHEN {next} THEN {next_after} ELSE w.after END,
        CASE
            WHEN {next} THEN (SELECT min(k.key) FROM {s}_records k
                              WHERE k.partition = {next_partition} AND k.key > coalesce({next_after}, '') AND {ready_k})
            WHEN w.key IS NULL THEN (SELECT min(k.key) FROM {s}_records k
                                     WHERE k.partition = w.partition AND k.key <= w.after AND {ready_k})
            WHEN w.wrapped THEN (SELECT min(k.key) FROM {s}_records k
                                 WHERE k.partition = w.partition AND k.key > w.key AND k.key <= w.after AND {ready_k})
            ELSE (SELECT min(k.key) FROM {s}_records k WHERE k.partition = w.partition AND k.key > w.key AND {ready_k})
        END,
        CASE WHEN {next} THEN 0 WHEN w.key IS NULL THEN 1 ELSE w.wrapped END,
        w.found + (w.key IS NOT NULL AND {serve})
    FROM walk w
    WHERE w.i < (SELECT n FROM served) AND w.found < $3
),
walked_keys AS MATERIALIZED (
    SELECT w.partition, w.key, w.found + 1 AS walk, {first_ready} AS seq
    FROM walk w WHERE w.key IS NOT NULL AND w.found < $3
),
walked AS MATERIALIZED (
    SELECT * FROM walked_keys w WHERE {serve_seq}
),
heads AS (
    SELECT * FROM (SELECT partition, key, NULL AS walk, seq FROM came_due LIMIT $3 - (SELECT count(*) FROM walked))
    UNION ALL
    SELECT partition, key, walk, seq FROM walked
)
SELECT {cols}, {due} AS due, CASE WHEN r.seq = heads.seq THEN heads.walk END AS walk FROM heads
JOIN {s}_records r ON r.partition = heads.partition AND r.key = heads.key AND r.seq >= heads.seq
    AND r.seq <= coalesce((SELECT x.seq FROM {s}_records x WHERE x.partition = heads.partition AND x.key = heads.key
                           AND x.seq >= heads.seq ORDER BY x.seq LIMIT 1 OFFSET $4), 9223372036854775807)";

/// Whether the walk leaves its partition: it ran off the end of it, after wrapping around (or with no
/// start key to wrap around to); then the next partition of `served` and its start key.
const NEXT: &str = "(w.key IS NULL AND (w.wrapped OR w.after IS NULL))";
const NEXT_PARTITION: &str = "(((SELECT list FROM served) -> (w.i + 1)) ->> 0)";
const NEXT_AFTER: &str = "(((SELECT list FROM served) -> (w.i + 1)) ->> 1)";

/// Whether the walk serves key `w.key` of `w.partition`, whose first record due at once is `{seq}`: not
/// in flight, and nothing held back before that record (`{held_x}`: with stop-on-first-failure any
/// record held back, without only one whose time came, which `came_due` serves or leaves for a later
/// fetch).
const SERVE: &str = "(w.key NOT IN (SELECT value FROM json_each($2)) AND NOT EXISTS (
    SELECT 1 FROM {s}_records x INDEXED BY {s}_records_held
    WHERE x.partition = w.partition AND x.key = w.key AND {held_x} AND x.seq < {seq}))";

/// The first record due at once of key `w.key` of `w.partition` (a probe of `records_ready`).
const FIRST_READY: &str = "(SELECT min(h.seq) FROM {s}_records h INDEXED BY {s}_records_ready
    WHERE h.partition = w.partition AND h.key = w.key AND {ready_h})";

/// A record of `{t}` due at once: in `records_ready`.
const READY: &str = "{t}.failed_at IS NULL AND {t}.next_attempt_at IS NULL";

/// A record of `x` held back (FAILED, or waiting for a time): in `records_held`. Without
/// stop-on-first-failure only one that keeps a later record back, one whose time came.
const HELD: &str = "(x.failed_at IS NOT NULL OR x.next_attempt_at IS NOT NULL) {earlier}";

/// The fence: the grants of `$1` (JSON `[[partition, hex owner, epoch], …]`) the partitions' rows still
/// show.
const FENCE: &str = "SELECT p.partition, p.owner, p.epoch FROM json_each($1) g
CROSS JOIN {s}_partitions p
    ON p.partition = g.value ->> 0 AND p.owner = unhex(g.value ->> 1) AND p.epoch = g.value ->> 2";

/// Copies the completed records of `$1` (JSON `[[hex id, attempts, outcome], …]`) still there, each
/// found by its id.
const KEEP: &str =
    "INSERT INTO {s}_completed (id, partition, key, seq, event_type, payload, headers, created_at, attempts, outcome)
SELECT r.id, r.partition, r.key, r.seq, r.event_type, r.payload, r.headers, r.created_at, j.value ->> 1, j.value ->> 2
FROM json_each($1) j CROSS JOIN {s}_records r ON r.id = unhex(j.value ->> 0)";

const DELETE: &str = "DELETE FROM {s}_records WHERE id IN (SELECT unhex(value ->> 0) FROM json_each($1)) RETURNING id";

/// For each record of `$1` (JSON `[[hex id, requeues, attempts, error, failed, delay ms], …]`) still
/// pending and not requeued since it was fetched, a retry at now + the delay, or FAILED: a late retry of
/// this write never undoes an operator's requeue. One statement for the batch, under the write lock that
/// every writer waits for (an outage fails every key in flight at once).
const FAIL: &str = "UPDATE {s}_records AS r SET attempts = j.value ->> 2, last_error = j.value ->> 3,
    next_attempt_at = CASE WHEN j.value ->> 4 THEN NULL ELSE {now} + (j.value ->> 5) END,
    failed_at = CASE WHEN j.value ->> 4 THEN {now} END
FROM json_each($1) j
WHERE r.id = unhex(j.value ->> 0) AND r.failed_at IS NULL AND r.requeues = j.value ->> 1
RETURNING id";

/// Lists FAILED records as PostgreSQL's statement does, found again by their rowid (`seq`); `length`
/// of a payload reads no overflow page.
const LIST_FAILED: &str = "WITH page AS (
    SELECT seq, partition, key, CASE WHEN $7 THEN length(payload) ELSE 0 END AS bytes
    FROM {s}_records
    WHERE failed_at IS NOT NULL AND ($1 IS NULL OR key = $1) AND ($2 IS NULL OR partition = $2)
        AND ($4 IS NULL OR (partition, key, seq) > ($4, $5, $6))
    ORDER BY partition, key, seq LIMIT $3
), listed AS (
    SELECT seq FROM (SELECT seq, sum(bytes) OVER (ORDER BY partition, key, seq) - bytes AS bytes_before FROM page)
    WHERE bytes_before < $8
)
SELECT id, partition, key, seq, event_type, attempts, requeues, last_error,
    {time:created_at} AS created_at, {time:failed_at} AS failed_at, CASE WHEN $7 THEN payload END AS payload
FROM listed JOIN {s}_records USING (seq)
ORDER BY partition, key, seq";

const REQUEUE: &str =
    "UPDATE {s}_records SET failed_at = NULL, attempts = 0, next_attempt_at = NULL, requeues = requeues + 1
WHERE failed_at IS NOT NULL AND (id = $1 OR key = $2)";

/// The next `$4` FAILED records after (`$1` partition, `$2` key, `$3` seq), in that order, requeued;
/// returns where each was (see `Db::requeue`).
const REQUEUE_ALL: &str =
    "UPDATE {s}_records SET failed_at = NULL, attempts = 0, next_attempt_at = NULL, requeues = requeues + 1
WHERE seq IN (SELECT seq FROM {s}_records WHERE failed_at IS NOT NULL AND (partition, key, seq) > ($1, $2, $3)
    ORDER BY partition, key, seq LIMIT $4)
RETURNING partition, key, seq";

const SKIP_KEEP: &str =
    "INSERT INTO {s}_completed (id, partition, key, seq, event_type, payload, headers, created_at, attempts, outcome)
SELECT id, partition, key, seq, event_type, payload, headers, created_at, attempts, 'skipped'
FROM {s}_records WHERE id = $1 AND failed_at IS NOT NULL";

const SKIP_DELETE: &str = "DELETE FROM {s}_records WHERE id = $1 AND failed_at IS NOT NULL RETURNING id";

/// Per partition: pending (due by their delivery time), scheduled for later, FAILED, and how long the
/// oldest pending record has been due.
const STATS: &str = "SELECT partition,
    count(*) FILTER (WHERE failed_at IS NULL AND coalesce(deliver_at, created_at) <= {now}) AS pending,
    count(*) FILTER (WHERE failed_at IS NULL AND deliver_at > {now}) AS scheduled,
    count(*) FILTER (WHERE failed_at IS NOT NULL) AS failed,
    ({now} - min(coalesce(deliver_at, created_at))
        FILTER (WHERE failed_at IS NULL AND coalesce(deliver_at, created_at) <= {now})) / 1000.0 AS oldest_pending_secs
FROM {s}_records GROUP BY partition ORDER BY partition";

const PURGE: &str = "DELETE FROM {s}_completed WHERE id IN (
    SELECT id FROM {s}_completed WHERE completed_at < {now} - $1 ORDER BY completed_at LIMIT $2)";

/// Records message `$2` of source `$1` as applied, unless it is already (see `Conn::accept`).
const ACCEPT: &str = "INSERT INTO {s}_inbox (source, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";

/// Records event `$3` of key `$2` of source `$1` as the key's last applied, if later than the last.
const ACCEPT_IN_ORDER: &str = "INSERT INTO {s}_inbox_keys (source, key, last_seq) VALUES ($1, $2, $3)
ON CONFLICT (source, key) DO UPDATE SET last_seq = excluded.last_seq WHERE last_seq < excluded.last_seq";

/// Deletes at most `$2` inbox rows older than `$1` ms.
const PURGE_INBOX: &str = "DELETE FROM {s}_inbox WHERE (source, message_id) IN (
    SELECT source, message_id FROM {s}_inbox WHERE accepted_at < {now} - $1 ORDER BY accepted_at LIMIT $2)";

/// SQLite's statements, built for one table prefix and mode.
#[derive(Debug)]
pub struct SqliteStatements {
    pub(super) schema: String,
    pub(super) insert: Arc<str>,
    pub(super) insert_many: Arc<str>,
    pub(super) fetch: Arc<str>,
    pub(super) fence: Arc<str>,
    pub(super) keep: Option<Arc<str>>,
    pub(super) delete: Arc<str>,
    pub(super) fail: Arc<str>,
    pub(super) list_failed: Arc<str>,
    pub(super) requeue: Arc<str>,
    pub(super) requeue_all: Arc<str>,
    pub(super) skip_keep: Arc<str>,
    pub(super) skip_delete: Arc<str>,
    pub(super) stats: Arc<str>,
    pub(super) purge: Arc<str>,
    pub(super) accept: Arc<str>,
    pub(super) accept_in_order: Arc<str>,
    pub(super) purge_inbox: Arc<str>,
}

/// Renders a SQLite statement: `{s}` becomes the table prefix (the configured schema name), `{now}`
/// SQLite's clock in milliseconds since the Unix epoch (as the outbox tables store times), `{time:COLUMN}`
/// such a stored time as RFC 3339 text (which sqlx decodes into `DateTime<Utc>`), `{cols}` the record
/// columns, `{due}` the due test of `r`. For crates that add statements over the outbox tables
/// (`outbox-cluster`).
pub fn render(text: &str, schema: &str) -> Arc<str> {
    let mut text = text
        .replace("{cols}", COLS)
        .replace("{unfinished}", &unfinished())
        .replace("{due}", DUE)
        .replace("{now}", NOW_MS)
        .replace("{s}", schema);
    while let Some(start) = text.find("{time:") {
        let Some(end) = text[start..].find('}').map(|n| start + n) else { break };
        let column = text[start + 6..end].to_string();
        text.replace_range(start..=end, &TEXT_TIME.replace("{}", &column));
    }
    text.into()
}

impl SqliteStatements {
    /// `schema` must already be validated as an identifier.
    pub(crate) fn new(schema: &str, stop_on_first_failure: bool, keep_completed: bool) -> Self {
        let build = |text: &str| render(text, schema);
        let deliver_at = |text: &str, at: &str, after: &str| {
            text.replace("{deliver_at}", &DELIVER_AT.replace("{at}", at).replace("{after}", after))
        };
        let earlier = if stop_on_first_failure { "" } else { "AND x.failed_at IS NULL AND x.next_attempt_at <= {now}" };
        let fetch = FETCH
            .replace("{next_partition}", NEXT_PARTITION)
            .replace("{next_after}", NEXT_AFTER)
            .replace("{next}", NEXT)
            // The walk finds the key's first ready record to decide; `walked` has it as a column.
            .replace("{serve_seq}", &SERVE.replace("{seq}", "w.seq"))
            .replace("{serve}", &SERVE.replace("{seq}", FIRST_READY))
            .replace("{first_ready}", FIRST_READY)
            .replace("{held_x}", &HELD.replace("{earlier}", earlier))
            .replace("{ready_x}", &READY.replace("{t}", "x"))
            .replace("{ready_k}", &READY.replace("{t}", "k"))
            .replace("{ready_h}", &READY.replace("{t}", "h"));
        Self {
            schema: schema.to_string(),
            insert: build(&deliver_at(INSERT, "$7", "$8")),
            insert_many: build(&deliver_at(INSERT_MANY, "j.value ->> 6", "j.value ->> 7")),
            fetch: build(&fetch),
            fence: build(FENCE),
            keep: keep_completed.then(|| build(KEEP)),
            delete: build(DELETE),
            fail: build(FAIL),
            list_failed: build(LIST_FAILED),
            requeue: build(REQUEUE),
            requeue_all: build(REQUEUE_ALL),
            skip_keep: build(SKIP_KEEP),
            skip_delete: build(SKIP_DELETE),
            stats: build(STATS),
            purge: build(PURGE),
            accept: build(ACCEPT),
            accept_in_order: build(ACCEPT_IN_ORDER),
            purge_inbox: build(PURGE_INBOX),
        }
    }
}
