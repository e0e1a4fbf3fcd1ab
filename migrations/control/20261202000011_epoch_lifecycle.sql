-- Epoch lifecycle: `tasks reinit` builds a new epoch in a table beside the live one; it is
-- validated, then made live by one switch (a target transaction that renames the tables);
-- the replaced epoch is retained for `tasks rollback`, then its table is dropped.
--   building -> live -> retained -> dropped      (abandoned: replaced while building, or
--                                                 rolled back)
ALTER TABLE epochs ADD COLUMN state text NOT NULL DEFAULT 'live'
    CHECK (state IN ('building', 'live', 'retained', 'dropped', 'abandoned'));
-- Epochs replaced before this migration were rebuilt in place: nothing of them is kept.
UPDATE epochs e SET state = 'dropped' FROM tasks t WHERE t.name = e.task AND e.epoch < t.current_epoch;
-- A live epoch whose reads broke (the task needed reinitialization) while its successor
-- builds: its shards are not handed out; its table keeps serving until the switch.
ALTER TABLE epochs ADD COLUMN frozen boolean NOT NULL DEFAULT false;
-- Building: the source clock when every shard had finished its snapshot (the validation
-- starts once the epoch's watermark passed it), the validating reconciliation run, its
-- verdict, and whether `tasks switch` asked for the switch.
ALTER TABLE epochs ADD COLUMN snapshot_done_micros bigint;
ALTER TABLE epochs ADD COLUMN validation_run bigint;
ALTER TABLE epochs ADD COLUMN validated_at timestamptz;
ALTER TABLE epochs ADD COLUMN blocked_reason text;
ALTER TABLE epochs ADD COLUMN switch_requested boolean NOT NULL DEFAULT false;
-- Building: the live table's non-unique secondary indexes, built once the snapshot is loaded
-- (a JSON array of statements; emptied when built).
ALTER TABLE epochs ADD COLUMN deferred_ddl jsonb NOT NULL DEFAULT '[]';
-- When it stopped being live (a retained epoch's table is dropped `epoch_retention` later).
ALTER TABLE epochs ADD COLUMN retired_at timestamptz;

-- The epoch building beside the live one (`current_epoch`), if any.
ALTER TABLE tasks ADD COLUMN building_epoch bigint;
-- A swap in flight: the epoch whose table becomes the live one (a switch or a rollback).
-- Set before the target renames its tables, cleared once the control database follows; a
-- leader that finds it set finishes the swap (the target's rename is idempotent).
ALTER TABLE tasks ADD COLUMN swap_to bigint;
-- Why the last attempt at that swap failed (a missing grant, an unreachable target); shown
-- by status until the swap completes.
ALTER TABLE tasks ADD COLUMN swap_error text;

-- Of a shard's repaired keys, those the watermark had already passed (see `keys_missed`).
ALTER TABLE reconcile_shards ADD COLUMN keys_missed bigint NOT NULL DEFAULT 0;

-- The epochs whose shards are handed out and may commit: the live one (unless frozen) and
-- the one building beside it.
CREATE VIEW running_epochs AS
    SELECT t.name AS task, t.current_epoch AS epoch
    FROM tasks t JOIN epochs e ON e.task = t.name AND e.epoch = t.current_epoch
    WHERE NOT e.frozen
    UNION ALL
    SELECT t.name, t.building_epoch FROM tasks t WHERE t.building_epoch IS NOT NULL;
