-- outbox schema for SQLite, version 2: the same changes as migrations/postgres/0002, with SQLite's means.

-- Live until `expires_at`; its partitions may be taken from `takeover_at` on (see the PostgreSQL file).
ALTER TABLE {s}_instances ADD COLUMN takeover_at INTEGER NOT NULL DEFAULT 0;
UPDATE {s}_instances SET takeover_at = expires_at;

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
