-- outbox schema, version 7: when an instance's partitions were first taken from it because its lease
-- ran out. Such a lease is never renewed again, however the renewal and the takeover interleave: a
-- renewal waiting for the row behind the takeover finds it set (PostgreSQL re-checks an updated row).
ALTER TABLE instances ADD COLUMN taken_over_at timestamptz;
