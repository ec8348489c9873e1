#!/usr/bin/env python3
"""Tables for bench/run.sh and bench/repeat.sh.

    ratio.py DIR                one run: one column per server
    ratio.py DIR1 DIR2 ...      repeated runs: median and min–max per figure and server

Each DIR holds <server>.json written by `presenced-bench --json` (and <server>.meta.json
written by bench/run.sh: start time, position in the run's order, load averages).
Servers: prosody, ejabberd, presenced (PostgreSQL + Redis), embedded (presenced on SQLite
with liveness in process).

"Best peer" is the better of Prosody and ejabberd for each figure (higher is better for
rates, lower for latency, memory and CPU; by median over the runs). With repeated runs a
ratio "presenced ÷ best peer" is the ratio of medians with its 95 % bootstrap interval
(each server's runs resampled with replacement); it is claimed only where the interval
excludes 1, and the cell says "not apart" where it does not.
"""
import json
import os
import random
import statistics
import sys

# (json key, label, higher_is_better; None: a count checked, not compared)
FIGURES = [
    ("logins_ok", "logins ok", None),
    ("login_rate_per_s", "login rate (sessions/s)", True),
    ("login_p50_ms", "login latency p50 (ms)", False),
    ("login_p99_ms", "login latency p99 (ms)", False),
    ("fixed_delivered", "deliveries received at fixed load", None),
    ("sat_deliveries_per_s", "presence deliveries/s at saturation", True),
    ("sat_missing", "deliveries owed at saturation and never received (after the drain)", None),
    ("sat_repeated", "deliveries received twice at saturation", None),
    ("fixed_p50_ms", "delivery latency p50 at fixed load (ms)", False),
    ("fixed_p99_ms", "delivery latency p99 at fixed load (ms)", False),
    ("fixed_max_ms", "delivery latency max at fixed load (ms)", False),
    ("rss_kb_per_session", "RSS per idle session (kB)", False),
    ("total_rss_kb_per_session", "RSS per idle session, with its Redis (kB)", False),
    ("all_rss_kb_per_session",
     "RSS per idle session with all its stores: its Redis, its PostgreSQL backends' private "
     "memory (kB)", False),
    ("cpu_s_per_1000_logins", "CPU s per 1,000 logins (server process)", False),
    ("total_cpu_s_per_1000_logins",
     "CPU s per 1,000 logins, server + its stores (PostgreSQL backends, Redis)", False),
    ("cpu_s_per_1000_deliveries", "CPU s per 1,000 deliveries (server process)", False),
    ("total_cpu_s_per_1000_deliveries",
     "CPU s per 1,000 deliveries, server + its stores (PostgreSQL backends, Redis)", False),
]
# The memory "with all its stores" of a server whose run measured no store outside its
# process: what it did measure.
ALL_RSS_FALLBACK = ["all_rss_kb_per_session", "total_rss_kb_per_session", "rss_kb_per_session"]
# Client state indication runs (bench/run.sh CSI=1): (json key, label). Counts per client
# are presence stanzas the clients received, the same count for every server.
CSI_FIGURES = [
    ("csi_baseline_per_client",
     "presences per client of the later-inactive half, all clients active"),
    ("csi_inactive_per_client", "presences per inactive client while idle"),
    ("csi_inactive_max_client", "most presences one inactive client received while idle"),
    ("csi_active_per_client", "presences per active client, same window"),
    ("csi_reduction_pct", "reduction for an inactive client (%)"),
    ("csi_baseline_deliveries_per_s", "presence deliveries/s, all active"),
    ("csi_deliveries_per_s", "presence deliveries/s, half inactive"),
    ("csi_flushed_per_inactive_client", "presences per inactive client after <active/>"),
    ("csi_lost", "latest presences missing after <active/>"),
    ("csi_checked", "(client, changed contact) pairs checked"),
    ("csi_interest_items", "interest lists: contacts named per inactive client"),
    ("csi_interest_inactive_per_client",
     "interest lists: presences per inactive client while idle"),
    ("csi_interest_reduction_pct", "interest lists: reduction for an inactive client (%)"),
    ("csi_interest_deliveries_per_s", "interest lists: presence deliveries/s"),
    ("csi_interest_lost", "interest lists: latest presences missing after <active/>"),
    ("csi_interest_checked", "interest lists: pairs checked"),
]
CSI_TARGET_PCT = 90.0
# The latency target: presenced's p99 at this fraction of the best peer's saturation at most
# LADDER_TARGET_SHARE of the best peer's p99 at the same offered load.
LADDER_TARGET_FRACTION = 0.5
LADDER_TARGET_SHARE = 1 / 3
# Reconnect storm runs (bench/run.sh STORM=1): per cause, (json key suffix, label,
# higher_is_better; None: a count shown, not compared). Times are from the drop.
STORM_FIGURES = [
    ("restored", "sessions back with presence restored at every watcher", None),
    ("restored_50_s", "time until 50 % restored (s)", False),
    ("restored_99_s", "time until 99 % restored (s)", False),
    ("restored_100_s", "time until 100 % restored (s)", False),
    ("taken_back", "restored sessions then announced unavailable (watched one grace period and a margin after)", None),
    ("back_99_s", "time until 99 % logged in again (s)", False),
    ("back_100_s", "time until 100 % logged in again (s)", False),
    ("server_down_s", "server down: stop to listening again (s)", False),
    ("attempts", "login attempts", None),
    ("failed_refused", "failed logins: refused (nothing listening)", None),
    ("failed_timeout", "failed logins: timeout (no login within the limit)", None),
    ("failed_stream", "failed logins: stream error or connection ended by the server", None),
    ("failed_other", "failed logins: other", None),
    ("rss_mb_before", "server RSS before the drop (MB)", False),
    ("peak_rss_mb", "server peak RSS during the storm (MB)", False),
]
# The storms' causes as the tables title them.
STORM_TITLES = {"cut": "Network cut", "restart": "Server restart",
                "relogin": "Every client logs in again"}
STORM_TARGET = 1 / 3
PEERS = ["prosody", "ejabberd"]
OURS = ["presenced", "embedded"]
SERVERS = PEERS + OURS
TITLES = {"prosody": "Prosody", "ejabberd": "ejabberd", "presenced": "presenced PG+Redis",
          "embedded": "presenced embedded"}
# Figures of the stores at rest: presenced's own counters, its Redis, and the PostgreSQL
# database of any server that has one (presenced, Prosody on SQL storage); otherwise n/a.
PRESENCED_ONLY = [
    ("redis_writes_per_session_per_min", "Redis writes/session/min at rest (server counter)"),
    ("redis_write_cmds_per_session_per_min",
     "Redis write commands/session/min at rest (INFO commandstats)"),
    ("pg_writes_per_session_per_min", "PostgreSQL writes/session/min at rest (server counter)"),
    ("pg_statements_per_session_per_min",
     "PostgreSQL statements/session/min at rest (pg_stat_activity)"),
    ("pg_xacts_per_session_per_min",
     "PostgreSQL commits/session/min at rest (pg_stat_database, once settled)"),
    ("pg_rows_per_session_per_min",
     "PostgreSQL rows written/session/min at rest (pg_stat_database)"),
]


def load(d, name, suffix=".json"):
    p = os.path.join(d, name + suffix)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        if v == int(v) and abs(v) >= 100:
            return str(int(v))
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


class Spread:
    """One figure of one server over the runs: median, min, max, count."""

    def __init__(self, values):
        self.values = [v for v in values if v is not None]

    def __bool__(self):
        return bool(self.values)

    @property
    def median(self):
        return statistics.median(self.values)

    @property
    def lo(self):
        return min(self.values)

    @property
    def hi(self):
        return max(self.values)

    def cell(self, form=fmt):
        """median (min–max), each value written by `form`."""
        if not self.values:
            return ""
        if self.lo == self.hi:
            return form(self.values[0])
        return f"{form(self.median)} ({form(self.lo)}–{form(self.hi)})"


def separated(ours, peer):
    """True when the two ranges do not overlap (either way)."""
    return ours.hi < peer.lo or peer.hi < ours.lo


# Bootstrap of a ratio of medians: resamples per interval, and a fixed seed so the same
# results always print the same table.
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 20261205


RATIO_NOTE = (
    "A ratio is presenced's median over the best peer's, with its 95 % bootstrap interval "
    "(each server's runs resampled with replacement, 10,000 times, fixed seed); \"not "
    "apart\" marks an interval that includes 1: the runs do not tell the two apart. With "
    "fewer than five runs per server the interval is coarse.")


def ratio_interval(ours, peer):
    """The 95 % percentile-bootstrap interval of median(ours) ÷ median(peer): each server's
    runs resampled with replacement, independently. None when a resampled median is 0."""
    rng = random.Random(BOOTSTRAP_SEED)
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        a = statistics.median(rng.choices(ours.values, k=len(ours.values)))
        b = statistics.median(rng.choices(peer.values, k=len(peer.values)))
        if not b:
            return None
        ratios.append(a / b)
    ratios.sort()
    return (ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1])


def fmt_ratio(x):
    """Two decimals; below 0.01, two significant digits (8.83 ms against 4,391 is 0.0020,
    not 0.00)."""
    return f"{x:.2f}" if x >= 0.01 or x == 0 else f"{x:.2g}"


def ratio_cell(ours, peers, higher, repeated):
    """ours ÷ best peer; with repeated runs the ratio of medians with its 95 % bootstrap
    interval, claimed only where the interval excludes 1."""
    peers = [p for p in peers if p]
    if not ours or not peers or higher is None:
        return ""
    best = (max if higher else min)(peers, key=lambda s: s.median)
    if not best.median:
        return ""
    r = fmt_ratio(ours.median / best.median)
    if not repeated:
        return r
    ci = ratio_interval(ours, best)
    if ci is None:
        return ""
    lo, hi = ci
    interval = f"{r} [{fmt_ratio(lo)}–{fmt_ratio(hi)}]"
    return interval if lo > 1 or hi < 1 else f"{interval}, not apart"


def csi_table(runs, present, spread):
    """The client state indication table and the per-server verdict on the target."""
    if not any((run[n] or {}).get("csi_secs") for run in runs for n in present):
        return False
    first = next(run[n] for run in runs for n in present if (run[n] or {}).get("csi_secs"))
    print(f"Client state indication: {first['csi_rate_changes_per_s']} presence changes/s "
          f"from the active half (odd users) for {first['csi_secs']:.0f} s per window; "
          "the inactive half are the even users")
    print()
    print("| figure | " + " | ".join(TITLES[n] for n in present) + " |")
    print("|---|" + "---:|" * len(present))
    for key, label in CSI_FIGURES:
        cells = [spread(n, key).cell() for n in present]
        if all(c == "" for c in cells):
            continue
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    for n in present:
        red = spread(n, "csi_reduction_pct")
        lost = spread(n, "csi_lost")
        checked = spread(n, "csi_checked")
        if not red:
            continue
        met = red.lo >= CSI_TARGET_PCT and lost and lost.hi == 0 and checked.lo > 0
        print(f"- {TITLES[n]}: reduction {red.cell()} %, latest presences missing after "
              f"<active/> {lost.cell()} of {checked.cell()}: target (at least "
              f"{CSI_TARGET_PCT:.0f}% fewer, nothing lost) "
              f"{'met in every run' if met else 'NOT met in every run'}")
    return True


def ladder_table(runs, present, spread):
    """The latency ladder (bench/run.sh LATENCY_FRACTIONS): p50 and p99 per offered rate
    and server, and the verdict on the latency target. Points are matched over runs and
    servers by their offered rate."""
    points = {}
    for run in runs:
        for n in present:
            for pt in (run[n] or {}).get("ladder", []):
                points.setdefault(round(pt["rate_changes_per_s"], 3), pt)
    if not points:
        return
    k = next(run[n]["contacts"] for run in runs for n in present if run[n])

    def at(rate, field):
        def values(n):
            out = []
            for run in runs:
                pt = next((p for p in (run[n] or {}).get("ladder", [])
                           if round(p["rate_changes_per_s"], 3) == rate), None)
                out.append(pt.get(field) if pt else None)
            return out
        return {n: Spread(values(n)) for n in present}

    sats = {n: spread(n, "sat_deliveries_per_s") for n in PEERS if n in present}
    sats = {n: s for n, s in sats.items() if s}
    print("\nLatency under load: open-loop phases after the saturation phase, lowest rate "
          "first; a rate a server did not sustain (a delivery missing after the drain) ends "
          "its ladder, so higher rows stay empty for it.")
    first = next(iter(points.values()))
    if first.get("fraction_of_deliveries_per_s"):
        line = (f"Offered rates: fractions of {first['fraction_of_deliveries_per_s']:.0f} "
                f"deliveries/s (a given figure, the same for every server), in changes/s "
                f"= deliveries/s ÷ K (K = {k})")
        if sats:
            line += ("; the peers' saturation measured in these runs: "
                     + ", ".join(f"{TITLES[n]} {s.cell()}" for n, s in sats.items()))
        print(line)
    print()
    print("| offered load | figure | " + " | ".join(TITLES[n] for n in present) + " |")
    print("|---|---|" + "---:|" * len(present))
    verdicts = []
    for rate in sorted(points):
        pt = points[rate]
        name = f"{rate:g} changes/s ({rate * k:.0f} deliveries/s"
        if pt.get("fraction") is not None:
            name += f", {pt['fraction'] * 100:.0f} %"
        name += ")"
        sent, delivered = at(rate, "sent"), at(rate, "delivered")
        cells = []
        for n in present:
            pairs = [(s, d) for s, d in zip(sent[n].values, delivered[n].values)]
            full = sum(1 for s, d in pairs if d >= s * k)
            cells.append(f"{full} of {len(pairs)}" if pairs else "not offered")
        print(f"| {name} | runs with every delivery | " + " | ".join(cells) + " |")
        for field, label in (("p50_ms", "p50 (ms)"), ("p99_ms", "p99 (ms)")):
            c = at(rate, field)
            print(f"| {name} | {label} | " + " | ".join(c[n].cell() for n in present) + " |")
        if pt.get("fraction") is not None and abs(pt["fraction"] - LADDER_TARGET_FRACTION) < 1e-9:
            verdicts.append((name, at(rate, "p99_ms"), sent, delivered))
    print()
    for name, p99, sent, delivered in verdicts:
        peers = [n for n in PEERS if n in present and p99[n]]
        if not peers:
            print(f"- at {name}: no peer was offered this rate (each ended its ladder below "
                  "it): the p99 target cannot be judged from these runs")
            continue
        unsustained = [n for n in peers
                       if any(d < s * k for s, d in zip(sent[n].values, delivered[n].values))]
        if unsustained:
            print(f"- at {name}: {', '.join(TITLES[n] for n in unsustained)} did not sustain "
                  "this rate in every run: its p99 there is a queue's, not a delivery time")
        best = min(peers, key=lambda n: p99[n].median)
        bound = p99[best].median * LADDER_TARGET_SHARE
        for n in [n for n in OURS if n in present and p99[n]]:
            ours = p99[n]
            if ours.hi <= p99[best].lo * LADDER_TARGET_SHARE:
                word = "met in every run (its highest p99 ≤ ⅓ of the best peer's lowest)"
            elif ours.median <= bound:
                word = "met by the medians, not in every run (the ranges overlap the bound)"
            else:
                word = "NOT met"
            print(f"- {TITLES[n]} at {name}: p99 {ours.cell()} ms against ⅓ of "
                  f"{TITLES[best]}'s {p99[best].cell()} ms = {bound:.3g} ms: target {word}")
def print_ratio_head(present, ours):
    """The head of a figures table: one column per server, one ratio column per ours."""
    head = "| figure | " + " | ".join(TITLES[n] for n in present)
    head += "".join(f" | {TITLES[n]} ÷ best peer" for n in ours) + " |"
    print(head)
    print("|---|" + "---:|" * (len(present) + len(ours)))


def print_ratio_row(label, cells, present, ours, higher, repeated):
    """One figure's row (nothing when no server has it): each server's cell, then each
    of ours against the best peer (bench's rule: a ratio only where the ranges are apart)."""
    if not any(cells.values()):
        return
    row = f"| {label} | " + " | ".join(cells[n].cell() for n in present)
    for n in ours:
        row += " | " + ratio_cell(cells[n], [cells[p] for p in PEERS if p in cells],
                                  higher, repeated)
    print(row + " |")


def storm_table(runs, present, repeated):
    """The reconnect storm table (one block per cause) and the verdict on the target:
    presenced back within a third of the best peer's time."""
    if not any((run[n] or {}).get("storm") for run in runs for n in present):
        return False
    for run in runs:
        for r in run.values():
            for c in ("cut", "restart"):
                for k in ("rss_kb_before", "peak_rss_kb"):
                    if r and r.get(f"{c}_{k}") is not None:
                        r[f"{c}_{k.replace('kb', 'mb')}"] = r[f"{c}_{k}"] / 1024
    first = next(run[n] for run in runs for n in present if (run[n] or {}).get("storm"))
    ours = [n for n in OURS if n in present]
    print(f"Reconnect storm: N = {first['users']} sessions, K = {first['contacts']} mutual "
          f"contacts; clients come back after a random {first['storm_backoff_min_s']:g}–"
          f"{first['storm_backoff_max_s']:g} s, doubling after each failed attempt, capped at "
          f"{first['storm_backoff_cap_s']:g} s; a login attempt gives up after "
          f"{first['storm_login_timeout_s']:g} s")
    if repeated:
        print("\n" + RATIO_NOTE)
    for cause in first.get("storm_causes", []):
        print(f"\n**{STORM_TITLES.get(cause, cause)}** ({cause})\n")
        print_ratio_head(present, ours)
        for key, label, higher in STORM_FIGURES:
            cells = {n: Spread([(run[n] or {}).get(f"{cause}_{key}") for run in runs])
                     for n in present}
            print_ratio_row(label, cells, present, ours, higher, repeated)
        print()
        for n in ours:
            for key in ("restored_99_s", "restored_100_s"):
                mine = Spread([(run[n] or {}).get(f"{cause}_{key}") for run in runs])
                peers = [(p, Spread([(run[p] or {}).get(f"{cause}_{key}") for run in runs]))
                         for p in PEERS if p in present]
                peers = [(p, sp) for p, sp in peers if sp]
                if not mine or not peers:
                    continue
                best, sp = min(peers, key=lambda x: x[1].median)
                r = mine.median / sp.median if sp.median else float("inf")
                met = r <= STORM_TARGET
                sure = separated(mine, sp) if repeated else False
                print(f"- {TITLES[n]}, {cause}, {key.split('_')[1]} % restored: "
                      f"{mine.cell()} s against {TITLES[best]}'s {sp.cell()} s: "
                      f"{r:.2f} of the best peer's time; target (≤ ⅓) "
                      f"{'met' if met else 'NOT met'}"
                      + ("" if not repeated else
                         " (ranges apart)" if sure else " (ranges overlap)"))
    return True


def main():
    dirs = sys.argv[1:]
    if not dirs:
        print(__doc__)
        sys.exit(2)
    runs = [{n: load(d, n) for n in SERVERS} for d in dirs]
    metas = [{n: load(d, n, ".meta.json") for n in SERVERS} for d in dirs]
    repeated = len(dirs) > 1
    any_run = next((r for run in runs for r in run.values() if r), None)
    if any_run is None:
        print("(no results)")
        return
    present = [n for n in SERVERS if any(run[n] for run in runs)]
    ours = [n for n in OURS if n in present]

    def spread(name, key):
        # A server with no store outside its process (ejabberd) has all its memory in it.
        keys = ALL_RSS_FALLBACK if key == "all_rss_kb_per_session" else [key]
        return Spread([next((r[k] for k in keys if r.get(k) is not None), None)
                       for r in (run[name] or {} for run in runs)])

    if repeated:
        counts = ", ".join(f"{TITLES[n]} {sum(1 for run in runs if run[n])}" for n in present)
        print(f"{len(dirs)} runs (runs per server: {counts}); each cell: median (min–max).\n")
    if storm_table(runs, present, repeated):
        load_table(metas, present)
        errors(runs)
        return
    csi = csi_table(runs, present, spread)
    if csi:
        print(f"\nN = {any_run['users']} sessions, K = {any_run['contacts']} mutual contacts, "
              f"idle window after logins {any_run.get('rest_secs', 0):.0f} s for every server; "
              "the CSI windows replace the fixed-load and saturation phases")
    else:
        print(f"N = {any_run['users']} sessions, K = {any_run['contacts']} mutual contacts, "
              f"fixed load {any_run['fixed_rate_changes_per_s']} changes/s "
              f"(x K deliveries), saturation window {any_run['sat_window']} deliveries, "
              f"idle window after logins {any_run.get('rest_secs', 0):.0f} s for every server")
    if repeated:
        print("\n" + RATIO_NOTE)
    print()
    print_ratio_head(present, ours)

    for key, label, higher in FIGURES:
        if csi and ("fixed" in key or "sat_" in key or "deliveries" in key):
            continue
        cells = {n: spread(n, key) for n in present}
        print_ratio_row(label, cells, present, ours, higher, repeated)
    for key, label in PRESENCED_ONLY:
        # A peer on SQL storage (Prosody) has its PostgreSQL figures measured too.
        cells = [spread(n, key).cell() or ("" if n in OURS else "n/a") for n in present]
        if all(c in ("", "n/a") for c in cells):
            continue
        print(f"| {label} | " + " | ".join(cells) + " |" + " |" * len(ours))
    if not csi:
        ladder_table(runs, present, spread)

    # What every server negotiated (the same handshake and mechanism for all, or not).
    neg = {}
    for run in runs:
        for n in present:
            for x in (run[n] or {}).get("negotiated", []):
                neg.setdefault(n, [])
                if x not in neg[n]:
                    neg[n].append(x)
    if neg:
        print("\nNegotiated (TLS version, cipher suite, SASL mechanism): "
              + "; ".join(f"{TITLES[n]} {', '.join(v)}" for n, v in neg.items()))
    for i, run in enumerate(runs):
        pres = run.get("presenced") or {}
        if pres.get("redis_write_cmds_seen"):
            seen = ", ".join(f"{c} {k}" for c, k in sorted(pres["redis_write_cmds_seen"].items()))
            which = f" (run {i + 1})" if repeated else ""
            print(f"\nRedis write commands in the {pres.get('rest_secs', 0):.0f} s window at "
                  f"rest{which} (calls, flagged `write` by COMMAND INFO): {seen}")
    procs = {n: r.get("procs") for n, r in runs[0].items() if r and r.get("procs")}
    if procs:
        print("\nGenerator processes: " + ", ".join(f"{TITLES[n]} {p}" for n, p in procs.items()))
    load_table(metas, present)
    errors(runs)


def load_table(metas, present):
    """Load averages per server run: this machine is shared with other work."""
    rows = []
    for i, meta in enumerate(metas):
        for n in present:
            m = meta.get(n)
            if m:
                rows.append((m["started"], i + 1, m.get("position"), n, m["load_before"],
                             m.get("load_at_restart") or "", m["load_after"]))
    # Where the processes ran (bench/run.sh PIN): said once per table, or per run when it
    # varied. Runs recorded before pinning existed were not pinned.
    pins = sorted({m.get("pin", "not pinned") for meta in metas for m in meta.values() if m})
    if pins:
        print("\nCPU placement: " + "; ".join(pins) + ".")
    # The machine and the commit built, recorded by bench/run.sh since 2026-12-06 05:20Z.
    for key, what in (("machine", "Machine"), ("commit", "Commit built")):
        seen = sorted({m[key] for meta in metas for m in meta.values() if m and m.get(key)})
        if seen:
            print(f"\n{what}: " + "; ".join(seen) + ".")
    if rows:
        restart = any(r[5] for r in rows)
        print("\n| run | order | server | started (UTC) | load average before |"
              + (" at the restart |" if restart else "") + " after |")
        print("|---:|---:|---|---|---|" + ("---|" if restart else "") + "---|")
        for started, i, pos, n, before, at, after in sorted(rows):
            print(f"| {i} | {pos} | {TITLES[n]} | {started} | {before} |"
                  + (f" {at} |" if restart else "") + f" {after} |")


def errors(runs):
    for run in runs:
        for n, r in run.items():
            if r and r.get("errors"):
                print(f"\n{TITLES[n]} errors: " + "; ".join(r["errors"][:3]))


if __name__ == "__main__":
    main()
