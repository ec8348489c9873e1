#!/usr/bin/env bash
# The test command of the README: installs what the tests need (Python clients), gives the
# tests a fresh database, and runs every Rust test (unit, integration, property) plus the
# conformance suite against this server. PostgreSQL and Redis must be running (.ci/run
# starts them on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."

export PGHOST="${PGHOST:-127.0.0.1}"
DB_NAME="${PRESENCED_TEST_DB:-presenced_test}"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/${DB_NAME}}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"

# Real XMPP clients this project did not write, driven by the tests.
python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt

# A fresh database per run: no state from earlier runs or other branches.
psql -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1 -q \
  -c "DROP DATABASE IF EXISTS ${DB_NAME} WITH (FORCE)" \
  -c "CREATE DATABASE ${DB_NAME}"

cargo test --all-targets --no-fail-fast

# The conformance runner's own offline tests, then the suite against this server (strict:
# a skipped scenario fails the run).
python3 -m pip install --quiet --disable-pip-version-check -r conformance/requirements.txt
python3 conformance/test_run.py
bash conformance/presenced.sh

# The fuzz crate's decoder tests and every seed document under all limit choices (its own
# workspace; no fuzzer needed for these).
(cd fuzz && cargo test --lib)
