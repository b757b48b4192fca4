-- outbox schema, version 3: records scheduled for later.
--
-- The time a record was scheduled to be delivered at, when later than its scheduling; NULL: at once.
-- `next_attempt_at` starts at the same time, so the fetch passes the record over until then (the rule
-- for records backing off). This column stays as it was through retries: delivery latency and the
-- oldest pending age count from it, not from `created_at`.
ALTER TABLE records ADD COLUMN deliver_at timestamptz;
