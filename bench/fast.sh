#!/usr/bin/env bash
# bench/fast.sh: FAST reconnects against full SCRAM logins (BENCHMARKS.md, "FAST reconnects:
# CPU per login and the storm"). presenced on PostgreSQL + Redis only, through bench/run.sh's
# storm mode with the causes cut (every client socket closed at once, back on the back-off)
# and relogin (every stream closed, then every client logs in again: the CPU per login of
# the server and its stores). One run per login mode in turn, RUNS times, so the modes are
# alternated rather than measured one block after another on this shared machine:
#   sasl1  SCRAM, stream restart, bind (the bench's default login)
#   sasl2  SASL2 SCRAM with Bind 2 inline, full TLS handshake every time
#   fast   SASL2 with the password and a token request first, then FAST with the token over
#          a resumed TLS 1.3 session on every reconnect
#   fast-resume  as fast, with XEP-0198 resumption enabled in the first login's Bind 2 and
#          every reconnect resuming the session inline in its FAST authentication (no
#          roster get, no presence); its relogin window cuts the sockets instead of
#          closing the streams, so the server keeps the sessions (not in MODES by default)
#
# Usage: bench/fast.sh OUT_DIR     (N=1000 K=10 RUNS=3 CERT_KIND=ecdsa MODES="sasl1 sasl2 fast"
#                                  FIRST_RUN=1: the number of the first run, to add runs)
# Each run's JSON goes to OUT_DIR/<cert>-n<N>-k<K>-<run>-<mode>/ with run.json: the commit,
# the machine and the load averages. bench/fast_table.py OUT_DIR prints the table.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
OUT="${1:?usage: bench/fast.sh OUT_DIR}"
N="${N:-1000}"
K="${K:-10}"
RUNS="${RUNS:-3}"
CERT_KIND="${CERT_KIND:-ecdsa}"
MODES="${MODES:-sasl1 sasl2 fast}"
export N K CERT_KIND
# Its own state, database and ports, so it can run beside someone else's bench/run.sh.
export BENCH_WORK="${BENCH_WORK:-/tmp/presenced-bench-fast}"
export PRESENCED_DB="${PRESENCED_DB:-postgres://postgres@127.0.0.1:5432/presenced_fast_n${N}_k${K}}"
export PRESENCED_PORT="${PRESENCED_PORT:-29332}" PRESENCED_HTTP_PORT="${PRESENCED_HTTP_PORT:-29290}"
export BENCH_REDIS_PORT="${BENCH_REDIS_PORT:-29389}"
export SERVERS=presenced STORM=1 STORM_CAUSES="${STORM_CAUSES:-cut,relogin}"
commit="$(git -C "$REPO" rev-parse --short HEAD)$(git -C "$REPO" diff --quiet HEAD -- src bench/generator || echo -dirty)"
machine="$(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(free -m | awk '/^Mem:/ {print $2 " MB RAM"}'), $(uname -sr)"
mkdir -p "$OUT"
FIRST_RUN="${FIRST_RUN:-1}"
for run in $(seq "$FIRST_RUN" $((FIRST_RUN + RUNS - 1))); do
    for mode in $MODES; do
        dir="$OUT/$CERT_KIND-n$N-k$K-$run-$mode"
        rm -rf "$dir"
        mkdir -p "$dir"
        before="$(cut -d' ' -f1-3 /proc/loadavg)"
        started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        rc=0
        RESULTS="$dir" "$HERE/run.sh" -- --login "$mode" >"$dir/run.log" 2>&1 || rc=$?
        printf '{"commit": "%s", "machine": "%s", "started": "%s", "load_before": "%s", "load_after": "%s", "login": "%s", "cert": "%s", "run": %d, "exit": %d}\n' \
            "$commit" "$machine" "$started" "$before" "$(cut -d' ' -f1-3 /proc/loadavg)" \
            "$mode" "$CERT_KIND" "$run" "$rc" > "$dir/run.json"
        echo "[fast.sh] $CERT_KIND N=$N K=$K run $run $mode: exit $rc" >&2
    done
done
