#!/usr/bin/env python3
"""Black-box XMPP presence conformance runner (RFC 6121).

Runs the scenario files in conformance/scenarios/ against any XMPP server reachable by
host/port, for a given domain, with accounts created per scenario by a shell command
(--register-cmd) or by XEP-0077 in-band registration (--ibr).

slixmpp is used only to open the stream (STARTTLS, SASL, resource binding). Once a session
is bound, every incoming <presence/>, <message/> and <iq/> is recorded in that client's inbox
and withheld from slixmpp, so the library never answers probes, approves subscriptions or
sends presence on its own: every stanza on the wire is one a scenario step asked for. The
only replies the runner sends by itself are the ones RFC 6120/6121 oblige any client to send:
an <iq type='result'/> for a roster push (RFC 6121 §2.1.6) and a service-unavailable error
for any other request addressed to the client (RFC 6120 §8.4).

See conformance/README.md for the scenario format.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import fnmatch
import glob
import json
import logging
import os
import re
import secrets
import shlex
import ssl
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

import yaml

try:
    import slixmpp
except ImportError:  # pragma: no cover - reported clearly instead of a traceback
    sys.exit("slixmpp is missing: pip install -r conformance/requirements.txt")

NS_CLIENT = "jabber:client"
NS_ROSTER = "jabber:iq:roster"
NS_STANZAS = "urn:ietf:params:xml:ns:xmpp-stanzas"
NS_STREAMS = "http://etherx.jabber.org/streams"
NS_BLOCKING = "urn:xmpp:blocking"
NS_DISCO_INFO = "http://jabber.org/protocol/disco#info"
NS_LAST = "jabber:iq:last"
HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger("conformance")


# --------------------------------------------------------------------------- outcomes


class StepFailed(Exception):
    """A step's expectation was not met; the scenario fails."""


class ScenarioSkipped(Exception):
    """The server lacks an optional feature the scenario needs; reported as skipped."""


class ScenarioError(Exception):
    """The scenario file itself is wrong (syntax, unknown actor)."""


# --------------------------------------------------------------------------- options


@dataclass
class Options:
    host: str
    ports: list[int]  # one c2s port per node of the server under test (one for a single node)
    domain: str
    tls_verify: bool
    ca_file: str | None
    register_cmd: str | None
    unregister_cmd: str | None
    ibr: bool
    timeout: float  # bound for positive expectations
    quiet: float  # window for negative expectations
    connect_timeout: float
    verbose: bool


# --------------------------------------------------------------------------- client


@dataclass
class Entry:
    """One stanza received after session start."""

    el: ET.Element
    at: float
    consumed: bool = False

    def text(self) -> str:
        return ET.tostring(self.el, encoding="unicode")


class Client:
    """One connected resource: a slixmpp stream plus an inbox of raw stanzas."""

    def __init__(self, label: str, bare: str, resource: str, password: str, opts: Options, port: int):
        self.label = label  # e.g. alice/phone
        self.port = port  # the node this resource connects to
        self.bare = bare
        self.password = password
        self.opts = opts
        self.inbox: list[Entry] = []
        self.features: list[ET.Element] = []
        self.full_jid: str | None = None
        self.connected = False
        self._waiters: list[asyncio.Future] = []
        self._started = False
        x = slixmpp.ClientXMPP(f"{bare}/{resource}", password)
        # Nothing automatic: no subscription handling, no keepalive, no direct TLS/plaintext.
        x.auto_authorize = None
        x.auto_subscribe = False
        x.whitespace_keepalive = False
        x.enable_plaintext = False
        x.enable_direct_tls = False
        x.enable_starttls = True
        configure_tls(x, opts)
        x.add_filter("in", self._filter_in)
        self.x = x

    # Every stanza passes here before slixmpp's own handlers see it.
    def _filter_in(self, stanza: Any) -> Any:
        el = stanza.xml
        local = el.tag.rsplit("}", 1)[-1]
        if el.tag == f"{{{NS_STREAMS}}}features":
            self.features.append(copy.deepcopy(el))
            return stanza
        if not self._started or local not in ("presence", "message", "iq"):
            return stanza
        self._record(copy.deepcopy(el))
        return None  # withheld from slixmpp: no automatic behaviour

    def _record(self, el: ET.Element) -> None:
        if self.opts.verbose:
            log.info("%s <- %s", self.label, ET.tostring(el, encoding="unicode"))
        self.inbox.append(Entry(el, time.monotonic()))
        local = el.tag.rsplit("}", 1)[-1]
        if local == "iq" and el.get("type") in ("get", "set"):
            self._answer_request(el)
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    def _answer_request(self, el: ET.Element) -> None:
        iq_id = el.get("id", "")
        frm = el.get("from")
        to_attr = f" to='{xml_escape(frm)}'" if frm else ""
        if is_roster_push(el, self.bare) or is_block_push(el, self.bare):
            # RFC 6121 §2.1.6: the client acknowledges a roster push with a result; a
            # XEP-0191 §3.3-§3.5 block/unblock push is an iq set from the account as well.
            self.send_raw(f"<iq type='result' id='{xml_escape(iq_id)}'{to_attr}/>")
        else:
            # RFC 6120 §8.4: a request the entity does not understand gets an error reply.
            self.send_raw(
                f"<iq type='error' id='{xml_escape(iq_id)}'{to_attr}><error type='cancel'>"
                f"<service-unavailable xmlns='{NS_STANZAS}'/></error></iq>"
            )

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def ok(_event: Any) -> None:
            self._started = True
            if not done.done():
                done.set_result(None)

        def bad(reason: Any) -> None:
            if not done.done():
                done.set_exception(StepFailed(f"connect {self.label}: {reason}"))

        self.x.add_event_handler("session_start", ok)
        self.x.add_event_handler("failed_all_auth", lambda e: bad("SASL authentication failed"))
        self.x.add_event_handler("connection_failed", lambda e: bad(f"connection failed: {e}"))
        self.x.add_event_handler("stream_error", lambda e: bad(f"stream error: {e}"))
        self.x.add_event_handler("disconnected", lambda e: bad(f"disconnected: {e}"))
        self.x.connect(self.opts.host, self.port)
        try:
            await asyncio.wait_for(done, self.opts.connect_timeout)
        except asyncio.TimeoutError:
            self.abort()
            raise StepFailed(f"connect {self.label}: no session within {self.opts.connect_timeout}s")
        except StepFailed:
            self.abort()
            raise
        self.full_jid = str(self.x.boundjid.full)
        self.connected = True

    def has_feature(self, ns: str) -> bool:
        """True if the last stream features offered a child element in namespace `ns`."""
        return any(child.tag.startswith(f"{{{ns}}}") for f in self.features for child in f)

    def send_raw(self, data: str) -> None:
        if self.opts.verbose:
            log.info("%s -> %s", self.label, data)
        self.x.send_raw(data)

    async def wait_change(self, timeout: float) -> None:
        f = asyncio.get_running_loop().create_future()
        self._waiters.append(f)
        try:
            await asyncio.wait_for(f, timeout)
        except asyncio.TimeoutError:
            pass

    async def disconnect(self) -> None:
        """Close the stream with </stream:stream> and wait for the server to close its side."""
        if not self.connected:
            return
        self.connected = False
        self._started = False
        try:
            await asyncio.wait_for(self.x.disconnect(wait=2.0), 3.0)
        except (asyncio.TimeoutError, Exception):
            self.x.abort()

    def abort(self) -> None:
        """Drop the TCP connection without closing the stream (a crash or network loss)."""
        self.connected = False
        self._started = False
        self.x.cancel_connection_attempt()
        self.x.abort()


def configure_tls(x: Any, opts: Options) -> None:
    if opts.ca_file:
        # Pin: trust exactly this certificate (or bundle); hostname is still checked.
        ctx = ssl.create_default_context(cafile=opts.ca_file)
        x.ssl_context = ctx
    elif not opts.tls_verify:
        x.ssl_context.check_hostname = False
        x.ssl_context.verify_mode = ssl.CERT_NONE


def xml_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace("'", "&apos;").replace('"', "&quot;")


def bare_of(jid: str | None) -> str | None:
    if jid is None:
        return None
    return jid.split("/", 1)[0]


def is_roster_push(el: ET.Element, own_bare: str) -> bool:
    """RFC 6121 §2.1.6: a push is an iq set with one roster item, from no one or the user's bare JID."""
    if el.tag != f"{{{NS_CLIENT}}}iq" or el.get("type") != "set":
        return False
    if el.find(f"{{{NS_ROSTER}}}query") is None:
        return False
    return from_own_account(el, own_bare)


def from_own_account(el: ET.Element, own_bare: str) -> bool:
    """RFC 6120 §8.1.2.1: the server speaks for the account with no `from` or the bare JID."""
    frm = el.get("from")
    return frm is None or frm.lower() == own_bare.lower()


def is_block_push(el: ET.Element, own_bare: str) -> bool:
    """XEP-0191 §3.3-§3.5: an iq set carrying <block/> or <unblock/>, from the user's account."""
    if el.tag != f"{{{NS_CLIENT}}}iq" or el.get("type") != "set":
        return False
    payload = next(iter(el), None)
    return payload is not None and payload.tag in (f"{{{NS_BLOCKING}}}block", f"{{{NS_BLOCKING}}}unblock") \
        and from_own_account(el, own_bare)


# --------------------------------------------------------------------------- matching

# `@NAME OP VALUE` conditions on the attributes of the `child=` payload.
ATTR_COND = re.compile(r"^@(?P<name>[A-Za-z_][\w.-]*)(?P<op>>=|<=|=|>|<)(?P<value>.*)$")


def attr_holds(got: str | None, op: str, want: str) -> bool:
    """`=none` means absent; `=` compares text; <, <=, >, >= compare integers (a non-integer fails)."""
    if op == "=":
        return got is None if want == "none" else got == want
    try:
        g, w = int(got or ""), int(want)
    except ValueError:
        return False
    return {"<": g < w, "<=": g <= w, ">": g > w, ">=": g >= w}[op]


@dataclass
class Pattern:
    """What a `receives` step looks for; parsed from e.g. `presence type=subscribe from={alice}`."""

    kind: str  # presence | message | iq | roster-push
    conds: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return " ".join([self.kind] + [k + v if k.startswith("@") else f"{k}={v}" for k, v in self.conds.items()])

    def payload(self, el: ET.Element) -> ET.Element | None:
        """The direct child named by `child={ns}local`, which items=/item=/@attr conditions inspect."""
        want = self.conds.get("child")
        return next((c for c in el if c.tag == want), None) if want else None

    def matches(self, el: ET.Element, client: Client) -> bool:
        local = el.tag.rsplit("}", 1)[-1]
        if self.kind == "roster-push":
            if not is_roster_push(el, client.bare):
                return False
            items = el.findall(f"{{{NS_ROSTER}}}query/{{{NS_ROSTER}}}item")
            if len(items) != 1:
                return False
            item = items[0]
            for k, v in self.conds.items():
                if k == "jid":
                    if not jid_eq(item.get("jid"), v):
                        return False
                elif k == "subscription":
                    if (item.get("subscription") or "none") != v:
                        return False
                elif k in ("ask", "approved", "name"):
                    got = item.get(k)
                    if v == "none" and k != "name":
                        if got is not None:
                            return False
                    elif got != v:
                        return False
                else:
                    raise ScenarioError(f"unknown roster-push condition {k}")
            return True
        if local != self.kind:
            return False
        payload = self.payload(el)
        for k, v in self.conds.items():
            if k == "child":
                if payload is None:
                    return False
            elif k in ("items", "item") or k.startswith("@"):
                if payload is None:
                    raise ScenarioError(f"condition {k} needs child={{ns}}name before it")
                ns = payload.tag[1:].split("}", 1)[0] if payload.tag.startswith("{") else ""
                item_tag = f"{{{ns}}}item" if ns else "item"
                if k == "items":
                    if len(payload.findall(item_tag)) != int(v):
                        return False
                elif k == "item":
                    if not any(jid_eq(i.get("jid"), v) for i in payload.findall(item_tag)):
                        return False
                else:
                    name, op = k[1:].rstrip("<>="), k[1:][len(k[1:].rstrip("<>=")):]
                    if not attr_holds(payload.get(name), op, v):
                        return False
            elif k == "app-error":
                err = el.find(f"{{{NS_CLIENT}}}error")
                if err is None or err.find(v) is None:
                    return False
            elif k == "feature":
                # disco#info: <feature var='v'/> inside the payload (or anywhere below the stanza)
                if not any(f.get("var") == v for f in el.iter(f"{{{NS_DISCO_INFO}}}feature")):
                    return False
            elif k == "type":
                got = el.get("type")
                if v == "available" and self.kind == "presence":
                    if got is not None:
                        return False
                elif got != v:
                    return False
            elif k == "from" and v == "self":
                if not from_own_account(el, client.bare):
                    return False
            elif k in ("from", "to"):
                if not jid_match(el.get(k), v):
                    return False
            elif k == "id":
                if el.get("id") != v:
                    return False
            elif k in ("show", "status", "priority", "body"):
                child = el.find(f"{{{NS_CLIENT}}}{k}")
                got = child.text if child is not None else None
                if v == "none":
                    if got is not None:
                        return False
                elif (got or "").strip() != v:
                    return False
            elif k == "error":
                err = el.find(f"{{{NS_CLIENT}}}error")
                if err is None or err.find(f"{{{NS_STANZAS}}}{v}") is None:
                    return False
            else:
                raise ScenarioError(f"unknown condition {k}")
        return True


def jid_eq(a: str | None, b: str) -> bool:
    return a is not None and a.lower() == b.lower()


def jid_match(got: str | None, want: str) -> bool:
    """`x@d` matches exactly the bare JID; `x@d/*` any full JID of it; `none` an absent attribute."""
    if want == "none":
        return got is None
    if got is None:
        return False
    if want.endswith("/*"):
        return "/" in got and jid_eq(bare_of(got), want[:-2])
    return jid_eq(got, want)


def parse_pattern(text: str) -> Pattern:
    parts = shlex.split(text)
    if not parts:
        raise ScenarioError("empty pattern")
    kind = parts[0]
    if kind == "roster" and len(parts) > 1 and parts[1] == "push":
        kind, parts = "roster-push", ["roster-push"] + parts[2:]
    if kind not in ("presence", "message", "iq", "roster-push"):
        raise ScenarioError(f"unknown stanza kind {kind!r}")
    conds: dict[str, str] = {}
    rest = parts[1:]
    i = 0
    while i < len(rest):
        tok = rest[i]
        m = ATTR_COND.match(tok)
        if m:
            conds["@" + m.group("name") + m.group("op")] = m.group("value")
        elif "=" in tok:
            k, v = tok.split("=", 1)
            conds[k] = v
        elif tok in ("from", "for", "to", "type") and i + 1 < len(rest):
            # readable forms: `from {alice}`, `for {bob}` (roster push), `type subscribe`
            key = {"for": "jid"}.get(tok, tok)
            conds[key] = rest[i + 1]
            i += 1
        else:
            raise ScenarioError(f"cannot read condition {tok!r} in {text!r}")
        i += 1
    return Pattern(kind, conds)


# --------------------------------------------------------------------------- scenario run


SUB_STATES = {
    # RFC 6121 Appendix A.1 states, from the first-named party's ("user's") point of view,
    # with the sequence of primitive exchanges that reaches each from "None".
    "None": [],
    "None + Pending Out": ["u_sub"],
    "None + Pending In": ["c_sub"],
    "None + Pending Out+In": ["u_sub", "c_sub"],
    "To": ["u_sub", "c_ok"],
    "To + Pending In": ["u_sub", "c_ok", "c_sub"],
    "From": ["c_sub", "u_ok"],
    "From + Pending Out": ["c_sub", "u_ok", "u_sub"],
    "Both": ["u_sub", "c_ok", "c_sub", "u_ok"],
}

# What the user's roster item for the contact shows in each state: (subscription, ask).
# Pending In is not visible in the roster (RFC 6121 §3.1.3), so it maps to the same item.
ROSTER_VIEW = {
    "None": ("none", None),
    "None + Pending Out": ("none", "subscribe"),
    "None + Pending In": ("none", None),
    "None + Pending Out+In": ("none", "subscribe"),
    "To": ("to", None),
    "To + Pending In": ("to", None),
    "From": ("from", None),
    "From + Pending Out": ("from", "subscribe"),
    "Both": ("both", None),
}
MIRROR = {
    "None": "None",
    "None + Pending Out": "None + Pending In",
    "None + Pending In": "None + Pending Out",
    "None + Pending Out+In": "None + Pending Out+In",
    "To": "From",
    "To + Pending In": "From + Pending Out",
    "From": "To",
    "From + Pending Out": "To + Pending In",
    "Both": "Both",
}

STEP_RES = [
    ("connect", re.compile(r"^connect (?P<who>\S+)$")),
    ("login", re.compile(r"^login (?P<who>\S+)$")),
    ("requests_roster", re.compile(r"^(?P<who>\S+) requests roster$")),
    ("syncs", re.compile(r"^(?P<who>\S+) syncs$")),
    ("sends", re.compile(r"^(?P<who>\S+) sends (?P<xml><.*>)$", re.S)),
    ("disconnects", re.compile(r"^(?P<who>\S+) disconnects$")),
    ("drops", re.compile(r"^(?P<who>\S+) drops$")),
    (
        "nothing",
        re.compile(r"^(?P<who>\S+) receives nothing matching (?P<pat>.+?)(?: within (?P<t>[\d.]+)s)?$"),
    ),
    ("receives", re.compile(r"^(?P<who>\S+) receives (?P<pat>.+?)(?: within (?P<t>[\d.]+)s)?$")),
    ("roster_has", re.compile(r"^(?P<who>\S+) roster has (?P<jid>\S+)(?P<conds>(?: \S+=\S+)*)$")),
    ("roster_shows", re.compile(r"^(?P<who>\S+) roster shows (?P<jid>\S+)(?P<conds>(?: \S+=\S+)*)$")),
    ("roster_lacks", re.compile(r"^(?P<who>\S+) roster lacks (?P<jid>\S+)$")),
    ("state", re.compile(r'^state (?P<u>\S+) (?P<c>\S+) "(?P<state>[^"]+)"$')),
    ("requires", re.compile(r"^(?P<who>\S+) requires feature (?P<ns>\S+)(?: \((?P<why>.*)\))?$")),
    (
        "requires_disco",
        re.compile(r"^(?P<who>\S+) requires disco feature (?P<ns>\S+)(?: \((?P<why>.*)\))?$"),
    ),
    (
        "last_grows",
        re.compile(r"^(?P<who>\S+) sees last activity of (?P<jid>\S+) grow over (?P<t>[\d.]+)s$"),
    ),
]


def normalize_step(raw: str) -> str:
    """Collapse whitespace in a step, except inside the XML of a `sends` step."""
    head, sep, tail = raw.strip().partition(" sends ")
    if sep and tail.lstrip().startswith("<"):
        return " ".join(head.split()) + sep + tail.strip()
    return " ".join(raw.split())


class Scenario:
    """One scenario: fresh accounts, clients, and the steps that drive and check them."""

    def __init__(self, spec: dict, file: str, file_rfc: str, index: int, opts: Options, run_id: str):
        self.spec = spec
        self.file = file
        self.name = spec.get("name") or f"{os.path.basename(file)}#{index}"
        self.rfc = str(spec.get("rfc") or file_rfc)
        self.opts = opts
        self.actors: dict[str, list[str]] = {k: list(v or []) for k, v in (spec.get("actors") or {}).items()}
        self.unregistered: list[str] = list(spec.get("unregistered") or [])
        self.accounts: dict[str, tuple[str, str]] = {}  # actor -> (user, password)
        self.clients: dict[str, Client] = {}  # "alice/phone" -> Client
        self.tag = f"{run_id}{index:03d}"
        self.step_no = 0

    # ---- templates

    def jid(self, actor: str) -> str:
        if actor in self.accounts:
            return f"{self.accounts[actor][0]}@{self.opts.domain}"
        if actor in self.unregistered:
            return f"{actor}_{self.tag}_nx@{self.opts.domain}"
        raise ScenarioError(f"unknown actor {actor!r}")

    def expand(self, text: str) -> str:
        def sub(m: re.Match) -> str:
            name = m.group(1)
            if name == "domain":
                return self.opts.domain
            if "/" in name:
                actor, res = name.split("/", 1)
                c = self.clients.get(name)
                if c is not None and c.full_jid:
                    return c.full_jid  # the server may have changed the resource (RFC 6120 §7.6)
                return f"{self.jid(actor)}/{res}"
            return self.jid(name)

        return re.sub(r"\{([A-Za-z0-9_]+(?:/[A-Za-z0-9_*-]+)?)\}", sub, text)

    def targets(self, who: str) -> list[Client]:
        if "/" in who and not who.endswith("/*"):
            c = self.clients.get(who)
            if c is None or not c.connected:
                raise ScenarioError(f"{who} is not connected")
            return [c]
        actor = who[:-2] if who.endswith("/*") else who
        got = [c for label, c in self.clients.items() if label.split("/")[0] == actor and c.connected]
        if not got:
            raise ScenarioError(f"{who}: no connected resource")
        return got

    def port_of(self, actor: str, res: str) -> int:
        """The node a resource connects to. With several nodes (a cluster), the i-th actor's
        j-th resource takes node (i + j) mod N: the first resources of neighbouring actors are
        on different nodes, and an actor's own resources are spread too."""
        ports = self.opts.ports
        i = list(self.actors).index(actor)
        j = self.actors[actor].index(res)
        return ports[(i + j) % len(ports)]

    # ---- lifecycle

    async def provision(self) -> None:
        for actor in self.actors:
            user = f"{actor}_{self.tag}".lower()
            password = secrets.token_hex(12)
            self.accounts[actor] = (user, password)
        await asyncio.gather(*(provision_account(u, p, self.opts) for u, p in self.accounts.values()))

    async def teardown(self) -> None:
        await asyncio.gather(*(c.disconnect() for c in self.clients.values()), return_exceptions=True)
        if self.opts.unregister_cmd:
            for user, _ in self.accounts.values():
                await shell(self.opts.unregister_cmd.format(user=user, domain=self.opts.domain, password=""))

    async def run(self) -> None:
        await self.provision()
        try:
            for raw in self.spec.get("steps") or []:
                self.step_no += 1
                step = normalize_step(str(raw))
                try:
                    await self.step(step)
                except StepFailed as e:
                    raise StepFailed(f"step {self.step_no} `{step}`: {e}") from None
        finally:
            await self.teardown()

    async def step(self, step: str) -> None:
        for kind, rx in STEP_RES:
            m = rx.match(step)
            if m:
                return await getattr(self, f"do_{kind}")(**m.groupdict())
        raise ScenarioError(f"cannot parse step: {step}")

    # ---- steps

    async def do_connect(self, who: str) -> None:
        if "/" not in who:
            raise ScenarioError("connect needs actor/resource")
        actor, res = who.split("/", 1)
        if actor not in self.accounts:
            raise ScenarioError(f"unknown actor {actor}")
        if res not in self.actors[actor]:
            raise ScenarioError(f"{who}: resource not declared in actors")
        old = self.clients.get(who)
        if old is not None and old.connected:
            raise ScenarioError(f"{who} already connected")
        user, password = self.accounts[actor]
        c = Client(who, f"{user}@{self.opts.domain}", res, password, self.opts, self.port_of(actor, res))
        self.clients[who] = c
        await c.connect()

    async def do_login(self, who: str) -> None:
        """What a typical client does (RFC 6121 §2.2, §4.2): connect, fetch roster, send initial presence."""
        await self.do_connect(who)
        await self.do_requests_roster(who)
        self.clients[who].send_raw("<presence/>")
        await self.do_syncs(who)

    async def do_syncs(self, who: str) -> None:
        """Barrier: an iq round trip, so the server has processed everything this resource sent.

        RFC 6120 §10.1 makes a server process one stream's stanzas in order; once the reply to a
        later request is back, earlier presence (e.g. initial presence) has taken effect.
        """
        for c in self.targets(who):
            await roster_get(c, self.opts.timeout)

    async def do_requests_roster(self, who: str) -> None:
        """Roster get; the resource becomes "interested" and receives roster pushes (RFC 6121 §2.1.6)."""
        for c in self.targets(who):
            await roster_get(c, self.opts.timeout)

    async def do_sends(self, who: str, xml: str) -> None:
        data = self.expand(xml)
        try:
            ET.fromstring(data)
        except ET.ParseError as e:
            raise ScenarioError(f"not well-formed XML in step: {data} ({e})")
        for c in self.targets(who):
            c.send_raw(data)

    async def do_disconnects(self, who: str) -> None:
        await asyncio.gather(*(c.disconnect() for c in self.targets(who)))

    async def do_drops(self, who: str) -> None:
        for c in self.targets(who):
            c.abort()

    async def do_receives(self, who: str, pat: str, t: str | None) -> None:
        pattern = parse_pattern(self.expand(pat))
        bound = float(t) if t else self.opts.timeout
        await asyncio.gather(*(expect(c, pattern, bound) for c in self.targets(who)))

    async def do_nothing(self, who: str, pat: str, t: str | None) -> None:
        pattern = parse_pattern(self.expand(pat))
        window = float(t) if t else self.opts.quiet
        await asyncio.gather(*(expect_nothing(c, pattern, window) for c in self.targets(who)))

    async def do_roster_shows(self, who: str, jid: str, conds: str) -> None:
        """Like `roster has`, but an absent item counts as subscription=none without ask."""
        await self.do_roster_has(who, jid, conds, absent_is_none=True)

    async def do_roster_has(self, who: str, jid: str, conds: str, absent_is_none: bool = False) -> None:
        want = dict(kv.split("=", 1) for kv in conds.split())
        for c in self.targets(who):
            items = await roster_get(c, self.opts.timeout)
            item = items.get(self.expand(jid).lower())
            if item is None and absent_is_none and want.get("subscription", "none") == "none" and want.get(
                "ask", "none"
            ) == "none" and want.get("approved", "none") == "none":
                continue
            if item is None:
                raise StepFailed(f"{c.label}: roster has no item for {self.expand(jid)}; roster={items}")
            for k, v in want.items():
                got = item.get(k)
                if k == "subscription":
                    got = got or "none"  # RFC 6121 §2.1.2.5: absent means "none"
                elif v == "none":
                    got = got or "none"  # ask=none / approved=none: attribute absent
                if got != v:
                    raise StepFailed(f"{c.label}: roster item {self.expand(jid)} has {k}={got}, want {v}")

    async def do_roster_lacks(self, who: str, jid: str) -> None:
        for c in self.targets(who):
            items = await roster_get(c, self.opts.timeout)
            if self.expand(jid).lower() in items:
                raise StepFailed(f"{c.label}: roster unexpectedly has {self.expand(jid)}: {items[self.expand(jid).lower()]}")

    async def do_requires(self, who: str, ns: str, why: str | None) -> None:
        c = self.targets(who)[0]
        if not c.has_feature(ns):
            raise ScenarioSkipped(f"server does not advertise stream feature {ns}" + (f" ({why})" if why else ""))

    async def do_requires_disco(self, who: str, ns: str, why: str | None) -> None:
        """Skip unless the server's disco#info (XEP-0030 §3.1, sent to the domain) lists feature `ns`."""
        c = self.targets(who)[0]
        res = await iq_round_trip(c, f"<iq type='get' to='{self.opts.domain}'><query xmlns='{NS_DISCO_INFO}'/></iq>",
                                  self.opts.timeout)
        if res.get("type") != "result" or not Pattern("iq", {"feature": ns}).matches(res, c):
            raise ScenarioSkipped(f"server disco#info does not list {ns}" + (f" ({why})" if why else ""))

    async def do_last_grows(self, who: str, jid: str, t: str) -> None:
        """XEP-0012 §3: two last-activity queries to a bare JID, `t` seconds apart (measured).

        The server evaluates the second query at least `t` s after the first (the second is sent
        `t` s after the first answer arrived), and at most as long after as the whole exchange
        took. With whole seconds rounded either way, the second 'seconds' value must exceed the
        first by at least t-1 and at most the measured span + 1.
        """
        c = self.targets(who)[0]
        wait = float(t)
        q = f"<iq type='get' to='{self.expand(jid)}'><query xmlns='{NS_LAST}'/></iq>"
        sent1 = time.monotonic()
        first = last_seconds(await iq_round_trip(c, q, self.opts.timeout), c)
        await asyncio.sleep(wait)  # the interval being measured, not a wait for the server
        second_el = await iq_round_trip(c, q, self.opts.timeout)
        span = time.monotonic() - sent1
        second = last_seconds(second_el, c)
        if not last_activity_grew(first, second, wait, span):
            raise StepFailed(
                f"{c.label}: last activity of {self.expand(jid)} went {first} -> {second} s "
                f"over {span:.1f} s (queries {wait} s apart); want a growth in [{wait - 1:g}, {span + 1:.1f}]"
            )

    async def do_state(self, u: str, c: str, state: str) -> None:
        """Drive user u and contact c (actor/resource, both available) into an Appendix A state."""
        if state not in SUB_STATES:
            raise ScenarioError(f"unknown subscription state {state!r}; one of {list(SUB_STATES)}")
        uc, cc = self.targets(u)[0], self.targets(c)[0]
        for prim in SUB_STATES[state]:
            a, b = (uc, cc) if prim.startswith("u_") else (cc, uc)
            a_jid, b_jid = a.bare, b.bare
            if prim.endswith("_sub"):
                a.send_raw(f"<presence to='{b_jid}' type='subscribe'/>")
                await asyncio.gather(
                    expect(a, Pattern("roster-push", {"jid": b_jid, "ask": "subscribe"}), self.opts.timeout),
                    expect(b, Pattern("presence", {"type": "subscribe", "from": a_jid}), self.opts.timeout),
                )
            else:  # approve b's pending request
                a.send_raw(f"<presence to='{b_jid}' type='subscribed'/>")
                await asyncio.gather(
                    expect(a, Pattern("roster-push", {"jid": b_jid}), self.opts.timeout),
                    expect(b, Pattern("presence", {"type": "subscribed", "from": a_jid}), self.opts.timeout),
                    expect(b, Pattern("roster-push", {"jid": a_jid}), self.opts.timeout),
                )
        # Verify both rosters show the state, then forget everything received so far.
        for client, other, st in ((uc, cc, state), (cc, uc, MIRROR[state])):
            items = await roster_get(client, self.opts.timeout)
            sub, ask = ROSTER_VIEW[st]
            item = items.get(other.bare.lower())
            got = ((item.get("subscription") or "none"), item.get("ask")) if item else ("none", None)
            if got != (sub, ask):
                raise StepFailed(f"setup of {state!r}: {client.label} roster shows {got} for {other.bare}, want {(sub, ask)}")
        for client in self.clients.values():
            for e in client.inbox:
                e.consumed = True


async def expect(c: Client, pattern: Pattern, bound: float) -> Entry:
    """Pass as soon as an unconsumed stanza matches; fail after `bound` seconds."""
    deadline = time.monotonic() + bound
    while True:
        for e in c.inbox:
            if not e.consumed and pattern.matches(e.el, c):
                e.consumed = True
                return e
        left = deadline - time.monotonic()
        if left <= 0:
            recent = [e.text() for e in c.inbox if not e.consumed][-6:]
            raise StepFailed(
                f"{c.label} did not receive {pattern.describe()} within {bound}s; unconsumed: {recent or 'none'}"
            )
        await c.wait_change(left)


async def expect_nothing(c: Client, pattern: Pattern, window: float) -> None:
    """Fail as soon as a matching stanza arrives (or is already waiting) within the quiet window."""
    deadline = time.monotonic() + window
    while True:
        for e in c.inbox:
            if not e.consumed and pattern.matches(e.el, c):
                raise StepFailed(f"{c.label} received {e.text()} (expected nothing matching {pattern.describe()})")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await c.wait_change(left)


_iq_counter = 0


async def iq_round_trip(c: Client, xml_with_no_id: str, bound: float) -> ET.Element:
    """Send an iq (the runner adds a unique id) and return the reply with that id."""
    global _iq_counter
    _iq_counter += 1
    iq_id = f"rt{_iq_counter}"
    c.send_raw(xml_with_no_id.replace("<iq ", f"<iq id='{iq_id}' ", 1))
    return (await expect(c, Pattern("iq", {"id": iq_id}), bound)).el


def last_activity_grew(first: int, second: int, wait: float, span: float) -> bool:
    """Two 'seconds' values asked `wait` s apart within a measured `span`: sane and grown.

    Whole seconds, truncated or rounded by the server, lose at most one second each way.
    """
    return first >= 0 and wait - 1 <= second - first <= span + 1


def last_seconds(el: ET.Element, c: Client) -> int:
    """The 'seconds' of a XEP-0012 result (§2: REQUIRED); anything else fails the step."""
    q = el.find(f"{{{NS_LAST}}}query")
    if el.get("type") != "result" or q is None:
        raise StepFailed(f"{c.label}: last activity query was not answered with a result: {ET.tostring(el, encoding='unicode')}")
    try:
        return int(q.get("seconds", ""))
    except ValueError:
        raise StepFailed(f"{c.label}: last activity result without integer seconds: {ET.tostring(el, encoding='unicode')}")


async def roster_get(c: Client, bound: float) -> dict[str, dict]:
    """RFC 6121 §2.1.3 roster get; returns {bare jid lowercased: item attributes}."""
    global _iq_counter
    _iq_counter += 1
    iq_id = f"rg{_iq_counter}"
    c.send_raw(f"<iq type='get' id='{iq_id}'><query xmlns='{NS_ROSTER}'/></iq>")
    e = await expect(c, Pattern("iq", {"id": iq_id}), bound)
    if e.el.get("type") != "result":
        raise StepFailed(f"{c.label}: roster get failed: {e.text()}")
    items = {}
    for item in e.el.findall(f"{{{NS_ROSTER}}}query/{{{NS_ROSTER}}}item"):
        items[(item.get("jid") or "").lower()] = dict(item.attrib)
    return items


# --------------------------------------------------------------------------- provisioning


async def shell(cmd: str) -> None:
    proc = await asyncio.create_subprocess_shell(
        cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise StepFailed(f"provisioning command failed ({proc.returncode}): {cmd}: {out.decode(errors='replace')}")


async def provision_account(user: str, password: str, opts: Options) -> None:
    if opts.register_cmd:
        await shell(opts.register_cmd.format(user=user, domain=opts.domain, password=password))
    elif opts.ibr:
        await register_ibr(user, password, opts)
    else:
        raise ScenarioError("no provisioning: pass --register-cmd or --ibr")


async def register_ibr(user: str, password: str, opts: Options) -> None:
    """XEP-0077 in-band registration on a fresh stream, then close it."""
    x = slixmpp.ClientXMPP(f"{user}@{opts.domain}/ibr", password)
    x.enable_plaintext = False
    x.enable_direct_tls = False
    configure_tls(x, opts)
    x.register_plugin("xep_0030")
    x.register_plugin("xep_0004")
    x.register_plugin("xep_0077")
    x["xep_0077"].force_registration = True
    done: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_register(_form: Any) -> None:
        iq = x.Iq()
        iq["type"] = "set"
        iq["register"]["username"] = user
        iq["register"]["password"] = password
        try:
            await iq.send(timeout=opts.timeout)
        except Exception as e:  # IqError / IqTimeout
            if not done.done():
                done.set_exception(StepFailed(f"in-band registration of {user} failed: {e}"))

    x.add_event_handler("register", on_register)
    x.add_event_handler("session_start", lambda e: done.done() or done.set_result(None))
    x.add_event_handler("failed_all_auth", lambda e: done.done() or done.set_exception(StepFailed("IBR: auth failed")))
    x.connect(opts.host, opts.ports[0])
    try:
        await asyncio.wait_for(done, opts.connect_timeout)
    finally:
        try:
            await asyncio.wait_for(x.disconnect(wait=1.0), 2.0)
        except Exception:
            x.abort()


# --------------------------------------------------------------------------- driver


def load_scenarios(pattern: str, opts: Options, run_id: str) -> list[Scenario]:
    files = sorted(glob.glob(os.path.join(HERE, "scenarios", "*.yaml")))
    out: list[Scenario] = []
    n = 0
    for f in files:
        base = os.path.basename(f)
        with open(f) as fh:
            doc = yaml.safe_load(fh)
        specs = doc.get("scenarios") or [doc]
        for spec in specs:
            n += 1
            sc = Scenario(spec, f, doc.get("rfc", ""), n, opts, run_id)
            if fnmatch.fnmatch(base, pattern) or fnmatch.fnmatch(sc.name, pattern):
                out.append(sc)
    return out


async def run_all(scenarios: list[Scenario], jobs: int) -> list[dict]:
    sem = asyncio.Semaphore(jobs)
    results: list[dict] = []

    async def one(sc: Scenario) -> None:
        async with sem:
            t0 = time.monotonic()
            status, reason = "pass", ""
            try:
                await sc.run()
            except ScenarioSkipped as e:
                status, reason = "skip", str(e)
            except (StepFailed, ScenarioError) as e:
                status, reason = ("error" if isinstance(e, ScenarioError) else "fail"), str(e)
            except Exception as e:  # a runner bug must not hide other results
                status, reason = "error", f"{type(e).__name__}: {e}"
            r = {
                "file": os.path.relpath(sc.file, HERE),
                "scenario": sc.name,
                "rfc": sc.rfc,
                "status": status,
                "reason": reason,
                "seconds": round(time.monotonic() - t0, 2),
            }
            results.append(r)
            mark = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP", "error": "ERROR"}[status]
            print(f"{mark:5} {sc.name}  [{sc.rfc}]" + (f"\n      {reason}" if reason else ""), flush=True)

    await asyncio.gather(*(one(sc) for sc in scenarios))
    order = {id(sc): i for i, sc in enumerate(scenarios)}
    names = {sc.name: order[id(sc)] for sc in scenarios}
    results.sort(key=lambda r: names.get(r["scenario"], 0))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Black-box RFC 6121 presence conformance suite")
    p.add_argument("--host", default="127.0.0.1", help="server address to connect to")
    p.add_argument("--port", default="5222",
                   help="c2s port; a comma-separated list for a cluster, one port per node "
                        "(the scenario's actors and resources are spread over them)")
    p.add_argument("--domain", required=True, help="XMPP domain served (accounts are created in it)")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--tls-verify", dest="tls_verify", action="store_true", default=True,
                     help="verify the server certificate against the system CAs (default)")
    tls.add_argument("--no-tls-verify", dest="tls_verify", action="store_false",
                     help="accept any certificate (self-signed test servers)")
    tls.add_argument("--ca-file", help="pin: trust only this PEM certificate/bundle")
    prov = p.add_mutually_exclusive_group(required=True)
    prov.add_argument("--register-cmd", help="shell template creating an account: {user} {domain} {password}")
    prov.add_argument("--ibr", action="store_true", help="create accounts by XEP-0077 in-band registration")
    p.add_argument("--unregister-cmd", help="optional shell template deleting an account after its scenario")
    p.add_argument("--scenario", default="*", help="glob on scenario file name or scenario name")
    p.add_argument("--json", help="write results to this file")
    p.add_argument("--timeout", type=float, default=3.0, help="bound for positive expectations (s)")
    p.add_argument("--quiet", type=float, default=1.0, help="window for negative expectations (s)")
    p.add_argument("--connect-timeout", type=float, default=10.0)
    p.add_argument("--jobs", type=int, default=4, help="scenarios run concurrently")
    p.add_argument("--server-name", default="", help="label stored in the JSON results")
    p.add_argument("--strict", action="store_true",
                   help="count a skipped scenario as a failure (for a server expected to support all)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every stanza")
    a = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(message)s")
    if not a.verbose:
        logging.getLogger("slixmpp").setLevel(logging.CRITICAL)
    try:
        ports = [int(x) for x in str(a.port).split(",") if x.strip()]
    except ValueError:
        p.error(f"--port: not a port or list of ports: {a.port!r}")
    if not ports:
        p.error("--port: no port given")
    opts = Options(a.host, ports, a.domain, a.tls_verify, a.ca_file, a.register_cmd, a.unregister_cmd,
                   a.ibr, a.timeout, a.quiet, a.connect_timeout, a.verbose)
    run_id = secrets.token_hex(3)
    scenarios = load_scenarios(a.scenario, opts, run_id)
    if not scenarios:
        print(f"no scenario matches {a.scenario!r}")
        print("0 passed, 0 failed")
        return 2
    t0 = time.monotonic()
    results = asyncio.run(run_all(scenarios, max(1, a.jobs)))
    passed = sum(r["status"] == "pass" for r in results)
    failed = sum(r["status"] in ("fail", "error") for r in results)
    skipped = sum(r["status"] == "skip" for r in results)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"server": a.server_name, "host": a.host, "port": ports[0], "ports": ports, "domain": a.domain,
                       "seconds": round(time.monotonic() - t0, 1), "results": results}, fh, indent=2)
    if skipped and a.strict:
        # A skip is a feature the server did not show: for the server under development that
        # is a regression, not a pass.
        failed += skipped
        print(f"{skipped} skipped, counted as failed (--strict)")
    elif skipped:
        print(f"{skipped} skipped")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
