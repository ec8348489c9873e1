#!/usr/bin/env python3
"""Drives one user on presenced and one on a peer server (Prosody or ejabberd) through a
mutual subscription and presence exchange across federation, in both directions.

usage: exchange.py OURS_JID OURS_HOST:PORT PEER_JID PEER_HOST:PORT PASSWORD [AGAIN_HOST:PORT]

AGAIN_HOST:PORT is where the presenced user logs in the second time (default: where it
logged in first); with a cluster, another node.

Every step prints PASS or FAIL with what was awaited; the exit status is 0 only when every
step passed. Certificates are self-signed on loopback, so verification is switched off for
these two client connections only (the s2s link between the servers is what is tested).
"""
import asyncio
import ssl
import sys
import time

import slixmpp

TIMEOUT = 30


class User:
    def __init__(self, jid, hostport, password, label):
        self.jid = slixmpp.JID(jid)
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)
        self.password = password
        self.label = label
        self.seen = []
        self.xmpp = None

    async def connect(self):
        x = slixmpp.ClientXMPP(str(self.jid) + "/interop", self.password)
        x.enable_direct_tls = False
        x.ssl_context.check_hostname = False
        x.ssl_context.verify_mode = ssl.CERT_NONE
        x.roster.auto_authorize = None  # answer subscription requests by hand
        x.roster.auto_subscribe = False
        started = asyncio.get_running_loop().create_future()

        async def on_start(_):
            await x.get_roster()
            x.send_presence()
            if not started.done():
                started.set_result(True)

        def on_presence(p):
            self.seen.append(
                (str(p["from"]), p.xml.get("type") or "available", p["show"] or "", time.time())
            )

        def on_failed(_):
            if not started.done():
                started.set_exception(RuntimeError(f"{self.label}: authentication failed"))

        x.add_event_handler("session_start", on_start)
        x.add_event_handler("presence", on_presence)
        x.add_event_handler("failed_auth", on_failed)
        x.connect(self.host, self.port)
        self.xmpp = x
        await asyncio.wait_for(started, TIMEOUT)

    async def disconnect(self):
        self.xmpp.disconnect()
        await asyncio.sleep(0)
        await self.xmpp.disconnected

    def send(self, to=None, ptype=None, show=None, status=None):
        self.xmpp.send_presence(pto=to, ptype=ptype, pshow=show, pstatus=status)

    async def wait(self, what, pred, since):
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            for s in self.seen:
                if s[3] >= since and pred(s):
                    return s
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.label} never saw {what}; saw {self.seen}")


failures = 0


async def step(name, coro):
    global failures
    t0 = time.time()
    try:
        await coro
        print(f"PASS  {name}  ({time.time() - t0:.2f}s)", flush=True)
    except Exception as e:  # noqa: BLE001 - report every failure and go on
        failures += 1
        print(f"FAIL  {name}: {e}", flush=True)


def frm(bare, ptype, show=None):
    def pred(s):
        return (
            s[0].split("/")[0] == bare
            and s[1] == ptype
            and (show is None or s[2] == show)
        )
    return pred


async def main():
    ours_jid, ours_addr, peer_jid, peer_addr, password = sys.argv[1:6]
    again_addr = sys.argv[6] if len(sys.argv) > 6 else ours_addr
    ours = User(ours_jid, ours_addr, password, "ours")
    peer = User(peer_jid, peer_addr, password, "peer")
    o, p = str(ours.jid.bare), str(peer.jid.bare)
    await step(f"{o} logs in on presenced", ours.connect())
    await step(f"{p} logs in on the peer", peer.connect())

    # Direction 1: presenced user subscribes to the peer's user.
    t = time.time()
    ours.send(to=p, ptype="subscribe")
    await step("peer user receives subscribe from presenced user", peer.wait("subscribe", frm(o, "subscribe"), t))
    t = time.time()
    peer.send(to=o, ptype="subscribed")
    await step("presenced user receives subscribed", ours.wait("subscribed", frm(p, "subscribed"), t))
    await step("presenced user sees the peer user available", ours.wait("available", frm(p, "available"), t))

    # Direction 2: the peer's user subscribes to the presenced user.
    t = time.time()
    peer.send(to=o, ptype="subscribe")
    await step("presenced user receives subscribe from peer user", ours.wait("subscribe", frm(p, "subscribe"), t))
    t = time.time()
    ours.send(to=p, ptype="subscribed")
    await step("peer user receives subscribed", peer.wait("subscribed", frm(o, "subscribed"), t))
    await step("peer user sees the presenced user available", peer.wait("available", frm(o, "available"), t))

    # Presence changes both ways.
    t = time.time()
    peer.send(show="away", status="interop away")
    await step("presenced user sees peer user go away", ours.wait("away", frm(p, "available", "away"), t))
    t = time.time()
    ours.send(show="dnd", status="interop busy")
    await step("peer user sees presenced user go dnd", peer.wait("dnd", frm(o, "available", "dnd"), t))

    # Logout and login of the presenced user, seen by the peer; the probe on login is
    # answered by the peer server.
    t = time.time()
    await ours.disconnect()
    await step("peer user sees presenced user log out", peer.wait("unavailable", frm(o, "unavailable"), t))
    t = time.time()
    ours = User(ours_jid, again_addr, password, "ours")
    where = "" if again_addr == ours_addr else f" on {again_addr}"
    await step(f"{o} logs in again{where}", ours.connect())
    await step("peer user sees presenced user log in", peer.wait("available", frm(o, "available"), t))
    await step("presenced user's probe is answered by the peer server", ours.wait("available", frm(p, "available"), t))

    # Logout of the peer's user, seen on presenced.
    t = time.time()
    await peer.disconnect()
    await step("presenced user sees peer user log out", ours.wait("unavailable", frm(p, "unavailable"), t))
    await ours.disconnect()
    print(f"RESULT {'PASS' if failures == 0 else 'FAIL'} ({failures} failed steps)", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(1 if asyncio.run(main()) else 0)
