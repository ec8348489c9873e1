#!/usr/bin/env python3
"""The headline table of BENCHMARKS.md: the latest repeated run of the servers side by side
at each size, from the committed raw results.

    headline.py [RESULTS_DIR]     (default: bench/results)

It reads every directory named <date>-peers-n<N>-k<K>[-<anything>] under RESULTS_DIR
(each holding run1/, run2/, ... from bench/repeat.sh), keeps the latest by name for each
(N, K), and prints, per size, the figures that decide the comparison: medians over the runs
with min–max, and presenced's median over the best peer's with bench/ratio.py's 95 %
bootstrap interval. Memory and CPU are each server's with its own stores: presenced's
PostgreSQL backends and Redis, Prosody's PostgreSQL backends when its storage is SQL;
ejabberd keeps its data in its own process.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ratio import (OURS, PEERS, SERVERS, TITLES, Spread, load,  # noqa: E402
                   ratio_cell)

NAME = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2}[^-]*)-peers-n(?P<n>\d+)-k(?P<k>\d+)(-.*)?$")
# (label, higher is better, json keys in order of preference: the first a run has is used)
FIGURES = [
    ("logins/s", True, ["login_rate_per_s"]),
    ("presence deliveries/s at saturation", True, ["sat_deliveries_per_s"]),
    ("deliveries missing or repeated at saturation", None, ["sat_missing", "sat_repeated"]),
    ("RSS per idle session, the process with its Redis (kB)", False,
     ["total_rss_kb_per_session", "rss_kb_per_session"]),
    ("RSS per idle session with all its stores (kB)", False,
     ["all_rss_kb_per_session", "total_rss_kb_per_session", "rss_kb_per_session"]),
    ("CPU s per 1,000 logins with its stores", False,
     ["total_cpu_s_per_1000_logins", "cpu_s_per_1000_logins"]),
    ("CPU s per 1,000 deliveries with its stores", False,
     ["total_cpu_s_per_1000_deliveries", "cpu_s_per_1000_deliveries"]),
    ("delivery latency p99 at fixed load (ms)", False, ["fixed_p99_ms"]),
]


def latest(results):
    """{(N, K): directory} with the latest directory name for each size."""
    best = {}
    for d in sorted(os.listdir(results)):
        m = NAME.match(d)
        if m and os.path.isdir(os.path.join(results, d)):
            best[(int(m["n"]), int(m["k"]))] = os.path.join(results, d)
    return best


def value(report, keys):
    if not report:
        return None
    if keys[0] in ("sat_missing",):  # a count: missing and repeated together
        parts = [report.get(k) for k in keys]
        return None if any(p is None for p in parts) else sum(parts)
    return next((report[k] for k in keys if report.get(k) is not None), None)


def main():
    results = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
    sizes = latest(results)
    if not sizes:
        print("(no peers-n<N>-k<K> results)")
        return
    tables = []
    present = set()
    for (n, k), d in sorted(sizes.items()):
        runs = sorted((r for r in os.listdir(d) if re.fullmatch(r"run\d+", r)),
                      key=lambda r: int(r[3:]))
        reports = [{s: load(os.path.join(d, r), s) for s in SERVERS} for r in runs]
        metas = [{s: load(os.path.join(d, r), s, ".meta.json") for s in SERVERS} for r in runs]
        here = [s for s in SERVERS if any(rep[s] for rep in reports)]
        present.update(here)
        tables.append((n, k, d, reports, metas, here))
    cols = [s for s in SERVERS if s in present]
    ours = [s for s in OURS if s in present]
    print("| size | figure | " + " | ".join(TITLES[s] for s in cols) + " | "
          + " | ".join(f"{TITLES[s]} ÷ best peer" for s in ours) + " |")
    print("|---|---|" + "---:|" * len(cols) + "---:|" * len(ours))
    notes = []
    for n, k, d, reports, metas, here in tables:
        counts = {s: sum(1 for rep in reports if rep[s]) for s in here}
        size = f"N = {n:,}, K = {k}"
        for label, higher, keys in FIGURES:
            cells = {s: Spread([value(rep[s], keys) for rep in reports]) for s in cols}
            if not any(cells.values()):
                continue
            ratios = [ratio_cell(cells[s], [cells[p] for p in PEERS], higher,
                                 min(counts.get(s, 0), 2) > 1) for s in ours]
            print(f"| {size} | {label} | " + " | ".join(cells[s].cell() for s in cols)
                  + " | " + " | ".join(ratios) + " |")
        started = sorted(m["started"] for meta in metas for m in meta.values() if m)
        pins = sorted({m.get("pin", "not pinned") for meta in metas for m in meta.values() if m})
        commits = sorted({m["commit"] for meta in metas for m in meta.values()
                          if m and m.get("commit")})
        machines = sorted({m["machine"] for meta in metas for m in meta.values()
                           if m and m.get("machine")})
        runs = ", ".join(f"{TITLES[s]} {c}" for s, c in counts.items())
        notes.append(f"- {size}: `{d}`, runs {runs}, {started[0]} to {started[-1]}; "
                     + "; ".join(pins)
                     + (f"; commit {', '.join(commits)}" if commits else "")
                     + (f"; {'; '.join(machines)}" if machines else "") + ".")
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main()
