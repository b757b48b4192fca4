-- outbox schema for SQLite, version 7: a record's sequence number is its rowid, given by AUTOINCREMENT.
--
-- SQLite numbers an AUTOINCREMENT rowid one past the highest it ever gave the table (kept in
-- `sqlite_sequence`), never reusing one, and one writer at a time holds the write lock to commit: the
-- numbers grow in commit order, as the counter of version 2 did. `schedule` then writes a record in one
-- plain INSERT and reads its number from the statement's result (the last inserted rowid), with no
-- counter row, trigger or RETURNING. The table is rebuilt, since SQLite cannot change a primary key.
CREATE TABLE {s}_records_numbered (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,      -- database-wide, increasing in commit order
    id              BLOB    NOT NULL UNIQUE,                -- UUID v7, stable: the JetStream message id
    partition       INTEGER NOT NULL CHECK (partition BETWEEN 0 AND 255), -- xxh3_64(key) % 256
    key             TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    headers         TEXT    NOT NULL DEFAULT '{}',
    created_at      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER,                                -- NULL: due now
    last_error      TEXT,
    failed_at       INTEGER,                                -- NOT NULL: FAILED, waits for an operator
    requeues        INTEGER NOT NULL DEFAULT 0,
    deliver_at      INTEGER
);
-- Records of version 1, numbered per key, may share numbers across keys; then every record is numbered
-- again, past every number given out, in the order of the old numbers (so each key's keep their
-- order). Otherwise they keep theirs.
INSERT INTO {s}_records_numbered (seq, id, partition, key, event_type, payload, headers, created_at, attempts,
    next_attempt_at, last_error, failed_at, requeues, deliver_at)
SELECT CASE WHEN (SELECT count(*) = count(DISTINCT seq) FROM {s}_records) THEN seq
        ELSE (SELECT last FROM {s}_sequence) + row_number() OVER (ORDER BY seq, key) END,
    id, partition, key, event_type, payload, headers, created_at, attempts, next_attempt_at, last_error,
    failed_at, requeues, deliver_at
FROM {s}_records;
-- The next number continues from the counter, which is past every number given out, even those of
-- records already completed.
DELETE FROM sqlite_sequence WHERE name = '{s}_records_numbered';
INSERT INTO sqlite_sequence (name, seq)
SELECT '{s}_records_numbered', max(last, coalesce((SELECT max(seq) FROM {s}_records_numbered), 0)) FROM {s}_sequence;
DROP TABLE {s}_records;
DROP TABLE {s}_sequence;
ALTER TABLE {s}_records_numbered RENAME TO {s}_records;
CREATE UNIQUE INDEX {s}_records_partition_key_seq ON {s}_records (partition, key, seq);
CREATE INDEX {s}_records_failed ON {s}_records (partition, key, seq) WHERE failed_at IS NOT NULL;
