#!/usr/bin/env bash
# reliability/faults.sh: faults under load, scaled down. For each scenario a fresh private
# PostgreSQL and Redis, presenced release node(s) with short liveness times (T = 5 s), and
# N sessions (presence changes, chat messages, probes, light churn) for LOAD_SECS; the fault
# starts FAULT_AT seconds into the load. Afterwards faults_report.py tells what the clients
# saw, when every online watcher saw presence changes again, and where every message went.
#
#   reliability/faults.sh                       # all four scenarios
#   SCENARIOS="redis-pause" reliability/faults.sh
#
# Scenarios:
#   redis-kill   Redis SIGKILLed, restarted empty on the same port 5 s later
#   pg-restart   PostgreSQL stopped (-m immediate, as a crash) and started again
#   redis-pause  the Redis process SIGSTOPped for 2 T (10 s), then SIGCONT
#   node-kill    two nodes on one database and Redis, users spread over both; node b
#                SIGKILLed (its clients log in again at node a)
#
#   N=500 K=10 LOAD_SECS=60 FAULT_AT=20   PORT_BASE=31700 (c2s +11/+12, /metrics +13/+14)
#   STORE_PORT_BASE=30411 (Redis), +1 (PostgreSQL)   WORK=/tmp/presenced-faults
#   PRESENCED_BIN, BENCH_BIN   prebuilt release binaries (else cargo build --release)
# Bounded: each scenario's generator stops at LOAD_SECS + 300 s.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

N="${N:-500}"
K="${K:-10}"
LOAD_SECS="${LOAD_SECS:-60}"
FAULT_AT="${FAULT_AT:-20}"
SCENARIOS="${SCENARIOS:-redis-kill pg-restart redis-pause node-kill}"
PORT_BASE="${PORT_BASE:-31700}"
STORE_PORT_BASE="${STORE_PORT_BASE:-30411}"
ROOT="${WORK:-/tmp/presenced-faults}"
C2S_A=$((PORT_BASE + 11)) C2S_B=$((PORT_BASE + 12))
MET_A=$((PORT_BASE + 13)) MET_B=$((PORT_BASE + 14))
stop_all() {
    set +e
    [ -n "${GEN_PID:-}" ] && kill "$GEN_PID" 2>/dev/null && wait "$GEN_PID"
    for v in NODE_PID_a NODE_PID_b; do
        [ -n "${!v:-}" ] && kill -CONT "${!v}" 2>/dev/null && kill "${!v}" 2>/dev/null && wait "${!v}" 2>/dev/null
        eval "$v="
    done
    if [ -n "${REDIS_PID:-}" ]; then
        kill -CONT "$REDIS_PID" 2>/dev/null
        kill "$REDIS_PID" 2>/dev/null
        wait "$REDIS_PID" 2>/dev/null
    fi
    [ -n "${PG_DIR:-}" ] && pg_stop fast
    GEN_PID= REDIS_PID= PG_DIR=
    set -e
}
trap stop_all EXIT

# T = 5 s: H 1 s, Redis refresh 1 s (T > H + refresh + 10%), grace 1 s, sweeps every 0.5 s
# (T leaves a client starved of CPU on a loaded machine a few seconds to answer a ping);
# a Redis command counts as failed after 0.5 s, reconnects back off to 1 s at most.
config() { # name c2s metrics
    node_config "$1" "$2" "$3"
    python3 - "$WORK/$1.toml" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
s = s.replace('key_prefix = ""', 'key_prefix = ""\ntimeout = 0.5\nreconnect_max = 1.0')
s += """
[liveness]
heartbeat_interval = 1.0
redis_refresh = 1.0
ttl = 5.0
grace = 1.0
sweep_interval = 0.5
"""
open(p, "w").write(s)
PY
}

# Seconds since the load started (the generator's "start" line), or empty before it.
load_t() {
    local s
    s="$(grep -m1 '"kind":"start"' "$WORK/clients.jsonl" 2>/dev/null | sed 's/.*"unix":\([0-9]*\).*/\1/')"
    [ -n "$s" ] && echo $(($(date +%s) - s))
}

# Waits until the load has run $1 seconds (bounded by the login time).
wait_load() {
    local i t
    for i in $(seq 600); do
        t="$(load_t || true)"
        [ -n "$t" ] && [ "$t" -ge "$1" ] && return 0
        sleep 0.5
    done
    return 1
}

event() { echo "{\"event\":\"$1\",\"unix\":$(date +%s.%N | cut -c1-14)}" >>"$WORK/events.jsonl"; }

run_scenario() {
    local sc=$1 also=()
    WORK="$ROOT/$sc"
    fresh_stores
    provision "$N" "$K"
    config a "$C2S_A" "$MET_A"
    node_start a "$C2S_A"
    if [ "$sc" = node-kill ]; then
        config b "$C2S_B" "$MET_B"
        node_start b "$C2S_B"
        also=(--also-target "127.0.0.1:$C2S_B")
    fi
    echo "{\"scenario\":\"$sc\",\"n\":$N,\"k\":$K,\"load_secs\":$LOAD_SECS,\"fault_at\":$FAULT_AT,\"load\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >"$WORK/run.json"
    : >"$WORK/events.jsonl"
    "$BENCH" --target "127.0.0.1:$C2S_A" "${also[@]}" --domain "$DOMAIN" -n "$N" -k "$K" \
        --scram-cache "$WORK/scram-cache.txt" --soak-secs "$LOAD_SECS" \
        --churn-per-min 0.05 --soak-presence-rate 10 --soak-message-rate 20 --probe-rate 2 \
        --sample-secs 1 --soak-log "$WORK/clients.jsonl" --drain-secs 20 --login-timeout 20 \
        --time-limit $((LOAD_SECS + 300)) 2>"$WORK/generator.log" &
    GEN_PID=$!
    wait_load "$FAULT_AT" || { log "$sc: the load did not start"; return 1; }
    case "$sc" in
        redis-kill)
            event fault_start; kill -KILL "$REDIS_PID"; wait "$REDIS_PID" 2>/dev/null || true
            sleep 5
            redis_start "$WORK/redis" "$STORE_PORT_BASE"; event fault_end ;;
        pg-restart)
            event fault_start; pg_stop immediate
            sleep 2
            pg_start; event fault_end ;;
        redis-pause)
            event fault_start; kill -STOP "$REDIS_PID"
            sleep 10
            kill -CONT "$REDIS_PID"; event fault_end ;;
        node-kill)
            event fault_start; kill -KILL "$NODE_PID_b"; wait "$NODE_PID_b" 2>/dev/null || true
            NODE_PID_b=; event fault_end ;;
    esac
    local rc=0
    wait "$GEN_PID" || rc=$?
    GEN_PID=
    # What the store still holds for later delivery once every client has left.
    sleep 2
    local offline sessions
    offline="$(psql_q 'SELECT count(*) FROM offline_messages' || true)"
    sessions="$(curl -s "http://127.0.0.1:$MET_A/metrics" | awk '/^presenced_sessions / {print $2}' || true)"
    echo "{\"generator_rc\":$rc,\"offline_left\":${offline:-null},\"sessions_a\":${sessions:-null}}" >>"$WORK/run.json"
    stop_all
    log "$sc: done (generator exit $rc)"
}

build_release
for sc in $SCENARIOS; do
    log "scenario $sc"
    run_scenario "$sc"
done
python3 "$REPO/reliability/faults_report.py" "$ROOT" $SCENARIOS | tee "$ROOT/report.md"
