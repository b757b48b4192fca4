-- outbox schema for SQLite, version 10: whether older libraries still run on a migration's schema (see
-- migrations/postgres/0008).
ALTER TABLE {s}_schema_migrations ADD COLUMN older_versions_run INTEGER NOT NULL DEFAULT 0;
