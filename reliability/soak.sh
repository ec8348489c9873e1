#!/usr/bin/env bash
# reliability/soak.sh: N sessions under continuous churn against one presenced release node
# for SOAK_SECS, with a private PostgreSQL and Redis; one sample of the node and the stores
# a minute; after every client has left, waits until no session and no liveness or
# directory key is left (at most 3 T + 60 s), then prints the summary (soak_report.py).
#
#   N=10000 K=10 SOAK_SECS=3600 reliability/soak.sh
#
#   CHURN=0.10          fraction of the sessions reconnecting per minute (half by dropping
#                       the connection, half by closing the stream)
#   PRESENCE_RATE=20    presence changes per second; MESSAGE_RATE=20 chat messages per second
#   SAMPLE_SECS=60      seconds between samples; WARMUP_SECS=600 left out of the slopes
#   BEAT_SECS=10        seconds between samples of the written beats' ages (beats.jsonl)
#   PORT_BASE=31700     c2s PORT_BASE+1, /metrics PORT_BASE+2
#   STORE_PORT_BASE=30401  private Redis on it, private PostgreSQL on it + 1
#   WORK=/tmp/presenced-soak   everything the run writes (removed first)
#   PRESENCED_BIN, BENCH_BIN   prebuilt release binaries (else cargo build --release)
# Bounded: the generator stops at SOAK_SECS + logins + 600 s, the leave check at 3 T + 60 s.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

N="${N:-10000}"
K="${K:-10}"
SOAK_SECS="${SOAK_SECS:-3600}"
CHURN="${CHURN:-0.10}"
PRESENCE_RATE="${PRESENCE_RATE:-20}"
MESSAGE_RATE="${MESSAGE_RATE:-20}"
SAMPLE_SECS="${SAMPLE_SECS:-60}"
WARMUP_SECS="${WARMUP_SECS:-600}"
BEAT_SECS="${BEAT_SECS:-10}"
PORT_BASE="${PORT_BASE:-31700}"
STORE_PORT_BASE="${STORE_PORT_BASE:-30401}"
WORK="${WORK:-/tmp/presenced-soak}"
TTL=100 # [liveness] ttl default: keys of a silent resource live at most this long
C2S=$((PORT_BASE + 1))
METRICS=$((PORT_BASE + 2))

cleanup() {
    set +e
    [ -n "${GEN_PID:-}" ] && kill "$GEN_PID" 2>/dev/null
    [ -n "${BEATS_PID:-}" ] && kill "$BEATS_PID" 2>/dev/null
    [ -n "${NODE_PID_soak:-}" ] && kill "$NODE_PID_soak" 2>/dev/null && wait "$NODE_PID_soak"
    [ -n "${REDIS_PID:-}" ] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID"
    [ -n "${PG_DIR:-}" ] && pg_stop fast
}
trap cleanup EXIT

build_release
fresh_stores
log "provisioning $N users with $K contacts each"
provision "$N" "$K"
node_config soak "$C2S" "$METRICS"
node_start soak "$C2S"
PID="$NODE_PID_soak"
log "presenced pid $PID on $C2S; $(cat /proc/loadavg)"
COMMIT="$(cd "$REPO" && git rev-parse --short HEAD)$(cd "$REPO" && git diff --quiet HEAD || echo -dirty)"
echo "{\"commit\":\"$COMMIT\",\"n\":$N,\"k\":$K,\"soak_secs\":$SOAK_SECS,\"churn\":$CHURN,\"presence_rate\":$PRESENCE_RATE,\"message_rate\":$MESSAGE_RATE,\"warmup_secs\":$WARMUP_SECS,\"nproc\":$(nproc),\"started\":\"$(date -u +%FT%TZ)\"}" >"$WORK/run.json"

"$BENCH" --target "127.0.0.1:$C2S" --domain "$DOMAIN" -n "$N" -k "$K" \
    --scram-cache "$WORK/scram-cache.txt" --soak-secs "$SOAK_SECS" \
    --churn-per-min "$CHURN" --soak-presence-rate "$PRESENCE_RATE" \
    --soak-message-rate "$MESSAGE_RATE" --sample-secs "$SAMPLE_SECS" \
    --soak-log "$WORK/clients.jsonl" --drain-secs 30 --login-timeout 60 \
    --time-limit $((SOAK_SECS + 1200)) 2>"$WORK/generator.log" &
GEN_PID=$!
# Server-side samples from the moment the generator starts; t counts from its start.
T0=$(date +%s)
# The written beats' ages every BEAT_SECS (default [liveness] beat_shards 16, ttl 100 s):
# a liveness key missing from a sample shows here as a beat older than T.
while kill -0 "$GEN_PID" 2>/dev/null; do
    beat_ages 16 $((TTL * 1000))
    sleep "$BEAT_SECS"
done >"$WORK/beats.jsonl" &
BEATS_PID=$!
: >"$WORK/samples.jsonl"
while kill -0 "$GEN_PID" 2>/dev/null; do
    sample "$PID" "$METRICS" $(($(date +%s) - T0)) >>"$WORK/samples.jsonl"
    for _ in $(seq "$SAMPLE_SECS"); do
        kill -0 "$GEN_PID" 2>/dev/null || break
        sleep 1
    done
done
GEN_RC=0
wait "$GEN_PID" || GEN_RC=$?
GEN_PID=
wait "$BEATS_PID" 2>/dev/null || true
BEATS_PID=
log "generator exited with $GEN_RC; checking that everything is released"
# After the last client left: sessions must reach 0 at once (clean closes), liveness and
# directory keys within the grace and expiry times. Sampled every 10 s, at most 3 T + 60 s.
LEFT_AT=$(date +%s)
: >"$WORK/after.jsonl"
while :; do
    s="$(sample "$PID" "$METRICS" $(($(date +%s) - T0)))"
    echo "$s" >>"$WORK/after.jsonl"
    if echo "$s" | grep -q '"sessions":0,' && echo "$s" | grep -q '"presence_keys":0,"dir_keys":0,'; then
        break
    fi
    [ $(($(date +%s) - LEFT_AT)) -gt $((3 * TTL + 60)) ] && break
    sleep 10
done
# What is left in Redis, by key shape (user names folded), for the report.
redis_cli --scan | sed -E 's/\{[^}]*\}/{USER}/; s/[0-9]+$/N/' | sort | uniq -c >"$WORK/keys_left.txt"
redis_cli --scan | head -3 >>"$WORK/keys_left.txt"
echo "{\"left_at\":$LEFT_AT,\"generator_rc\":$GEN_RC}" >>"$WORK/run.json"
python3 "$REPO/reliability/soak_report.py" "$WORK" | tee "$WORK/report.md"
