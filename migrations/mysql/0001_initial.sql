-- outbox schema for MariaDB 10.6+ / MySQL 8.0+, version 1: the tables of migrations/postgres (at its
-- version 2) with MySQL's means.
--
-- A MySQL schema is a database, so the outbox's tables live in the connection's database and the
-- configured schema name (default `outbox`) prefixes them, as on SQLite: the migrator replaces `{s}` with
-- it. `{bin}` is the collation of keys: byte order and no padding (`utf8mb4_nopad_bin` on MariaDB,
-- `utf8mb4_0900_bin` on MySQL), so keys that differ only in trailing spaces stay two keys.
-- Times are DATETIME(6) in UTC, always taken from the server's clock (`UTC_TIMESTAMP(6)`).
-- UUIDs are BINARY(16), headers JSON. `key` and `partition` are reserved words: always quoted.

-- A key's lock row: `schedule` upserts it and holds its row lock until commit, so writers of one key
-- serialise (per-key order = commit order). Only keys with records still pending need one; the purge
-- deletes the others.
CREATE TABLE {s}_keys (
    `key`       VARCHAR(512) CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL PRIMARY KEY,
    `partition` SMALLINT NOT NULL
) ENGINE = InnoDB;

-- Pending and FAILED records; completion deletes the row (copying it to `completed` when kept).
-- `seq` is the table's AUTO_INCREMENT, drawn at insert while the key's lock row is held, so a key's
-- numbers grow in commit order; InnoDB keeps the counter across restarts (MariaDB 10.2.4+, MySQL 8.0+),
-- so numbers never repeat for the life of the database.
CREATE TABLE {s}_records (
    id              BINARY(16)   NOT NULL PRIMARY KEY,      -- UUID v7, stable: the JetStream message id
    `partition`     SMALLINT     NOT NULL CHECK (`partition` BETWEEN 0 AND 255), -- xxh3_64(key) % 256
    `key`           VARCHAR(512) CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    seq             BIGINT       NOT NULL AUTO_INCREMENT,
    event_type      VARCHAR(256) CHARACTER SET utf8mb4 NOT NULL,
    payload         LONGBLOB     NOT NULL,
    headers         JSON         NOT NULL,
    created_at      DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    attempts        INT          NOT NULL DEFAULT 0,
    requeues        INT          NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6),                            -- NULL: due now
    last_error      TEXT CHARACTER SET utf8mb4,
    failed_at       DATETIME(6),                            -- NOT NULL: FAILED, waits for an operator
    UNIQUE KEY {s}_records_partition_key_seq (`partition`, `key`, seq),
    KEY {s}_records_seq (seq),
    KEY {s}_records_failed (failed_at)
) ENGINE = InnoDB;

CREATE TABLE {s}_completed (
    id           BINARY(16)   NOT NULL PRIMARY KEY,
    `partition`  SMALLINT     NOT NULL,
    `key`        VARCHAR(512) CHARACTER SET utf8mb4 COLLATE {bin} NOT NULL,
    seq          BIGINT       NOT NULL,
    event_type   VARCHAR(256) CHARACTER SET utf8mb4 NOT NULL,
    payload      LONGBLOB     NOT NULL,
    headers      JSON         NOT NULL,
    created_at   DATETIME(6)  NOT NULL,
    attempts     INT          NOT NULL,
    outcome      VARCHAR(16)  NOT NULL CHECK (outcome IN ('delivered', 'fallback', 'skipped')),
    completed_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    KEY {s}_completed_completed_at (completed_at)
) ENGINE = InnoDB;

-- Worker instances; live while expires_at > UTC_TIMESTAMP(6) (the server's clock).
CREATE TABLE {s}_instances (
    id           BINARY(16)  NOT NULL PRIMARY KEY,
    name         VARCHAR(256) CHARACTER SET utf8mb4 NOT NULL,
    started_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    heartbeat_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    expires_at   DATETIME(6) NOT NULL,
    heartbeat_ms BIGINT      NOT NULL DEFAULT 0,
    draining     BOOLEAN     NOT NULL DEFAULT FALSE
) ENGINE = InnoDB;

-- The 256 partitions: owner and fencing epoch. Every write a worker makes for a partition's records
-- first locks this row `LOCK IN SHARE MODE` at its (owner, epoch).
CREATE TABLE {s}_partitions (
    `partition`  SMALLINT    NOT NULL PRIMARY KEY CHECK (`partition` BETWEEN 0 AND 255),
    owner        BINARY(16),                                -- NULL: free
    epoch        BIGINT      NOT NULL DEFAULT 0,
    target_owner BINARY(16),                                -- written only by the rebalancer
    changed_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    KEY {s}_partitions_owner (owner)
) ENGINE = InnoDB;
INSERT INTO {s}_partitions (`partition`)
WITH RECURSIVE n (p) AS (SELECT 0 UNION ALL SELECT p + 1 FROM n WHERE p < 255) SELECT p FROM n;
