-- outbox schema for MySQL, version 4: instances' delivered counts (see migrations/postgres/0005).
ALTER TABLE {s}_instances ADD COLUMN delivered BIGINT NOT NULL DEFAULT 0;
