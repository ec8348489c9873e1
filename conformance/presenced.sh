#!/usr/bin/env bash
# Runs the conformance suite against this server: builds it, starts it on loopback with its
# own domain, database and certificate, provisions accounts with `presenced user add`, runs
# every scenario, stops the server. Exit status is the suite's.
#
# Usage: conformance/presenced.sh [extra run.py args, e.g. --scenario 'rfc6121-4*' -v]
# Env: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/presenced_conformance),
#      C2S_PORT (default 26222), KEEP=1 to leave the server running.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
DOMAIN="${DOMAIN:-pres.example}"
C2S_PORT="${C2S_PORT:-26222}"
RUN_DIR="${RUN_DIR:-/tmp/conformance-presenced}"
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/presenced_conformance}"

python3 -c 'import slixmpp, yaml' 2>/dev/null || python3 -m pip install -q -r "$HERE/requirements.txt"

port_open() { python3 -c "import socket; socket.create_connection(('127.0.0.1', $1), 0.2)" 2>/dev/null; }
if port_open "$C2S_PORT"; then
    echo "port $C2S_PORT is already in use; refusing to test whatever listens there" >&2
    exit 1
fi

(cd "$ROOT" && cargo build --quiet --bin presenced)
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/presenced"

rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
CFG="$RUN_DIR/presenced.toml"
cat >"$CFG" <<TOML
domains = ["$DOMAIN"]
[c2s]
bind = "127.0.0.1"
port = $C2S_PORT
direct_tls = false
[tls]
certs_dir = "$RUN_DIR/certs"
[database]
url = "$DATABASE_URL"
# The schema is built into the binary; no operator migrations.
migrations = "$RUN_DIR/migrations.d"
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
socket = "$RUN_DIR/admin.sock"
[limits]
connections_per_ip_per_minute = 100000
stanzas_per_second = 1000
stanza_burst = 1000
TOML
"$BIN" --config "$CFG" check-config >/dev/null

RUST_LOG="${RUST_LOG:-warn}" "$BIN" --config "$CFG" serve >"$RUN_DIR/server.log" 2>&1 &
PID=$!
stop() {
    if [[ "${KEEP:-0}" != 1 ]] && kill -0 "$PID" 2>/dev/null; then
        kill "$PID"; wait "$PID" 2>/dev/null || true
    fi
}
trap stop EXIT
for _ in $(seq 1 200); do
    port_open "$C2S_PORT" && break
    kill -0 "$PID" 2>/dev/null || { echo "presenced exited:"; cat "$RUN_DIR/server.log"; exit 1; }
    sleep 0.1
done

set +e
python3 "$HERE/run.py" --host 127.0.0.1 --port "$C2S_PORT" --domain "$DOMAIN" \
    --ca-file "$RUN_DIR/certs/selfsigned-$DOMAIN.pem" \
    --register-cmd "printf '%s\n' {password} | $BIN --config $CFG user add {user}@{domain} --password-file -" \
    --server-name "presenced $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo dev)" \
    --json "$RUN_DIR/results.json" --strict "$@"
STATUS=$?
set -e
if [[ $STATUS != 0 ]]; then
    echo "--- server log (last 50 lines) ---"; tail -50 "$RUN_DIR/server.log"
fi
exit $STATUS
