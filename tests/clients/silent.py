#!/usr/bin/env python3
"""Two slixmpp users become contacts, see each other online, then one dies silently.

Usage: silent.py HOST PORT DOMAIN CAFILE USER1 PASS1 USER2 PASS2 WAIT

Both log in over STARTTLS (certificate verified against CAFILE) and go online. USER1 asks
USER2 to subscribe; both clients auto-authorize and subscribe back, so both items reach
subscription 'both' and each sees the other online. Then USER1 pings the server (its last
words) and goes silent the way a phone that lost its network does: its socket stays open,
it stops reading and never writes again (no close, no unavailable, no keepalive). USER2
waits up to WAIT seconds for USER1's unavailable presence from the server.

Prints one JSON line: both subscriptions, USER1's full JID, the sender of the unavailable
USER2 got and the seconds from USER1's last words to it; exits 0. On any failure prints
{"error": ...} and exits 1.
"""

import asyncio

from peers import Peer, finish, mutual_and_online, run

TIMEOUT = 10


class Silent(Peer):
    def __init__(self, jid, password, cafile):
        super().__init__(jid, password, cafile)
        # Only the server's pings (answered by XEP-0199) keep this client alive: a
        # whitespace keepalive of its own would be traffic after it "died".
        self.whitespace_keepalive = False
        self.register_plugin("xep_0199")
        self.offline = asyncio.Queue()
        self.add_event_handler("presence_unavailable", self.on_unavailable)

    def on_unavailable(self, presence):
        self.offline.put_nowait((asyncio.get_event_loop().time(), str(presence["from"])))


async def scenario(argv):
    host, port, domain, cafile, u1, p1, u2, p2, wait = argv[1:10]
    alice = Silent(f"{u1}@{domain}", p1, cafile)
    bob = Silent(f"{u2}@{domain}", p2, cafile)
    bob_jid, alice_jid = f"{u2}@{domain}", f"{u1}@{domain}"
    for peer in (alice, bob):
        peer.connect(host, int(port))
    try:
        await asyncio.wait_for(asyncio.gather(alice.started, bob.started), TIMEOUT)
        alice.send_presence(pto=bob_jid, ptype="subscribe")
        await mutual_and_online(alice, alice_jid, bob, bob_jid)
        alice_full = str(alice.boundjid.full)
        # Last words: a ping answered by the server, so its record of alice's last beat
        # is no earlier than `silent_since`.
        loop = asyncio.get_event_loop()
        silent_since = loop.time()
        await alice.plugin["xep_0199"].ping(jid=domain, timeout=TIMEOUT)
        # Dead: nothing is read (so nothing can be answered) and nothing is written.
        alice.transport.pause_reading()
        alice.send_raw = lambda *_args, **_kwargs: None
        deadline = loop.time() + float(wait)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError("no unavailable for the silent client")
            at, sender = await asyncio.wait_for(bob.offline.get(), left)
            if sender == alice_full:
                break
        result = {
            "alice_sub": alice.item(bob_jid)["subscription"],
            "bob_sub": bob.item(alice_jid)["subscription"],
            "alice_full": alice_full,
            "unavailable_from": sender,
            "after": round(at - silent_since, 3),
            "bob_sees_alice_resources": len(bob.item(alice_jid).resources),
        }
    except Exception as exc:
        result = {"error": repr(exc)}
    if alice.transport is not None:
        alice.transport.abort()
    return await finish((bob,), result)


if __name__ == "__main__":
    run(scenario, 10)
