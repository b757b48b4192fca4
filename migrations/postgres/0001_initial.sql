-- outbox schema, version 1.
--
-- Names are unqualified: the migrator runs this file with `search_path` set to the configured schema
-- (default `outbox`). Users with their own migration tool can do the same:
--   SET search_path TO outbox; \i migrations/0001_initial.sql

-- Per-key serialisation at insert. `schedule` upserts the key's row inside the caller's transaction and
-- holds its row lock until commit, so two transactions writing one key commit in sequence order
-- (per-key order = commit order). Only the primary key is indexed, so the counter update is HOT.
CREATE TABLE keys (
    key      text   PRIMARY KEY,
    last_seq bigint NOT NULL
);

-- Pending and FAILED records. Completion deletes the row (and, when completed records are kept, copies
-- it to `completed`), so the table holds only work still to do and stays small.
-- Mutable columns (attempts, next_attempt_at, last_error) are not indexed, so retries are HOT updates.
CREATE TABLE records (
    id              uuid        PRIMARY KEY,                -- UUID v7, stable: the JetStream message id
    partition       smallint    NOT NULL CHECK (partition BETWEEN 0 AND 255), -- xxh3_64(key) % 256
    key             text        NOT NULL,
    seq             bigint      NOT NULL,                   -- per-key, gapless, in commit order
    event_type      text        NOT NULL,
    payload         bytea       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,                            -- NULL: due now
    last_error      text,
    failed_at       timestamptz                             -- NOT NULL: FAILED, waits for an operator
);

-- The processor's only read path: walk the keys of a partition and take each key's head (lowest seq).
-- Unique because (key, seq) is, and partition is a function of key.
CREATE UNIQUE INDEX records_partition_key_seq ON records (partition, key, seq);

-- Operators list FAILED records; they are few, so the index is tiny. `failed_at` changes only when a
-- record fails or is requeued, so retry updates stay HOT.
CREATE INDEX records_failed ON records (partition, key, seq) WHERE failed_at IS NOT NULL;

-- Completed records kept for `completed_retention` (audit, replay); purged in bounded batches.
-- Append-only: nothing here is updated.
CREATE TABLE completed (
    id           uuid        PRIMARY KEY,
    partition    smallint    NOT NULL,
    key          text        NOT NULL,
    seq          bigint      NOT NULL,
    event_type   text        NOT NULL,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL,
    created_at   timestamptz NOT NULL,
    attempts     integer     NOT NULL,
    outcome      text        NOT NULL CHECK (outcome IN ('delivered', 'fallback', 'skipped')),
    completed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX completed_completed_at ON completed (completed_at);

-- Worker instances. Liveness is judged by database time only: an instance is live while
-- expires_at > now(); each heartbeat moves expires_at to now() + its stale timeout.
CREATE TABLE instances (
    id           uuid        PRIMARY KEY,
    name         text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    draining     boolean     NOT NULL DEFAULT false
);

-- The 256 partitions: owner and fencing epoch. The epoch grows on every change of owner; every write a
-- worker makes for a partition's records first locks this row FOR SHARE with its (owner, epoch).
CREATE TABLE partitions (
    partition    smallint    PRIMARY KEY CHECK (partition BETWEEN 0 AND 255),
    owner        uuid,                                      -- NULL: free
    epoch        bigint      NOT NULL DEFAULT 0,
    target_owner uuid,                                      -- written only by the rebalancer
    changed_at   timestamptz NOT NULL DEFAULT now()
);
INSERT INTO partitions (partition) SELECT generate_series(0, 255);
