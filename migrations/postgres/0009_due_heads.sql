-- outbox schema, version 9: a fetch that finds due heads without reading keys that wait.
--
-- Records due at once (neither FAILED nor waiting for a time): the fetch walks their keys, so a key
-- whose records all wait (scheduled for later, backing off, FAILED) costs a poll nothing. Walking every
-- key instead, a million reminders a week out cost each poll seconds. The predicates' columns change
-- only when a record fails, is retried or requeued, so counted calls stay HOT updates.
CREATE INDEX records_ready ON records (partition, key, seq) WHERE failed_at IS NULL AND next_attempt_at IS NULL;

-- The rest, held back (FAILED, or waiting for a time): with the first, every record of a key in
-- sequence order. The fetch asks it whether anything of a key comes before a record it walked to.
CREATE INDEX records_held ON records (partition, key, seq) WHERE failed_at IS NOT NULL OR next_attempt_at IS NOT NULL;

-- Records waiting for a time (a retry's, or the delivery time asked for), by that time: the fetch takes
-- those that came due from here.
CREATE INDEX records_waiting ON records (partition, next_attempt_at)
    WHERE failed_at IS NULL AND next_attempt_at IS NOT NULL;

-- The fetch no longer reads records_partition_key_seq; it stays for the libraries that know only the
-- migrations before this one and walk it (a rolling deploy runs both), until a later migration drops it.
