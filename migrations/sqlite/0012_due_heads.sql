-- outbox schema for SQLite, version 12: a fetch that finds due heads without reading keys that wait
-- (see migrations/postgres/0009).
--
-- Records due at once (neither FAILED nor waiting for a time): the fetch walks their keys. The two
-- columns of the predicate are in the index, always NULL there, so the walk reads the index alone.
CREATE INDEX {s}_records_ready ON {s}_records (partition, key, seq, failed_at, next_attempt_at)
    WHERE failed_at IS NULL AND next_attempt_at IS NULL;

-- The rest, held back (FAILED, or waiting for a time): the fetch asks it whether anything of a key
-- comes before a record it walked to.
CREATE INDEX {s}_records_held ON {s}_records (partition, key, seq)
    WHERE failed_at IS NOT NULL OR next_attempt_at IS NOT NULL;

-- Records waiting for a time (a retry's, or the delivery time asked for), by that time: the fetch takes
-- those that came due from here, and passes over those of keys in flight or behind an earlier record
-- without reading the table (the key is in the index, the sequence is the rowid).
CREATE INDEX {s}_records_waiting ON {s}_records (partition, next_attempt_at, key, failed_at)
    WHERE failed_at IS NULL AND next_attempt_at IS NOT NULL;

-- {s}_records_partition_key_seq stays: the fetch reads a head's followers from it, and libraries that
-- know only the migrations before this one walk it (a rolling deploy runs both).
