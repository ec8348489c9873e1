#!/usr/bin/env python3
"""Summary of reliability/faults.sh runs as Markdown: one row per scenario.

Times are seconds from the fault's end (restart, resume, or the kill itself). "presence
right again": from the first probe (a presence change counted at every watcher) after which
every probe reached every contact that was online when it was sent. Messages: every chat
message the clients sent is received (live or from offline storage), bounced with an error,
still stored offline at the end, or unaccounted (silently lost).
"""
import sys
from pathlib import Path

from soak_report import lines


def one(root, sc):
    d = Path(root) / sc
    run = {}
    for r in lines(d / "run.json"):
        run.update(r)
    ev = {e["event"]: e["unix"] for e in lines(d / "events.jsonl")}
    cl = lines(d / "clients.jsonl")
    start = next((c for c in cl if c["kind"] == "start"), None)
    end = next((c for c in cl if c["kind"] == "end"), None)
    if not start or not end or "fault_end" not in ev:
        return None, f"| {sc} | incomplete run (see {d}) |"
    t0 = start["unix"]
    f0, f1 = ev["fault_start"] - t0, ev["fault_end"] - t0
    samples = [c for c in cl if c["kind"] == "sample"]
    n = run.get("n")
    during = [c for c in samples if c["t"] >= f0 - 1]
    min_online = min((c["online"] for c in during), default=None)
    back = next((c["t"] for c in during if c["t"] > f0 and c["online"] == n), None)
    # Counters just before the fault: what happened before it (the login storm) is shown
    # apart from what the fault did.
    # (The log's times are whole seconds of the wall clock: one second of margin.)
    base = max((c for c in samples if c["t"] <= f0 - 1.0), key=lambda c: c["t"], default=start)
    lost_before = base["sessions_lost"]
    lost_sessions = f"{end['sessions_lost'] - lost_before} (+{lost_before} before)"
    unacc_before = base["msg_sent"] - base["msg_received"] - base["msg_bounced"]
    right = end.get("probes_complete_since")
    incomplete = end.get("incomplete", [])
    if not incomplete:
        right_s = "never wrong"
    elif right is None:
        right_s = "not within the run"
    else:
        right_s = f"{right - f1:+.1f} s"
    first_bad = f"{incomplete[0][0] - f0:+.1f} s" if incomplete else "–"
    off = run.get("offline_left")
    unacc = end["msg_sent"] - end["msg_received"] - end["msg_bounced"] - (off or 0)
    unacc_s = f"{unacc - unacc_before} (+{unacc_before} before)" if unacc_before else f"{unacc}"
    row = (f"| {sc} | {f1 - f0:.1f} s | {lost_sessions} | {end['login_failures']} | "
           f"{min_online} / {n} | {'–' if back is None else f'{back - f1:+.0f} s'} | "
           f"{end['probes_incomplete']} of {end['probes']} (first {first_bad}) | {right_s} | "
           f"{end['msg_sent']} | {end['msg_received']} ({end['msg_delayed']} delayed) | "
           f"{end['msg_bounced']} | {off} | {unacc_s} |")
    errs = end.get("errors", [])[:4]
    return (sc, run, errs), row


def main(root, scenarios):
    print("| scenario | fault lasted | sessions lost from the fault on | failed logins | fewest online | all online again (from fault end) | probes not seen by every online watcher | presence right again (from fault end) | messages sent | received | bounced | stored offline at end | unaccounted from the fault on (in flight or lost before it) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for sc in scenarios:
        info, row = one(root, sc)
        print(row)
        if info:
            notes.append(info)
    print()
    for sc, run, errs in notes:
        load = run.get("load")
        e = "; ".join(f"`{x[:160]}`" for x in errs) or "none"
        print(f"- {sc}: load average at start {load}; first client errors: {e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["redis-kill", "pg-restart", "redis-pause", "node-kill"])
