-- outbox schema, version 2: exclusive deliveries (a lease and a later takeover time per instance), a
-- requeue count on records, and one database-wide sequence instead of a counter row per key ever written.

-- An instance counts as live until `expires_at`; its partitions may be taken from `takeover_at` on. The
-- gap is the time the instance itself needs to notice that its lease ended early (a heartbeat that
-- finds the lease expired fences the instance at once), so that no one else delivers its partitions
-- before it has stopped. Each heartbeat renews both, and only a lease that has not expired.
ALTER TABLE instances ADD COLUMN takeover_at timestamptz;
UPDATE instances SET takeover_at = expires_at;
ALTER TABLE instances ALTER COLUMN takeover_at SET NOT NULL;

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
