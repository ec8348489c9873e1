"""What the client scenarios share: how a slixmpp client is set up against the test
server, and how a scenario ends (disconnect everyone, print one JSON line, exit status)."""

import asyncio
import json
import sys
from pathlib import Path

import slixmpp


def starttls_only(client, cafile):
    """STARTTLS verified against CAFILE; no direct TLS, never plaintext."""
    client.ca_certs = Path(cafile)
    client.enable_direct_tls = False
    client.enable_starttls = True
    client.enable_plaintext = False


class Peer(slixmpp.ClientXMPP):
    """A client that, once logged in, fetches its roster and goes online; `started`
    completes then (or fails with the SASL condition)."""

    def __init__(self, jid, password, cafile):
        super().__init__(jid, password)
        starttls_only(self, cafile)
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


async def report(peers, result):
    """Disconnects `peers`, prints `result` as the one JSON line the tests read, and
    returns the exit status: 1 when the result is an error."""
    for peer in peers:
        peer.disconnect()
    for peer in peers:
        try:
            await asyncio.wait_for(peer.disconnected, 5)
        except Exception:
            pass
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


def main(doc, argc, scenario):
    """Runs `scenario(argv)` when the script got `argc` arguments, else prints `doc`."""
    if len(sys.argv) != argc + 1:
        print(doc, file=sys.stderr)
        sys.exit(2)
    sys.exit(asyncio.run(scenario(sys.argv)))
