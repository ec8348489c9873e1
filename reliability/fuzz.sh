#!/usr/bin/env bash
# reliability/fuzz.sh: every cargo-fuzz target of fuzz/ (see fuzz/README.md) for FUZZ_SECS
# each (or until FUZZ_RUNS executions, whichever comes first), all at once at `nice -n 10`,
# then one line per target: executions, seconds, rate, corpus files, coverage, and whether
# it crashed (the crash input stays in fuzz/artifacts/<target>/).
#
#   FUZZ_SECS=1800 reliability/fuzz.sh
#   FUZZ_RUNS=10000000 FUZZ_SECS=7200 reliability/fuzz.sh   # 10 M executions, at most 2 h
#   TARGETS="stream_reader framed_reader"   SANITIZER=none (or address: slower, see below)
#   RSS_LIMIT_MB=2048   libFuzzer's memory limit per target process
#   SEEDS=0             do not write the seed corpus first (it needs a debug build of the
#                       fuzz crate; libFuzzer then starts from what corpus/<target>/ holds)
#
# SANITIZER=none by default: the reader under test has no unsafe code, and without
# AddressSanitizer each execution costs less, so a run of fixed length reaches more
# executions (not measured yet on this machine); the invariants (panics, split invariance, the socket
# reader's agreement, round trip, error conditions) are assertions in the harness and are
# checked either way. Needs cargo-fuzz (`cargo install cargo-fuzz --locked`) and, on stable
# Rust, RUSTC_BOOTSTRAP=1 (set here) for its -Z flags. The seed corpus comes from
# `cargo run --example write_seeds`; the corpus and artifacts stay in the gitignored
# fuzz/corpus and fuzz/artifacts.
set -euo pipefail
FUZZ="$(cd "$(dirname "$0")/../fuzz" && pwd)"
FUZZ_SECS="${FUZZ_SECS:-600}"
FUZZ_RUNS="${FUZZ_RUNS:--1}" # libFuzzer's -runs: -1 means no limit
TARGETS="${TARGETS:-stream_reader framed_reader}"
SANITIZER="${SANITIZER:-none}"
RSS_LIMIT_MB="${RSS_LIMIT_MB:-2048}"
export RUSTC_BOOTSTRAP=1
cd "$FUZZ"
unset CARGO_TARGET_DIR
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz missing: cargo install cargo-fuzz --locked" >&2; exit 1; }
[ "${SEEDS:-1}" = 0 ] || cargo run --quiet --example write_seeds >/dev/null
for t in $TARGETS; do
    nice -n 10 cargo fuzz build -s "$SANITIZER" "$t" >/dev/null
done
pids=()
for t in $TARGETS; do
    mkdir -p "corpus/$t" "artifacts/$t"
    echo "$(ls "corpus/$t" | wc -l)" >"/tmp/fuzz-$t.corpus0"
    nice -n 10 cargo fuzz run -s "$SANITIZER" "$t" -- -max_total_time="$FUZZ_SECS" -runs="$FUZZ_RUNS" \
        -print_final_stats=1 -rss_limit_mb="$RSS_LIMIT_MB" >"/tmp/fuzz-$t.log" 2>&1 &
    pids+=($!)
done
rcs=()
for p in "${pids[@]}"; do
    rc=0
    wait "$p" || rc=$?
    rcs+=("$rc")
done
echo "| target | executions | seconds | execs/s | corpus files (start → end) | cov | ft | result |"
echo "|---|---|---|---|---|---|---|---|"
i=0
for t in $TARGETS; do
    log="/tmp/fuzz-$t.log"
    execs="$(awk '/stat::number_of_executed_units/ {print $NF}' "$log" | tail -1)"
    secs="$(awk '/stat::average_exec_per_sec/ {print $NF}' "$log" | tail -1)"
    last="$(grep -E '^#[0-9]+' "$log" | tail -1)"
    cov="$(echo "$last" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')"
    ft="$(echo "$last" | sed -n 's/.*ft: \([0-9]*\).*/\1/p')"
    result=clean
    [ "${rcs[$i]}" = 0 ] || result="CRASH (exit ${rcs[$i]}; $(ls "artifacts/$t" | head -1))"
    # "Done N runs in S second(s)" when the time or the runs ran out; else executions / rate.
    dur="$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)"
    if [ -z "$dur" ] && [ -n "$execs" ] && [ -n "$secs" ] && [ "$secs" != 0 ]; then
        dur=$((execs / secs))
    fi
    echo "| $t | ${execs:-?} | ${dur:-?} | ${secs:-?} | $(cat "/tmp/fuzz-$t.corpus0") → $(ls "corpus/$t" | wc -l) | ${cov:-?} | ${ft:-?} | $result |"
    i=$((i + 1))
done
echo
echo "FUZZ_SECS=$FUZZ_SECS FUZZ_RUNS=$FUZZ_RUNS SANITIZER=$SANITIZER, $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg), commit $(git rev-parse --short HEAD)"
