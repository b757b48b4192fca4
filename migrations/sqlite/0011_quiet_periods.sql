-- outbox schema for SQLite, version 11: the end of a partition's quiet period, ms since the Unix epoch
-- (see migrations/postgres/0010).
ALTER TABLE {s}_partitions ADD COLUMN quiet_until INTEGER;
