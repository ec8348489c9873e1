# bench/where.sh, sourced by bench/run.sh and bench/cluster.sh (REPO set): what every run's
# meta.json says of where it ran: the commit of the server and generator built from this
# checkout ("-dirty" with uncommitted changes), and the machine.
BENCH_COMMIT="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
git -C "$REPO" diff --quiet HEAD -- 2>/dev/null || BENCH_COMMIT="$BENCH_COMMIT-dirty"
BENCH_MACHINE="$(nproc) cores, $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1), $(awk '/^MemTotal/ {printf "%.0f GB", $2 / 1048576}' /proc/meminfo), Linux $(uname -r)"
