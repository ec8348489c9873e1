#!/usr/bin/env python3
"""XEP-0198 stream management with slixmpp's own xep_0198 plugin.

Usage: stream_management.py HOST PORT DOMAIN CAFILE ALICE BOB PASSWORD

ALICE and BOB are mutual contacts; both use STARTTLS verified against CAFILE. ALICE loads
xep_0198, which enables resumable stream management when the server offers it.

1. Acks: ALICE sends BOB seven messages and asks for the server's count; every one of them
   is acknowledged (slixmpp's stanza_acked event).
2. Resumption: ALICE's TCP connection is aborted (no closing tag, as a phone losing its
   network); BOB writes to her while she is away; ALICE connects again and her plugin
   resumes the session, after which the message arrives. BOB records any unavailable
   presence from ALICE throughout; ALICE's "back" after the resumption is the positive
   control that he is listening.

Prints one JSON line with what was seen and exits 0, or prints {"error": ...} and exits 1.
"""

import asyncio

from peers import Peer as LoggedIn, finish, until, run

TIMEOUT = 10


class Peer(LoggedIn):
    def __init__(self, jid, password, cafile, sm=False):
        super().__init__(jid, password, cafile)
        self.register_plugin("xep_0199")
        if sm:
            self.register_plugin("xep_0198")
        self.messages = asyncio.Queue()
        self.acked = 0
        self.unavailable_from = []
        self.sm_enabled = asyncio.get_event_loop().create_future()
        self.resumed = asyncio.get_event_loop().create_future()
        self.add_event_handler("message", lambda m: self.messages.put_nowait(m))
        self.add_event_handler("stanza_acked", self.on_acked)
        self.add_event_handler("sm_enabled", self.on_enabled)
        self.add_event_handler("session_resumed", self.on_resumed)
        self.add_event_handler("presence_unavailable", self.on_unavailable)

    def on_acked(self, stanza):
        if stanza.name == "message":
            self.acked += 1

    def on_enabled(self, stanza):
        if not self.sm_enabled.done():
            self.sm_enabled.set_result(stanza)

    def on_resumed(self, stanza):
        if not self.resumed.done():
            self.resumed.set_result(stanza)

    def on_unavailable(self, presence):
        self.unavailable_from.append(str(presence["from"]))

    async def next_message(self, what):
        try:
            return await asyncio.wait_for(self.messages.get(), TIMEOUT)
        except asyncio.TimeoutError:
            raise TimeoutError(what) from None


async def scenario(argv):
    host, port, domain, cafile, alice_name, bob_name, password = argv[1:8]
    alice = Peer(f"{alice_name}@{domain}/phone", password, cafile, sm=True)
    bob = Peer(f"{bob_name}@{domain}/desk", password, cafile)
    peers = [alice, bob]
    result = {}
    try:
        for p in peers:
            p.connect(host, int(port))
        await asyncio.wait_for(asyncio.gather(alice.started, bob.started), TIMEOUT)
        enabled = await asyncio.wait_for(alice.sm_enabled, TIMEOUT)
        result["sm_enabled"] = True
        result["resumable"] = enabled["resume"] in (True, "true", "1")
        alice_full = alice.boundjid.full
        await until("bob sees alice online",
                    lambda: alice.boundjid.resource
                    in bob.client_roster[alice.boundjid.bare].resources)

        # 1. Acks.
        for i in range(7):
            alice.send_message(mto=bob.boundjid.bare, mbody=f"m{i}", mtype="chat")
        for i in range(7):
            await bob.next_message(f"bob gets m{i}")
        result["bob_got"] = 7
        alice["xep_0198"].request_ack()
        await until("the server acknowledges alice's messages", lambda: alice.acked >= 7)
        result["acked"] = alice.acked

        # 2. The connection dies; bob writes meanwhile; alice resumes.
        alice.transport.abort()
        await asyncio.wait_for(alice.disconnected, TIMEOUT)
        bob.send_message(mto=alice_full, mbody="while you were away", mtype="chat")
        await bob["xep_0199"].ping(jid=domain, timeout=TIMEOUT)
        alice.connect(host, int(port))
        await asyncio.wait_for(alice.resumed, TIMEOUT)
        result["resumed"] = True
        got = await alice.next_message("alice gets what bob wrote while she was away")
        result["got_while_away"] = got["body"]

        alice.send_message(mto=bob.boundjid.bare, mbody="back", mtype="chat")
        back = await bob.next_message("bob hears from the resumed session")
        result["bob_got_back"] = back["body"]
        result["bob_saw_unavailable"] = alice_full in bob.unavailable_from
    except Exception as exc:
        result = {"error": repr(exc)}
    return await finish(peers, result)


if __name__ == "__main__":
    run(scenario, 8)
