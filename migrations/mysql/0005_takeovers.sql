-- outbox schema for MySQL, version 5: partitions' last takeover time (see migrations/postgres/0006).
ALTER TABLE {s}_partitions ADD COLUMN taken_over_at DATETIME(6) NULL;
