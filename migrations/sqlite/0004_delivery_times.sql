-- outbox schema for SQLite, version 4: records scheduled for later (see migrations/postgres/0003).
ALTER TABLE {s}_records ADD COLUMN deliver_at INTEGER;
