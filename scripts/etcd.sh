#!/usr/bin/env bash
# Starts a single-node etcd on loopback (client port $TIDEMARK_ETCD_PORT, default 23790) with
# its data under .tidemark-run/, unless one is already answering there. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${TIDEMARK_ETCD_PORT:-23790}"
peer=$((port + 1))
dir=".tidemark-run/etcd-$port"
if ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$port" endpoint health >/dev/null 2>&1; then
  exit 0
fi
mkdir -p "$dir"
nohup etcd --name tidemark-demo --data-dir "$dir/data" \
  --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
  --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
  --initial-cluster "tidemark-demo=http://127.0.0.1:$peer" >"$dir/etcd.log" 2>&1 &
echo $! >"$dir/pid"
for _ in $(seq 1 50); do
  ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$port" endpoint health >/dev/null 2>&1 && exit 0
  sleep 0.2
done
echo "etcd did not become healthy on 127.0.0.1:$port; see $dir/etcd.log" >&2
exit 1
