#!/usr/bin/env python3
"""Message carbons, client state indication and offline messages with slixmpp's own plugins.

Usage: extensions.py HOST PORT DOMAIN CAFILE ALICE BOB CAROL PASSWORD

ALICE and BOB are mutual contacts; CAROL is offline at the start. ALICE logs in twice
(phone, pc), BOB once; all use STARTTLS verified against CAFILE.

1. Carbons (xep_0280): the pc finds urn:xmpp:carbons:2 in the server's disco#info and
   enables carbons; BOB writes to alice/phone (the pc gets a received carbon), the phone
   writes to BOB (the pc gets a sent carbon).
2. CSI (xep_0352): the phone saw the csi stream feature and sends <inactive/>; BOB changes
   his show to away, then xa, then writes to the phone. The shows the phone sees before
   the message are recorded (only the latest is expected).
3. Offline (xep_0203 for the delay): BOB writes to CAROL while she is offline; CAROL logs
   in and the message carries a delay stamp.

Prints one JSON line with what was seen and exits 0, or prints {"error": ...} and exits 1.
"""

import asyncio


from peers import Peer as LoggedIn, finish, run

TIMEOUT = 10


class Peer(LoggedIn):
    def __init__(self, jid, password, cafile):
        super().__init__(jid, password, cafile)
        for plugin in ("xep_0030", "xep_0199", "xep_0203", "xep_0280", "xep_0352"):
            self.register_plugin(plugin)
        self.events = asyncio.Queue()
        self.add_event_handler("message", lambda m: self.events.put_nowait(("message", m)))
        self.add_event_handler("carbon_received", lambda m: self.events.put_nowait(("received", m)))
        self.add_event_handler("carbon_sent", lambda m: self.events.put_nowait(("sent", m)))
        self.add_event_handler("presence", lambda p: self.events.put_nowait(("presence", p)))

    async def next(self, kinds, what):
        """The next event of one of `kinds`, skipping others, within TIMEOUT."""
        async def wait():
            while True:
                kind, stanza = await self.events.get()
                if kind in kinds:
                    return kind, stanza
        try:
            return await asyncio.wait_for(wait(), TIMEOUT)
        except asyncio.TimeoutError:
            raise TimeoutError(what) from None


async def online(*peers):
    for peer in peers:
        peer.connect(peer.host_port[0], peer.host_port[1])
    await asyncio.wait_for(asyncio.gather(*(p.started for p in peers)), TIMEOUT)


async def scenario(argv):
    host, port, domain, cafile, alice, bob, carol, password = argv[1:9]
    peers = []

    def peer(jid):
        p = Peer(jid, password, cafile)
        p.host_port = (host, int(port))
        peers.append(p)
        return p

    phone = peer(f"{alice}@{domain}/phone")
    pc = peer(f"{alice}@{domain}/pc")
    desk = peer(f"{bob}@{domain}/desk")
    result = {}
    try:
        await online(phone, pc, desk)
        alice_bare = f"{alice}@{domain}"

        # 1. Carbons.
        info = await pc["xep_0030"].get_info(jid=domain, timeout=TIMEOUT)
        result["carbons_advertised"] = "urn:xmpp:carbons:2" in info["disco_info"]["features"]
        result["msgoffline_advertised"] = "msgoffline" in info["disco_info"]["features"]
        await pc["xep_0280"].enable(timeout=TIMEOUT)
        desk.send_message(mto=phone.boundjid.full, mbody="to the phone", mtype="chat")
        _, got = await phone.next({"message"}, "the phone gets bob's message")
        result["phone_got"] = got["body"]
        _, copy = await pc.next({"received"}, "the pc gets a received carbon")
        inner = copy["carbon_received"]
        result["received_body"] = inner["body"]
        result["received_to"] = str(inner["to"])
        phone.send_message(mto=f"{bob}@{domain}", mbody="from the phone", mtype="chat")
        _, copy = await pc.next({"sent"}, "the pc gets a sent carbon")
        inner = copy["carbon_sent"]
        result["sent_body"] = inner["body"]
        result["sent_from"] = str(inner["from"])

        # 2. Client state indication.
        result["csi_offered"] = phone["xep_0352"].enabled
        phone["xep_0352"].send_inactive()
        # A round trip after the nonza: the server has switched before bob acts.
        await phone["xep_0199"].ping(jid=domain, timeout=TIMEOUT)
        while not phone.events.empty():
            phone.events.get_nowait()
        desk.send_presence(pshow="away")
        desk.send_presence(pshow="xa")
        desk.send_message(mto=phone.boundjid.full, mbody="wake up", mtype="chat")
        shows = []
        while True:
            kind, stanza = await phone.next({"presence", "message"}, "the phone wakes up")
            if kind == "message":
                result["csi_message"] = stanza["body"]
                break
            if stanza["from"].bare == desk.boundjid.bare:
                shows.append(stanza["show"])
        result["csi_shows_before_message"] = ",".join(shows)
        phone["xep_0352"].send_active()

        # 3. Offline message, delivered with a XEP-0203 delay.
        desk.send_message(mto=f"{carol}@{domain}", mbody="while you were out", mtype="chat")
        await desk["xep_0199"].ping(jid=domain, timeout=TIMEOUT)
        laptop = peer(f"{carol}@{domain}/laptop")
        await online(laptop)
        _, got = await laptop.next({"message"}, "carol gets the kept message")
        result["offline_body"] = got["body"]
        result["offline_delay_from"] = str(got["delay"]["from"])
        result["offline_delay_stamped"] = got["delay"]["stamp"] is not None
        result["alice"] = alice_bare
    except Exception as exc:
        result = {"error": repr(exc)}
    return await finish(peers, result)


if __name__ == "__main__":
    run(scenario, 9)
