"""The slixmpp client the two-user scripts share (scenario.py, silent.py).

A Peer logs in over STARTTLS with the server certificate verified against a CA file, fetches
its roster and goes online; it accepts and returns subscription requests on its own
(slixmpp's auto_authorize/auto_subscribe), as a stock client set up for it does.
"""

import asyncio
import json
import sys
from pathlib import Path

import slixmpp


class Peer(slixmpp.ClientXMPP):
    def __init__(self, jid, password, cafile):
        super().__init__(jid, password)
        self.ca_certs = Path(cafile)
        self.enable_direct_tls = False
        self.enable_starttls = True
        self.enable_plaintext = False
        self.roster.auto_authorize = True
        self.roster.auto_subscribe = True
        self.started = asyncio.get_event_loop().create_future()
        self.add_event_handler("session_start", self.on_start)
        self.add_event_handler("failed_auth", self.on_fail)

    async def on_start(self, _event):
        await self.get_roster(timeout=10)
        self.send_presence()
        if not self.started.done():
            self.started.set_result(True)

    def on_fail(self, stanza):
        if not self.started.done():
            self.started.set_exception(RuntimeError(f"auth failed: {stanza['condition']}"))

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


async def mutual_and_online(alice, alice_jid, bob, bob_jid):
    """Waits until both roster items reach 'both' and each peer sees the other online."""
    await until("alice's item for bob reaches 'both'",
                lambda: bob_jid in alice.client_roster
                and alice.item(bob_jid)["subscription"] == "both")
    await until("bob's item for alice reaches 'both'",
                lambda: alice_jid in bob.client_roster
                and bob.item(alice_jid)["subscription"] == "both")
    await until("alice sees bob online", lambda: len(alice.item(bob_jid).resources) > 0)
    await until("bob sees alice online", lambda: len(bob.item(alice_jid).resources) > 0)


async def finish(peers, result):
    """Disconnects `peers` (waiting up to 5 s for each), prints `result` as the one JSON line
    the Rust test reads, and returns the script's exit status."""
    for p in peers:
        p.disconnect()
    for p in peers:
        try:
            await asyncio.wait_for(p.disconnected, 5)
        except Exception:
            pass
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


def run(scenario, argc):
    """The entry point of a scenario script: runs `scenario(sys.argv)` and exits with its
    status, or prints the calling script's usage and exits 2 when it was not given `argc`
    arguments (the script's own name included)."""
    if len(sys.argv) != argc:
        print(sys.modules["__main__"].__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(scenario(sys.argv)))
