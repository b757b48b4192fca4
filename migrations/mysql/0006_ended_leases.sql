-- outbox schema for MySQL, version 6: instances' takeover time (see migrations/postgres/0007). A
-- renewal that waited for the row reads it as committed, whatever `SYSDATE()` says under --sysdate-is-now.
ALTER TABLE {s}_instances ADD COLUMN taken_over_at DATETIME(6) NULL;
