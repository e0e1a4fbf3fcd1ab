#!/usr/bin/env bash
# Tidemark end to end on this machine: a demo source table in PostgreSQL, etcd, one
# coordinator and two workers; snapshot, then live updates and inserts; then a per-key
# verification of target against source. Usage:
#   scripts/demo.sh [--source mariadb] [--target mariadb] [ROWS]
# (default 100000 rows; `--source mariadb` reads the table from the machine's MariaDB,
# `--target mariadb` writes it into a MariaDB database instead of PostgreSQL).
set -euo pipefail
cd "$(dirname "$0")/.."
source_engine=postgres
target_engine=postgres
while [ "${1:-}" = "--source" ] || [ "${1:-}" = "--target" ]; do
  if [ "$1" = "--source" ]; then source_engine="${2:-}"; else target_engine="${2:-}"; fi
  shift 2
done
case "$source_engine" in postgres|mariadb) ;; *) echo "demo: --source is postgres or mariadb" >&2; exit 2 ;; esac
case "$target_engine" in postgres|mariadb) ;; *) echo "demo: --target is postgres or mariadb" >&2; exit 2 ;; esac
rows="${1:-100000}"
mariadb_q() { mariadb -h 127.0.0.1 -u root -N -B "$@"; }
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
echo "demo: creating $rows source rows in $source_engine"
source_url="$pg/tidemark_demo_app"
source_table="public.items"
if [ "$source_engine" = mariadb ]; then
  source_url="mysql://root@127.0.0.1:3306/tidemark_demo_app"
  source_table="items"
  mariadb_q <<SQL
DROP DATABASE IF EXISTS tidemark_demo_app;
CREATE DATABASE tidemark_demo_app CHARACTER SET utf8mb4;
USE tidemark_demo_app;
CREATE TABLE items (
  id BIGINT NOT NULL PRIMARY KEY,
  name VARCHAR(200) NOT NULL,
  price DECIMAL(12,2),
  payload JSON,
  updated_at TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3),
  KEY items_cursor (updated_at, id)
);
INSERT INTO items SELECT seq, CONCAT('item ', seq), (seq % 1000) / 7.0, JSON_OBJECT('n', seq, 'tags', JSON_ARRAY('a', seq % 3)),
       NOW(3) - INTERVAL 1 HOUR + INTERVAL (seq % 3600) SECOND FROM seq_1_to_$rows;
SQL
else
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
fi

target_url="$pg/tidemark_demo_warehouse"
target_table="public.items"
if [ "$target_engine" = mariadb ]; then
  target_url="mysql://root@127.0.0.1:3306/tidemark_demo_warehouse"
  target_table="items"
  mariadb_q -e "DROP DATABASE IF EXISTS tidemark_demo_warehouse; CREATE DATABASE tidemark_demo_warehouse CHARACTER SET utf8mb4"
fi

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
source = "$source_url"
source_table = "$source_table"
target = "$target_url"
target_table = "$target_table"
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
if [ "$source_engine" = mariadb ]; then
  mariadb_q tidemark_demo_app -e "UPDATE items SET name = CONCAT(name, ' (updated)'), updated_at = NOW(3) WHERE id % 50 = 0 AND id <= 100000;
    INSERT INTO items SELECT seq, CONCAT('new ', seq), 1.5, NULL, NOW(3) FROM seq_$((rows + 1))_to_$((rows + 2000))"
  writes_end=$(mariadb_q -e "SELECT CONCAT(LEFT(DATE_FORMAT(UTC_TIMESTAMP(3), '%Y-%m-%dT%H:%i:%s.%f'), 23), 'Z')")
else
psql_q -d tidemark_demo_app -c "UPDATE items SET name = name || ' (updated)', updated_at = now() WHERE id % 50 = 0 AND id <= 100000" \
  -c "INSERT INTO items SELECT g, 'new ' || g, 1.5, NULL, now() FROM generate_series($rows + 1, $rows + 2000) g"
writes_end=$(psql_q -d tidemark_demo_app -At -c "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')")
fi
wait_for "t['watermark'] is not None and t['watermark'] > '$writes_end'" 120
echo "demo: watermark $(status_field "t['watermark']") passed the end of the writes ($writes_end)"
"$bin/tidemark-coordinator" status --coordinator http://127.0.0.1:7400

echo "demo: per-key verification (every column and the source version)"
if [ "$target_engine" = mariadb ]; then
  # Times rendered in UTC on every side; the target stores the source instants' UTC times.
  if [ "$source_engine" = mariadb ]; then
    mariadb_q tidemark_demo_app -e "SET time_zone = '+00:00'; SELECT id, name, IFNULL(price, 'NULL'), IFNULL(payload, 'NULL'),
      LEFT(DATE_FORMAT(updated_at, '%Y-%m-%d %H:%i:%s.%f'), 23), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated_at)
      FROM items ORDER BY id" >"$run/source.tsv"
  else
    psql_q -d tidemark_demo_app -At -c "COPY (SELECT id, name, coalesce(price::text, 'NULL'), coalesce(payload::text, 'NULL'),
      to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.MS'), (extract(epoch from updated_at) * 1000000)::bigint
      FROM items ORDER BY id) TO STDOUT" >"$run/source.tsv"
  fi
  mariadb_q tidemark_demo_warehouse -e "SELECT id, name, IFNULL(price, 'NULL'), IFNULL(payload, 'NULL'),
    LEFT(DATE_FORMAT(updated_at, '%Y-%m-%d %H:%i:%s.%f'), 23), _tidemark_version FROM items ORDER BY id" >"$run/target.tsv"
elif [ "$source_engine" = mariadb ]; then
  # Each side rendered by its own functions: MariaDB's and PostgreSQL's.
  mariadb_q tidemark_demo_app -e "SELECT id, name, IFNULL(price, 'NULL'), IFNULL(payload, 'NULL'),
    LEFT(DATE_FORMAT(updated_at, '%Y-%m-%d %H:%i:%s.%f'), 23),
    TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', CONVERT_TZ(updated_at, @@session.time_zone, '+00:00'))
    FROM items ORDER BY id" >"$run/source.tsv"
  # MariaDB renders TIMESTAMP in its session zone: render the target's in the same one.
  zone=$(mariadb_q -e "SELECT IF(@@session.time_zone = 'SYSTEM', @@system_time_zone, @@session.time_zone)")
  psql_q -d tidemark_demo_warehouse -At -c "COPY (SELECT id, name, coalesce(price::text, 'NULL'), coalesce(payload, 'NULL'),
    to_char(updated_at AT TIME ZONE '$zone', 'YYYY-MM-DD HH24:MI:SS.MS'), _tidemark_version FROM items ORDER BY id) TO STDOUT" >"$run/target.tsv"
else
psql_q -d tidemark_demo_app -At -c "COPY (SELECT id, name, price, payload, updated_at, (extract(epoch from updated_at) * 1000000)::bigint FROM items ORDER BY id) TO STDOUT" >"$run/source.tsv"
psql_q -d tidemark_demo_warehouse -At -c "COPY (SELECT id, name, price, payload, updated_at, _tidemark_version FROM items ORDER BY id) TO STDOUT" >"$run/target.tsv"
fi
source scripts/verdict.sh
verdict demo "$run"
