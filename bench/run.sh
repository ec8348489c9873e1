#!/usr/bin/env bash
# bench/run.sh: the same XMPP workload against Prosody, ejabberd, presenced on PostgreSQL +
# Redis and presenced embedded (SQLite, liveness in process), one after another on this
# machine, then a ratio table. bench/repeat.sh runs this several times and reports medians.
#
# Usage: bench/run.sh [--smoke] [--record] [--fresh] [-- extra presenced-bench args]
#   N=1000 K=10          sessions and mutual contacts per user
#   SERVERS="prosody ejabberd presenced embedded"   (run in this order)
#   PRESENCED_CMD="..."  command that starts presenced in the foreground on
#                        127.0.0.1:$PRESENCED_PORT for domain bench.example, with STARTTLS
#                        using $BENCH_WORK/tls/bench.crt and bench.key like the peers, SCRAM,
#                        and no rate limits (skipped if unset; the column stays empty)
#   PRESENCED_SQL=FILE   SQL that provisions presenced users (see provision_presenced())
#   BENCH_WORK=/tmp/presenced-bench  state, configs, logs
#   RESULTS=DIR          where the JSON results and the summary go ($BENCH_WORK/results)
#   PEER_PROVISION=files  how the peers get their users and rosters (untimed): "files"
#                        writes Prosody's storage and imports it into ejabberd (seconds);
#                        "xmpp" registers in-band and subscribes over XMPP (hours at 10k)
#   PROSODY_STORAGE=sql  Prosody's storage: "sql" (PostgreSQL on 127.0.0.1, database
#                        prosody_bench_n<N>_k<K>, filled from the provisioned files by
#                        prosody-migrator), as an operator with many users runs it; "internal"
#                        (its files), as the tables before 2026-12-05 ran it
#   PROVISION_TIME_LIMIT=14400  seconds the untimed provisioning may take
#   PROVISION_RATE=500   users per second sending their subscription requests
#   PROCS=P              generator processes for the timed run (default: one per 10,000
#                        sessions; a process may open at most 20,000 descriptors here)
#   BENCH_BIN=PATH       use this presenced-bench binary instead of building one
#   REST_SECS=60         idle window after logins, the same for every server (so the load
#                        phases start at the same offset); presenced's Redis/PostgreSQL
#                        write rates at rest are read over it
#   PRESENCED_HTTP_PORT=29280, BENCH_REDIS_PORT=29379  presenced's /metrics listener and the
#                        private redis-server the bench runs for it (exact INFO commandstats)
#   CSI=1                the client state indication workload (XEP-0352) instead of the
#                        fixed-load and saturation phases: Prosody with mod_csi_simple,
#                        ejabberd with mod_client_state; CSI_SECS=20 per window,
#                        CSI_INTEREST=2 contacts in the interest lists of presenced's third
#                        window (presenced and embedded only; 0 skips it). One generator
#                        process (the nothing-lost check compares sessions of one process).
#   LATENCY_FRACTIONS=0.25,0.5,0.75  the latency ladder after the saturation phase: one
#                        fixed-load phase per fraction of LATENCY_OF, each with its own
#                        latency figures (empty: no ladder; not with CSI=1)
#   LATENCY_OF=22000     the saturation those are fractions of, in deliveries/s: a given
#                        figure, the same offered load for every server in every run (the
#                        best peer's median at N = 1,000, K = 10; --smoke: 120)
#   LADDER_SECS=10       length of each ladder phase, s
#   STORM=1              the reconnect storms (BENCHMARKS.md, "Reconnect storm") instead of
#                        the timed phases: after the logins every session is dropped at once
#                        and comes back on the clients' back-off, once per cause of
#                        STORM_CAUSES="cut,restart" (cut: the generator closes every client
#                        socket; restart: this script stops the server process and starts
#                        it again when the generator asks, through $DATA/<server>/storm/;
#                        relogin: every stream closed, then every client logs in again:
#                        the CPU per reconnect; `-- --login sasl2|fast` for SASL2 or FAST
#                        reconnects, see bench/fast.sh);
#                        STORM_WAIT=300 s at most per storm. One generator process.
#   CERT_KIND=ecdsa      the certificate every server serves: ecdsa (P-256) or rsa2048
#                        (BENCHMARKS-ARCHIVE.md, "TLS session resumption: handshake CPU")
#   PIN=auto             where the processes run: with 2 or more cores and taskset, the
#                        generator on CPU 0 and every server under test (with presenced's
#                        private Redis) on the other cores, so the load never takes the
#                        server's core; PIN=0 leaves it to the scheduler. The machine's
#                        PostgreSQL is not pinned (it serves presenced and Prosody alike).
#                        Recorded as "pin" in each <server>.meta.json.
#   --record             append the results block to BENCHMARKS.md
#   --fresh              wipe server data (re-provision) first
#   --provision-only     provision what is missing for this N/K (untimed) and stop
#
# Ports: Prosody 29222, ejabberd 29422 (PROSODY_PORT, EJABBERD_PORT: e.g. to provision two
# sizes at once), presenced 29322, presenced /metrics 29280, its private Redis 29379;
# embedded 29323 (EMBEDDED_PORT) and /metrics 29281 (EMBEDDED_HTTP_PORT). All lie below the
# kernel's ephemeral range (32768 and up on Linux), where any outgoing connection on the
# machine may hold a port as its source and a server then cannot listen on it; and clear of
# the tests' fixed ports (26222+, 28300+, 30201+). ejabberd's Erlang distribution listens on a port the
# kernel picks (ephemeral) unless EJABBERD_DIST_PORTS=LOW-HIGH names a range (the node
# and each ejabberdctl call take one port of it: give it a few).
# Everything listens on 127.0.0.1 only. Provisioning happens before each timed run and the
# server is restarted in between, so the timed run starts from a fresh process.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
N="${N:-1000}"
K="${K:-10}"
SERVERS="${SERVERS:-prosody ejabberd presenced embedded}"
# CPU pinning (PIN above): GEN_PIN and SRV_PIN prefix the generator's and the servers'
# commands, and PIN_DESC says which in the results.
PIN="${PIN:-auto}"
if [ "$PIN" = auto ]; then
    if [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null 2>&1; then PIN=1; else PIN=0; fi
fi
if [ "$PIN" = 1 ]; then
    GEN_PIN=(taskset -c 0)
    SRV_PIN=(taskset -c "1-$(($(nproc) - 1))")
    if [ "$(nproc)" = 2 ]; then PIN_DESC="generator on CPU 0, server on CPU 1"
    else PIN_DESC="generator on CPU 0, server on CPUs 1-$(($(nproc) - 1))"; fi
else
    GEN_PIN=()
    SRV_PIN=()
    PIN_DESC="not pinned"
fi
# BENCH_COMMIT and BENCH_MACHINE for every run's meta.json.
. "$HERE/where.sh"
WORK="${BENCH_WORK:-/tmp/presenced-bench}"
RESULTS="${RESULTS:-$WORK/results}"
DOMAIN=bench.example
CERT_KIND="${CERT_KIND:-ecdsa}"
case "$CERT_KIND" in
    ecdsa) CERT_BASE=bench ;;
    rsa2048) CERT_BASE=bench-rsa2048 ;;
    *) echo "CERT_KIND must be ecdsa or rsa2048" >&2; exit 2 ;;
esac
PROSODY_PORT="${PROSODY_PORT:-29222}"
EJABBERD_PORT="${EJABBERD_PORT:-29422}"
PROSODY_STORAGE="${PROSODY_STORAGE:-sql}"
PROSODY_DB="prosody_bench_n${N}_k${K}"
PRESENCED_PORT="${PRESENCED_PORT:-29322}"
PRESENCED_HTTP_PORT="${PRESENCED_HTTP_PORT:-29280}"
EMBEDDED_PORT="${EMBEDDED_PORT:-29323}"
EMBEDDED_HTTP_PORT="${EMBEDDED_HTTP_PORT:-29281}"
BENCH_REDIS_PORT="${BENCH_REDIS_PORT:-29379}"
REST_SECS="${REST_SECS:-60}"
CSI="${CSI:-0}"
CSI_SECS="${CSI_SECS:-20}"
CSI_INTEREST="${CSI_INTEREST:-2}"
STORM="${STORM:-0}"
STORM_CAUSES="${STORM_CAUSES:-cut,restart}"
STORM_WAIT="${STORM_WAIT:-300}"
PEER_PROVISION="${PEER_PROVISION:-files}"
LATENCY_FRACTIONS="${LATENCY_FRACTIONS-0.25,0.5,0.75}"
LADDER_SECS="${LADDER_SECS:-10}"
SMOKE=0
RECORD=0
FRESH=0
PROVISION_ONLY=0
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1; N=20; K=3; REST_SECS=3; LATENCY_OF="${LATENCY_OF:-120}"; shift ;;
        --record) RECORD=1; shift ;;
        --fresh) FRESH=1; shift ;;
        --provision-only) PROVISION_ONLY=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
# One generator process holds at most ~19k sessions (20,000 descriptors per process on
# this machine); one per 10,000 sessions keeps each well below that and spreads the
# generator's own work over the cores.
PROCS="${PROCS:-$(( (N + 9999) / 10000 ))}"
LATENCY_OF="${LATENCY_OF:-22000}"
[ "$CSI" = 1 ] && PROCS=1
[ "$STORM" = 1 ] && PROCS=1
# Server data per N and K, so that 10k and 19k can be provisioned ahead of time side by side
# and timed later (provisioning the peers takes tens of minutes at these sizes).
DATA="$WORK/n$N-k$K"
COMMAND_LINE="$([ "$CSI" = 1 ] && echo "CSI=1 CSI_SECS=$CSI_SECS CSI_INTEREST=$CSI_INTEREST " || true)$([ "$STORM" = 1 ] && echo "STORM=1 STORM_CAUSES=$STORM_CAUSES " || true)$([ "$CSI" != 1 ] && [ "$STORM" != 1 ] && [ -n "$LATENCY_FRACTIONS" ] && echo "LATENCY_FRACTIONS=$LATENCY_FRACTIONS LATENCY_OF=$LATENCY_OF LADDER_SECS=$LADDER_SECS " || true)N=$N K=$K PROCS=$PROCS SERVERS=\"$SERVERS\" bench/run.sh $([ "$SMOKE" = 1 ] && echo --smoke || true) ${EXTRA[*]:-}"

log() { echo "[run.sh $(date +%H:%M:%S)] $*" >&2; }

# ---------------------------------------------------------------- install (idempotent)
install_peers() {
    # erlang-luerl: ejabberd's import_prosody reads the provisioned Lua files with it.
    # lua-dbi-postgresql: Prosody's SQL storage on PostgreSQL (PROSODY_STORAGE=sql).
    local pkgs="prosody lua-unbound lua-dbi-postgresql ejabberd erlang-luerl" p missing=0
    for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing=1; done
    if [ "$missing" = 1 ]; then
        log "installing $pkgs from Debian"
        apt-get install -y $pkgs >/dev/null \
            || { apt-get update >/dev/null && apt-get install -y $pkgs >/dev/null; }
    fi
}

# ---------------------------------------------------------------- build
build_bench() {
    if [ -n "${BENCH_BIN:-}" ]; then BENCH="$BENCH_BIN"; return; fi # a prebuilt generator
    log "building presenced-bench (release)"
    (cd "$REPO" && cargo build --release --quiet -p presenced-bench)
    BENCH="${CARGO_TARGET_DIR:-$REPO/target}/release/presenced-bench"
    [ -x "$BENCH" ] || { echo "no binary at $BENCH" >&2; exit 1; }
}

# ---------------------------------------------------------------- TLS (same for all)
make_cert() {
    mkdir -p "$WORK/tls"
    local key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1)
    [ "$CERT_KIND" = rsa2048 ] && key=(-newkey rsa:2048)
    if [ ! -f "$WORK/tls/$CERT_BASE.crt" ]; then
        log "self-signed $CERT_KIND certificate for $DOMAIN"
        openssl req -x509 "${key[@]}" -nodes \
            -days 30 -subj "/CN=$DOMAIN" -addext "subjectAltName=DNS:$DOMAIN" \
            -keyout "$WORK/tls/$CERT_BASE.key" -out "$WORK/tls/$CERT_BASE.crt" 2>/dev/null
        cat "$WORK/tls/$CERT_BASE.crt" "$WORK/tls/$CERT_BASE.key" > "$WORK/tls/$CERT_BASE.pem"
    fi
}

# A server process must be able to hold N sessions plus its own files; each server inherits
# the descriptor limit from this shell (raised below), so check what it actually got.
check_fd_limit() { # pid
    local have
    have="$(awk '/^Max open files/ {print $4}' "/proc/$1/limits")"
    if [ "$have" != unlimited ] && [ "$have" -lt $(( N + 200 )) ]; then
        echo "server pid $1 may open only $have descriptors, fewer than N=$N + 200" >&2
        return 1
    fi
    log "server pid $1: descriptor limit $have"
}

wait_port() { # port seconds [pid of the server that is to listen]
    local i
    for i in $(seq 1 $(( $2 * 10 ))); do
        ss -Hltn "sport = :$1" | grep -q LISTEN && return 0
        if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then
            echo "the server (pid $3) exited before listening on port $1" >&2
            return 1
        fi
        sleep 0.1
    done
    echo "nothing listens on port $1 after $2 s" >&2
    return 1
}

# ---------------------------------------------------------------- Prosody
# Prosody's storage lines: SQL on PostgreSQL (Prosody's docs, "Choosing a storage
# backend": the SQL backend for larger deployments) or its files.
prosody_storage() {
    if [ "$PROSODY_STORAGE" = sql ]; then
        echo 'storage = "sql"'
        echo "sql = { driver = \"PostgreSQL\"; database = \"$PROSODY_DB\"; username = \"postgres\"; host = \"127.0.0.1\" }"
    else
        echo 'storage = "internal"'
    fi
}
prosody_config() {
    local d="$DATA/prosody" csi=""
    mkdir -p "$d/data"
    # XEP-0352: mod_csi_simple holds presence for inactive clients (its csi_queue_size of
    # 256 stanzas and any bytes from the client flush the held ones).
    [ "$CSI" = 1 ] && csi='; "csi_simple"'
    cat > "$d/prosody.cfg.lua" <<CFG
-- generated by bench/run.sh
run_as_root = true -- this machine runs everything as root (no systemd, no prosody user switch)
pidfile = "$d/prosody.pid"
data_path = "$d/data"
interfaces = { "127.0.0.1" }
local_interfaces = { "127.0.0.1" }
c2s_ports = { $PROSODY_PORT }
c2s_direct_tls_ports = { }
s2s_ports = { }
component_ports = { }
http_ports = { }
https_ports = { }
network_backend = "epoll"
-- server_epoll has no connection cap of its own: the process's descriptor limit is the cap
-- (run.sh raises ulimit -n before starting it and checks /proc/PID/limits). On EMFILE it
-- stops accepting for accept_retry_interval (10 s), so a too-low limit shows as a stall.
network_settings = { tcp_backlog = 1024 }
log = { warn = "$d/prosody.log" }
modules_enabled = { "roster"; "saslauth"; "tls"; "disco"; "register"$csi }
modules_disabled = { "s2s" }
allow_registration = true -- provisioning uses XEP-0077 (no throttle: min_seconds_between_registrations unset)
c2s_require_encryption = true
authentication = "internal_hashed"
$(prosody_storage)
ssl = { certificate = "$WORK/tls/$CERT_BASE.crt"; key = "$WORK/tls/$CERT_BASE.key" }
VirtualHost "$DOMAIN"
    ssl = { certificate = "$WORK/tls/$CERT_BASE.crt"; key = "$WORK/tls/$CERT_BASE.key" }
CFG
}
prosody_start() {
    "${SRV_PIN[@]}" prosody -F --config "$DATA/prosody/prosody.cfg.lua" >>"$DATA/prosody/stdout.log" 2>&1 &
    SERVER_PID=$!
    wait_port "$PROSODY_PORT" 60 "$SERVER_PID" || return 1
    SERVER_PIDS=("$SERVER_PID")
    check_fd_limit "$SERVER_PID"
}
# SIGTERM, then SIGKILL after 30 s: Prosody 0.12 can hang in shutdown when sessions are
# still mid-login (mod_c2s "attempt to call a nil value (method 'close')"); its file
# storage has written every change already.
stop_pid() { # pid
    local i
    kill "$1" 2>/dev/null || return 0
    for i in $(seq 1 300); do
        kill -0 "$1" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}
prosody_stop() {
    stop_pid "$SERVER_PID"
}
# The users' accounts (SCRAM-SHA-1, Prosody's own iteration count) and rosters written
# straight into the data directory (presenced-bench --provision-files): the same users,
# passwords and mutual contacts as the XMPP provisioning, in seconds instead of hours.
# Written from empty (with a fresh SaltedPassword cache): nothing of an earlier
# provisioning is mixed in.
prosody_provision() { # generator args...
    rm -rf "$DATA/prosody/data" "$DATA/prosody/scram-cache.txt"
    "$BENCH" "$@" --provision --provision-files "$DATA/prosody/data" --scram-iterations 10000
    [ "$PROSODY_STORAGE" = sql ] || return 0
    # The same files into a fresh database with Prosody's own migrator (the ejabberd
    # import still reads the files).
    psql -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1 -q \
        -c "DROP DATABASE IF EXISTS $PROSODY_DB WITH (FORCE)" -c "CREATE DATABASE $PROSODY_DB"
    cat > "$DATA/prosody/migrator.cfg.lua" <<CFG
-- generated by bench/run.sh
files {
    type = "internal"; path = "$DATA/prosody/data";
    hosts = { ["$DOMAIN"] = { "accounts"; "roster" } };
}
database { type = "sql"; driver = "PostgreSQL"; database = "$PROSODY_DB"; username = "postgres"; host = "127.0.0.1" }
CFG
    log "prosody: migrating the provisioned files into PostgreSQL ($PROSODY_DB)"
    prosody-migrator --config="$DATA/prosody/migrator.cfg.lua" files database >/dev/null
}

# ---------------------------------------------------------------- ejabberd
ejabberd_config() {
    local d="$DATA/ejabberd" csi=""
    # XEP-0352: mod_client_state queues presence (the latest per sender), chat states and
    # PEP for inactive clients.
    [ "$CSI" = 1 ] && csi="
  mod_client_state:
    queue_presence: true
    queue_chat_states: true
    queue_pep: true"
    mkdir -p "$d/db" "$d/logs"
    # Mnesia ties its data to the node name: keep the name the data was provisioned under
    # (EJABBERD_NODE lets two sizes be provisioned side by side on two ports).
    [ -f "$d/node" ] || echo "${EJABBERD_NODE:-ejabberd-bench@localhost}" > "$d/node"
    EJ_NODE="$(cat "$d/node")"
    cp "$WORK/tls/$CERT_BASE.pem" "$d/bench.pem"
    cp /etc/ejabberd/inetrc "$d/inetrc" 2>/dev/null || true
    # Tuned as an operator with this working set would: ejabberd's caches (global
    # `cache_size`, 1,000 entries by default) hold the whole working set, every user's
    # roster and every item, N × (K + 1). The roster tables stay as mod_roster_mnesia
    # makes them (disc_only_copies): turning them into disc_copies through ejabberd's
    # Mnesia schema file (ejabberd.schema) lost the roster table's index on `us` at start
    # in 23.01, and every roster read then failed (tried 2026-12-05).
    local cache=$(( N * (K + 1) ))
    [ "$cache" -lt 1000 ] && cache=1000
    cat > "$d/ejabberd.yml" <<CFG
# generated by bench/run.sh
hosts:
  - $DOMAIN
loglevel: warning
log_rotate_count: 0
certfiles:
  - "$d/bench.pem"
listen:
  -
    port: $EJABBERD_PORT
    ip: "127.0.0.1"
    module: ejabberd_c2s
    starttls_required: true
    max_stanza_size: 262144
    shaper: none
    access: c2s
    backlog: 1024
# ejabberd's overload killer terminates the busiest client processes when the machine's
# memory use (all processes, e.g. other builds) passes oom_watermark: on a shared machine
# it killed provisioning sessions. A benchmark wants every session kept.
oom_killer: false
auth_method: internal
auth_password_format: scram
cache_size: $cache
registration_timeout: infinity
shaper_rules:
  max_user_sessions: 10
  c2s_shaper: none
access_rules:
  c2s:
    allow: all
  register:
    allow: all
modules:
  mod_roster: {}
  mod_disco: {}
  mod_register:
    ip_access: all
    access: register$csi
CFG
    cat > "$d/ejabberdctl.cfg" <<CFG
# generated by bench/run.sh: our own ctl config (the system one would replace --config)
ERLANG_NODE=$EJ_NODE
INET_DIST_INTERFACE=127.0.0.1
CONFIG_DIR=$d
EJABBERD_CONFIG_PATH=$d/ejabberd.yml
SPOOL_DIR=$d/db
LOGS_DIR=$d/logs
EJABBERD_PID_PATH=$d/ejabberd.pid
# Erlang ports (sockets) cap: above the descriptor limit, so the limit is what counts.
ERL_MAX_PORTS=65536
# ejabberdctl would re-run itself through su as user ejabberd, and su (pam_limits) drops
# the descriptor limit to 1024: ejabberd then silently stops accepting at ~990 sessions.
# Run it as the current user (root) with the inherited limit, as Prosody runs (run_as_root).
EXEC_CMD=as_current_user
# The Erlang distribution's listening ports (empty: the kernel picks one).
FIREWALL_WINDOW=${EJABBERD_DIST_PORTS:-}
# Erlang's schedulers busy-wait before they sleep (by default): on 2 cores shared with the
# generator that spinning takes CPU from the other processes and is counted as ejabberd's
# CPU time. Switched off for the dirty CPU and IO schedulers too.
ERL_OPTIONS="+sbwt none +sbwtdcpu none +sbwtdio none"
CFG
    chown -R ejabberd:ejabberd "$d"
}
ejabberd_start() {
    local d="$DATA/ejabberd" i p try
    # A port can be held for a moment by another program (eaddrinuse, and ejabberd exits),
    # most likely when PORT variables put it in the ephemeral range. Then try again.
    for try in 1 2 3; do
        "${SRV_PIN[@]}" ejabberdctl --ctl-config "$d/ejabberdctl.cfg" foreground >>"$d/stdout.log" 2>&1 &
        SERVER_PID=$!
        wait_port "$EJABBERD_PORT" 300 "$SERVER_PID" && break
        wait "$SERVER_PID" 2>/dev/null
        [ "$try" = 3 ] && return 1
        log "ejabberd did not start (see $d/stdout.log); again in 5 s"
        sleep 5
    done
    SERVER_PIDS=()
    for i in $(seq 1 50); do
        for p in $(pgrep -x beam.smp); do
            tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q -- "-s*name $EJ_NODE " \
                && SERVER_PIDS=("$p")
        done
        [ ${#SERVER_PIDS[@]} -gt 0 ] && break
        sleep 0.2
    done
    [ ${#SERVER_PIDS[@]} -gt 0 ] || { echo "beam.smp of $EJ_NODE not found" >&2; return 1; }
    check_fd_limit "${SERVER_PIDS[0]}"
}
ejabberd_stop() {
    ejabberdctl --ctl-config "$DATA/ejabberd/ejabberdctl.cfg" stop >/dev/null 2>&1 || true
    wait "$SERVER_PID" 2>/dev/null || true
}
# The same files as Prosody's (ejabberd's own iteration count) go into an empty Mnesia
# database on a running node. Mnesia stays the backend, as in every earlier run.
# * Accounts: `ejabberdctl import_prosody` (SCRAM records). ejabberdctl gives up on a
#   command after 60 s (the import goes on unseen), so the files go in chunks of
#   EJABBERD_IMPORT_CHUNK users (1,000 accounts take seconds).
# * Roster items: import_prosody writes them at ≈ 300 items/s (100,000 in ≈ 5.5 min; the
#   3,000,000 of N = 10,000, K = 300 would take hours), so by default
#   (EJABBERD_ROSTERS=mnesia) the same items are written as the `roster` records
#   import_prosody writes, with mnesia:dirty_write through a hidden Erlang node
#   (ejabberd_write_rosters); EJABBERD_ROSTERS=import keeps import_prosody for them too.
# The account and roster item counts are checked at the end.
ejabberd_provision() { # generator args...
    local d="$DATA/ejabberd" src="$DATA/ejabberd/import" rc=0 part f host have items
    local rosters="${EJABBERD_ROSTERS:-mnesia}"
    rm -rf "$src" "$src".* "$d/db" "$d/scram-cache.txt"
    mkdir -p "$d/db"
    "$BENCH" "$@" --provision --provision-files "$src" --scram-iterations 4096 || return 1
    host="$(ls "$src")"
    ls "$src/$host/accounts" | split -l "${EJABBERD_IMPORT_CHUNK:-1000}" - "$src.list-"
    ejabberd_start || { echo "ejabberd did not start" >&2; ejabberd_stop; return 1; }
    for part in "$src".list-*; do
        rm -rf "$src.chunk"
        mkdir -p "$src.chunk/$host/accounts" "$src.chunk/$host/roster"
        while read -r f; do
            mv "$src/$host/accounts/$f" "$src.chunk/$host/accounts/"
            if [ "$rosters" = import ]; then mv "$src/$host/roster/$f" "$src.chunk/$host/roster/"; fi
        done < "$part"
        log "ejabberd: import_prosody $(wc -l < "$part") users ($part)"
        ejabberdctl --ctl-config "$d/ejabberdctl.cfg" import_prosody "$src.chunk" || { rc=1; break; }
    done
    if [ "$rc" = 0 ] && [ "$rosters" = mnesia ]; then
        ejabberd_write_rosters "$src/$host/roster" || rc=1
    fi
    have="$(ejabberdctl --ctl-config "$d/ejabberdctl.cfg" registered_users "$DOMAIN" 2>/dev/null | grep -c .)"
    items="$(ejabberd_eval 'io:format("~p~n", [rpc:call(Node, mnesia, table_info, [roster, size])])')" || true
    ejabberd_stop
    rm -rf "$src" "$src".*
    [ "$rc" = 0 ] && [ "$have" = "$N" ] || { echo "ejabberd: $have of $N accounts imported" >&2; return 1; }
    [ "$items" = $(( N * K )) ] || { echo "ejabberd: $items of $(( N * K )) roster items" >&2; return 1; }
}
# Erlang expressions run on a hidden node of this machine with `Node` bound to the running
# ejabberd node (same user, so the same ~/.erlang.cookie); what they print is the output.
ejabberd_eval() { # expressions (without the final halt)
    EJ_NODE="$EJ_NODE" erl -sname "bench-prov-$$@localhost" -hidden -noshell -noinput \
        -eval "Node = list_to_atom(os:getenv(\"EJ_NODE\")), $1, halt(0)."
}
# Every roster file DIR/<user>.dat as the records import_prosody makes of it: for user U
# and contact C@CS, #roster{usj = {U, Host, {C, CS, <<>>}}, us = {U, Host},
# jid = {C, CS, <<>>}, name = <<>>, subscription = both, ask = none, groups = [],
# askmessage = <<>>, xs = []} (mod_roster.hrl of 23.01), written with mnesia:dirty_write
# (the table's index on `us` is kept by Mnesia) in batches of 5,000 records per call.
# ejabberd keeps `roster` as disc_only_copies (a dets file): one write at a time there runs
# at ≈ 300 records/s, as slow as import_prosody. So the table is turned into disc_copies
# (in memory, logged) for the writes and back into disc_only_copies afterwards, which
# writes the dets file in one pass: the timed run finds the table as ejabberd made it.
# Turning it back failed with "Dump of table to disc failed, enoent" on a fast machine at
# N = 1,000, K = 10 and 300, while Mnesia reported its log overloaded by the bulk write: the
# transaction log is dumped first.
ejabberd_write_rosters() { # roster dir
    local pairs="$DATA/ejabberd/roster-pairs.eterm"
    # The bench's user names are letters and digits: the file name is the user name.
    if ls "$1" | grep -q '%'; then echo "ejabberd: encoded roster file names" >&2; return 1; fi
    find "$1" -name '*.dat' -print0 | xargs -0 awk '
        FNR == 1 { u = FILENAME; sub(/.*\//, "", u); sub(/\.dat$/, "", u) }
        /^\t\["/ { j = $0; sub(/^\t\["/, "", j); sub(/"\].*/, "", j); split(j, a, "@")
                   printf "{<<\"%s\">>, <<\"%s\">>, <<\"%s\">>}.\n", u, a[1], a[2] }' > "$pairs"
    log "ejabberd: writing $(wc -l < "$pairs") roster items into Mnesia"
    EJ_PAIRS="$pairs" EJ_HOST="$DOMAIN" ejabberd_eval '
        {ok, Pairs} = file:consult(os:getenv("EJ_PAIRS")),
        Host = list_to_binary(os:getenv("EJ_HOST")),
        Rec = fun({U, C, CS}) -> {roster, {U, Host, {C, CS, <<>>}}, {U, Host}, {C, CS, <<>>},
                                  <<>>, both, none, [], <<>>, []} end,
        Write = fun W([], _) -> ok;
                    W(L, Len) -> {B, Rest} = lists:split(min(5000, Len), L),
                                 ok = rpc:call(Node, lists, foreach,
                                               [fun mnesia:dirty_write/1, [Rec(P) || P <- B]],
                                               infinity),
                                 W(Rest, Len - min(5000, Len)) end,
        Type = rpc:call(Node, mnesia, table_info, [roster, storage_type]),
        {atomic, ok} = rpc:call(Node, mnesia, change_table_copy_type, [roster, Node, disc_copies]),
        ok = Write(Pairs, length(Pairs)),
        dumped = rpc:call(Node, mnesia, dump_log, [], infinity),
        {atomic, ok} = rpc:call(Node, mnesia, change_table_copy_type, [roster, Node, Type], infinity),
        io:format("roster: ~p records, ~p~n", [rpc:call(Node, mnesia, table_info, [roster, size]),
                                               rpc:call(Node, mnesia, table_info, [roster, storage_type])])'
    local rc=$?
    rm -f "$pairs"
    return $rc
}

# ---------------------------------------------------------------- presenced
# Unless PRESENCED_CMD is given, the release build of this checkout runs with a config like
# the peers': STARTTLS on 127.0.0.1:$PRESENCED_PORT, the peers' certificate,
# its own database (recreated when provisioning) and Redis key prefix. The schema is the
# one compiled into the binary: no [database] migrations directory (the operator's own,
# default migrations.d beside the config, absent here), so a prebuilt binary older than
# this checkout still starts.
PRESENCED_DB="${PRESENCED_DB:-postgres://postgres@127.0.0.1:5432/presenced_bench_n${N}_k${K}}"
# One configuration for both presenced columns; they differ only in the store section.
presenced_toml() { # name c2s-port admin-port store-section
    mkdir -p "$DATA/$1"
    cat >"$DATA/$1/presenced.toml" <<TOML
domains = ["$DOMAIN"]
[c2s]
bind = "127.0.0.1"
port = $2
direct_tls = false
[tls]
# The same certificate the peers serve (same TLS cost for every server; CERT_KIND).
cert = "$WORK/tls/$CERT_BASE.crt"
key = "$WORK/tls/$CERT_BASE.key"
certs_dir = "$DATA/$1/certs"
$4
[http]
bind = "127.0.0.1"
port = 0
tls = false
[admin]
# /metrics for the write rates at rest; the socket for the allocator's figures (stats).
port = $3
socket = "$DATA/$1/admin.sock"
[s2s]
# No federation in the bench (and no listener on 0.0.0.0:5269 that others may use).
enabled = false
[limits]
connections_per_ip_per_minute = 1000000
max_connections_per_ip = 100000
# ~19k sessions in one process: below the 20,000-descriptor limit minus pools and listeners.
max_connections = 19600
stanzas_per_second = 100000
stanza_burst = 100000
TOML
}
presenced_config() {
    presenced_toml presenced "$PRESENCED_PORT" "$PRESENCED_HTTP_PORT" "[database]
url = \"$PRESENCED_DB\"
[redis]
# The bench's private redis-server: INFO commandstats then counts presenced's writes only.
url = \"redis://127.0.0.1:$BENCH_REDIS_PORT\"
key_prefix = \"bench:\""
}
# The presenced binary: this checkout's release build, or PRESENCED_BIN (e.g. another
# commit's build, for before/after comparisons).
presenced_bin() {
    if [ -z "${PRESENCED_BIN:-}" ]; then
        (cd "$REPO" && cargo build --release --quiet --bin presenced)
        PRESENCED_BIN="${CARGO_TARGET_DIR:-$REPO/target}/release/presenced"
    fi
}
presenced_start() {
    if [ -z "${PRESENCED_CMD:-}" ]; then
        presenced_bin
        PRESENCED_CMD="$PRESENCED_BIN --config $DATA/presenced/presenced.toml serve"
    fi
    "${SRV_PIN[@]}" redis-server --port "$BENCH_REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$DATA/presenced" --logfile "$DATA/presenced/redis.log" &
    BENCH_REDIS_PID=$!
    wait_port "$BENCH_REDIS_PORT" 30 "$BENCH_REDIS_PID" || return 1
    launch_presenced presenced "$PRESENCED_PORT" "$PRESENCED_CMD"
}
launch_presenced() { # name port command
    # The environment's DATABASE_URL / REDIS_URL would override the config's (README):
    # the bench server must use its own database and Redis.
    local try
    # As ejabberd's, its port can be held for a moment by another program (it then exits
    # with "Address already in use"). Then try again.
    for try in 1 2 3; do
        env -u DATABASE_URL -u REDIS_URL "${SRV_PIN[@]}" bash -c "exec $3" >>"$DATA/$1/stdout.log" 2>&1 &
        SERVER_PID=$!
        wait_port "$2" 120 "$SERVER_PID" && break
        wait "$SERVER_PID" 2>/dev/null || true
        [ "$try" = 3 ] && return 1
        log "$1 did not start (see $DATA/$1/stdout.log); again in 5 s"
        sleep 5
    done
    SERVER_PIDS=("$SERVER_PID")
    check_fd_limit "$SERVER_PID"
}
presenced_stop() {
    stop_pid "$SERVER_PID"
    stop_pid "$BENCH_REDIS_PID"
}
# Sources of the write rates at rest (presenced only; the peers' columns say n/a).
presenced_rest_args() {
    REST_ARGS=(--metrics-url "http://127.0.0.1:$PRESENCED_HTTP_PORT/metrics"
               --admin-socket "$DATA/presenced/admin.sock"
               --redis-stats "redis://127.0.0.1:$BENCH_REDIS_PORT"
               --pg-stats "${PRESENCED_DB%/*}/postgres" --pg-stats-db "${PRESENCED_DB##*/}"
               # Its storage works for it: charge that CPU too (the peers' is in-process).
               --store-pid "$BENCH_REDIS_PID" --pg-backends)
}

# ---------------------------------------------------------------- presenced embedded
# presenced as one process with nothing beside it: an SQLite file and liveness in process
# (no [redis] url). Otherwise the same configuration as presenced above.
EMBEDDED_DB="$DATA/embedded/presenced.db"
embedded_config() {
    presenced_toml embedded "$EMBEDDED_PORT" "$EMBEDDED_HTTP_PORT" "[database]
url = \"sqlite://$EMBEDDED_DB\""
}
# The generator provisions PostgreSQL only: provision a scratch PostgreSQL database the
# same way as presenced's, then `presenced copy-store` it into the SQLite file (accounts
# with their SCRAM credentials, so the generator's SaltedPassword cache stays valid, and
# the rosters), then drop the scratch database.
embedded_provision() { # generator args...
    # Named after PRESENCED_DB, so that two runs with their own databases do not share it.
    local scratch="${PRESENCED_DB}_embedded"
    psql "${PRESENCED_DB%/*}/postgres" -q -c "DROP DATABASE IF EXISTS ${scratch##*/} WITH (FORCE)"
    psql "${PRESENCED_DB%/*}/postgres" -q -c "CREATE DATABASE ${scratch##*/}"
    "$BENCH" "$@" --provision --provision-db "$scratch" || return 1
    presenced_bin
    rm -f "$EMBEDDED_DB" "$EMBEDDED_DB-wal" "$EMBEDDED_DB-shm"
    log "embedded: copy-store $scratch -> sqlite://$EMBEDDED_DB"
    env -u DATABASE_URL -u REDIS_URL "$PRESENCED_BIN" --config "$DATA/embedded/presenced.toml" \
        copy-store --from "$scratch" --to "sqlite://$EMBEDDED_DB" || return 1
    psql "${PRESENCED_DB%/*}/postgres" -q -c "DROP DATABASE ${scratch##*/} WITH (FORCE)"
}
embedded_start() {
    presenced_bin
    launch_presenced embedded "$EMBEDDED_PORT" "$PRESENCED_BIN --config $DATA/embedded/presenced.toml serve"
}
embedded_stop() {
    stop_pid "$SERVER_PID"
}

# ---------------------------------------------------------------- reconnect storm
# The restart the storm's generator asks for: the server process stopped as an operator
# stops it (SIGTERM; ejabberdctl stop) and started again with the same data. presenced's
# private Redis keeps running (a restart of the server, not of its Redis).
restart_server() { # name
    case "$1" in
        prosody) prosody_stop; prosody_start ;;
        ejabberd) ejabberd_stop; ejabberd_start ;;
        presenced) stop_pid "$SERVER_PID"
                   launch_presenced presenced "$PRESENCED_PORT" "$PRESENCED_CMD" ;;
        embedded) embedded_stop; embedded_start ;;
    esac
}
# Runs the storm generator in the background and answers its restart request: the stop
# time (ns) into stop_ns before stopping, then "<listening ns> <pid>…" into pids once the
# new process listens (written whole: a file renamed into place).
run_storm() { # name generator-args...
    local name="$1" sd="$DATA/$1/storm" gen rc=0
    shift
    rm -rf "$sd"
    mkdir -p "$sd"
    "${GEN_PIN[@]}" "$BENCH" "$@" --storm "$STORM_CAUSES" --storm-dir "$sd" --storm-wait "$STORM_WAIT" \
        >"$RESULTS/$name.txt" &
    gen=$!
    while kill -0 "$gen" 2>/dev/null; do
        if [ -f "$sd/restart" ] && [ ! -f "$sd/stop_ns" ]; then
            echo "$(cut -d' ' -f1-3 /proc/loadavg)" > "$sd/load_at_restart"
            date +%s%N > "$sd/stop_ns.tmp" && mv "$sd/stop_ns.tmp" "$sd/stop_ns"
            log "$name: restarting the server for the storm"
            if restart_server "$name"; then
                echo "$(date +%s%N) ${SERVER_PIDS[*]}" > "$sd/pids.tmp" && mv "$sd/pids.tmp" "$sd/pids"
                log "$name: listening again (pid ${SERVER_PIDS[*]})"
            else
                echo "$name did not start again" >&2
            fi
        fi
        sleep 0.1
    done
    wait "$gen" || rc=$?
    cat "$RESULTS/$name.txt"
    return $rc
}

# ---------------------------------------------------------------- one server
run_one() { # name port
    local name="$1" port="$2" pidargs=() p
    mkdir -p "$DATA/$name"
    "${name}_config"
    local kind="$name"
    [ "$name" = embedded ] && kind=presenced
    local common=(--target "127.0.0.1:$port" --domain "$DOMAIN" --server "$kind"
                  -n "$N" -k "$K" --scram-cache "$DATA/$name/scram-cache.txt")
    local marker="$DATA/$name/provisioned-$N-$K"
    if [ ! -f "$marker" ]; then
        # The data directory (and presenced's database) belong to this N/K only. Written
        # files (the peers' by default, the embedded SQLite file) start from empty; an
        # interrupted provisioning over XMPP or into presenced's database is resumed, not
        # wiped: registration treats existing accounts as done and the subscription rounds
        # add only the missing contacts. --fresh starts from empty data.
        if [ "$name" = presenced ] && [ "$FRESH" = 1 ]; then
            psql "${PRESENCED_DB%/*}/postgres" -q -c "DROP DATABASE IF EXISTS ${PRESENCED_DB##*/} WITH (FORCE)"
        fi
        "${name}_config"
        log "$name: provisioning N=$N K=$K (untimed)"
        case "$name:$PEER_PROVISION" in
            embedded:*|prosody:files|ejabberd:files)
                "${name}_provision" "${common[@]}" || return 1
                touch "$marker" ;;
        esac
    fi
    if [ ! -f "$marker" ]; then
        "${name}_start" || { echo "$name did not start" >&2; "${name}_stop"; return 1; }
        # Provisioning 19k users into a peer over XMPP takes tens of minutes to hours.
        local prov=(--provision --time-limit "${PROVISION_TIME_LIMIT:-14400}"
                    --provision-rate "${PROVISION_RATE:-500}")
        if [ "$name" = presenced ]; then
            if [ -n "${PRESENCED_SQL:-}" ]; then prov+=(--provision-sql "$PRESENCED_SQL")
            else prov+=(--provision-db "$PRESENCED_DB"); fi
        fi
        "$BENCH" "${common[@]}" "${prov[@]}" || { "${name}_stop"; return 1; }
        "${name}_stop"
        touch "$marker"
    fi
    [ "$PROVISION_ONLY" = 1 ] && { log "$name: provisioned for N=$N K=$K"; return 0; }
    # This machine's PostgreSQL runs without autovacuum: a freshly provisioned roster table
    # (3,000,000 rows at N = 10,000, K = 300) would have no planner statistics and keep the
    # dead rows of its version bumps. A deployment's autovacuum does this; here it is done
    # before every timed run, untimed.
    if [ "$name" = presenced ]; then psql "$PRESENCED_DB" -q -c "VACUUM ANALYZE" || return 1; fi
    log "$name: timed run"
    "${name}_start" || { echo "$name did not start" >&2; "${name}_stop"; return 1; }
    sleep "${SETTLE:-5}" # let start-up work (and its garbage) settle before the 0-session reading
    # The tuning in force, for the record: where ejabberd keeps its roster.
    [ "$name" = ejabberd ] && log "ejabberd: $(ejabberd_eval 'io:format("roster ~p, cache_size ~p", [rpc:call(Node, mnesia, table_info, [roster, storage_type]), rpc:call(Node, ejabberd_option, cache_size, [])])' 2>&1)"
    for p in "${SERVER_PIDS[@]}"; do pidargs+=(--server-pid "$p"); done
    local mode=(--procs "$PROCS")
    [ "$SMOKE" = 1 ] && mode+=(--smoke)
    if [ "$CSI" = 1 ]; then
        mode+=(--csi --csi-secs "$CSI_SECS")
        # Interest lists are presenced's own namespace: the peers get the first two windows.
        [ "$kind" = presenced ] && mode+=(--csi-interest "$CSI_INTEREST")
    elif [ -n "$LATENCY_FRACTIONS" ]; then
        mode+=(--fixed-fractions "$LATENCY_FRACTIONS" --fractions-of "$LATENCY_OF"
               --ladder-secs "$LADDER_SECS")
    fi
    REST_ARGS=()
    [ "$name" = presenced ] && presenced_rest_args
    # Prosody on SQL storage: its PostgreSQL backends work for it as presenced's do, so
    # their CPU goes into its "server + stores" figures and its statements at rest count.
    [ "$name" = prosody ] && [ "$PROSODY_STORAGE" = sql ] \
        && REST_ARGS=(--pg-stats "postgres://postgres@127.0.0.1:5432/postgres"
                      --pg-stats-db "$PROSODY_DB" --pg-backends)
    # The embedded server's own counters (its liveness table writes) at rest.
    [ "$name" = embedded ] && REST_ARGS=(--metrics-url "http://127.0.0.1:$EMBEDDED_HTTP_PORT/metrics"
                                         --admin-socket "$DATA/embedded/admin.sock")
    local rc=0 load_before started
    load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
    started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    if [ "$STORM" = 1 ]; then
        local smoke=()
        [ "$SMOKE" = 1 ] && smoke=(--smoke)
        # The stores' CPU is charged to presenced in the storms' login figures too.
        run_storm "$name" "${common[@]}" "${pidargs[@]}" "${smoke[@]}" "${REST_ARGS[@]}" \
            --label "$name" --json "$RESULTS/$name.json" "${EXTRA[@]}" || rc=$?
    else
    # The same idle window for every server (see REST_SECS): same timeline for all.
    "${GEN_PIN[@]}" "$BENCH" "${common[@]}" "${pidargs[@]}" "${mode[@]}" --rest-secs "$REST_SECS" \
        "${REST_ARGS[@]}" --label "$name" \
        --json "$RESULTS/$name.json" "${EXTRA[@]}" | tee "$RESULTS/$name.txt" || rc=$?
    fi
    "${name}_stop"
    # Load averages (1, 5, 15 min) around this server's timed run: the machine is shared.
    # A storm's restart also records the load at the moment the server was stopped.
    local at_restart=""
    [ "$STORM" = 1 ] && [ -f "$DATA/$name/storm/load_at_restart" ] \
        && at_restart="$(cat "$DATA/$name/storm/load_at_restart")"
    printf '{"started": "%s", "position": %d, "load_before": "%s", "load_after": "%s", "load_at_restart": "%s", "pin": "%s", "commit": "%s", "machine": "%s"}\n' \
        "$started" "$POSITION" "$load_before" "$(cut -d' ' -f1-3 /proc/loadavg)" "$at_restart" "$PIN_DESC" \
        "$BENCH_COMMIT" "$BENCH_MACHINE" \
        > "$RESULTS/$name.meta.json"
    return $rc
}

# ---------------------------------------------------------------- main
install_peers
build_bench
[ "$FRESH" = 1 ] && rm -rf "$DATA"
mkdir -p "$RESULTS"
rm -f "$RESULTS"/*.json
make_cert
# As many descriptors as allowed (20,000 here): every server and generator process inherits it.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
log "descriptor limit $(ulimit -n), $PROCS generator process(es) for N=$N"
FAILED=0
LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"
POSITION=0
for s in $SERVERS; do
    POSITION=$((POSITION + 1))
    case "$s" in
        prosody) run_one prosody "$PROSODY_PORT" || FAILED=1 ;;
        ejabberd) run_one ejabberd "$EJABBERD_PORT" || FAILED=1 ;;
        presenced) run_one presenced "$PRESENCED_PORT" || FAILED=1 ;;
        embedded) run_one embedded "$EMBEDDED_PORT" || FAILED=1 ;;
        *) echo "unknown server $s" >&2; exit 2 ;;
    esac
done
[ "$PROVISION_ONLY" = 1 ] && exit $FAILED

{
    echo "### Run $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "Command: \`$COMMAND_LINE\`"
    echo
    echo "Machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(free -m | awk '/^Mem:/ {print $2 " MB RAM, " $7 " MB available"}'), $(uname -sr)"
    echo "Load average before / after: $LOAD_BEFORE / $(cut -d' ' -f1-3 /proc/loadavg) (the machine is shared; other builds compete for the 2 cores)"
    echo "Peers: $(dpkg-query -W -f='${Package} ${Version}, ' prosody ejabberd 2>/dev/null | sed 's/, $//')"
    echo
    python3 "$HERE/ratio.py" "$RESULTS"
} | tee "$RESULTS/summary.md"
if [ "$RECORD" = 1 ]; then
    { echo; cat "$RESULTS/summary.md"; } >> "$REPO/BENCHMARKS.md"
    log "appended to BENCHMARKS.md"
fi
exit $FAILED
