-- The embedded control store (SQLite): the same tables, columns and rules as the PostgreSQL
-- control database (migrations/control), in its final shape. Times are microseconds since the
-- Unix epoch; JSON values are text written by the coordinator (one canonical form, so that
-- text equality is value equality); booleans are 0 and 1.

CREATE TABLE tasks (
    name                    TEXT PRIMARY KEY,
    current_epoch           INTEGER NOT NULL,
    paused_reason           TEXT,
    created_at              INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
    max_source_clock_micros INTEGER,
    resumed_at              INTEGER,
    source_hold             TEXT,
    building_epoch          INTEGER,
    swap_to                 INTEGER,
    swap_error              TEXT
) STRICT;

CREATE TABLE epochs (
    task                    TEXT NOT NULL REFERENCES tasks (name),
    epoch                   INTEGER NOT NULL,
    schema_id               TEXT NOT NULL,
    columns                 TEXT NOT NULL,
    h0_time_micros          INTEGER NOT NULL,
    h0_max_key              TEXT,
    incremental_start       TEXT NOT NULL,
    started_at              INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
    estimated_rows          INTEGER,
    cursor_zone             TEXT,
    source_table_id         TEXT,
    state                   TEXT NOT NULL DEFAULT 'live'
                            CHECK (state IN ('building', 'live', 'retained', 'dropped', 'abandoned')),
    frozen                  INTEGER NOT NULL DEFAULT 0,
    snapshot_done_micros    INTEGER,
    validation_run          INTEGER,
    validated_at            INTEGER,
    blocked_reason          TEXT,
    switch_requested        INTEGER NOT NULL DEFAULT 0,
    deferred_ddl            TEXT NOT NULL DEFAULT '[]',
    retired_at              INTEGER,
    PRIMARY KEY (task, epoch)
) STRICT;

CREATE TABLE checkpoints (
    task                TEXT NOT NULL,
    epoch               INTEGER NOT NULL,
    shard_id            INTEGER NOT NULL,
    range               TEXT NOT NULL,
    phase               TEXT NOT NULL CHECK (phase IN ('SNAPSHOT', 'INCREMENTAL')),
    cursor              TEXT NOT NULL,
    version             INTEGER NOT NULL DEFAULT 0,
    fence               INTEGER NOT NULL DEFAULT 0,
    owner               TEXT,
    last_batch_id       TEXT,
    rows_applied        INTEGER NOT NULL DEFAULT 0,
    updated_at          INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
    retired             INTEGER NOT NULL DEFAULT 0,
    release_requested   INTEGER NOT NULL DEFAULT 0,
    pending_op          TEXT,
    reserved_for        TEXT,
    reserved_until      INTEGER,
    acquired_at         INTEGER,
    last_failure        TEXT,
    failures            INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (task, epoch, shard_id),
    FOREIGN KEY (task, epoch) REFERENCES epochs (task, epoch)
) STRICT;

CREATE TABLE batches (
    batch_id        TEXT PRIMARY KEY,
    task            TEXT NOT NULL,
    epoch           INTEGER NOT NULL,
    shard_id        INTEGER NOT NULL,
    lower           TEXT NOT NULL,
    upper           TEXT NOT NULL,
    row_count       INTEGER NOT NULL,
    byte_size       INTEGER NOT NULL,
    content_hash    TEXT NOT NULL,
    manifest_path   TEXT NOT NULL,
    fence           INTEGER NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('STAGED', 'COMMITTED', 'ABANDONED')),
    replayed        INTEGER NOT NULL DEFAULT 0,
    staged_at       INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
    committed_at    INTEGER
) STRICT;

CREATE INDEX batches_staged ON batches (task, epoch, shard_id) WHERE state = 'STAGED';

CREATE TABLE checkpoint_history (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    task            TEXT NOT NULL,
    epoch           INTEGER NOT NULL,
    shard_id        INTEGER NOT NULL,
    version         INTEGER NOT NULL,
    fence           INTEGER NOT NULL,
    cursor          TEXT NOT NULL,
    batch_id        TEXT,
    row_count       INTEGER NOT NULL,
    committed_at    INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER))
) STRICT;

CREATE INDEX checkpoint_history_shard ON checkpoint_history (task, epoch, shard_id, id);

CREATE TABLE late_rows (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    task            TEXT NOT NULL,
    epoch           INTEGER NOT NULL,
    shard_id        INTEGER NOT NULL,
    batch_id        TEXT NOT NULL,
    lateness_micros INTEGER NOT NULL,
    found_at        INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER))
) STRICT;

CREATE INDEX late_rows_task ON late_rows (task, epoch);

CREATE TABLE reconcile_runs (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    task            TEXT NOT NULL,
    epoch           INTEGER NOT NULL,
    reason          TEXT NOT NULL,
    since_micros    INTEGER,
    requested_at    INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
    finished_at     INTEGER,
    compare         TEXT NOT NULL DEFAULT 'content' CHECK (compare IN ('content', 'versions'))
) STRICT;

CREATE INDEX reconcile_runs_task ON reconcile_runs (task, id);

CREATE TABLE reconcile_shards (
    run_id          INTEGER NOT NULL REFERENCES reconcile_runs (id),
    shard_id        INTEGER NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('PENDING', 'DONE')),
    ranges_compared INTEGER NOT NULL DEFAULT 0,
    rows_read       INTEGER NOT NULL DEFAULT 0,
    keys_repaired   INTEGER NOT NULL DEFAULT 0,
    extra_in_target INTEGER NOT NULL DEFAULT 0,
    duration_ms     INTEGER NOT NULL DEFAULT 0,
    finished_at     INTEGER,
    keys_missed     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, shard_id)
) STRICT;

CREATE TABLE workers (
    id              TEXT PRIMARY KEY,
    lease_id        INTEGER NOT NULL,
    registered_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
    last_seen       INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
    draining        INTEGER NOT NULL DEFAULT 0
) STRICT;

CREATE VIEW running_epochs AS
    SELECT t.name AS task, t.current_epoch AS epoch
    FROM tasks t JOIN epochs e ON e.task = t.name AND e.epoch = t.current_epoch
    WHERE NOT e.frozen
    UNION ALL
    SELECT t.name, t.building_epoch FROM tasks t WHERE t.building_epoch IS NOT NULL;
