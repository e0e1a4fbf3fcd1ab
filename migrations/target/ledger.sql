-- Target-side ledger: one row per applied batch, written in the same transaction as the
-- batch's rows, so "was this batch applied?" has one answer even after a crash.
CREATE TABLE IF NOT EXISTS tidemark_ledger (
    batch_id        text PRIMARY KEY,
    task            text NOT NULL,
    epoch           bigint NOT NULL,
    shard_id        integer NOT NULL,
    row_count       bigint NOT NULL,
    content_hash    text NOT NULL,
    fence           bigint NOT NULL,
    applied_at      timestamptz NOT NULL DEFAULT now()
);
-- How many of the batch's rows went to the dead letters instead of the table. Altered only
-- when missing: `ADD COLUMN IF NOT EXISTS` takes ACCESS EXCLUSIVE even when the column exists,
-- so a coordinator starting would queue behind any open apply transaction, and every apply
-- behind it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'tidemark_ledger'::regclass
                   AND attname = 'dead_letters' AND NOT attisdropped) THEN
        ALTER TABLE tidemark_ledger ADD COLUMN dead_letters bigint NOT NULL DEFAULT 0;
    END IF;
END
$$;

-- The epoch each task's batches must belong to, set by `tasks reinit` in the transaction
-- that resets an accumulate task's totals. Every batch's transaction reads it (FOR SHARE)
-- and refuses a batch of an older epoch, so a replaced epoch's late batch never writes.
CREATE TABLE IF NOT EXISTS tidemark_epochs (
    task            text PRIMARY KEY,
    epoch           bigint NOT NULL
);
