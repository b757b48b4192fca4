-- outbox schema for SQLite, version 5: the inbox (see migrations/postgres/0004).
CREATE TABLE {s}_inbox (
    source      TEXT    NOT NULL,
    message_id  TEXT    NOT NULL,
    accepted_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (source, message_id)
) WITHOUT ROWID;
CREATE INDEX {s}_inbox_accepted_at ON {s}_inbox (accepted_at);
CREATE TABLE {s}_inbox_keys (
    source   TEXT    NOT NULL,
    key      TEXT    NOT NULL,
    last_seq INTEGER NOT NULL,
    PRIMARY KEY (source, key)
) WITHOUT ROWID;
