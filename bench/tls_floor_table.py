#!/usr/bin/env python3
"""The BENCHMARKS.md table of bench/tls_floor.rs runs: memory per idle TLS connection of a
minimal tokio + rustls server, median and range per way of waiting, from the JSON files
of one results directory (one run each).

Usage: bench/tls_floor_table.py bench/results/<date>-tls-floor
"""
import json
import pathlib
import statistics
import sys


def main(directory):
    runs = {}
    meta = set()
    for path in sorted(pathlib.Path(directory).glob("*.json")):
        run = json.loads(path.read_text())
        r = run["result"]
        if r["accepted"] != r["connections"]:
            sys.exit(f"{path}: {r['accepted']} of {r['connections']} connections accepted")
        runs.setdefault(r["mode"], []).append((r["bytes_per_connection"], r["connections"]))
        meta.add((run["commit"], run["machine"]))
    what = {
        "buffer": "a 4 KiB read buffer per connection, awaited",
        "shared": "readiness awaited, one read buffer per thread",
        "plain": "the same without TLS (tokio's share)",
    }
    print("| how a connection waits | connections | runs | kB per idle connection, median (range) |")
    print("|---|---:|---:|---:|")
    for mode in ("buffer", "shared", "plain"):
        if mode not in runs:
            continue
        kb = [b / 1000 for b, _ in runs[mode]]
        n = {c for _, c in runs[mode]}
        print(f"| {what[mode]} | {', '.join(f'{c:,}' for c in sorted(n))} | {len(kb)} "
              f"| {statistics.median(kb):.2f} ({min(kb):.2f}–{max(kb):.2f}) |")
    for commit, machine in sorted(meta):
        print(f"\nCommit {commit}; {machine}.")


if __name__ == "__main__":
    main(sys.argv[1])
