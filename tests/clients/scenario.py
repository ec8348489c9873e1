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

from peers import Peer, finish, mutual_and_online, until, run


class Chatter(Peer):
    def __init__(self, jid, password, cafile):
        super().__init__(jid, password, cafile)
        self.inbox = asyncio.Queue()
        self.add_event_handler("message", self.on_message)

    def on_message(self, msg):
        if msg["type"] in ("chat", "normal"):
            self.inbox.put_nowait(msg)


async def scenario(argv):
    host, port, domain, cafile, u1, p1, u2, p2 = argv[1:9]
    alice = Chatter(f"{u1}@{domain}", p1, cafile)
    bob = Chatter(f"{u2}@{domain}", p2, cafile)
    bob_jid, alice_jid = f"{u2}@{domain}", f"{u1}@{domain}"
    for peer in (alice, bob):
        peer.connect(host, int(port))
    try:
        await asyncio.wait_for(asyncio.gather(alice.started, bob.started), 10)
        await alice.update_roster(bob_jid, name="Bob", groups=["Friends"], timeout=10)
        await until("alice's roster shows the new item",
                    lambda: bob_jid in alice.client_roster and alice.item(bob_jid)["name"] == "Bob")
        alice.send_presence(pto=bob_jid, ptype="subscribe")
        await mutual_and_online(alice, alice_jid, bob, bob_jid)
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
    return await finish((alice, bob), result)


if __name__ == "__main__":
    run(scenario, 9)
