-- Control database: tasks, epochs, per-shard checkpoints, the batch registry and the
-- checkpoint history (every advance, for audits and the chaos oracle).

CREATE TABLE tasks (
    name            text PRIMARY KEY,
    current_epoch   bigint NOT NULL,
    paused_reason   text,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE epochs (
    task                    text NOT NULL REFERENCES tasks (name),
    epoch                   bigint NOT NULL,
    schema_id               text NOT NULL,
    -- The source columns (name, type) frozen for this epoch, as JSON.
    columns                 jsonb NOT NULL,
    -- H0: source time at planning (microseconds since the Unix epoch) and the largest key.
    h0_time_micros          bigint NOT NULL,
    h0_max_key              jsonb,
    incremental_start       jsonb NOT NULL,
    started_at              timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task, epoch)
);

-- One row per shard: its range, phase and checkpoint. `version` is the CAS counter and
-- `fence` the token of the current lease holder; both only ever increase.
CREATE TABLE checkpoints (
    task            text NOT NULL,
    epoch           bigint NOT NULL,
    shard_id        integer NOT NULL,
    range           jsonb NOT NULL,
    phase           text NOT NULL CHECK (phase IN ('SNAPSHOT', 'INCREMENTAL')),
    cursor          jsonb NOT NULL,
    version         bigint NOT NULL DEFAULT 0,
    fence           bigint NOT NULL DEFAULT 0,
    owner           text,
    last_batch_id   text,
    rows_applied    bigint NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task, epoch, shard_id),
    FOREIGN KEY (task, epoch) REFERENCES epochs (task, epoch)
);

CREATE TABLE batches (
    batch_id        text PRIMARY KEY,
    task            text NOT NULL,
    epoch           bigint NOT NULL,
    shard_id        integer NOT NULL,
    lower           jsonb NOT NULL,
    upper           jsonb NOT NULL,
    row_count       bigint NOT NULL,
    byte_size       bigint NOT NULL,
    content_hash    text NOT NULL,
    manifest_path   text NOT NULL,
    fence           bigint NOT NULL,
    state           text NOT NULL CHECK (state IN ('STAGED', 'COMMITTED', 'ABANDONED')),
    -- Set when the batch was committed by an owner that re-applied it from staging.
    replayed        boolean NOT NULL DEFAULT false,
    staged_at       timestamptz NOT NULL DEFAULT now(),
    committed_at    timestamptz
);

CREATE INDEX batches_staged ON batches (task, epoch, shard_id) WHERE state = 'STAGED';

CREATE TABLE checkpoint_history (
    id              bigserial PRIMARY KEY,
    task            text NOT NULL,
    epoch           bigint NOT NULL,
    shard_id        integer NOT NULL,
    version         bigint NOT NULL,
    fence           bigint NOT NULL,
    cursor          jsonb NOT NULL,
    batch_id        text,
    row_count       bigint NOT NULL,
    committed_at    timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX checkpoint_history_shard ON checkpoint_history (task, epoch, shard_id, id);
