-- What a reconciliation run compares per key: the version and every column's content
-- (`content`, the default), or the version alone (`versions`, cheaper, blind to drift at an
-- equal version).
ALTER TABLE reconcile_runs ADD COLUMN compare text NOT NULL DEFAULT 'content'
    CHECK (compare IN ('content', 'versions'));
