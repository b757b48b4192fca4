-- outbox schema, version 8: whether a library that knows only the migrations before one still runs on
-- the schema it leaves. A library meeting a migration newer than all it knows reads this, and goes on
-- (a deploy rolled back) where the migration says so, instead of refusing the database.
ALTER TABLE schema_migrations ADD COLUMN older_versions_run boolean NOT NULL DEFAULT false;
