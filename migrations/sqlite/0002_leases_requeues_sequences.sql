-- outbox schema for SQLite, version 2: the same changes as migrations/postgres/0002, with SQLite's means.

-- The instance's heartbeat interval (see the PostgreSQL file).
ALTER TABLE {s}_instances ADD COLUMN heartbeat_ms INTEGER NOT NULL DEFAULT 0;

-- Operator requeues of the record (a late FAILED write cannot undo a requeue).
ALTER TABLE {s}_records ADD COLUMN requeues INTEGER NOT NULL DEFAULT 0;

-- One database-wide counter for sequence numbers. SQLite has one writer at a time, and a scheduling
-- transaction holds the write lock from its first write to its commit, so numbers grow in commit order
-- for every key; no per-key counter (or lock) row is needed. It starts above every number the per-key
-- counters gave out.
CREATE TABLE {s}_sequence (
    id   INTEGER PRIMARY KEY CHECK (id = 0),
    last INTEGER NOT NULL
);
INSERT INTO {s}_sequence (id, last) SELECT 0, coalesce(max(last_seq), 0) FROM {s}_keys;
DROP TABLE {s}_keys;
