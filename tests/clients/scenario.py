#!/usr/bin/env python3
"""Two slixmpp users become contacts and chat, the way a new user would with a stock client.

Usage: scenario.py HOST PORT DOMAIN CAFILE USER1 PASS1 USER2 PASS2

Both log in over STARTTLS (certificate verified against CAFILE), fetch their rosters and go
online. USER1 adds USER2 to the roster with a name and a group and asks to subscribe; both
clients auto-authorize and subscribe back (slixmpp's auto_authorize/auto_subscribe), so both
items must reach subscription 'both' through the server's roster pushes. Then USER1 sends a
chat message, USER2 answers it. Prints one JSON line with what each side saw and exits 0, or
prints {"error": ...} and exits 1.
"""

import asyncio

import harness
from harness import main, report

TIMEOUT = 25


class Peer(harness.Peer):
    def __init__(self, jid, password, cafile):
        super().__init__(jid, password, cafile)
        self.roster.auto_authorize = True
        self.roster.auto_subscribe = True
        self.inbox = asyncio.Queue()
        self.add_event_handler("message", self.on_message)

    def on_message(self, msg):
        if msg["type"] in ("chat", "normal"):
            self.inbox.put_nowait(msg)

    def item(self, jid):
        return self.client_roster[jid]


async def until(what, predicate, limit=10.0):
    """Waits for a condition the clients update from server stanzas, failing after limit."""
    loop = asyncio.get_event_loop()
    deadline = loop.time() + limit
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


async def scenario(argv):
    host, port, domain, cafile, u1, p1, u2, p2 = argv[1:9]
    alice = Peer(f"{u1}@{domain}", p1, cafile)
    bob = Peer(f"{u2}@{domain}", p2, cafile)
    bob_jid, alice_jid = f"{u2}@{domain}", f"{u1}@{domain}"
    for peer in (alice, bob):
        peer.connect(host, int(port))
    try:
        await asyncio.wait_for(asyncio.gather(alice.started, bob.started), 10)
        await alice.update_roster(bob_jid, name="Bob", groups=["Friends"], timeout=10)
        await until("alice's roster shows the new item",
                    lambda: bob_jid in alice.client_roster and alice.item(bob_jid)["name"] == "Bob")
        alice.send_presence(pto=bob_jid, ptype="subscribe")
        await until("alice's item for bob reaches 'both'",
                    lambda: alice.item(bob_jid)["subscription"] == "both")
        await until("bob's item for alice reaches 'both'",
                    lambda: alice_jid in bob.client_roster
                    and bob.item(alice_jid)["subscription"] == "both")
        await until("alice sees bob online", lambda: len(alice.item(bob_jid).resources) > 0)
        await until("bob sees alice online", lambda: len(bob.item(alice_jid).resources) > 0)
        alice.send_message(mto=bob_jid, mbody="hello bob", mtype="chat")
        got = await asyncio.wait_for(bob.inbox.get(), 10)
        bob.send_message(mto=got["from"], mbody="hello alice", mtype="chat")
        reply = await asyncio.wait_for(alice.inbox.get(), 10)
        result = {
            "alice_sub": alice.item(bob_jid)["subscription"],
            "bob_sub": bob.item(alice_jid)["subscription"],
            "alice_item_name": alice.item(bob_jid)["name"],
            "alice_item_groups": ",".join(alice.item(bob_jid)["groups"]),
            "bob_got": got["body"],
            "bob_got_from": str(got["from"]),
            "alice_full": str(alice.boundjid.full),
            "alice_got": reply["body"],
            "alice_got_from": str(reply["from"]),
            "bob_full": str(bob.boundjid.full),
        }
    except Exception as exc:
        result = {"error": repr(exc)}
    return await report((alice, bob), result)


if __name__ == "__main__":
    main(__doc__, 8, scenario)
