#!/usr/bin/env bash
# bench/repeat.sh: bench/run.sh REPEATS times (default 3) with the servers' order alternated
# (as given, then reversed, then as given, ...), so no server always runs first or last on
# a machine whose load drifts; then one table of medians and min–max ranges (bench/ratio.py).
#
# Usage: [REPEATS=3] [N=1000 K=10 SERVERS="..."] bench/repeat.sh [--record] [-- generator args]
#   Every other variable is bench/run.sh's. Results: $BENCH_WORK/repeats/<UTC stamp>/run<i>/.
#   --record appends the table to BENCHMARKS.md.
#   BENCH_LOCK=FILE: each run holds this flock(1) lock (benchmarks sharing the machine take
#   turns; -o: the servers started inside do not inherit it). Provision first
#   (bench/run.sh --provision-only) so that the lock is not held while provisioning.
# Provisioning (untimed) happens in the first run for what is missing.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
REPEATS="${REPEATS:-3}"
SERVERS="${SERVERS:-prosody ejabberd presenced embedded}"
WORK="${BENCH_WORK:-/tmp/presenced-bench}"
RECORD=0
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --record) RECORD=1; shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="$WORK/repeats/$STAMP"
mkdir -p "$OUT"
reversed() { local out="" s; for s in $1; do out="$s${out:+ $out}"; done; echo "$out"; }
FAILED=0
DIRS=()
for i in $(seq 1 "$REPEATS"); do
    order="$SERVERS"
    [ $((i % 2)) = 0 ] && order="$(reversed "$SERVERS")"
    echo "[repeat.sh $(date -u +%H:%M:%S)] run $i of $REPEATS: $order (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    lock=()
    [ -n "${BENCH_LOCK:-}" ] && lock=(flock -o "$BENCH_LOCK")
    RESULTS="$OUT/run$i" SERVERS="$order" "${lock[@]}" "$HERE/run.sh" "${PASS[@]}" || FAILED=1
    DIRS+=("$OUT/run$i")
done
{
    echo "### Repeated runs $STAMP"
    echo
    echo "Command: \`REPEATS=$REPEATS N=${N:-1000} K=${K:-10} SERVERS=\"$SERVERS\" bench/repeat.sh ${PASS[*]:-}\`"
    echo
    echo "Machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(free -m | awk '/^Mem:/ {print $2 " MB RAM"}'), $(uname -sr)"
    echo "Peers: $(dpkg-query -W -f='${Package} ${Version}, ' prosody ejabberd 2>/dev/null | sed 's/, $//')"
    echo
    python3 "$HERE/ratio.py" "${DIRS[@]}"
} | tee "$OUT/summary.md"
if [ "$RECORD" = 1 ]; then
    { echo; cat "$OUT/summary.md"; } >> "$REPO/BENCHMARKS.md"
fi
exit $FAILED
