-- Why the source currently holds a task's watermark without pausing it (a prepared
-- transaction, whose start no time bound can cover), as the leader's watcher last saw it;
-- `status` shows it as a warning.
ALTER TABLE tasks ADD COLUMN source_hold text;
