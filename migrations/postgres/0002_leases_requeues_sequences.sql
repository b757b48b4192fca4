-- outbox schema, version 2: exclusive deliveries (each instance's heartbeat interval), a requeue count
-- on records, and one database-wide sequence instead of a counter row per key ever written.

-- The instance's heartbeat interval. An instance that takes partitions from an owner whose lease
-- expired waits two of the owner's intervals before delivering them: the time the owner needs to find
-- its lease expired at its next heartbeat and stop, even if the lease ended early (a clock step).
ALTER TABLE instances ADD COLUMN heartbeat_ms bigint NOT NULL DEFAULT 0;

-- Operator requeues of the record. A worker writes a failure only if the record has not been
-- requeued since it was fetched, so a late retry of a FAILED write cannot undo a requeue.
ALTER TABLE records ADD COLUMN requeues integer NOT NULL DEFAULT 0;

-- Sequence numbers come from one sequence, drawn while the key's lock row is held, so a key's numbers
-- grow in commit order and never repeat for the life of the database, without remembering every key
-- ever written. It starts above every number the per-key counters gave out.
CREATE SEQUENCE record_seq AS bigint;
SELECT setval('record_seq', coalesce((SELECT max(last_seq) FROM keys), 0) + 1, false);

-- A key's lock row: `schedule` upserts it and holds its row lock until commit, so writers of one key
-- serialise. Only keys with records still pending need one; the purge deletes the others.
DROP TABLE keys;
CREATE TABLE keys (
    key       text     PRIMARY KEY,
    partition smallint NOT NULL
);
