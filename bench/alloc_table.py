#!/usr/bin/env python3
"""Where an idle session's RSS sits in the allocator, from bench/run.sh results.

    bench/alloc_table.py ROOT BUILD K [K ...]

ROOT holds one directory per run, named k<K>-<i>-<build> (bench/ab.py's layout), each with
a presenced.json whose alloc_* figures are the allocator's, from presenced's admin `stats`
(its /metrics in build 6435420), read by the generator before the logins and after the idle
window. For each K, prints the median and min–max over BUILD's runs, per idle session, of:

- RSS: the process's growth, what the headline's memory figures count;
- live: bytes in live allocations (jemalloc's stats.allocated);
- pages around live data: the rest of the pages that hold live allocations (active −
  allocated), room freed inside pages that still hold something;
- bookkeeping: the allocator's metadata (stats.metadata);
- pages kept with nothing live: resident − active − metadata (dirty pages not yet given
  back);
- outside the allocator: RSS − resident (stacks, the binary's data, other mappings).

A part's median is taken over the runs on its own, so the parts' medians need not add up to
the RSS median exactly.
"""
import glob
import json
import os
import statistics
import sys


def runs(root, k, build):
    out = []
    for path in sorted(glob.glob(os.path.join(root, f"k{k}-*-{build}", "presenced.json"))):
        with open(path) as f:
            r = json.load(f)
        if isinstance(r.get("alloc_allocated_kb_per_session"), (int, float)):
            out.append(r)
    return out


PARTS = [
    ("RSS per idle session", lambda r: r["rss_kb_per_session"]),
    ("live allocations", lambda r: r["alloc_allocated_kb_per_session"]),
    ("free room in pages that hold live data (active − live)",
     lambda r: r["alloc_active_kb_per_session"] - r["alloc_allocated_kb_per_session"]),
    ("allocator bookkeeping (metadata)", lambda r: r["alloc_metadata_kb_per_session"]),
    ("pages kept with nothing live (resident − active − metadata)",
     lambda r: r["alloc_resident_kb_per_session"] - r["alloc_active_kb_per_session"]
     - r["alloc_metadata_kb_per_session"]),
    ("outside the allocator (RSS − resident)",
     lambda r: r["rss_kb_per_session"] - r["alloc_resident_kb_per_session"]),
]


def fmt(x):
    """Two decimals, without the sign of a negative zero (a difference of two readings that
    rounds to 0.00)."""
    return f"{round(x, 2) + 0.0:.2f}"


def main():
    root, build, ks = sys.argv[1], sys.argv[2], sys.argv[3:]
    by_k = {k: runs(root, k, build) for k in ks}
    head = " | ".join(f"K = {k} ({len(by_k[k])} runs)" for k in ks)
    print(f"kB per idle session, build {build}, median (min–max)\n")
    print(f"| part | {head} |")
    print("|---|" + "---:|" * len(ks))
    for label, f in PARTS:
        cells = []
        for k in ks:
            v = [f(r) for r in by_k[k]]
            cells.append(f"{fmt(statistics.median(v))} ({fmt(min(v))}–{fmt(max(v))})" if v else "–")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
