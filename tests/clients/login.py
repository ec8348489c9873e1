#!/usr/bin/env python3
"""Log in to presenced with slixmpp, a client library this project did not write.

Usage: login.py HOST PORT DOMAIN USER PASSWORD MECHANISM CAFILE [direct_tls]

Connects to HOST:PORT (STARTTLS, or XEP-0368 direct TLS when the last argument is
"direct_tls"), verifies the server certificate against CAFILE, authenticates with exactly
MECHANISM ("any": the one slixmpp prefers among those offered; slixmpp also checks the SCRAM
server signature), binds a server-generated
resource, fetches the roster, sends initial presence and waits for the server to echo it
back (RFC 6121 §4.2.2). Prints one JSON line and exits 0 on success; on any failure it
prints a JSON line with "error" and exits 1.
"""

import asyncio
import json
import sys
from pathlib import Path

import slixmpp

TIMEOUT = 20


class Login(slixmpp.ClientXMPP):
    def __init__(self, jid, password, mechanism, cafile, direct_tls):
        super().__init__(jid, password, sasl_mech=None if mechanism == "any" else mechanism)
        self.ca_certs = Path(cafile)
        # slixmpp tries direct TLS first on any port unless told otherwise.
        self.enable_direct_tls = direct_tls
        self.enable_starttls = not direct_tls
        self.enable_plaintext = False
        self.direct_tls = direct_tls
        self.done = asyncio.get_event_loop().create_future()
        self.add_event_handler("session_start", self.on_session_start)
        self.add_event_handler("failed_auth", self.on_failed_auth)
        self.add_event_handler("disconnected", self.on_disconnected)
        self.add_event_handler("presence_available", self.on_presence)
        self.own_presence = asyncio.get_event_loop().create_future()

    def finish(self, result):
        if not self.done.done():
            self.done.set_result(result)

    def on_failed_auth(self, stanza):
        self.finish({"error": "failed_auth", "condition": stanza["condition"]})

    def on_disconnected(self, reason):
        self.finish({"error": "disconnected", "reason": str(reason)})

    def on_presence(self, pres):
        if pres["from"] == self.boundjid and not self.own_presence.done():
            self.own_presence.set_result(True)

    async def on_session_start(self, _event):
        try:
            roster = await self.get_roster(timeout=10)
            ver = roster["roster"]["ver"]
            self.send_presence(pstatus="slixmpp login test")
            await asyncio.wait_for(self.own_presence, 10)
            self.finish(
                {
                    "jid": str(self.boundjid.full),
                    "resource": self.boundjid.resource,
                    "mechanism": self.plugin["feature_mechanisms"].mech.name,
                    "tls": "direct" if self.direct_tls else "starttls",
                    "starttls_negotiated": "starttls" in self.features,
                    "roster_ver": ver,
                    "roster_items": len(roster["roster"]["items"]),
                    "own_presence_echoed": True,
                }
            )
        except Exception as exc:  # report, never hang
            self.finish({"error": "session", "reason": repr(exc)})


async def main(argv):
    if len(argv) not in (8, 9):
        print(__doc__, file=sys.stderr)
        return 2
    host, port, domain, user, password, mechanism, cafile = argv[1:8]
    direct_tls = len(argv) == 9 and argv[8] == "direct_tls"
    xmpp = Login(f"{user}@{domain}", password, mechanism, cafile, direct_tls)
    xmpp.connect(host, int(port))
    try:
        result = await asyncio.wait_for(xmpp.done, TIMEOUT)
    except asyncio.TimeoutError:
        result = {"error": "timeout"}
    # The done future may be resolved by 'disconnected' below; keep the first result.
    xmpp.disconnect()
    try:
        await asyncio.wait_for(xmpp.disconnected, 5)
    except (asyncio.TimeoutError, Exception):
        pass
    print(json.dumps(result), flush=True)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv)))
