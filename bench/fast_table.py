#!/usr/bin/env python3
"""FAST reconnects against full SCRAM logins: the BENCHMARKS.md table from bench/fast.sh's
results (each run's presenced.json and run.json), medians with min–max ranges.

Usage: bench/fast_table.py DIR   (DIR holds <cert>-n<N>-k<K>-<run>-<mode>/ from bench/fast.sh)

The CPU per login is the server's plus its stores' (PostgreSQL backends and the private
Redis) over a storm's window divided by the logins completed in it: "relogin" (every
stream closed, then every client logs in again through the login concurrency; for
fast-resume every socket cut, then every client resumes its XEP-0198 session inline in
its FAST authentication) and the first logins. The target: a FAST reconnect with TLS
resumption costs at most a quarter of a full SCRAM login. Each reconnect mode's ratio to a
full login is the ratio of medians with bench/ratio.py's 95 % bootstrap interval.
"""
import json
import os
import re
import sys
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ratio import Spread, ratio_interval  # noqa: E402  (the same cells and intervals)

TARGET = 0.25
MODES = {"sasl1": "SASL1 SCRAM (stream restart, bind by iq)",
         "sasl2": "SASL2 SCRAM, Bind 2 inline",
         "fast": "FAST token, resumed TLS 1.3, Bind 2 inline",
         "fast-resume": "FAST token, resumed TLS 1.3, XEP-0198 resumed inline"}
# The reconnect modes, each set against the full logins.
RECONNECTS = ("fast", "fast-resume")
FULL = ("sasl1", "sasl2")
CERTS = {"ecdsa": "ECDSA P-256", "rsa2048": "RSA-2048"}


def load(root):
    """{(cert, n, k): {mode: [(run, report, meta)]}}"""
    out = {}
    for name in sorted(os.listdir(root)):
        m = re.fullmatch(r"(\w+)-n(\d+)-k(\d+)-(\d+)-([\w-]+)", name)
        path = os.path.join(root, name)
        if not m or not os.path.exists(os.path.join(path, "presenced.json")):
            continue
        cert, n, k, run, mode = m.groups()
        with open(os.path.join(path, "presenced.json")) as f:
            rep = json.load(f)
        meta = {}
        if os.path.exists(os.path.join(path, "run.json")):
            with open(os.path.join(path, "run.json")) as f:
                meta = json.load(f)
        # bench/run.sh's own record of the run: where the processes ran (PIN).
        if os.path.exists(os.path.join(path, "presenced.meta.json")):
            with open(os.path.join(path, "presenced.meta.json")) as f:
                meta.setdefault("pin", json.load(f).get("pin", "not pinned"))
        out.setdefault((cert, int(n), int(k)), {}).setdefault(mode, []).append(
            (int(run), rep, meta))
    return out


def per_login(rep, window, part):
    """ms per completed login in `window`: server, stores or both ("total")."""
    logins = rep.get(f"{window}_logins") or 0
    if not logins:
        return None
    if part == "total":
        return rep.get(f"{window}_total_cpu_ms_per_login")
    v = rep.get(f"{window}_{part}")
    return None if v is None else v * 1000.0 / logins


def sm(rep, window):
    """`<resumed>/<refused>` XEP-0198 resumptions of a window, where the run counted them."""
    if rep.get(f"{window}_sm_resumed") is None:
        return None
    return f"{rep[f'{window}_sm_resumed']}/{rep[f'{window}_sm_failed']}"


def against(quick, full):
    """The ratio of medians quick ÷ full with its 95 % bootstrap interval, and the verdict
    on the ¼ target: met where the whole interval is at most ¼."""
    ratio = quick.median / full.median
    ci = ratio_interval(quick, full)
    if ci is None:
        return f"{ratio:.2f} of it; target (≤ ¼) not judged (a resampled median is 0)"
    lo, hi = ci
    if hi <= TARGET:
        verdict = "met (the whole interval at most ¼)"
    elif ratio <= TARGET:
        verdict = "met by the median only (the interval reaches above ¼)"
    elif lo <= TARGET:
        verdict = "NOT met by the median (the interval reaches ¼)"
    else:
        verdict = "NOT met (the whole interval above ¼)"
    return (f"{ratio:.2f} [{lo:.2f}–{hi:.2f}] of it (95 % bootstrap interval, "
            f"{len(quick.values)} and {len(full.values)} runs); target (≤ ¼) {verdict}")


def table(cfg, modes):
    cert, n, k = cfg
    runs = {m: len(v) for m, v in modes.items()}
    present = [m for m in MODES if m in modes]
    print(f"#### {CERTS.get(cert, cert)} certificate, N = {n:,}, K = {k}\n")
    print("Runs per mode: " + ", ".join(f"{m} {runs[m]}" for m in present)
          + "; each cell: median (min–max).\n")
    print("| figure | " + " | ".join(f"`{m}`" for m in present) + " |")
    print("|---|" + "---:|" * len(present))

    def row(label, fn, fmt="{:.3g}"):
        cells = [Spread([fn(rep) for _, rep, _ in modes[m]]).cell(fmt.format) for m in present]
        if any(cells):
            print(f"| {label} | " + " | ".join(cells) + " |")

    for window, what in (("relogin", "reconnect (relogin window)"),
                         ("first", "first login")):
        row(f"CPU ms per {what}, server + stores", lambda r, w=window: per_login(r, w, "total"))
        row(f"… of which server", lambda r, w=window: per_login(r, w, "cpu_s"))
        row(f"… of which PostgreSQL + Redis", lambda r, w=window: per_login(r, w, "store_cpu_s"))
    row("relogin: logins / resumed TLS / FAST",
        lambda r: f"{r.get('relogin_logins')}/{r.get('relogin_resumed')}/{r.get('relogin_fast')}"
        if r.get("relogin_logins") is not None else None, "{}")
    row("relogin: XEP-0198 resumed / refused (bound anew)", lambda r: sm(r, "relogin"), "{}")
    row("cut storm: logins / resumed TLS / FAST",
        lambda r: f"{r.get('cut_logins')}/{r.get('cut_resumed')}/{r.get('cut_fast')}"
        if r.get("cut_logins") is not None else None, "{}")
    row("cut storm: XEP-0198 resumed / refused (bound anew)", lambda r: sm(r, "cut"), "{}")
    row("cut storm: 50 % restored, s", lambda r: r.get("cut_restored_50_s"))
    row("cut storm: 99 % restored, s", lambda r: r.get("cut_restored_99_s"))
    row("cut storm: 100 % restored, s", lambda r: r.get("cut_restored_100_s"))
    row("cut storm: 100 % logged in again, s", lambda r: r.get("cut_back_100_s"))
    row("cut storm: failed attempts", lambda r: r.get("cut_failed"), "{:g}")
    row("cut storm: CPU ms per login, server + stores",
        lambda r: per_login(r, "cut", "total"))
    row("relogin: 100 % restored, s", lambda r: r.get("relogin_restored_100_s"))
    if any(sm(r, w) for m in present for _, r, _ in modes[m] for w in ("cut", "relogin")):
        row("cut storm: restored sessions then announced unavailable",
            lambda r: r.get("cut_taken_back"), "{:g}")
        row("relogin: restored sessions then announced unavailable",
            lambda r: r.get("relogin_taken_back"), "{:g}")
        row("XEP-0198 window the server granted, s", lambda r: r.get("sm_window_s"), "{:g}")
    print()
    negotiated = sorted({x for m in present for _, r, _ in modes[m] for x in r.get("negotiated", [])})
    if negotiated:
        print("Negotiated (TLS version, cipher suite, mechanism): " + "; ".join(negotiated) + "\n")

    for quick in RECONNECTS:
        fast = Spread([per_login(r, "relogin", "total") for _, r, _ in modes.get(quick, [])])
        for full in FULL:
            ref = Spread([per_login(r, "relogin", "total") for _, r, _ in modes.get(full, [])])
            if not fast or not ref:
                continue
            print(f"- `{quick}` reconnect against a full {full.upper()} SCRAM login (CPU per "
                  f"login, server + stores): {fast.median:.3g} ms against {ref.median:.3g} ms "
                  f"= {against(fast, ref)}.")
    for quick in RECONNECTS:
        f100 = Spread([r.get("cut_restored_100_s") for _, r, _ in modes.get(quick, [])])
        for full in FULL:
            ref = Spread([r.get("cut_restored_100_s") for _, r, _ in modes.get(full, [])])
            if ref and f100:
                ci = ratio_interval(f100, ref)
                # The target (≤ ½) is set for the storm of N = 10,000.
                within = "" if ci is None else f" [{ci[0]:.2f}–{ci[1]:.2f}]"
                if ci is not None and n >= 10_000:
                    within += "; target (≤ ½) " + (
                        "met (the whole interval at most ½)" if ci[1] <= 0.5 else
                        "met by the median only (the interval reaches above ½)"
                        if f100.median <= 0.5 * ref.median else "NOT met")
                print(f"- Cut storm, 100 % restored: `{quick}` {f100.cell()} s against {full} "
                      f"{ref.cell()} s ({f100.median / ref.median:.2f} of it{within}).")
    for quick in RECONNECTS:
        resumed = [(r.get("relogin_resumed"), r.get("relogin_logins"))
                   for _, r, _ in modes.get(quick, [])]
        if resumed:
            print(f"- `{quick}` runs, relogin window, resumed TLS handshakes of logins: "
                  + ", ".join(f"{a} of {b}" for a, b in resumed) + ".")
    print()
    print("| run | mode | started (UTC) | load before | load after | commit |")
    print("|---:|---|---|---|---|---|")
    rows = sorted((meta.get("started", ""), run, m, meta)
                  for m in present for run, _, meta in modes[m])
    for started, run, m, meta in rows:
        print(f"| {run} | {m} | {started} | {meta.get('load_before', '')} | "
              f"{meta.get('load_after', '')} | {meta.get('commit', '')} |")
    machines = sorted({meta.get("machine") for _, _, m, meta in rows if meta.get("machine")})
    if machines:
        print("\nMachine: " + "; ".join(machines))
    pins = sorted({meta.get("pin", "not pinned") for _, _, m, meta in rows})
    print("\nCPU placement: " + "; ".join(pins) + ".")
    print()


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    data = load(sys.argv[1])
    if not data:
        print("(no results)")
        return
    for cfg in sorted(data, key=lambda c: (c[2], c[1], c[0] != "ecdsa", c[0])):
        table(cfg, data[cfg])


if __name__ == "__main__":
    main()
