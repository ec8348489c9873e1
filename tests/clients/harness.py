"""What the client scenarios share: how a slixmpp client is set up against the test
server, and how a scenario ends (disconnect everyone, print one JSON line, exit status)."""

import asyncio
import json
import sys
from pathlib import Path


def starttls_only(client, cafile):
    """STARTTLS verified against CAFILE; no direct TLS, never plaintext."""
    client.ca_certs = Path(cafile)
    client.enable_direct_tls = False
    client.enable_starttls = True
    client.enable_plaintext = False


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
