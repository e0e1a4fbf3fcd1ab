#!/usr/bin/env bash
# CPU profile of a Tidemark snapshot: runs the benchmark and, once its baseline is done and the
# snapshot starts, samples every process on the machine for PROFILE_SECONDS with perf.
# Prints the CPU split by process and the worker's hottest functions.
#
#   bench/profile.sh [ROWS] [PROFILE_SECONDS]      (default 1000000 rows, 10 s)
#
# Needs `perf` (Debian: linux-perf) and permission to sample system-wide (root, or
# kernel.perf_event_paranoid <= 0).
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-1000000}"
seconds="${2:-10}"
out="$(mktemp -d /tmp/tidemark-profile.XXXXXX)"
cargo build --release --bins -p tidemark-coordinator -p tidemark-worker -p tidemark-bench
target/release/tidemark-bench --rows "$rows" > "$out/bench.out" 2> "$out/bench.err" &
bench=$!
until grep -q "COPY binary pipes by key range" "$out/bench.err" 2>/dev/null; do
    kill -0 "$bench" 2>/dev/null || { cat "$out/bench.err"; exit 1; }
    sleep 0.5
done
sleep 1
perf record -a -g -F 199 -o "$out/perf.data" -- sleep "$seconds" 2> "$out/perf.err"
wait "$bench"
cat "$out/bench.out"
# Tokio threads are named tokio-runtime-w in every Rust process: the binary (dso) tells them apart.
echo "== CPU samples by thread name and binary during the snapshot ($seconds s) =="
perf report -i "$out/perf.data" --no-children --sort comm,dso --stdio -g none 2>/dev/null \
    | grep -v '^#' | grep -v '^$' | head -15 || true
echo "== hottest functions in Tidemark's own code (self time, share of all samples) =="
perf report -i "$out/perf.data" --no-children --dsos tidemark-worker,tidemark-coordinator --sort dso,sym \
    --stdio -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -25 || true
echo "== hottest functions in PostgreSQL =="
perf report -i "$out/perf.data" --no-children --comm postgres --sort sym --stdio -g none 2>/dev/null \
    | grep -v '^#' | grep -v '^$' | head -15 || true
echo "(perf data in $out)"
