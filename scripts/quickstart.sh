#!/usr/bin/env bash
# Tidemark in one process: a demo table in PostgreSQL synced by `tidemark sync` (no etcd, no
# control server: the control state lives in a SQLite file in the state directory), then
# changed and synced again, then verified per key. Needs only PostgreSQL on 127.0.0.1:5432 (user postgres).
# Usage: scripts/quickstart.sh [ROWS]   (default 100000)
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-100000}"
pg="postgres://postgres@127.0.0.1:5432"
run=".tidemark-run/quickstart"
psql_q() { psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres "$@"; }

bash scripts/setup.sh --build-only
if [ ! -x target/debug/tidemark ]; then
  echo "quickstart: building tidemark; the first build compiles about 400 crates and takes 5 to 10 minutes on 2 cores (later runs take seconds)"
fi
cargo build --bin tidemark
tidemark=target/debug/tidemark

rm -rf "$run"; mkdir -p "$run"
for db in tidemark_quick_app tidemark_quick_warehouse; do
  psql_q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
done
echo "quickstart: creating $rows rows in tidemark_quick_app.public.items"
psql_q -d tidemark_quick_app <<SQL
CREATE TABLE items (
  id bigint PRIMARY KEY,
  name text NOT NULL,
  price numeric(12,2),
  payload jsonb,
  created_at timestamptz(3),
  updated_at timestamptz(3) NOT NULL DEFAULT now()
);
CREATE INDEX items_cursor ON items (updated_at, id);
INSERT INTO items
SELECT g, 'item ' || g, (g % 1000) / 7.0, jsonb_build_object('n', g, 'tags', jsonb_build_array('a', g % 3)),
       now() - interval '2 hours', now() - interval '1 hour' + (g % 3600) * interval '1 second'
FROM generate_series(1, $rows) g;
SQL

sync=("$tidemark" sync --source "$pg/tidemark_quick_app" --table public.items
      --target "$pg/tidemark_quick_warehouse" --state "$run/state")
echo "quickstart: ${sync[*]} --once"
"${sync[@]}" --once

echo "quickstart: updating 2000 rows and inserting 2000, then the same command again"
psql_q -d tidemark_quick_app -c "UPDATE items SET name = name || ' (updated)', updated_at = now() WHERE id % 50 = 0 AND id <= 100000" \
  -c "INSERT INTO items SELECT g, 'new ' || g, 1.5, NULL, now(), now() FROM generate_series($rows + 1, $rows + 2000) g"
"${sync[@]}" --once

echo "quickstart: per-key verification (every column and the source version)"
psql_q -d tidemark_quick_app -At -c "COPY (SELECT id, name, price, payload, created_at, updated_at, (extract(epoch from updated_at) * 1000000)::bigint FROM items ORDER BY id) TO STDOUT" >"$run/source.tsv"
psql_q -d tidemark_quick_warehouse -At -c "COPY (SELECT id, name, price, payload, created_at, updated_at, _tidemark_version FROM items ORDER BY id) TO STDOUT" >"$run/target.tsv"
source scripts/verdict.sh
verdict quickstart "$run"
echo "quickstart: keep it in step with: ${sync[*]} --follow   (Ctrl-C stops it cleanly)"
