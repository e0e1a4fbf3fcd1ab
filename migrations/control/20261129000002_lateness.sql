-- Late rows found by the overlap re-read, per task (for status: count, p99, max), and the
-- highest source clock reading seen per task (to notice a clock that moves backwards).
CREATE TABLE late_rows (
    id              bigserial PRIMARY KEY,
    task            text NOT NULL,
    epoch           bigint NOT NULL,
    shard_id        integer NOT NULL,
    batch_id        text NOT NULL,
    lateness_micros bigint NOT NULL,
    found_at        timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX late_rows_task ON late_rows (task, epoch);

ALTER TABLE tasks ADD COLUMN max_source_clock_micros bigint;
