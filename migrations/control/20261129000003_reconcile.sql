-- Reconciliation runs: one row per run, one row per shard of the run's epoch. A shard's part
-- is done by the shard's owner between cycles; a part that was in flight when its owner died
-- is simply done again by the next owner (repairs are versioned and ledgered).
CREATE TABLE reconcile_runs (
    id              bigserial PRIMARY KEY,
    task            text NOT NULL,
    epoch           bigint NOT NULL,
    reason          text NOT NULL,
    since_micros    bigint,
    requested_at    timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);

CREATE INDEX reconcile_runs_task ON reconcile_runs (task, id);

CREATE TABLE reconcile_shards (
    run_id          bigint NOT NULL REFERENCES reconcile_runs (id),
    shard_id        integer NOT NULL,
    state           text NOT NULL CHECK (state IN ('PENDING', 'DONE')),
    ranges_compared bigint NOT NULL DEFAULT 0,
    rows_read       bigint NOT NULL DEFAULT 0,
    keys_repaired   bigint NOT NULL DEFAULT 0,
    extra_in_target bigint NOT NULL DEFAULT 0,
    duration_ms     bigint NOT NULL DEFAULT 0,
    finished_at     timestamptz,
    PRIMARY KEY (run_id, shard_id)
);
