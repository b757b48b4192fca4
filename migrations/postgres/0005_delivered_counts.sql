-- outbox schema, version 5: each instance's count of records it delivered (by its handler or a
-- fallback) since it started, written by its heartbeat, so an operator sees delivered/s per instance and
-- for the cluster without a count over the completed records.
ALTER TABLE instances ADD COLUMN delivered bigint NOT NULL DEFAULT 0;
