-- The source table's storage identity when the epoch was planned, for an engine without a
-- TRUNCATE trigger (MySQL/MariaDB: the InnoDB table id, which TRUNCATE changes): a delete-
-- logged task whose table id changed pauses with `reinitialization required`.
ALTER TABLE epochs ADD COLUMN source_table_id text;
