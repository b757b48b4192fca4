-- outbox schema for MySQL, version 2: records scheduled for later (see migrations/postgres/0003).
ALTER TABLE {s}_records ADD COLUMN deliver_at DATETIME(6) NULL;
