#!/usr/bin/env bash
# Runs the conformance suite against this server: builds it, starts it on loopback with its
# own domain, database and certificate, provisions accounts with `presenced user add`, runs
# every scenario, stops the server. Exit status is the suite's.
#
# With NODES=N (N > 1) the server under test is a cluster: N nodes on the one database and
# the one Redis (REDIS_URL, required then) under a key prefix of this run's own, on c2s ports
# C2S_PORT .. C2S_PORT+N-1; the suite spreads each scenario's users and resources over them
# (run.py --port with a list), so every scenario also checks the paths between nodes.
#
# Usage: conformance/presenced.sh [extra run.py args, e.g. --scenario 'rfc6121-4*' -v]
# Env: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/presenced_conformance),
#      C2S_PORT (default 26222), NODES (default 1), KEEP=1 to leave the server running.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
DOMAIN="${DOMAIN:-pres.example}"
C2S_PORT="${C2S_PORT:-26222}"
NODES="${NODES:-1}"
RUN_DIR="${RUN_DIR:-/tmp/conformance-presenced}"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/presenced_conformance}"

python3 -c 'import slixmpp, yaml' 2>/dev/null || python3 -m pip install -q -r "$HERE/requirements.txt"

port_open() { python3 -c "import socket; socket.create_connection(('127.0.0.1', $1), 0.2)" 2>/dev/null; }
PORTS=()
for i in $(seq 0 $((NODES - 1))); do PORTS+=($((C2S_PORT + i))); done
for p in "${PORTS[@]}"; do
    if port_open "$p"; then
        echo "port $p is already in use; refusing to test whatever listens there" >&2
        exit 1
    fi
done
if [[ $NODES -gt 1 && -z "${REDIS_URL:-}" ]]; then
    echo "NODES=$NODES needs REDIS_URL: the nodes of a cluster meet in Redis" >&2
    exit 1
fi

(cd "$ROOT" && cargo build --quiet --bin presenced)
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/presenced"

rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
# One configuration per node: the same domain, database, Redis prefix and certificate;
# its own c2s port, node id and admin socket.
PREFIX="conformance-$$-$(date +%s):"
write_config() {
    local i=$1 cfg=$2
    cat >"$cfg" <<TOML
domains = ["$DOMAIN"]
[c2s]
bind = "127.0.0.1"
port = ${PORTS[$i]}
direct_tls = false
[tls]
certs_dir = "$RUN_DIR/certs"
[database]
url = "$DATABASE_URL"
# The schema is built into the binary; no operator migrations.
migrations = "$RUN_DIR/migrations.d"
[redis]
# Only read when REDIS_URL is set (it overrides url); a prefix of this run's own, so two
# runs on one Redis never meet as one cluster.
key_prefix = "$PREFIX"
[cluster]
node_id = "conformance-$i"
[liveness]
# The grace period holds back the unavailable of a closed or dropped stream (RFC 6121
# §4.5.2 then still holds, later); the suite waits 3 s per expectation, so it runs with 1 s
# instead of the default 10 s.
grace = 1
[http]
# Loopback and a port the system picks: the suite speaks TCP only, and two runs (or a
# running server) must not collide on the default ports.
bind = "127.0.0.1"
port = 0
[s2s]
bind = "127.0.0.1"
port = 0
direct_tls_port = 0
nameserver = "none"
[admin]
port = 0
socket = "$RUN_DIR/admin-$i.sock"
[limits]
connections_per_ip_per_minute = 100000
stanzas_per_second = 1000
stanza_burst = 1000
TOML
}
CFG="$RUN_DIR/presenced.toml"
PIDS=()
stop() {
    if [[ "${KEEP:-0}" != 1 ]]; then
        for pid in "${PIDS[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then kill "$pid"; wait "$pid" 2>/dev/null || true; fi
        done
    fi
}
trap stop EXIT
# The first node generates the development certificate; the others start after it is
# listening and load the same one.
for i in $(seq 0 $((NODES - 1))); do
    cfg="$RUN_DIR/presenced-$i.toml"
    write_config "$i" "$cfg"
    [[ $i == 0 ]] && cp "$cfg" "$CFG"
    "$BIN" --config "$cfg" check-config >/dev/null
    RUST_LOG="${RUST_LOG:-warn}" "$BIN" --config "$cfg" serve >"$RUN_DIR/server-$i.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 200); do
        port_open "${PORTS[$i]}" && break
        kill -0 "${PIDS[$i]}" 2>/dev/null || { echo "presenced node $i exited:"; cat "$RUN_DIR/server-$i.log"; exit 1; }
        sleep 0.1
    done
done
if [[ $NODES -gt 1 ]]; then
    # A node's first heartbeat happens before it listens and it announces itself to the
    # live nodes, so all have met once the last one listens; a scenario starting earlier
    # would find no peer and test nothing between nodes. Checked, not assumed: every node
    # must list the others in the Redis set of live instances.
    for _ in $(seq 1 100); do
        live=$(redis-cli -u "$REDIS_URL" ZCARD "${PREFIX}cluster:nodes" 2>/dev/null || echo 0)
        [[ "$live" == "$NODES" ]] && break
        sleep 0.1
    done
    [[ "$live" == "$NODES" ]] || { echo "the $NODES nodes did not all register in Redis ($live)"; exit 1; }
fi

PORT_LIST="$(IFS=,; echo "${PORTS[*]}")"
set +e
python3 "$HERE/run.py" --host 127.0.0.1 --port "$PORT_LIST" --domain "$DOMAIN" \
    --ca-file "$RUN_DIR/certs/selfsigned-$DOMAIN.pem" \
    --register-cmd "printf '%s\n' {password} | $BIN --config $CFG user add {user}@{domain} --password-file -" \
    --server-name "presenced $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo dev)$([[ $NODES -gt 1 ]] && echo ", $NODES nodes")" \
    --json "$RUN_DIR/results.json" --strict "$@"
STATUS=$?
set -e
if [[ $STATUS != 0 ]]; then
    for i in $(seq 0 $((NODES - 1))); do
        echo "--- server log of node $i (last 50 lines) ---"; tail -50 "$RUN_DIR/server-$i.log"
    done
fi
exit $STATUS
