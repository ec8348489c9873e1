#!/usr/bin/env python3
"""The table of bench/cluster.sh: one column per (nodes, N), each figure the median of the
runs with min–max when there are several, and the load averages around every run."""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def fmt(values, digits):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:,.{digits}f}"
    return f"{med:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def main(results):
    runs = defaultdict(list)
    for p in sorted(Path(results).glob("nodes*-n*-run*.json")):
        if p.name.endswith(".meta.json"):
            continue
        r = json.loads(p.read_text())
        meta = p.with_name(p.name[: -len(".json")] + ".meta.json")
        r["meta"] = json.loads(meta.read_text()) if meta.exists() else {}
        runs[(r["meta"].get("nodes", 1), r["users"])].append(r)
    if not runs:
        print("no results")
        return
    cols = sorted(runs)

    def per_session_kb(r):
        return r.get("total_rss_kb_per_session")

    def within(r):
        s = r.get("kill_sessions") or 0
        return 100.0 * r["kill_within_bound"] / s if s else None

    def reached(r):
        e = r.get("kill_watchers_expected") or 0
        return 100.0 * r["kill_watchers_reached"] / e if e else None

    rows = [
        ("runs", lambda r: 1, 0, "count"),
        ("sessions held (logins ok)", lambda r: r["logins_ok"], 0, None),
        ("logins failed", lambda r: r["logins_failed"], 0, None),
        ("login rate (sessions/s)", lambda r: r["login_rate_per_s"], 0, None),
        ("login latency p99 (ms)", lambda r: r["login_p99_ms"], 0, None),
        ("deliveries/s at saturation", lambda r: r["sat_deliveries_per_s"], 0, None),
        ("deliveries missing at saturation", lambda r: r.get("sat_missing"), 0, None),
        ("deliveries repeated at saturation", lambda r: r.get("sat_repeated"), 0, None),
        ("delivery latency p50 at fixed load (ms)", lambda r: r["fixed_p50_ms"], 2, None),
        ("delivery latency p99 at fixed load (ms)", lambda r: r["fixed_p99_ms"], 2, None),
        ("RSS per session, nodes (kB)", lambda r: r["rss_kb_per_session"], 1, None),
        ("RSS per session, nodes + Redis (kB)", per_session_kb, 1, None),
        ("CPU s per 1,000 logins, nodes", lambda r: r.get("cpu_s_per_1000_logins"), 2, None),
        ("CPU s per 1,000 logins, Redis", lambda r: r.get("store_cpu_s_per_1000_logins"), 2, None),
        ("CPU s per 1,000 deliveries at saturation, nodes",
         lambda r: r.get("cpu_s_per_1000_deliveries"), 4, None),
        ("Redis write commands per session per minute at rest",
         lambda r: r.get("redis_write_cmds_per_session_per_min"), 2, None),
        ("Redis commands per presence change", lambda r: r["fixed_redis_cmds_per_change"], 2, None),
        ("Redis PUBLISH per presence change", lambda r: r["fixed_redis_publish_per_change"], 2, None),
        ("Redis directory and channel commands per presence change",
         lambda r: r.get("fixed_redis_cluster_cmds_per_change"), 2, None),
        ("Redis bytes in+out per presence change", lambda r: r["fixed_redis_bytes_per_change"], 0, None),
        ("killed node: sessions", lambda r: r.get("kill_sessions") or None, 0, None),
        ("killed node: sessions announced within T + sweep (%)", within, 1, None),
        ("killed node: watchers told (%)", reached, 1, None),
        ("killed node: unavailables a watcher got again",
         lambda r: r.get("kill_repeated_unavailables"), 0, None),
        ("killed node: announcement min (s)", lambda r: ms_s(r.get("kill_min_ms")), 1, None),
        ("killed node: announcement p50 (s)", lambda r: ms_s(r.get("kill_p50_ms")), 1, None),
        ("killed node: announcement p99 (s)", lambda r: ms_s(r.get("kill_p99_ms")), 1, None),
        ("killed node: announcement max (s)", lambda r: ms_s(r.get("kill_max_ms")), 1, None),
        ("sessions lost (not asked to end)", lambda r: r["sessions_lost"], 0, None),
    ]
    head = [f"{n} node{'s' if n > 1 else ''}, N = {u:,}" for n, u in cols]
    print("| figure | " + " | ".join(head) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, f, digits, kind in rows:
        cells = []
        for c in cols:
            if kind == "count":
                cells.append(str(len(runs[c])))
            else:
                cells.append(fmt([f(r) for r in runs[c]], digits))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print("Load average (1, 5, 15 min) before → after each run:")
    print()
    for c in cols:
        for r in runs[c]:
            m = r["meta"]
            swap = " (swapping)" if m.get("swapping") else ""
            # Runs recorded before cluster.sh wrote these have neither.
            where = "; ".join(m[k] for k in ("pin", "commit", "machine") if m.get(k))
            print(f"* {r['label']} at {m.get('started', '?')}: {m.get('load_before', '?')} → "
                  f"{m.get('load_after', '?')}{swap}{f' ({where})' if where else ''}")
    errors = sorted({e for c in cols for r in runs[c] for e in r.get("errors", [])})
    if errors:
        print()
        print("First errors reported by the generator:")
        print()
        for e in errors[:10]:
            print(f"* `{e}`")


def ms_s(v):
    return None if v is None else v / 1000.0


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/presenced-cluster-bench/results")
