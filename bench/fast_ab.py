#!/usr/bin/env python3
"""A/B of two presenced builds on bench/fast.sh's windows: the CPU per login of each mode
in each build, with the ratio of the medians and its 95 % bootstrap interval.

    bench/fast_ab.py ROOT OLD NEW

ROOT/OLD and ROOT/NEW each hold bench/fast.sh's run directories for one server build
(bench/fast_table.py reads the same ones). A ratio is NEW's median over OLD's; a
difference is claimed only where the interval excludes 1. Below each mode's rows, the
reconnect's share of a full login (`fast-resume` ÷ `sasl1`) in each build.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fast_table import load, per_login  # noqa: E402
from ratio import Spread, fmt_ratio, ratio_interval  # noqa: E402

FIGURES = [
    ("relogin", "total", "CPU ms per reconnect (relogin window), server + stores"),
    ("relogin", "cpu_s", "… of which server"),
    ("relogin", "store_cpu_s", "… of which PostgreSQL + Redis"),
    ("cut", "total", "cut storm: CPU ms per login, server + stores"),
]


def spread(runs, window, part):
    return Spread([per_login(rep, window, part) for _, rep, _ in runs])


def ratio(new, old):
    if not new or not old or not old.median:
        return "", ""
    ci = ratio_interval(new, old)
    r = fmt_ratio(new.median / old.median)
    if ci is None:
        return r, ""
    lo, hi = ci
    apart = "" if lo > 1 or hi < 1 else ", not apart"
    return r, f"[{fmt_ratio(lo)}–{fmt_ratio(hi)}]{apart}"


def main():
    root, old, new = sys.argv[1:4]
    a, b = load(os.path.join(root, old)), load(os.path.join(root, new))
    for cfg in sorted(set(a) & set(b)):
        cert, n, k = cfg
        print(f"#### {cert}, N = {n:,}, K = {k}: {old} against {new}\n")
        print(f"| mode | figure | {old} | {new} | {new} ÷ {old} | 95 % interval |")
        print("|---|---|---:|---:|---:|---|")
        modes = [m for m in a[cfg] if m in b[cfg]]
        for mode in modes:
            counts = f"{len(a[cfg][mode])} and {len(b[cfg][mode])} runs"
            for window, part, label in FIGURES:
                so, sn = spread(a[cfg][mode], window, part), spread(b[cfg][mode], window, part)
                if not so or not sn:
                    continue
                r, ci = ratio(sn, so)
                print(f"| `{mode}` ({counts}) | {label} | {so.cell()} | {sn.cell()} | {r} | {ci} |")
        print()
        if "sasl1" in modes and "fast-resume" in modes:
            for build, runs in ((old, a[cfg]), (new, b[cfg])):
                quick = spread(runs["fast-resume"], "relogin", "total")
                full = spread(runs["sasl1"], "relogin", "total")
                lo, hi = ratio_interval(quick, full) or (float("nan"), float("nan"))
                print(f"- {build}: a `fast-resume` reconnect costs {fmt_ratio(quick.median / full.median)} "
                      f"[{fmt_ratio(lo)}–{fmt_ratio(hi)}] of a full `sasl1` login "
                      f"(CPU per login, server + stores, relogin window).")
        print()


if __name__ == "__main__":
    main()
