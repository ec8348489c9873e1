#!/usr/bin/env python3
"""A XEP-0357 app server played by slixmpp: receives one push notification and answers it.

Usage: push_app.py HOST PORT DOMAIN CAFILE USER PASS RESOURCE WAIT

Logs in over STARTTLS as USER@DOMAIN/RESOURCE (certificate verified against CAFILE), goes
online and waits up to WAIT seconds for an <iq type='set'/> carrying a pubsub publish, as
the XMPP server of a sleeping phone sends it to the phone's app server. It answers with a
result, as an app server that forwarded the notification to Apple or Google does.

Prints one JSON line: the sender, the node, the publish options' secret and the summary
form's fields; exits 0. On any failure prints {"error": ...} and exits 1.
"""

import asyncio

from slixmpp.xmlstream.handler import Callback
from slixmpp.xmlstream.matcher import MatchXPath

from peers import Peer, finish, run

PUBSUB = "http://jabber.org/protocol/pubsub"
DATA = "jabber:x:data"
PUSH = "urn:xmpp:push:0"
TIMEOUT = 10


class AppServer(Peer):
    def __init__(self, jid, password, cafile):
        super().__init__(jid, password, cafile)
        self.register_plugin("xep_0199")
        self.notifications = asyncio.Queue()
        self.register_handler(Callback(
            "push notification",
            MatchXPath(f"{{jabber:client}}iq/{{{PUBSUB}}}pubsub"),
            self.on_publish,
        ))

    def on_publish(self, iq):
        if iq["type"] != "set":
            return
        self.notifications.put_nowait(iq)
        iq.reply().send()


def fields(form):
    """The var -> first value map of a data form element."""
    out = {}
    if form is None:
        return out
    for field in form.findall(f"{{{DATA}}}field"):
        value = field.find(f"{{{DATA}}}value")
        out[field.get("var")] = value.text if value is not None else None
    return out


async def scenario(argv):
    host, port, domain, cafile, user, password, resource, wait = argv[1:9]
    app = AppServer(f"{user}@{domain}/{resource}", password, cafile)
    app.connect(host, int(port))
    try:
        await asyncio.wait_for(app.started, TIMEOUT)
        iq = await asyncio.wait_for(app.notifications.get(), float(wait))
        pubsub = iq.xml.find(f"{{{PUBSUB}}}pubsub")
        publish = pubsub.find(f"{{{PUBSUB}}}publish")
        note = publish.find(f"{{{PUBSUB}}}item/{{{PUSH}}}notification")
        options = pubsub.find(f"{{{PUBSUB}}}publish-options/{{{DATA}}}x")
        result = {
            "from": str(iq["from"]),
            "node": publish.get("node"),
            "secret": fields(options).get("secret"),
            "summary": fields(note.find(f"{{{DATA}}}x") if note is not None else None),
        }
    except Exception as exc:
        result = {"error": repr(exc)}
    return await finish((app,), result)


if __name__ == "__main__":
    run(scenario, 9)
