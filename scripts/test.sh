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
# nextest (on this machine kind) runs every test in its own process, three at a time across
# all suites (.config/nextest.toml: settings, and the MariaDB group of two); the suites wait
# mostly on their services, so three keep two cores busy without a tail per suite. Without
# nextest: cargo test, suite by suite, two threads each.
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --test-threads "${TIDEMARK_TEST_THREADS:-3}"
else
  cargo test --workspace --no-fail-fast -- --test-threads "${TIDEMARK_TEST_THREADS:-2}"
fi
