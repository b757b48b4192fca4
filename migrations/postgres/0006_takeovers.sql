-- outbox schema, version 6: when each partition was last taken from an owner that did not give it up
-- (its lease ran out), by database time. That owner may have ended in the middle of a handler call, so
-- every later owner counts each call of a record scheduled before then before making it.
ALTER TABLE partitions ADD COLUMN taken_over_at timestamptz;
