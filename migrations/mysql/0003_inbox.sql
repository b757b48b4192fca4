-- outbox schema for MySQL, version 3: the inbox (see migrations/postgres/0004). Binary strings, so
-- ids compare byte for byte.
CREATE TABLE {s}_inbox (
    source      VARBINARY(256) NOT NULL,
    message_id  VARBINARY(256) NOT NULL,
    accepted_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (source, message_id),
    KEY {s}_inbox_accepted_at (accepted_at)
) ENGINE = InnoDB;
CREATE TABLE {s}_inbox_keys (
    source   VARBINARY(256) NOT NULL,
    `key`    VARBINARY(512) NOT NULL,
    last_seq BIGINT         NOT NULL,
    PRIMARY KEY (source, `key`)
) ENGINE = InnoDB;
