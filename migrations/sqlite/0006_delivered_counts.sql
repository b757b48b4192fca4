-- outbox schema for SQLite, version 6: instances' delivered counts (see migrations/postgres/0005).
ALTER TABLE {s}_instances ADD COLUMN delivered INTEGER NOT NULL DEFAULT 0;
