#!/usr/bin/env bash
# Tidemark end to end on this machine: a demo source table in PostgreSQL, etcd, one
# coordinator and two workers; snapshot, then live updates and inserts; then a per-key
# verification of target against source. Usage: scripts/demo.sh [ROWS]  (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-100000}"
run=".tidemark-run/demo"
pg="postgres://postgres@127.0.0.1:5432"
psql_q() { psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres "$@"; }

bash scripts/setup.sh
TIDEMARK_ETCD_PORT=23790 bash scripts/etcd.sh
cargo build --quiet --bin tidemark-coordinator --bin tidemark-worker
bin=target/debug

rm -rf "$run"; mkdir -p "$run"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

for db in tidemark_demo_app tidemark_demo_warehouse tidemark_demo_control; do
  psql_q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
done
echo "demo: creating $rows source rows"
psql_q -d tidemark_demo_app <<SQL
CREATE TABLE items (
  id bigint PRIMARY KEY,
  name text NOT NULL,
  price numeric(12,2),
  payload jsonb,
  updated_at timestamptz(3) NOT NULL DEFAULT now()
);
CREATE INDEX items_cursor ON items (updated_at, id);
INSERT INTO items
SELECT g, 'item ' || g, (g % 1000) / 7.0, jsonb_build_object('n', g, 'tags', jsonb_build_array('a', g % 3)),
       now() - interval '1 hour' + (g % 3600) * interval '1 second'
FROM generate_series(1, $rows) g;
SQL

cat >"$run/tidemark.toml" <<TOML
[coordinator]
listen = "127.0.0.1:7400"
etcd_endpoints = ["http://127.0.0.1:23790"]
etcd_prefix = "/tidemark-demo"
control_db = "$pg/tidemark_demo_control"
staging = "file://$PWD/$run/staging"
lease_ttl = "10s"

[[tasks]]
name = "items"
source = "$pg/tidemark_demo_app"
source_table = "public.items"
target = "$pg/tidemark_demo_warehouse"
target_table = "public.items"
key = ["id"]
cursor_column = "updated_at"
shards = 8
page_size = 5000
safety_delay = "2s"
poll_interval = "1s"
TOML
ETCDCTL_API=3 etcdctl --endpoints http://127.0.0.1:23790 del --prefix /tidemark-demo >/dev/null

"$bin/tidemark-coordinator" serve --config "$run/tidemark.toml" 2>"$run/coordinator.log" & pids+=($!)
for _ in $(seq 1 100); do
  "$bin/tidemark-coordinator" status --coordinator http://127.0.0.1:7400 >/dev/null 2>&1 && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$run/coordinator.log"; exit 1; }
  sleep 0.2
done
for w in 1 2; do
  "$bin/tidemark-worker" --coordinator http://127.0.0.1:7400 --id "demo-worker-$w" 2>"$run/worker-$w.log" & pids+=($!)
done

status_field() {
  "$bin/tidemark-coordinator" status --coordinator http://127.0.0.1:7400 --json |
    python3 -c "import json,sys; t=json.load(sys.stdin)['tasks'][0]; print($1)"
}
wait_for() { # wait_for PYTHON_EXPR SECONDS
  local deadline=$((SECONDS + $2))
  until [ "$(status_field "$1")" = "True" ]; do
    [ $SECONDS -lt $deadline ] || { echo "demo: timed out waiting for $1" >&2; exit 1; }
    sleep 1
  done
}
start=$SECONDS
wait_for "t['snapshot_complete']" 600
echo "demo: snapshot of $rows rows complete in $((SECONDS - start)) s"

echo "demo: updating 2000 rows and inserting 2000 while the workers run"
psql_q -d tidemark_demo_app -c "UPDATE items SET name = name || ' (updated)', updated_at = now() WHERE id % 50 = 0 AND id <= 100000" \
  -c "INSERT INTO items SELECT g, 'new ' || g, 1.5, NULL, now() FROM generate_series($rows + 1, $rows + 2000) g"
writes_end=$(psql_q -d tidemark_demo_app -At -c "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')")
wait_for "t['watermark'] is not None and t['watermark'] > '$writes_end'" 120
echo "demo: watermark $(status_field "t['watermark']") passed the end of the writes ($writes_end)"
"$bin/tidemark-coordinator" status --coordinator http://127.0.0.1:7400

echo "demo: per-key verification (every column and the source version)"
psql_q -d tidemark_demo_app -At -c "COPY (SELECT id, name, price, payload, updated_at, (extract(epoch from updated_at) * 1000000)::bigint FROM items ORDER BY id) TO STDOUT" >"$run/source.tsv"
psql_q -d tidemark_demo_warehouse -At -c "COPY (SELECT id, name, price, payload, updated_at, _tidemark_version FROM items ORDER BY id) TO STDOUT" >"$run/target.tsv"
keys=$(wc -l <"$run/source.tsv")
if diff -q "$run/source.tsv" "$run/target.tsv" >/dev/null; then
  echo "demo: PASS: $keys keys, target equals source per key (0 lost, 0 stale, 0 phantom)"
else
  lost=$(comm -23 <(cut -f1 "$run/source.tsv" | sort) <(cut -f1 "$run/target.tsv" | sort) | wc -l)
  phantom=$(comm -13 <(cut -f1 "$run/source.tsv" | sort) <(cut -f1 "$run/target.tsv" | sort) | wc -l)
  differing=$(diff "$run/source.tsv" "$run/target.tsv" | grep -c '^<' || true)
  echo "demo: FAIL: $keys source keys; $lost lost, $phantom phantom, $differing rows differ (see $run/*.tsv)"
  exit 1
fi
