#!/usr/bin/env bash
# The test command of the README: installs what the tests need (Python clients; Node packages,
# Chromium, Profanity and tmux for the stock-client tests), gives the tests a fresh database,
# and runs every Rust test (unit, integration, property) plus the conformance suite against
# this server.
#
# Services: PostgreSQL and Redis are the machine's when DATABASE_URL / REDIS_URL name them
# or when something answers on 127.0.0.1:5432 / :6379 (.ci/run starts those on a fresh
# machine). Otherwise this script starts private ones from the installed binaries (initdb +
# pg_ctl, redis-server) in a temporary directory on loopback ports from
# PRESENCED_PRIVATE_PORT_BASE (default 30201) up, installing the Debian packages first when
# they are missing and it runs as root, and stops them when it exits.
# PRESENCED_PRIVATE_SERVICES=1 starts private ones even when the machine's answer.
#
# Redis Cluster: the cluster tests (tests/cluster.rs) run every case on a single Redis and
# on a Redis Cluster of three masters with one replica each, which this script starts on
# loopback ports PRESENCED_REDIS_CLUSTER_PORT_BASE (default 30301) to +5 (cluster bus +10 to +15) and stops when it
# exits, passing the start nodes as PRESENCED_TEST_REDIS_CLUSTER (unless that is already set).
#
# Usage: tests/run.sh                 everything
#        tests/run.sh ARGS...         only `cargo test ARGS...` (e.g. --test liveness in_process)
set -euo pipefail
cd "$(dirname "$0")/.."

DB_NAME="${PRESENCED_TEST_DB:-presenced_test}"
FORCE_PRIVATE="${PRESENCED_PRIVATE_SERVICES:-}"
PORT_BASE="${PRESENCED_PRIVATE_PORT_BASE:-30201}"
PRIVATE_DIR=""
PRIVATE_PG=""
PRIVATE_REDIS_PID=""
REDIS_CLUSTER_PIDS=()
PG_OS_USER=""

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A loopback port from PORT_BASE up (ten tries) that nothing listens on.
free_port() {
  local p
  for p in $(seq "$1" $(("$1" + 9))); do
    if ! port_open "$p"; then echo "$p"; return 0; fi
  done
  echo "no free port in $1..$(("$1" + 9))" >&2
  return 1
}

cleanup() {
  if [ -n "$PRIVATE_PG" ]; then
    as_pg_user pg_ctl -D "$PRIVATE_DIR/pg" -m fast -w stop >/dev/null 2>&1 || true
  fi
  if [ -n "$PRIVATE_REDIS_PID" ]; then
    kill "$PRIVATE_REDIS_PID" 2>/dev/null || true
    wait "$PRIVATE_REDIS_PID" 2>/dev/null || true
  fi
  local pid
  for pid in "${REDIS_CLUSTER_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ -n "$PRIVATE_DIR" ]; then rm -rf "$PRIVATE_DIR"; fi
  if [ -s "$PRESENCED_SKIP_LOG" ]; then
    echo "tests that skipped themselves at run time ($(sort -u "$PRESENCED_SKIP_LOG" | wc -l)):"
    sort -u "$PRESENCED_SKIP_LOG" | sed 's/^/  /'
  fi
  rm -f "$PRESENCED_SKIP_LOG"
}
# Tests that return early because something they need is missing write a line here
# (tests/common `skip`); cleanup prints them, so a skip never reads as a pass.
PRESENCED_SKIP_LOG="$(mktemp /tmp/presenced-skipped.XXXXXX)"
export PRESENCED_SKIP_LOG
trap cleanup EXIT

# PostgreSQL refuses to run as root: a private cluster then belongs to the postgres user
# (or nobody).
as_pg_user() {
  if [ -n "$PG_OS_USER" ]; then runuser -u "$PG_OS_USER" -- "$@"; else "$@"; fi
}

# The directory of initdb/pg_ctl: on PATH, or Debian's versioned one.
pg_bindir() {
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(command -v initdb)"
    return 0
  fi
  local d
  d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
  [ -n "$d" ] && [ -x "$d/initdb" ] && echo "$d"
}

# Installs Debian packages that provide missing binaries, when that is allowed.
install_packages() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "missing $* and not root with apt-get: install them, or set DATABASE_URL/REDIS_URL" >&2
    return 1
  fi
  echo "installing $*"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

private_dir() {
  if [ -z "$PRIVATE_DIR" ]; then
    PRIVATE_DIR="$(mktemp -d /tmp/presenced-services.XXXXXX)"
    chmod 755 "$PRIVATE_DIR"
  fi
}

start_private_postgres() {
  local bindir port
  bindir="$(pg_bindir || true)"
  if [ -z "$bindir" ]; then
    install_packages postgresql postgresql-client
    bindir="$(pg_bindir)"
  fi
  export PATH="$bindir:$PATH"
  if [ "$(id -u)" = 0 ]; then
    PG_OS_USER=postgres
    id postgres >/dev/null 2>&1 || PG_OS_USER=nobody
  fi
  private_dir
  port="$(free_port "$PORT_BASE")"
  mkdir -p "$PRIVATE_DIR/pg" "$PRIVATE_DIR/pgsock"
  if [ -n "$PG_OS_USER" ]; then chown "$PG_OS_USER" "$PRIVATE_DIR/pg" "$PRIVATE_DIR/pgsock"; fi
  as_pg_user initdb -D "$PRIVATE_DIR/pg" -U postgres --auth=trust -E UTF8 --no-sync \
    >"$PRIVATE_DIR/initdb.log"
  PRIVATE_PG=1
  as_pg_user pg_ctl -D "$PRIVATE_DIR/pg" -l "$PRIVATE_DIR/pg/server.log" -w -t 30 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $PRIVATE_DIR/pgsock -c fsync=off -c max_connections=300" \
    start >/dev/null
  export PGPORT="$port"
  export DATABASE_URL="postgres://postgres@127.0.0.1:${port}/${DB_NAME}"
  echo "private PostgreSQL on 127.0.0.1:$port ($PRIVATE_DIR/pg)"
}

start_private_redis() {
  local port
  command -v redis-server >/dev/null 2>&1 || install_packages redis-server
  private_dir
  port="$(free_port $(("$PORT_BASE" + 1)))"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$PRIVATE_DIR" --logfile "$PRIVATE_DIR/redis.log" &
  PRIVATE_REDIS_PID=$!
  for _ in $(seq 100); do port_open "$port" && break; sleep 0.05; done
  port_open "$port" || { echo "private redis-server did not start" >&2; exit 1; }
  export REDIS_URL="redis://127.0.0.1:${port}"
  echo "private Redis on 127.0.0.1:$port"
}

# Three masters, three replicas (the failover test promotes one), cluster bus timeouts of
# one second so a failover completes within a test's bounds. Each node's cluster bus listens
# on base+10+i (Redis' default, port+10000, lies in the kernel's ephemeral range, where any
# outgoing connection may hold it and the node then exits at start); the test's own cluster
# in tests/cluster.rs uses base+20 and up.
start_redis_cluster() {
  local base="${PRESENCED_REDIS_CLUSTER_PORT_BASE:-30301}" p i nodes=()
  command -v redis-server >/dev/null 2>&1 || install_packages redis-server
  private_dir
  for i in 0 1 2 3 4 5; do
    p=$((base + i))
    local bus=$((base + 10 + i))
    if port_open "$p" || port_open "$bus"; then
      echo "port $p or $bus is taken: set PRESENCED_REDIS_CLUSTER_PORT_BASE" >&2
      exit 1
    fi
    mkdir -p "$PRIVATE_DIR/cluster-$p"
    redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes --cluster-port "$bus" \
      --cluster-config-file "$PRIVATE_DIR/cluster-$p/nodes.conf" --cluster-node-timeout 1000 \
      --save "" --appendonly no --dir "$PRIVATE_DIR/cluster-$p" \
      --logfile "$PRIVATE_DIR/cluster-$p/redis.log" &
    REDIS_CLUSTER_PIDS+=($!)
    nodes+=("127.0.0.1:$p")
  done
  for p in "${nodes[@]}"; do
    for _ in $(seq 100); do port_open "${p#*:}" && break; sleep 0.05; done
    port_open "${p#*:}" || {
      echo "cluster redis-server on $p did not start; its log:" >&2
      cat "$PRIVATE_DIR/cluster-${p#*:}/redis.log" >&2 || true
      exit 1
    }
  done
  redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes \
    >"$PRIVATE_DIR/cluster-create.log"
  for p in "${nodes[@]}"; do
    for _ in $(seq 200); do
      redis-cli -p "${p#*:}" cluster info | grep -q '^cluster_state:ok' && break
      sleep 0.05
    done
    redis-cli -p "${p#*:}" cluster info | grep -q '^cluster_state:ok' ||
      { echo "Redis Cluster not ok on $p" >&2; exit 1; }
  done
  export PRESENCED_TEST_REDIS_CLUSTER="redis://127.0.0.1:${base},redis://127.0.0.1:$((base + 1)),redis://127.0.0.1:$((base + 2))"
  echo "Redis Cluster on 127.0.0.1:${base}-$((base + 5))"
}

if [ -n "$FORCE_PRIVATE" ] || { [ -z "${DATABASE_URL:-}" ] && ! port_open 5432; }; then
  start_private_postgres
fi
if [ -n "$FORCE_PRIVATE" ] || { [ -z "${REDIS_URL:-}" ] && ! port_open 6379; }; then
  start_private_redis
fi
export PGHOST="${PGHOST:-127.0.0.1}"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/${DB_NAME}}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379}"
if [ -z "${PRESENCED_TEST_REDIS_CLUSTER:-}" ]; then
  start_redis_cluster
fi

# Real XMPP clients this project did not write, driven by the tests.
python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
# The stock clients of tests/browser.rs and tests/profanity.rs: Node with the locked npm
# packages of tests/browser (converse.js, puppeteer-core, @xmpp/client), Debian's Chromium
# (also the browser of the admin status page test in tests/operations.rs), Profanity and
# tmux. Without them (not root) those tests fail and say what is missing.
missing=()
command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v profanity >/dev/null 2>&1 || missing+=(profanity)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
if [ "${#missing[@]}" -gt 0 ]; then
  install_packages "${missing[@]}" || echo "tests/browser.rs and tests/profanity.rs will fail" >&2
fi
# npm ci again when the lock file is newer than the installed tree.
if command -v npm >/dev/null 2>&1 && { [ ! -e tests/browser/node_modules/.package-lock.json ] ||
  [ tests/browser/package-lock.json -nt tests/browser/node_modules/.package-lock.json ]; }; then
  (cd tests/browser && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
fi

# A fresh database per run: no state from earlier runs or other branches.
psql -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1 -q \
  -c "DROP DATABASE IF EXISTS ${DB_NAME} WITH (FORCE)" \
  -c "CREATE DATABASE ${DB_NAME}"

if [ "$#" -gt 0 ]; then
  cargo test "$@"
  exit
fi

cargo test --all-targets --no-fail-fast

# The integration binaries that lean on the store again, in the embedded mode: their servers
# on an SQLite file and liveness in process (an empty REDIS_URL means no Redis). The store
# tests themselves (store, store_extra, gate_inputs, login_reads, ...) run every case on
# both stores, login_reads with its SQLite servers already in the embedded mode.
PRESENCED_TEST_STORE=sqlite REDIS_URL= cargo test --no-fail-fast \
  --test roster_sql --test privacy --test limits --test presence_property
# PEP on the embedded store; its cluster case needs Redis and ran above.
PRESENCED_TEST_STORE=sqlite REDIS_URL= cargo test --no-fail-fast --test pep -- --skip cluster

# The conformance runner's own offline tests, then the suite against this server (strict:
# a skipped scenario fails the run).
python3 -m pip install --quiet --disable-pip-version-check -r conformance/requirements.txt
python3 conformance/test_run.py
bash conformance/presenced.sh
# Once more with the server under test a cluster: two nodes on the same PostgreSQL and
# Redis, each scenario's users and resources spread over them.
CLUSTER_CONF_DIR="$(mktemp -d /tmp/cluster-conformance.XXXXXX)"
NODES=2 RUN_DIR="${CLUSTER_CONF_DIR}/run" bash conformance/presenced.sh
rm -rf "${CLUSTER_CONF_DIR}"
# Federation with a real Prosody across a cluster of two nodes: the peer's streams land on
# one node, the user is on the other, then on the first. federation.sh installs Prosody
# (apt) when it runs as root; without it and without root this one check is skipped.
if command -v prosody >/dev/null 2>&1 || [ "$(id -u)" = 0 ]; then
  FEDERATION_DIR="$(mktemp -d /tmp/cluster-federation.XXXXXX)"
  CLUSTER=1 WORK="$FEDERATION_DIR" bash tests/interop/federation.sh prosody
  rm -rf "$FEDERATION_DIR"
else
  echo "SKIP federation with Prosody across a cluster: prosody is not installed and this is not root"
fi
# And in the embedded mode, as the example configuration runs: SQLite, no Redis.
SQLITE_CONF_DIR="$(mktemp -d /tmp/sqlite-conformance.XXXXXX)"
REDIS_URL= DATABASE_URL="sqlite://${SQLITE_CONF_DIR}/conformance.db" RUN_DIR="${SQLITE_CONF_DIR}/run" \
  bash conformance/presenced.sh
rm -rf "${SQLITE_CONF_DIR}"

# Every generated table in BENCHMARKS.md and BENCHMARKS-ARCHIVE.md still matches what its
# script prints from the committed raw results under bench/results/ (no table by hand).
python3 bench/tables.py --check

# The fuzz crate's decoder tests and every seed document under all limit choices (its own
# workspace; no fuzzer needed for these).
(cd fuzz && cargo test --lib)
