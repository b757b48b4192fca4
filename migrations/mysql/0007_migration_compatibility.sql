-- outbox schema for MySQL, version 7: whether older libraries still run on a migration's schema (see
-- migrations/postgres/0008).
ALTER TABLE {s}_schema_migrations ADD COLUMN older_versions_run BOOLEAN NOT NULL DEFAULT FALSE;
