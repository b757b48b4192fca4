-- outbox schema for MySQL, version 8: the end of a partition's quiet period (see
-- migrations/postgres/0010).
ALTER TABLE {s}_partitions ADD COLUMN quiet_until DATETIME(6) NULL;
