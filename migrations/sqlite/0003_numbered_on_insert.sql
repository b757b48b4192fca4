-- outbox schema for SQLite, version 3: a record can be numbered by the statement that inserts it.
--
-- `schedule` of one record inserts it numbered one past the counter; this trigger then moves the counter
-- to it, inside the same statement, so one record costs one statement and not two (each is a round trip
-- to sqlx's connection thread). Batches still take their numbers first and insert below the counter,
-- which leaves it alone. The write lock held to commit keeps numbers in commit order, as before.
CREATE TRIGGER {s}_records_sequence AFTER INSERT ON {s}_records
WHEN NEW.seq > (SELECT last FROM {s}_sequence)
BEGIN
    UPDATE {s}_sequence SET last = NEW.seq;
END;
