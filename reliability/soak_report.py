#!/usr/bin/env python3
"""Summary of one reliability/soak.sh run (its WORK directory) as Markdown.

Slopes are least-squares fits over the samples after the warm-up, per hour; the client
counters are the generator's (clients.jsonl); "after leave" is the check that every session
and key went away once all clients had left.
"""
import json
import sys
from pathlib import Path


def lines(p):
    p = Path(p)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def slope(points):
    """Least-squares slope of (t, v) pairs, per hour; None with fewer than 3 points."""
    pts = [(t, v) for t, v in points if v is not None]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    den = sum((t - mt) ** 2 for t, _ in pts)
    if den == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in pts) / den * 3600


def main(work):
    work = Path(work)
    runs = lines(work / "run.json")
    run = {}
    for r in runs:
        run.update(r)
    samples = lines(work / "samples.jsonl")
    clients = lines(work / "clients.jsonl")
    after = lines(work / "after.jsonl")
    warm = run.get("warmup_secs", 600)
    # Samples are timed from the generator's start; the load starts after the first logins.
    start = next((c for c in clients if c["kind"] == "start"), None)
    end = next((c for c in clients if c["kind"] == "end"), None)
    login_secs = None
    if start and samples:
        login_secs = start["unix"] - (samples[0]["unix"] - samples[0]["t"])
    t_load0 = login_secs or 0
    steady = [s for s in samples if s["t"] - t_load0 >= warm and (end is None or s["unix"] <= end["unix"])]
    print(f"Commit `{run.get('commit')}`, started {run.get('started')}, N = {run.get('n')}, "
          f"K = {run.get('k')}, load {run.get('soak_secs')} s (churn {run.get('churn')} of the "
          f"sessions per minute, {run.get('presence_rate')} presence changes/s, "
          f"{run.get('message_rate')} messages/s), {len(samples)} samples, first logins took "
          f"{login_secs} s, warm-up {warm} s left out of the slopes ({len(steady)} samples after it).")
    print()
    loads = [s["load"] for s in samples if s.get("load")]
    if loads:
        l1 = [x[0] for x in loads]
        print(f"Load average (1 min) over the run: min {min(l1):.2f}, mean "
              f"{sum(l1) / len(l1):.2f}, max {max(l1):.2f} on {run.get('nproc')} cores "
              f"(shared machine: other engineers' builds and tests ran too).")
        print()
    print("| figure | first after warm-up | last | min | max | slope per hour after warm-up |")
    print("|---|---|---|---|---|---|")
    for key, label in [
        ("rss_kb", "server RSS, kB"),
        ("fds", "server open descriptors"),
        ("sessions", "bound sessions (/metrics)"),
        ("redis_keys", "Redis keys (all; private instance)"),
        ("presence_keys", "liveness keys presence:{…}"),
        ("dir_keys", "directory keys dir:{…}"),
        ("offline_messages", "PostgreSQL offline_messages rows"),
        ("last_activity", "PostgreSQL last_activity rows"),
        ("pending_subscriptions", "PostgreSQL pending_subscriptions rows"),
        ("roster_items", "PostgreSQL roster_items rows"),
        ("pg_backends", "PostgreSQL connections of the node"),
    ]:
        vals = [s.get(key) for s in steady if s.get(key) is not None]
        if not vals:
            print(f"| {label} | – | – | – | – | – |")
            continue
        sl = slope([(s["t"], s.get(key)) for s in steady])
        sl_s = "–" if sl is None else f"{sl:+.1f}"
        print(f"| {label} | {vals[0]} | {vals[-1]} | {min(vals)} | {max(vals)} | {sl_s} |")
    print()
    if end:
        e = end
        lost = e["msg_sent"] - e["msg_received"] - e["msg_bounced"]
        print(f"Clients (generator, at the end of the load after a drain): {e['logins']} logins, "
              f"{e['reconnects']} reconnects, {e['login_failures']} failed login attempts, "
              f"{e['sessions_lost']} sessions lost without being asked to, "
              f"{e['skipped']} orders skipped (user busy logging in); "
              f"{e['presence_sent']} presence changes sent, {e['presence_delivered']} deliveries; "
              f"messages: {e['msg_sent']} sent, {e['msg_received']} received "
              f"({e['msg_delayed']} of them from offline storage), {e['msg_bounced']} bounced, "
              f"{lost} neither received nor bounced; probes {e['probes']}, "
              f"{e['probes_incomplete']} not seen by every online watcher.")
        if e.get("errors"):
            print()
            print("First client errors: " + "; ".join(f"`{x}`" for x in e["errors"][:5]))
        print()
    beats = lines(work / "beats.jsonl")
    if beats:
        t0 = samples[0]["unix"] - samples[0]["t"] if samples else beats[0]["unix_ms"] / 1000
        late = [b for b in beats if b["older_ttl"] > 0]
        worst = max(beats, key=lambda b: b["older_90s"])
        oldest = max(beats, key=lambda b: b["oldest_s"])
        print(f"Written beats (beats.jsonl, {len(beats)} samples of the beat ZSETs): members "
              f"{min(b['members'] for b in beats)}–{max(b['members'] for b in beats)}; "
              f"beats older than 60 s: at most {max(b['older_60s'] for b in beats)}; older than "
              f"90 s: at most {worst['older_90s']} (t = {worst['unix_ms'] / 1000 - t0:.0f} s); "
              f"older than T (their liveness key expired while the member waited for the next "
              f"sweep): in {len(late)} samples, at most "
              f"{max((b['older_ttl'] for b in beats), default=0)}; oldest beat "
              f"{oldest['oldest_s']} s (t = {oldest['unix_ms'] / 1000 - t0:.0f} s).")
        print()
    counted = [s for s in samples if "redis_writes" in s]
    if len(counted) >= 2:
        a, b = counted[0], counted[-1]
        mins = (b["unix"] - a["unix"]) / 60 or 1
        def d(k):
            return b.get(k, 0) - a.get(k, 0)
        print(f"Node liveness counters from t = {a['t']} s to {b['t']} s: "
              f"{d('redis_writes') / mins:.0f} resource writes to Redis per minute, "
              f"{d('redis_errors')} failed or dropped Redis operations, "
              f"{d('pings_sent') / mins:.0f} pings per minute, {d('swept_resources')} resources "
              f"swept, {d('silent_deaths')} silent deaths.")
        print()
    if after:
        left = run.get("left_at")
        first_zero_s = next((a for a in after if a.get("sessions") == 0), None)
        first_zero_k = next((a for a in after if a.get("presence_keys") == 0 and a.get("dir_keys") == 0), None)
        last = after[-1]
        def since(a):
            return "never (within the bound)" if a is None else f"{a['unix'] - left} s"
        print(f"After every client left: sessions 0 after {since(first_zero_s)}, liveness and "
              f"directory keys 0 after {since(first_zero_k)}; last check: sessions "
              f"{last.get('sessions')}, presence keys {last.get('presence_keys')}, dir keys "
              f"{last.get('dir_keys')}, Redis keys {last.get('redis_keys')}, offline_messages "
              f"{last.get('offline_messages')}, RSS {last.get('rss_kb')} kB, descriptors "
              f"{last.get('fds')}.")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/presenced-soak")
