#!/usr/bin/env bash
# The whole test suite on a fresh machine of this kind: installs what is missing (etcd,
# protoc, PyYAML), starts PostgreSQL if needed, validates deploy/, builds the binaries the integration tests run, then
# runs every unit and integration test. Each test starts its own etcd on free loopback ports
# and creates (and drops) its own databases.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The deploy manifests (compose, Kubernetes, Prometheus) must parse.
python3 deploy/validate.py
cargo build --bins
cargo test --workspace --no-fail-fast -- --test-threads "${TIDEMARK_TEST_THREADS:-2}"
