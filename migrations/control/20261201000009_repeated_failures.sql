-- A shard whose owner keeps stopping on the same error that retrying cannot fix: the last
-- such error and how many times in a row it ended the shard's run (reset by every commit and
-- by `tasks resume`). At `max_batch_failures` the task pauses with it.
ALTER TABLE checkpoints ADD COLUMN last_failure text;
ALTER TABLE checkpoints ADD COLUMN failures integer NOT NULL DEFAULT 0;
