#!/usr/bin/env bash
# Federation interop: presenced against Prosody (and ejabberd with `ejabberd` / `all`), on
# loopback only, each server with its own .example domain. A slixmpp driver (exchange.py)
# proves a mutual subscription and presence exchange in both directions.
#
# Two modes (second argument, or MODE in the environment):
# - dialback (default): self-signed certificates nobody can verify, so every link
#   authenticates with XEP-0220 dialback over STARTTLS.
# - certs: a throw-away local CA issues certificates for pd.example, pros.example and
#   ej.example; every server trusts only that CA, requires verified certificates and has
#   dialback switched off (presenced: require_verified_cert, allow_dialback = false;
#   Prosody: s2s_secure_auth, no mod_dialback; ejabberd: s2s_cafile, no
#   mod_s2s_dialback), so a link can only come up with SASL EXTERNAL (XEP-0178). The
#   script then checks presenced's log: EXTERNAL in both directions, and no dialback.
#
# Name resolution never touches the machine's resolver: dns.py answers A and SRV for the
# two test names on 127.0.0.1:$DNS_PORT and refuses everything else. presenced uses it
# through `[s2s] nameserver` (SRV _xmpp-server._tcp via hickory); Prosody through its
# libunbound settings (forward + hosts file).
#
# With CLUSTER=1, pd.example is served by two presenced nodes on one database and one Redis
# (REDIS_URL, default redis://127.0.0.1:6379, under a key prefix of this run's own), each
# with its own c2s and s2s port. DNS names only node 1's s2s port, so every stream the peer
# opens lands on node 1, while node 2 opens its own streams to the peer (and its dialback
# keys are verified by node 1: one [s2s] secret). The presenced user logs in on node 2
# first and on node 1 the second time: the peer's user sees its presence, and is seen,
# whichever node holds the link.
#
# usage: tests/interop/federation.sh [prosody|ejabberd|all] [dialback|certs]
#        (defaults: prosody, dialback)
# Ports: every fixed port is from INTEROP_PORT_BASE (default 28300) up, base+0 .. +8.
# Output: $WORK/result-<peer>.txt plus every server log in $WORK (default /tmp/presenced-interop).
set -euo pipefail

PEERS=${1:-prosody}
MODE=${2:-${MODE:-dialback}}
case "$MODE" in dialback | certs) ;; *) echo "unknown mode $MODE" >&2; exit 2 ;; esac
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/tmp/presenced-interop}
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
# Fixed ports from INTEROP_PORT_BASE up (base+0 .. +8), below the kernel's ephemeral range
# (32768 and up on Linux): a port in that range can be held as the source port of any
# outgoing connection on the machine (to PostgreSQL, Redis, a peer), and a server then
# fails to bind it. Never 5222/5269 or the other suites' 26222+ and 30201+.
B=${INTEROP_PORT_BASE:-28300}
DNS_PORT=$B OURS_C2S=$((B + 1)) OURS_S2S=$((B + 2)) PROS_C2S=$((B + 3)) PROS_S2S=$((B + 4))
EJ_C2S=$((B + 5)) EJ_S2S=$((B + 6)) OURS2_C2S=$((B + 7)) OURS2_S2S=$((B + 8))
CLUSTER=${CLUSTER:-0}
OURS=pd.example
PROS=pros.example
EJ=ej.example
PASSWORD=interop-pw
RUN=$(date +%s)$$

pids=()
EJ_CTL=""
cleanup() {
    if [ -n "$EJ_CTL" ]; then ejabberdctl --ctl-config "$EJ_CTL" stop >/dev/null 2>&1 || true; fi
    # Remove only our own /etc/hosts lines (others may have added theirs meanwhile).
    if grep -q '# presenced-interop$' /etc/hosts 2>/dev/null; then
        grep -v '# presenced-interop$' /etc/hosts >"$WORK/hosts.clean" && cat "$WORK/hosts.clean" >/etc/hosts
    fi
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

wait_port() { # host port seconds [log pid]: with a log, its tail is shown on failure
    local end=$((SECONDS + $3))
    until (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; do
        if ((SECONDS > end)) || { [ -n "${5:-}" ] && ! kill -0 "$5" 2>/dev/null; }; then
            echo "port $1:$2 did not open" >&2
            if [ -n "${5:-}" ] && ! kill -0 "$5" 2>/dev/null; then echo "(its process exited)" >&2; fi
            if [ -n "${4:-}" ]; then echo "--- last lines of $4:" >&2; tail -30 "$4" >&2 || true; fi
            return 1
        fi
        sleep 0.2
    done
}

rm -rf "$WORK"
mkdir -p "$WORK"

if ! command -v prosody >/dev/null || ! dpkg -s lua-unbound >/dev/null 2>&1; then
    apt-get update && apt-get install -y prosody lua-unbound
fi
python3 -c 'import slixmpp' 2>/dev/null || pip install slixmpp

echo "== building presenced"
(cd "$REPO" && CARGO_TARGET_DIR="$TARGET" cargo build --quiet --bin presenced)
BIN="$TARGET/debug/presenced"

echo "== DNS on 127.0.0.1:$DNS_PORT"
python3 "$HERE/dns.py" "$DNS_PORT" \
    "$OURS=127.0.0.1" "$PROS=127.0.0.1" "$EJ=127.0.0.1" \
    "SRV:_xmpp-server._tcp.$OURS=$OURS:$OURS_S2S" \
    "SRV:_xmpp-server._tcp.$PROS=$PROS:$PROS_S2S" \
    "SRV:_xmpp-server._tcp.$EJ=$EJ:$EJ_S2S" >"$WORK/dns.log" 2>&1 &
pids+=($!)

PKI="$WORK/pki"
mkdir -p "$PKI"
if [ "$MODE" = certs ]; then
    echo "== local CA in $PKI"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=presenced interop CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout "$PKI/ca.key" -out "$PKI/ca.crt" 2>/dev/null
fi

# A certificate for a domain in a directory: signed by the local CA in certs mode (usable
# as TLS server and client certificate, as servers present it both ways), else self-signed.
cert_for() { # domain dir
    if [ "$MODE" = certs ]; then
        openssl req -newkey rsa:2048 -nodes -subj "/CN=$1" -keyout "$2/$1.key" \
            -out "$2/$1.csr" 2>/dev/null
        printf 'subjectAltName=DNS:%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$1" >"$2/$1.ext"
        openssl x509 -req -in "$2/$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
            -CAcreateserial -days 2 -extfile "$2/$1.ext" -out "$2/$1.crt" 2>/dev/null
    else
        openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=$1" \
            -addext "subjectAltName=DNS:$1" -keyout "$2/$1.key" -out "$2/$1.crt" 2>/dev/null
    fi
}

echo "== presenced for $OURS (c2s $OURS_C2S, s2s $OURS_S2S, $MODE)"
if [ "$MODE" = certs ]; then
    cert_for "$OURS" "$PKI"
    TLS_CONF="cert = \"$PKI/$OURS.crt\"
key = \"$PKI/$OURS.key\""
    S2S_AUTH_CONF="ca_file = \"$PKI/ca.crt\"
[s2s.default_policy]
require_verified_cert = true
allow_dialback = false"
else
    TLS_CONF="certs_dir = \"$WORK/certs\""
    S2S_AUTH_CONF=""
fi
# One configuration per node (node 2 only with CLUSTER=1): its own c2s and s2s ports,
# admin socket and node id; the HTTP and metrics listeners are off the fixed ports.
CLUSTER_CONF=""
if [ "$CLUSTER" = 1 ]; then
    CLUSTER_CONF="[redis]
url = \"${REDIS_URL:-redis://127.0.0.1:6379}\"
key_prefix = \"interop-$RUN:\""
fi
write_config() { # file c2s-port s2s-port node-id
    cat >"$1" <<EOF
domains = ["$OURS"]
[c2s]
bind = "127.0.0.1"
port = $2
direct_tls = false
[tls]
$TLS_CONF
[database]
url = "${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}"
migrations = "$REPO/migrations"
max_connections = 4
[http]
bind = "127.0.0.1"
port = 0
[admin]
port = 0
socket = "$WORK/admin-$4.sock"
[cluster]
node_id = "$4"
$CLUSTER_CONF
[s2s]
bind = "127.0.0.1"
port = $3
nameserver = "127.0.0.1:$DNS_PORT"
idle_timeout = 120
# One secret for every node: a dialback key one node made is verified by another.
secret = "interop-$RUN"
$S2S_AUTH_CONF
EOF
}
write_config "$WORK/presenced.toml" "$OURS_C2S" "$OURS_S2S" interop-1
printf '%s\n' "$PASSWORD" >"$WORK/password"
OURS_USER="pd$RUN"
"$BIN" -c "$WORK/presenced.toml" user add "$OURS_USER@$OURS" --password-file "$WORK/password"
RUST_LOG=info,presenced=debug "$BIN" -c "$WORK/presenced.toml" serve >"$WORK/presenced.log" 2>&1 &
pids+=($!)
wait_port 127.0.0.1 "$OURS_C2S" 30 "$WORK/presenced.log" "$!"
wait_port 127.0.0.1 "$OURS_S2S" 5 "$WORK/presenced.log"
# Where the presenced user logs in first, and where it logs in again.
FIRST_C2S=$OURS_C2S
SECOND_C2S=$OURS_C2S
if [ "$CLUSTER" = 1 ]; then
    echo "== presenced node 2 for $OURS (c2s $OURS2_C2S, s2s $OURS2_S2S; not in DNS)"
    write_config "$WORK/presenced-2.toml" "$OURS2_C2S" "$OURS2_S2S" interop-2
    RUST_LOG=info,presenced=debug "$BIN" -c "$WORK/presenced-2.toml" serve >"$WORK/presenced-2.log" 2>&1 &
    pids+=($!)
    wait_port 127.0.0.1 "$OURS2_C2S" 30 "$WORK/presenced-2.log" "$!"
    FIRST_C2S=$OURS2_C2S
fi

run_prosody() {
    local dir="$WORK/prosody"
    mkdir -p "$dir/data"
    cert_for "$PROS" "$dir"
    local modules='"roster"; "saslauth"; "tls"; "dialback"; "disco"; "ping"'
    local secure=false cafile=""
    if [ "$MODE" = certs ]; then
        # Certificates only: no mod_dialback, and s2s_secure_auth refuses any peer whose
        # certificate does not chain to cafile (our local CA) and name its domain.
        modules='"roster"; "saslauth"; "tls"; "disco"; "ping"'
        secure=true
        cafile="cafile = \"$PKI/ca.crt\";"
    fi
    printf '127.0.0.1 %s %s %s\n' "$OURS" "$PROS" "$EJ" >"$dir/hosts"
    cat >"$dir/prosody.cfg.lua" <<EOF
run_as_root = true
pidfile = "$dir/prosody.pid"
data_path = "$dir/data"
log = { { levels = { min = "debug" }, to = "file", filename = "$dir/prosody.log" } }
modules_enabled = { $modules }
c2s_ports = { $PROS_C2S }
c2s_interfaces = { "127.0.0.1" }
c2s_direct_tls_ports = { }
s2s_ports = { $PROS_S2S }
s2s_interfaces = { "127.0.0.1" }
s2s_direct_tls_ports = { }
http_ports = { }
https_ports = { }
c2s_require_encryption = true
s2s_require_encryption = true
s2s_secure_auth = $secure
ssl = { $cafile }
authentication = "internal_hashed"
certificates = "$dir"
unbound = { resolvconf = false; forward = "127.0.0.1@$DNS_PORT"; hoststxt = "$dir/hosts" }
VirtualHost "$PROS"
    ssl = { certificate = "$dir/$PROS.crt"; key = "$dir/$PROS.key"; $cafile }
EOF
    local user="pr$RUN"
    prosodyctl --config "$dir/prosody.cfg.lua" register "$user" "$PROS" "$PASSWORD"
    echo "== Prosody for $PROS (c2s $PROS_C2S, s2s $PROS_S2S)"
    prosody -F --config "$dir/prosody.cfg.lua" >"$dir/stdout.log" 2>&1 &
    pids+=($!)
    wait_port 127.0.0.1 "$PROS_C2S" 30 "$dir/prosody.log" "$!"
    echo "== exchange presenced <-> Prosody"
    python3 "$HERE/exchange.py" "$OURS_USER@$OURS" "127.0.0.1:$FIRST_C2S" \
        "$user@$PROS" "127.0.0.1:$PROS_C2S" "$PASSWORD" "127.0.0.1:$SECOND_C2S" \
        | tee "$WORK/result-prosody.txt"
    check_auth "$PROS" "$WORK/result-prosody.txt"
}

run_ejabberd() {
    local dir="$WORK/ejabberd"
    mkdir -p "$dir/logs" "$dir/db"
    cert_for "$EJ" "$dir"
    local dialback_module="mod_s2s_dialback: {}" cafile=""
    if [ "$MODE" = certs ]; then
        # Certificates only: peers verified against the local CA, no dialback module.
        dialback_module=""
        cafile="s2s_cafile: \"$PKI/ca.crt\""
    fi
    cat "$dir/$EJ.crt" "$dir/$EJ.key" >"$dir/$EJ.pem"
    # Debian's ejabberd resolves s2s host names with getaddrinfo (/etc/hosts, PEERS.md);
    # our lines carry a marker and are removed on exit. With no SRV answer it dials
    # outgoing_s2s_port on the address found here.
    printf '127.0.0.1 %s %s # presenced-interop\n' "$OURS" "$EJ" >>/etc/hosts
    printf '127.0.0.1 %s %s %s\n' "$OURS" "$PROS" "$EJ" >"$dir/hosts"
    # Erlang resolver: the hosts file above, then only the loopback DNS (never the system's).
    cat >"$dir/inetrc" <<EOF
{host, {127,0,0,1}, ["localhost", "$OURS", "$PROS", "$EJ"]}.
{nameserver, {127,0,0,1}, $DNS_PORT}.
{lookup, [file, dns]}.
EOF
    cat >"$dir/ejabberdctl.cfg" <<EOF
CONFIG_DIR=$dir
EJABBERD_CONFIG_PATH=$dir/ejabberd.yml
LOGS_DIR=$dir/logs
SPOOL_DIR=$dir/db
ERLANG_NODE=presenced-interop@localhost
INET_DIST_INTERFACE=127.0.0.1
# Run as root like Prosody (run_as_root): through su, ERL_INETRC does not reach the VM.
EXEC_CMD=as_current_user
EOF
    cat >"$dir/ejabberd.yml" <<EOF
hosts: ["$EJ"]
loglevel: info
certfiles: ["$dir/$EJ.pem"]
listen:
  - port: $EJ_C2S
    ip: "127.0.0.1"
    module: ejabberd_c2s
    starttls_required: true
  - port: $EJ_S2S
    ip: "127.0.0.1"
    module: ejabberd_s2s_in
s2s_use_starttls: required
outgoing_s2s_port: $OURS_S2S
$cafile
auth_method: internal
access_rules:
  s2s:
    allow: all
s2s_access: s2s
modules:
  mod_roster: {}
  mod_disco: {}
  mod_ping: {}
  $dialback_module
EOF
    echo "== ejabberd for $EJ (c2s $EJ_C2S, s2s $EJ_S2S)"
    EJ_CTL="$dir/ejabberdctl.cfg"
    ejabberdctl --ctl-config "$dir/ejabberdctl.cfg" foreground >"$dir/stdout.log" 2>&1 &
    pids+=($!)
    local end=$((SECONDS + 90))
    until grep -q "is started in the node" "$dir/logs/ejabberd.log" 2>/dev/null; do
        if ((SECONDS > end)); then
            echo "ejabberd did not start" >&2
            tail -20 "$dir/stdout.log" >&2
            return 1
        fi
        sleep 0.5
    done
    local user="ej$RUN"
    ejabberdctl --ctl-config "$dir/ejabberdctl.cfg" register "$user" "$EJ" "$PASSWORD"
    echo "== exchange presenced <-> ejabberd"
    python3 "$HERE/exchange.py" "$OURS_USER@$OURS" "127.0.0.1:$FIRST_C2S" \
        "$user@$EJ" "127.0.0.1:$EJ_C2S" "$PASSWORD" "127.0.0.1:$SECOND_C2S" \
        | tee "$WORK/result-ejabberd.txt"
    check_auth "$EJ" "$WORK/result-ejabberd.txt" || return 1
    ejabberdctl --ctl-config "$dir/ejabberdctl.cfg" stop >/dev/null 2>&1 || true
    EJ_CTL=""
}

# certs mode: the link to `peer` must have authenticated with SASL EXTERNAL in both
# directions and never with dialback, according to presenced's own log. Appends AUTH lines
# to the peer's result file.
check_auth() { # peer-domain result-file
    [ "$MODE" = certs ] || return 0
    local log="$WORK/presenced.log" ok=0
    check() { # description command...
        local what=$1; shift
        if "$@"; then echo "AUTH PASS  $what"; else echo "AUTH FAIL  $what"; ok=1; fi
    }
    {
        check "$1 -> $OURS authenticated by SASL EXTERNAL (inbound)" \
            grep -q "inbound s2s stream authenticated by SASL EXTERNAL.*$1" "$log"
        check "$OURS -> $1 authenticated by SASL EXTERNAL (outgoing)" \
            grep -q "outgoing s2s stream authenticated by SASL EXTERNAL.*$1" "$log"
        check "no dialback with $1 in either direction" \
            bash -c "! grep -q 'authenticated by dialback.*$1' '$log'"
    } | tee -a "$2"
    return $ok
}

status=0
case "$PEERS" in
prosody) run_prosody || status=1 ;;
ejabberd) run_ejabberd || status=1 ;;
all)
    run_prosody || status=1
    run_ejabberd || status=1
    ;;
*) echo "unknown peer $PEERS" >&2; exit 2 ;;
esac
for r in "$WORK"/result-*.txt; do
    grep -q '^RESULT PASS' "$r" || status=1
    if grep -q '^AUTH FAIL' "$r"; then status=1; fi
done
exit $status
