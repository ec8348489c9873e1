#!/usr/bin/env python3
"""Ratio table for bench/run.sh: one column per server, then presenced ÷ best peer.

Reads <dir>/{prosody,ejabberd,presenced}.json written by `presenced-bench --json`.
"Best peer" is the better of Prosody and ejabberd for each figure (higher is better for
rates, lower for latency, memory and CPU). Missing servers leave their column empty.
"""
import json
import os
import sys

# (json key, label, higher_is_better)
FIGURES = [
    ("logins_ok", "logins ok", True),
    ("login_rate_per_s", "login rate (sessions/s)", True),
    ("login_p50_ms", "login latency p50 (ms)", False),
    ("login_p99_ms", "login latency p99 (ms)", False),
    ("fixed_delivered", "deliveries received at fixed load", True),
    ("sat_deliveries_per_s", "presence deliveries/s at saturation", True),
    ("fixed_p50_ms", "delivery latency p50 at fixed load (ms)", False),
    ("fixed_p99_ms", "delivery latency p99 at fixed load (ms)", False),
    ("fixed_max_ms", "delivery latency max at fixed load (ms)", False),
    ("rss_kb_per_session", "RSS per idle session (kB)", False),
    ("total_rss_kb_per_session", "RSS per idle session, with its Redis (kB)", False),
    ("cpu_s_per_1000_logins", "CPU s per 1,000 logins (server process)", False),
    ("total_cpu_s_per_1000_logins",
     "CPU s per 1,000 logins, server + its PostgreSQL and Redis", False),
    ("cpu_s_per_1000_deliveries", "CPU s per 1,000 deliveries (server process)", False),
    ("total_cpu_s_per_1000_deliveries",
     "CPU s per 1,000 deliveries, server + its PostgreSQL and Redis", False),
]
PEERS = ["prosody", "ejabberd"]
# Figures only presenced has (writes at rest); the peers' cells say n/a.
PRESENCED_ONLY = [
    ("redis_writes_per_session_per_min", "Redis writes/session/min at rest (server counter)"),
    ("redis_write_cmds_per_session_per_min",
     "Redis write commands/session/min at rest (INFO commandstats)"),
    ("pg_writes_per_session_per_min", "PostgreSQL writes/session/min at rest (server counter)"),
    ("pg_xacts_per_session_per_min",
     "PostgreSQL commits/session/min at rest (pg_stat_database)"),
    ("pg_rows_per_session_per_min",
     "PostgreSQL rows written/session/min at rest (pg_stat_database)"),
]


def load(d, name):
    p = os.path.join(d, name + ".json")
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def main():
    d = sys.argv[1]
    runs = {n: load(d, n) for n in PEERS + ["presenced"]}
    any_run = next((r for r in runs.values() if r), None)
    if any_run is None:
        print("(no results)")
        return
    print(f"N = {any_run['users']} sessions, K = {any_run['contacts']} mutual contacts, "
          f"fixed load {any_run['fixed_rate_changes_per_s']} changes/s "
          f"(x K deliveries), saturation window {any_run['sat_window']} deliveries")
    print()
    print("| figure | Prosody | ejabberd | presenced | presenced ÷ best peer |")
    print("|---|---:|---:|---:|---:|")
    for key, label, higher in FIGURES:
        vals = {n: (r or {}).get(key) for n, r in runs.items()}
        peer_vals = [vals[p] for p in PEERS if vals[p] is not None]
        best = (max if higher else min)(peer_vals) if peer_vals else None
        ratio = ""
        if vals["presenced"] is not None and best:
            ratio = f"{vals['presenced'] / best:.2f}"
        print(f"| {label} | {fmt(vals['prosody'])} | {fmt(vals['ejabberd'])} | "
              f"{fmt(vals['presenced'])} | {ratio} |")
    pres = runs["presenced"] or {}
    for key, label in PRESENCED_ONLY:
        v = pres.get(key)
        cell = "" if v is None else f"{v:.4g}"
        print(f"| {label} | n/a | n/a | {cell} | |")
    if pres.get("redis_write_cmds_seen"):
        seen = ", ".join(f"{c} {n}" for c, n in sorted(pres["redis_write_cmds_seen"].items()))
        print(f"\nRedis write commands in the {pres.get('rest_secs', 0):.0f} s window at rest "
              f"(calls, flagged `write` by COMMAND INFO): {seen}")
    procs = {n: r.get("procs") for n, r in runs.items() if r and r.get("procs")}
    if procs:
        print("\nGenerator processes: " + ", ".join(f"{n} {p}" for n, p in procs.items()))
    for n, r in runs.items():
        if r and r.get("errors"):
            print(f"\n{n} errors: " + "; ".join(r["errors"][:3]))


if __name__ == "__main__":
    main()
