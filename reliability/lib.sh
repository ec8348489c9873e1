# reliability/lib.sh: pieces shared by soak.sh and faults.sh (sourced, not run).
#
# Private PostgreSQL and Redis started from the installed binaries in $WORK, on loopback
# ports the caller chooses; presenced release nodes with their own config; one sample of a
# node's resources. Nothing here touches a service it did not start.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DOMAIN=soak.example

log() { echo "[$(basename "$0") $(date -u +%H:%M:%S)] $*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # port seconds
    local i
    for i in $(seq 1 $(($2 * 10))); do
        port_open "$1" && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1 after $2 s" >&2
    return 1
}

pg_bindir() {
    if command -v initdb >/dev/null 2>&1; then dirname "$(command -v initdb)"; return; fi
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1
}

# PostgreSQL refuses to run as root: the private cluster belongs to the postgres user.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

pg_init() { # dir port
    local bin
    bin="$(pg_bindir)"
    mkdir -p "$1"
    [ "$(id -u)" = 0 ] && chown postgres "$1"
    as_pg "$bin/initdb" -D "$1/data" -U postgres --auth=trust -E UTF8 --no-sync >"$1.initdb.log"
    PG_DIR="$1" PG_PORT="$2"
}
pg_start() {
    as_pg "$(pg_bindir)/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k $PG_DIR -c fsync=off -c max_connections=200" \
        start >/dev/null
}
pg_stop() { # mode: fast (clean) or immediate (like a crash)
    as_pg "$(pg_bindir)/pg_ctl" -D "$PG_DIR/data" -m "${1:-fast}" -w -t 60 stop >/dev/null 2>&1 || true
}
pg_url() { echo "postgres://postgres@127.0.0.1:$PG_PORT/${1:-presenced}"; }
psql_q() { psql "$(pg_url)" -Atq -c "$1" 2>/dev/null; }

redis_start() { # dir port
    mkdir -p "$1"
    REDIS_DIR="$1" REDIS_PORT="$2"
    redis-server --port "$2" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$1" --logfile "$1/redis.log" &
    REDIS_PID=$!
    wait_port "$2" 30
}
redis_cli() { redis-cli -p "$REDIS_PORT" "$@"; }
# Keys matching a pattern (SCAN, never KEYS), e.g. 'presence:*'.
redis_count() { redis-cli -p "$REDIS_PORT" --scan --pattern "$1" 2>/dev/null | wc -l; }

# node_config name c2s_port metrics_port [extra toml]: writes $WORK/<name>.toml
node_config() {
    cat >"$WORK/$1.toml" <<TOML
domains = ["$DOMAIN"]
[c2s]
bind = "127.0.0.1"
port = $2
direct_tls = false
[tls]
certs_dir = "$WORK/certs"
[database]
url = "$(pg_url)"
migrations = "$WORK/migrations.d"
[redis]
url = "redis://127.0.0.1:$REDIS_PORT"
key_prefix = ""
[http]
enabled = false
[admin]
port = $3
socket = ""
[s2s]
enabled = false
[cluster]
node_id = "$1"
[limits]
connections_per_ip_per_minute = 1000000
max_connections_per_ip = 100000
max_connections = 19600
stanzas_per_second = 100000
stanza_burst = 100000
${4:-}
TOML
}

# node_start name c2s_port: starts presenced with $WORK/<name>.toml; sets NODE_PID_<name>
node_start() {
    env -u DATABASE_URL -u REDIS_URL "$PRESENCED" --config "$WORK/$1.toml" serve \
        >>"$WORK/$1.log" 2>&1 &
    eval "NODE_PID_$1=$!"
    wait_port "$2" 120
}

# One JSON sample of a node and the stores: RSS, descriptors, sessions, keys, rows, load.
sample() { # pid metrics_port t
    local pid=$1 rss fds sessions load
    rss="$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo null)"
    fds="$(ls "/proc/$pid/fd" 2>/dev/null | wc -l)"
    sessions="$(curl -s "http://127.0.0.1:$2/metrics" | awk '/^presenced_sessions / {print $2}')"
    load="$(cut -d' ' -f1-3 /proc/loadavg | tr ' ' ',')"
    printf '{"t":%s,"unix":%s,"rss_kb":%s,"fds":%s,"sessions":%s,"redis_keys":%s,' \
        "$3" "$(date +%s)" "${rss:-null}" "$fds" "${sessions:-null}" "$(redis_cli dbsize 2>/dev/null || echo null)"
    printf '"presence_keys":%s,"dir_keys":%s,' "$(redis_count 'presence:{*')" "$(redis_count 'dir:{*')"
    printf '"offline_messages":%s,"last_activity":%s,"pending_subscriptions":%s,"roster_items":%s,' \
        "$(psql_q 'SELECT count(*) FROM offline_messages' || echo null)" \
        "$(psql_q 'SELECT count(*) FROM last_activity' || echo null)" \
        "$(psql_q 'SELECT count(*) FROM pending_subscriptions' || echo null)" \
        "$(psql_q 'SELECT count(*) FROM roster_items' || echo null)"
    printf '"pg_backends":%s,%s"load":[%s]}\n' \
        "$(psql_q "SELECT count(*) FROM pg_stat_activity WHERE datname = 'presenced'" || echo null)" \
        "$(c="$(live_counters "$2")"; [ -n "$c" ] && echo "$c,")" "$load"
}

# The liveness node counters from /metrics as JSON fields (no trailing comma): writes that
# reached Redis, failed or dropped Redis operations, pings, beats, sweeps, swept resources,
# silent deaths.
live_counters() { # metrics_port
    curl -s "http://127.0.0.1:$1/metrics" | awk '
        /^presenced_[a-z_]+(_total)? / {
            n = $1; sub(/^presenced_/, "", n); sub(/_total$/, "", n)
            if (n ~ /^(redis_writes|redis_errors|pings_sent|heartbeats|sweeps|swept_resources|silent_deaths)$/)
                out = out (out == "" ? "" : ",") "\"" n "\":" $2
        }
        END { print out }'
}

# Ages of the beats written to Redis (one EVAL, cheap enough to run every few seconds): a
# resource's key expires T after the beat its last write carried, so a member of the beat
# ZSETs older than T has lost its key. Prints {"unix_ms", "members", "older_60s",
# "older_90s", "older_ttl", "oldest_s", "dbsize"}.
BEAT_AGES='local now = tonumber(ARGV[1]); local shards = tonumber(ARGV[2]); local ttl = tonumber(ARGV[3])
local c, a, b, d, m = 0, 0, 0, 0, now
for s = 0, shards - 1 do
  local k = "presence:beats:" .. s
  c = c + redis.call("ZCARD", k)
  a = a + redis.call("ZCOUNT", k, "-inf", now - 60000)
  b = b + redis.call("ZCOUNT", k, "-inf", now - 90000)
  d = d + redis.call("ZCOUNT", k, "-inf", now - ttl)
  local r = redis.call("ZRANGE", k, 0, 0, "WITHSCORES")
  if #r > 0 and tonumber(r[2]) < m then m = tonumber(r[2]) end
end
return {c, a, b, d, now - m, redis.call("DBSIZE")}'
beat_ages() { # shards ttl_ms
    local now v
    now="$(date +%s%3N)"
    v="$(redis_cli --no-raw EVAL "$BEAT_AGES" 0 "$now" "$1" "$2" 2>/dev/null | awk '{print $NF}' | paste -sd' ')"
    set -- $v
    [ $# -eq 6 ] || return 0
    printf '{"unix_ms":%s,"members":%s,"older_60s":%s,"older_90s":%s,"older_ttl":%s,"oldest_s":%s,"dbsize":%s}\n' \
        "$now" "$1" "$2" "$3" "$4" "$(awk -v m="$5" 'BEGIN{printf "%.1f", m / 1000}')" "$6"
}

# fresh_stores: an empty $WORK with a private PostgreSQL on STORE_PORT_BASE + 1 and a
# private Redis on STORE_PORT_BASE in it.
fresh_stores() {
    rm -rf "$WORK"
    mkdir -p "$WORK"
    chmod 755 "$WORK"
    pg_init "$WORK/pg" $((STORE_PORT_BASE + 1))
    pg_start
    redis_start "$WORK/redis" "$STORE_PORT_BASE"
}

build_release() {
    if [ -n "${PRESENCED_BIN:-}" ] && [ -n "${BENCH_BIN:-}" ]; then
        PRESENCED="$PRESENCED_BIN" BENCH="$BENCH_BIN"
        return
    fi
    log "release build of presenced and presenced-bench"
    (cd "$REPO" && cargo build --release --quiet -p presenced --bin presenced -p presenced-bench)
    PRESENCED="${CARGO_TARGET_DIR:-$REPO/target}/release/presenced"
    BENCH="${CARGO_TARGET_DIR:-$REPO/target}/release/presenced-bench"
}

# provision N K: accounts and the ring of mutual contacts, through presenced's own store.
provision() {
    "$BENCH" --server presenced --provision --provision-db "$(pg_url)" --domain "$DOMAIN" \
        -n "$1" -k "$2" --scram-cache "$WORK/scram-cache.txt" >&2
}
