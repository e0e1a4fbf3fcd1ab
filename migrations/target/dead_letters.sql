-- Rows the target could not take (or the transform could not read), written in the same
-- transaction that applies the rest of their batch and advances past them. One row per task
-- and key: a key that fails again replaces its earlier letter.
CREATE TABLE IF NOT EXISTS tidemark_dead_letters (
    task            text NOT NULL,
    key             text NOT NULL,
    shard_id        integer NOT NULL,
    batch_id        text NOT NULL,
    -- The row as staged (one line of the batch's COPY text) and that line's layout.
    payload         bytea NOT NULL,
    payload_layout  text NOT NULL,
    error_class     text NOT NULL,
    message         text NOT NULL,
    status          text NOT NULL DEFAULT 'INIT'
                    CHECK (status IN ('INIT', 'RETRY', 'PROCESSING', 'RESOLVED', 'FAILED')),
    retry_count     integer NOT NULL DEFAULT 0,
    -- The retry run holding the row (status PROCESSING) and since when.
    claimed_by      text,
    claimed_at      timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task, key)
);
CREATE INDEX IF NOT EXISTS tidemark_dead_letters_status ON tidemark_dead_letters (task, status)
