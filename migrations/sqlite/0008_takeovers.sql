-- outbox schema for SQLite, version 8: partitions' last takeover time (see migrations/postgres/0006).
ALTER TABLE {s}_partitions ADD COLUMN taken_over_at INTEGER;
