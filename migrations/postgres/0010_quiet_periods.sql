-- outbox schema, version 10: the end of a partition's quiet period, by database time. An acquisition
-- from an owner whose lease ran out sets it; every later acquisition, from a dead owner or of the
-- partition free, waits out what is left of it. So the period outlives its acquirer: released, handed
-- on, or lapsed with it, the partition stays undelivered until the owner it was taken from has had time
-- to notice.
ALTER TABLE partitions ADD COLUMN quiet_until timestamptz;
