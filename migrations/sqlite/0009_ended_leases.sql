-- outbox schema for SQLite, version 9: instances' takeover time (see migrations/postgres/0007). A lease
-- whose partitions were taken stays ended even if its expiry reads live again (the host's clock
-- stepped back).
ALTER TABLE {s}_instances ADD COLUMN taken_over_at INTEGER;
