#!/usr/bin/env bash
# Installs the tools the benchmark compares Tidemark with, each at a pinned version, into a
# venv of the benchmark's own (idempotent: a second run only checks the pins), and prints
# where they are:
#   sling <path of the sling binary>
#   python <path of the venv's python, which has dlt>
# sling 1.4.11 ships its binary in the sling-linux-amd64 wheel; newer versions download it
# at first use and fail offline. Never a CI dependency: only `tidemark-bench --peers` runs it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${TIDEMARK_PEERS_VENV:-$root/target/bench-peers}
pins="sling==1.4.11 sling-linux-amd64==1.4.11 dlt[postgres,sql-database]==1.31.0 pyarrow==26.0.1"
if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]; then
    echo "installing the peers into $venv: $pins" >&2
    python3 -m venv "$venv"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install --quiet --disable-pip-version-check $pins >&2
    echo "$pins" > "$venv/.pins"
fi
sling=$("$venv/bin/python" -c 'import os, sling_linux_amd64 as s; print(os.path.join(os.path.dirname(s.__file__), "bin", "sling-linux-amd64"))')
[ -x "$sling" ] || { echo "no sling binary at $sling" >&2; exit 1; }
echo "sling $sling"
echo "python $venv/bin/python"
