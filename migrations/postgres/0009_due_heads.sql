-- outbox schema, version 9: a fetch that finds due heads without reading keys that wait.
--
-- Records due at once (neither FAILED nor waiting for a time): the fetch walks their keys, so a key
-- whose records all wait (scheduled for later, backing off, FAILED) costs a poll nothing. Walking every
-- key instead, a million reminders a week out cost each poll seconds. Its predicate's columns change
-- only when a record fails, is retried or requeued, so completions and counted calls stay HOT updates.
CREATE INDEX records_ready ON records (partition, key, seq) WHERE failed_at IS NULL AND next_attempt_at IS NULL;

-- Records waiting for a time (a retry's, or the delivery time asked for), by that time: the fetch takes
-- those that came due from here.
CREATE INDEX records_waiting ON records (partition, next_attempt_at)
    WHERE failed_at IS NULL AND next_attempt_at IS NOT NULL;

-- `records_partition_key_seq` stays: the fetch checks each key's head and reads its followers there,
-- and libraries that know only the migrations before this one walk it (a rolling deploy runs both).
