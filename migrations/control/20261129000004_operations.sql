-- Operating the cluster: shard split/merge/move, worker drain, balancing.
-- A retired shard (split or merged away) keeps its row for history; it can no longer be
-- claimed or committed. `release_requested` asks the current owner to finish its batch and
-- release the shard (answered on its next commit or poll). `pending_op` is the operation the
-- leader performs once the shard is unowned: {"kind":"split","at":{key}},
-- {"kind":"merge","with":S} or {"kind":"move","to":W}. A moved shard is reserved for its
-- new worker for a short while.
ALTER TABLE checkpoints ADD COLUMN retired boolean NOT NULL DEFAULT false;
ALTER TABLE checkpoints ADD COLUMN release_requested boolean NOT NULL DEFAULT false;
ALTER TABLE checkpoints ADD COLUMN pending_op jsonb;
ALTER TABLE checkpoints ADD COLUMN reserved_for text;
ALTER TABLE checkpoints ADD COLUMN reserved_until timestamptz;

CREATE TABLE workers (
    id              text PRIMARY KEY,
    lease_id        bigint NOT NULL,
    registered_at   timestamptz NOT NULL DEFAULT now(),
    last_seen       timestamptz NOT NULL DEFAULT now(),
    draining        boolean NOT NULL DEFAULT false
);

-- The planner's row estimate (pg_class.reltuples) for snapshot progress.
ALTER TABLE epochs ADD COLUMN estimated_rows bigint;
