-- outbox schema, version 4: the inbox, a consumer's record of the messages it has applied.
--
-- One row per (source, message id) a consumer accepted, written in the consumer's own transaction
-- with the changes the message caused: a redelivered message finds its row and is not applied again.
-- Rows older than the consumer's retention are purged in bounded batches (by `accepted_at`).
CREATE TABLE inbox (
    source      text        NOT NULL,
    message_id  text        NOT NULL,
    accepted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, message_id)
);
CREATE INDEX inbox_accepted_at ON inbox (accepted_at);

-- Per key of a source, the sequence number of the last event applied (an outbox record's `seq`, the
-- `Outbox-Seq` header): a consumer that keeps only the latest state per key skips an older event that
-- arrives after a newer one (a redelivery overtaken by the next event).
CREATE TABLE inbox_keys (
    source   text   NOT NULL,
    key      text   NOT NULL,
    last_seq bigint NOT NULL,
    PRIMARY KEY (source, key)
);
