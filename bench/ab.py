#!/usr/bin/env python3
"""A/B table of two presenced builds from bench/run.sh results (SERVERS=presenced).

    bench/ab.py ROOT K OLD NEW [--stores]

ROOT holds one directory per run, named k<K>-<i>-<build> (each with bench/run.sh's
presenced.json); OLD and NEW are the builds' names. Prints, per figure, the median and
min–max of each build's runs, the ratio of the medians, and whether the ranges overlap
(where they do, the runs do not tell the builds apart). With --stores, also the CPU of the
server's PostgreSQL backends and Redis per 1,000 logins and deliveries, and the sum.
"""
import glob
import json
import os
import statistics
import sys

FIGURES = [
    ("login_rate_per_s", "login rate (sessions/s)"),
    ("login_p50_ms", "login latency p50 (ms)"),
    ("login_p99_ms", "login latency p99 (ms)"),
    ("sat_deliveries_per_s", "presence deliveries/s at saturation"),
    ("fixed_p50_ms", "delivery latency p50 at fixed load (ms)"),
    ("fixed_p99_ms", "delivery latency p99 at fixed load (ms)"),
    ("rss_kb_per_session", "RSS per idle session (kB)"),
    ("cpu_s_per_1000_logins", "CPU s per 1,000 logins (server)"),
    ("cpu_s_per_1000_deliveries", "CPU s per 1,000 deliveries (server)"),
    ("pg_writes_per_session_per_min", "PostgreSQL writes per session per minute at rest"),
]
STORES = [
    ("store_cpu_s_per_1000_logins", "CPU s per 1,000 logins (its PostgreSQL backends and Redis)"),
    ("total_cpu_s_per_1000_logins", "CPU s per 1,000 logins (server and stores)"),
    ("store_cpu_s_per_1000_deliveries", "CPU s per 1,000 deliveries (its PostgreSQL backends and Redis)"),
    ("total_cpu_s_per_1000_deliveries", "CPU s per 1,000 deliveries (server and stores)"),
]


def runs(root, k, build):
    out = []
    for path in sorted(glob.glob(os.path.join(root, f"k{k}-*-{build}", "presenced.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def main():
    root, k, old, new = sys.argv[1:5]
    figures = FIGURES + (STORES if "--stores" in sys.argv[5:] else [])
    a, b = runs(root, k, old), runs(root, k, new)
    print(f"K = {k}: {len(a)} runs of {old}, {len(b)} of {new}\n")
    print(f"| figure | {old} | {new} | {new} ÷ {old}, medians | ranges |")
    print("|---|---:|---:|---:|---|")
    for key, label in figures:
        va = [r[key] for r in a if isinstance(r.get(key), (int, float))]
        vb = [r[key] for r in b if isinstance(r.get(key), (int, float))]
        if not va or not vb:
            continue
        ma, mb = statistics.median(va), statistics.median(vb)
        ratio = f"{mb / ma:.2f}" if ma else "–"
        apart = max(va) < min(vb) or max(vb) < min(va)
        cell = lambda m, v: f"{m:.4g} ({min(v):.4g}–{max(v):.4g})"
        print(f"| {label} | {cell(ma, va)} | {cell(mb, vb)} | {ratio} | {'disjoint' if apart else 'overlap'} |")


if __name__ == "__main__":
    main()
