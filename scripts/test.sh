#!/usr/bin/env bash
# The whole test suite on a fresh machine of this kind: installs what is missing (etcd,
# protoc, PyYAML, and moto and kubernetes-validate into a venv), starts PostgreSQL if needed,
# validates deploy/, builds the binaries the integration tests run, then
# runs every unit and integration test. Each test starts its own etcd on free loopback ports
# and creates (and drops) its own databases.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The deploy manifests (compose, Kubernetes, Prometheus) must parse, and the Kubernetes ones
# must be valid against the API's schemas in strict mode (offline).
python3 deploy/validate.py
.tidemark-run/venv/bin/kubernetes-validate --strict --quiet deploy/k8s/*.yaml
cargo build --bins
cargo test --workspace --no-fail-fast -- --test-threads "${TIDEMARK_TEST_THREADS:-2}"
