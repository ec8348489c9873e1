#!/usr/bin/env bash
# bench/cluster.sh: presenced as one node and as a cluster of several nodes on this machine,
# with the same generator (bench/generator) and workload: sessions held, logins/s,
# deliveries/s (contacts spread over the nodes), RSS and CPU per session, Redis commands and
# bytes per presence change, and, with more than one node, how long a SIGKILLed node takes
# to be announced unavailable for every one of its sessions. BENCHMARKS.md, "Cluster", has the
# results and how to read them.
#
# Usage: bench/cluster.sh [--record]
#   RUNS="1:19000 3:51000"  runs in order, each NODES:N; a run with more than one node
#                           ends with the SIGKILL of the last node (six nodes hold 100,000:
#                           RUNS="6:10000 6:100000" DB_POOL=12 RUN_LIMIT=2400)
#   REPEAT=1                repetitions of RUNS (medians and min–max need 3)
#   K=10                    mutual contacts per user (ring: user i's contacts are i±1..±5,
#                           and user i logs in to node i mod NODES, so most contacts of a
#                           session are on other nodes)
#   PORT_BASE=29500         node j (1..NODES): c2s PORT_BASE+j, admin PORT_BASE+100+j;
#                           the private Redis PORT_BASE+379
#   CLUSTER_WORK=/tmp/presenced-cluster-bench   configs, logs, provisioning markers
#   RESULTS=$CLUSTER_WORK/results   one JSON per run (nodes<M>-n<N>-run<R>, replaced when
#                           run again); the summary covers every JSON there
#   PG=postgres://postgres@127.0.0.1:5432      PostgreSQL server; each N gets its own
#                           database presenced_cluster_bench_n<N>_k<K> (provisioned once)
#   TTL=45 HEARTBEAT=15 REFRESH=15 SWEEP=5 GRACE=10  liveness timings of the nodes (s):
#                           the kill phase counts announcements against T + one sweep
#   DB_POOL=16              PostgreSQL connections per node (six nodes at 16 would take
#                           96 of the server's default 100)
#   RUN_LIMIT=1200          seconds one generator run may take (its --time-limit)
#   REST_SECS=30            idle window after logins (the at-rest Redis rate is read over it)
#   BENCH_BIN, PRESENCED_BIN  prebuilt binaries (else the release builds of this checkout)
#   --record                append the summary to BENCHMARKS.md
#
# Everything listens on 127.0.0.1; the descriptor limit is raised to at most 20,000 (one
# process holds at most ~19,000 sessions: node and generator process alike, hence one
# generator process per 10,000 sessions). Stops early if the machine starts to swap.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
RUNS="${RUNS:-1:19000 3:51000}"
REPEAT="${REPEAT:-1}"
K="${K:-10}"
PORT_BASE="${PORT_BASE:-29500}"
WORK="${CLUSTER_WORK:-/tmp/presenced-cluster-bench}"
PG="${PG:-postgres://postgres@127.0.0.1:5432}"
TTL="${TTL:-45}"
HEARTBEAT="${HEARTBEAT:-15}"
REFRESH="${REFRESH:-15}"
SWEEP="${SWEEP:-5}"
GRACE="${GRACE:-10}"
RUN_LIMIT="${RUN_LIMIT:-1200}"
DB_POOL="${DB_POOL:-16}"
REST_SECS="${REST_SECS:-30}"
REDIS_PORT=$((PORT_BASE + 379))
DOMAIN=bench.example
RESULTS="${RESULTS:-$WORK/results}"
RECORD=0
[ "${1:-}" = --record ] && RECORD=1
# BENCH_COMMIT and BENCH_MACHINE for every run's meta.json.
. "$HERE/where.sh"

log() { echo "[cluster.sh $(date +%H:%M:%S)] $*" >&2; }

# ---------------------------------------------------------------- build, certificate
if [ -z "${BENCH_BIN:-}" ] || [ -z "${PRESENCED_BIN:-}" ]; then
    log "release build of presenced and presenced-bench"
    (cd "$REPO" && cargo build --release --quiet -p presenced --bin presenced &&
        cargo build --release --quiet -p presenced-bench)
fi
BENCH="${BENCH_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/presenced-bench}"
PRESENCED="${PRESENCED_BIN:-${CARGO_TARGET_DIR:-$REPO/target}/release/presenced}"
mkdir -p "$WORK/tls" "$RESULTS"
if [ ! -f "$WORK/tls/bench.crt" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
        -subj "/CN=$DOMAIN" -addext "subjectAltName=DNS:$DOMAIN" \
        -keyout "$WORK/tls/bench.key" -out "$WORK/tls/bench.crt" 2>/dev/null
fi
ulimit -n 20000
log "descriptor limit $(ulimit -n)"

# ---------------------------------------------------------------- processes
PIDS=()
stop_all() {
    local p
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
}
trap stop_all EXIT

wait_port() { # port seconds
    local i
    for i in $(seq 1 $(($2 * 10))); do
        ss -Hltn "sport = :$1" | grep -q LISTEN && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1 after $2 s" >&2
    return 1
}

swapping() { # true when swap is in use (the machine has none configured normally)
    awk '/^SwapTotal/ {t=$2} /^SwapFree/ {f=$2} END {exit !(t > 0 && t - f > 65536)}' /proc/meminfo
}

node_config() { # j db
    local d="$WORK/node$1"
    mkdir -p "$d"
    cat >"$d/presenced.toml" <<TOML
# generated by bench/cluster.sh
domains = ["$DOMAIN"]
[c2s]
bind = "127.0.0.1"
port = $((PORT_BASE + $1))
direct_tls = false
[tls]
cert = "$WORK/tls/bench.crt"
key = "$WORK/tls/bench.key"
certs_dir = "$d/certs"
[database]
url = "$2"
max_connections = $DB_POOL
migrations = "$REPO/migrations"
[redis]
url = "redis://127.0.0.1:$REDIS_PORT"
key_prefix = "bench:"
[cluster]
node_id = "node$1"
[liveness]
heartbeat_interval = $HEARTBEAT
ttl = $TTL
redis_refresh = $REFRESH
sweep_interval = $SWEEP
grace = $GRACE
[http]
enabled = false
[admin]
port = $((PORT_BASE + 100 + $1))
socket = ""
[s2s]
enabled = false
[limits]
connections_per_ip_per_minute = 1000000
max_connections_per_ip = 100000
max_connections = 19600
stanzas_per_second = 100000
stanza_burst = 100000
TOML
}

# ---------------------------------------------------------------- one run
run_once() { # nodes n index
    local nodes="$1" n="$2" idx="$3" db procs j
    db="$PG/presenced_cluster_bench_n${n}_k${K}"
    procs=$(((n + 9999) / 10000))
    local common=(--target "127.0.0.1:$((PORT_BASE + 1))" --domain "$DOMAIN" --server presenced
                  -n "$n" -k "$K" --scram-cache "$WORK/scram-n${n}-k${K}.txt")
    if [ ! -f "$WORK/provisioned-n${n}-k${K}" ]; then
        log "provisioning N=$n K=$K into ${db##*/} (untimed)"
        psql "$PG/postgres" -q -c "DROP DATABASE IF EXISTS ${db##*/} WITH (FORCE)"
        psql "$PG/postgres" -q -c "CREATE DATABASE ${db##*/}"
        "$BENCH" "${common[@]}" --provision --provision-db "$db" --time-limit 3600
        touch "$WORK/provisioned-n${n}-k${K}"
    fi
    # A fresh private Redis per run: INFO commandstats sees this run's nodes only.
    rm -rf "$WORK/redis" && mkdir -p "$WORK/redis"
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$WORK/redis" --logfile "$WORK/redis/redis.log" &
    local redis_pid=$!
    PIDS+=("$redis_pid")
    wait_port "$REDIS_PORT" 30
    local node_pids=() args=() pidargs=()
    for j in $(seq 1 "$nodes"); do
        node_config "$j" "$db"
        env -u DATABASE_URL -u REDIS_URL "$PRESENCED" --config "$WORK/node$j/presenced.toml" serve \
            >>"$WORK/node$j/stdout.log" 2>&1 &
        node_pids+=($!)
        PIDS+=($!)
    done
    for j in $(seq 1 "$nodes"); do
        wait_port "$((PORT_BASE + j))" 120
        pidargs+=(--server-pid "${node_pids[$((j - 1))]}")
        [ "$j" -gt 1 ] && args+=(--also-target "127.0.0.1:$((PORT_BASE + j))")
    done
    if [ "$nodes" -gt 1 ]; then
        # The last node dies after the load phases; the others' sweepers announce it.
        args+=(--kill-pid "${node_pids[$((nodes - 1))]}" --kill-target $((nodes - 1))
               --kill-bound-secs $((TTL + SWEEP)) --kill-wait $((2 * TTL + 30)))
    fi
    sleep 5 # start-up work settles before the 0-session reading
    local name="nodes${nodes}-n${n}-run${idx}" rc=0 load_before started
    load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
    started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    log "$name: timed run ($procs generator processes)"
    "$BENCH" "${common[@]}" "${args[@]}" "${pidargs[@]}" --procs "$procs" \
        --settle-secs 120 --rest-secs "$REST_SECS" --time-limit "$RUN_LIMIT" \
        --redis-stats "redis://127.0.0.1:$REDIS_PORT" --store-pid "$redis_pid" \
        --label "$name" --json "$RESULTS/$name.json" | tee "$RESULTS/$name.txt" || rc=$?
    printf '{"started": "%s", "nodes": %d, "load_before": "%s", "load_after": "%s", "swapping": %s, "pin": "not pinned", "commit": "%s", "machine": "%s"}\n' \
        "$started" "$nodes" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" \
        "$(swapping && echo true || echo false)" "$BENCH_COMMIT" "$BENCH_MACHINE" \
        >"$RESULTS/$name.meta.json"
    stop_all
    return $rc
}

# ---------------------------------------------------------------- main
FAILED=0
for r in $(seq 1 "$REPEAT"); do
    for spec in $RUNS; do
        if swapping; then
            log "the machine is swapping: stopping"
            FAILED=1
            break 2
        fi
        run_once "${spec%%:*}" "${spec#*:}" "$r" || FAILED=1
    done
done
python3 "$HERE/cluster_summary.py" "$RESULTS" | tee "$RESULTS/summary.md"
if [ "$RECORD" = 1 ]; then
    { echo; cat "$RESULTS/summary.md"; } >>"$REPO/BENCHMARKS.md"
    log "appended to BENCHMARKS.md"
fi
exit $FAILED
