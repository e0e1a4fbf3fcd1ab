-- A worker that stops on a problem only an operator can fix (the target rejects most of a
-- batch) asks for a pause when it releases its shard. The request counts only when the shard
-- was acquired after the task's last resume: a batch that failed before the operator's fix
-- must not pause the task again.
ALTER TABLE tasks ADD COLUMN resumed_at timestamptz;
ALTER TABLE checkpoints ADD COLUMN acquired_at timestamptz;
