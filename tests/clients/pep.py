#!/usr/bin/env python3
"""XEP-0163 personal eventing with slixmpp's own plugins (xep_0163, xep_0084, xep_0115).

Usage: pep.py HOST PORT DOMAIN CAFILE ALICE BOB CAROL DAVE EVE PASSWORD

ALICE is a mutual contact of BOB, CAROL and EVE; DAVE is a stranger. BOB, DAVE and EVE run
xep_0084, which announces urn:xmpp:avatar:metadata+notify in their XEP-0115 caps; CAROL
runs xep_0115 and xep_0163 without it. All use STARTTLS verified against CAFILE.

1. ALICE blocks EVE (xep_0191), publishes avatar data and metadata (xep_0084).
2. BOB gets the metadata event; CAROL (no +notify), DAVE (stranger) and EVE (blocked) get
   nothing (checked after a ping round trip each, behind BOB's positive control).
3. BOB retrieves the avatar data by the metadata's id.
4. A second BOB resource comes online and gets the last metadata item.

Prints one JSON line with what was seen and exits 0, or prints {"error": ...} and exits 1.
"""

import asyncio

from peers import Peer as LoggedIn, finish, run

TIMEOUT = 10
AVATAR = b"\x89PNG\r\n\x1a\n presenced test avatar"


class Peer(LoggedIn):
    def __init__(self, jid, password, cafile, avatars):
        super().__init__(jid, password, cafile)
        for plugin in ("xep_0030", "xep_0115", "xep_0163", "xep_0199", "xep_0191"):
            self.register_plugin(plugin)
        if avatars:
            self.register_plugin("xep_0084")
        self.events = asyncio.Queue()
        self.add_event_handler("avatar_metadata_publish",
                               lambda m: self.events.put_nowait(m))

    async def next_event(self, what):
        try:
            return await asyncio.wait_for(self.events.get(), TIMEOUT)
        except asyncio.TimeoutError:
            raise TimeoutError(what) from None


async def online(*peers):
    for peer in peers:
        peer.connect(peer.host_port[0], peer.host_port[1])
    await asyncio.wait_for(asyncio.gather(*(p.started for p in peers)), TIMEOUT)
    # The initial presence (with caps) is handled before this round trip returns.
    for peer in peers:
        await peer["xep_0199"].ping(jid=peer.boundjid.domain, timeout=TIMEOUT)


async def scenario(argv):
    host, port, domain, cafile, alice, bob, carol, dave, eve, password = argv[1:11]
    peers = []

    def peer(name, res, avatars):
        p = Peer(f"{name}@{domain}/{res}", password, cafile, avatars)
        p.host_port = (host, int(port))
        peers.append(p)
        return p

    owner = peer(alice, "pc", True)
    desk = peer(bob, "desk", True)
    web = peer(carol, "web", False)
    stranger = peer(dave, "x", True)
    blocked = peer(eve, "x", True)
    result = {}
    try:
        await online(owner, desk, web, stranger, blocked)
        await owner["xep_0191"].block(f"{eve}@{domain}", timeout=TIMEOUT)

        # 1. Publish data, then metadata pointing at it.
        avatar_id = owner["xep_0084"].generate_id(AVATAR)
        await owner["xep_0084"].publish_avatar(AVATAR, timeout=TIMEOUT)
        await owner["xep_0084"].publish_avatar_metadata(
            {"id": avatar_id, "type": "image/png", "bytes": len(AVATAR)}, timeout=TIMEOUT)

        # 2. The subscribed contact with +notify, and nobody else.
        msg = await desk.next_event("bob gets the metadata event")
        item = msg["pubsub_event"]["items"]["item"]
        result["bob_event_from"] = str(msg["from"])
        result["bob_event_id"] = item["id"]
        result["bob_event_bytes"] = int(item["avatar_metadata"]["info"]["bytes"])
        for name, p in (("carol", web), ("dave", stranger), ("eve", blocked)):
            await p["xep_0199"].ping(jid=domain, timeout=TIMEOUT)
            result[f"{name}_events"] = p.events.qsize()

        # 3. The data, fetched by the id the metadata named.
        got = await desk["xep_0084"].retrieve_avatar(f"{alice}@{domain}", avatar_id,
                                                     timeout=TIMEOUT)
        data = got["pubsub"]["items"]["item"]["avatar_data"]["value"]
        result["bob_data_matches"] = data == AVATAR

        # 4. A new resource of bob's gets the last item on coming online.
        phone = peer(bob, "phone", True)
        await online(phone)
        msg = await phone.next_event("bob's phone gets the last metadata item")
        result["phone_event_id"] = msg["pubsub_event"]["items"]["item"]["id"]
        result["avatar_id"] = avatar_id
    except Exception as exc:
        result = {"error": repr(exc)}
    return await finish(peers, result)


if __name__ == "__main__":
    run(scenario, 11)
