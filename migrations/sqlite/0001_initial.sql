-- outbox schema for SQLite, version 1: the same tables as migrations/postgres, with SQLite's types.
--
-- SQLite has no schemas inside a database file: the configured schema name (default `outbox`) prefixes
-- every table instead, and the migrator replaces `{s}` with it (`{s}_records` → `outbox_records`).
-- Times are integer milliseconds since the Unix epoch, always taken from SQLite's clock
-- (`unixepoch('subsec')`), which is the host's: every instance of one database file runs on its host.
-- UUIDs are 16-byte blobs, headers JSON text.

-- Per-key sequence counter. SQLite has one writer at a time, so a writer of a key holds the database
-- write lock from its first write until commit: per-key order = commit order without row locks.
CREATE TABLE {s}_keys (
    key      TEXT    PRIMARY KEY,
    last_seq INTEGER NOT NULL
) WITHOUT ROWID;

-- Pending and FAILED records; completion deletes the row (copying it to `completed` when kept).
CREATE TABLE {s}_records (
    id              BLOB    PRIMARY KEY,                    -- UUID v7, stable: the JetStream message id
    partition       INTEGER NOT NULL CHECK (partition BETWEEN 0 AND 255), -- xxh3_64(key) % 256
    key             TEXT    NOT NULL,
    seq             INTEGER NOT NULL,                       -- per-key, gapless, in commit order
    event_type      TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    headers         TEXT    NOT NULL DEFAULT '{}',
    created_at      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER,                                -- NULL: due now
    last_error      TEXT,
    failed_at       INTEGER                                 -- NOT NULL: FAILED, waits for an operator
);
CREATE UNIQUE INDEX {s}_records_partition_key_seq ON {s}_records (partition, key, seq);
CREATE INDEX {s}_records_failed ON {s}_records (partition, key, seq) WHERE failed_at IS NOT NULL;

CREATE TABLE {s}_completed (
    id           BLOB    PRIMARY KEY,
    partition    INTEGER NOT NULL,
    key          TEXT    NOT NULL,
    seq          INTEGER NOT NULL,
    event_type   TEXT    NOT NULL,
    payload      BLOB    NOT NULL,
    headers      TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    attempts     INTEGER NOT NULL,
    outcome      TEXT    NOT NULL CHECK (outcome IN ('delivered', 'fallback', 'skipped')),
    completed_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
CREATE INDEX {s}_completed_completed_at ON {s}_completed (completed_at);

-- Worker instances; live while expires_at > now (SQLite's clock).
CREATE TABLE {s}_instances (
    id           BLOB    PRIMARY KEY,
    name         TEXT    NOT NULL,
    started_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    heartbeat_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    expires_at   INTEGER NOT NULL,
    draining     INTEGER NOT NULL DEFAULT 0
);

-- The 256 partitions: owner and fencing epoch. A worker's writes for a partition's records run in a
-- write transaction that first checks (owner, epoch) here; with one writer at a time nobody can move
-- the epoch between that check and the commit.
CREATE TABLE {s}_partitions (
    partition    INTEGER PRIMARY KEY CHECK (partition BETWEEN 0 AND 255),
    owner        BLOB,                                      -- NULL: free
    epoch        INTEGER NOT NULL DEFAULT 0,
    target_owner BLOB,                                      -- written only by the rebalancer
    changed_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
WITH RECURSIVE n(p) AS (SELECT 0 UNION ALL SELECT p + 1 FROM n WHERE p < 255)
INSERT INTO {s}_partitions (partition) SELECT p FROM n;
