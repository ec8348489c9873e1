#!/usr/bin/env python3
"""Write scenarios/rfc6121-A-*.yaml: every RFC 6121 Appendix A transition a client can cause.

Two local accounts, alice and bob. The state is alice's view of bob (Appendix A.1); bob's view
is its mirror. alice sends each of the four subscription stanzas from each of the nine states:
4 x 9 = 36 scenarios, which also covers bob-sends-X from every state of his (by symmetry).

Expectations come from the tables, not from any server:
  - A.2 (user's server, outbound): alice's new state;
  - A.3 (contact's server, inbound): whether bob gets the stanza, and bob's new state;
  - roster pushes (§3.1.2, §3.1.5, §3.1.6, §3.2.2, §3.2.3, §3.3.2, §3.3.3) whenever the roster item
    visibly changes, and none to bob when his server must ignore the stanza (§3.1.6, §3.2.3);
  - presence side effects: approval sends the approver's current presence (§3.1.5), unsubscribe
    makes the contact's server send unavailable (§3.3.3), cancellation sends unavailable (§3.2.2);
  - finally both rosters are read back (§2.1.3) and must show the new state.
Pre-approval (§3.4) changes what an unsolicited "subscribed" does on servers that support it; these
scenarios check only what holds either way (not routed to bob, no state change), and
rfc6121-3.4-preapproval.yaml covers pre-approval itself.

Run: python3 conformance/gen_appendix_a.py   (rewrites the four files)
"""

import os

STATES = [
    "None",
    "None + Pending Out",
    "None + Pending In",
    "None + Pending Out+In",
    "To",
    "To + Pending In",
    "From",
    "From + Pending Out",
    "Both",
]
FLAGS = {  # (to, from, pending_out, pending_in)
    "None": (0, 0, 0, 0),
    "None + Pending Out": (0, 0, 1, 0),
    "None + Pending In": (0, 0, 0, 1),
    "None + Pending Out+In": (0, 0, 1, 1),
    "To": (1, 0, 0, 0),
    "To + Pending In": (1, 0, 0, 1),
    "From": (0, 1, 0, 0),
    "From + Pending Out": (0, 1, 1, 0),
    "Both": (1, 1, 0, 0),
}
BY_FLAGS = {v: k for k, v in FLAGS.items()}


def mirror(s):
    to, fr, po, pi = FLAGS[s]
    return BY_FLAGS[(fr, to, pi, po)]


def outbound(kind, s):
    """Appendix A.2: the sender's state after sending `kind`."""
    to, fr, po, pi = FLAGS[s]
    if kind == "subscribe" and not to:
        po = 1
    elif kind == "unsubscribe":
        to, po = 0, 0
    elif kind == "subscribed" and pi:
        fr, pi = 1, 0
    elif kind == "unsubscribed":
        fr, pi = 0, 0
    return BY_FLAGS[(to, fr, po, pi)]


def delivered(kind, receiver_state):
    """Appendix A.3: does the receiver's server deliver `kind` to the receiver?"""
    to, fr, po, pi = FLAGS[receiver_state]
    return {
        "subscribe": not fr and not pi,  # A.3.1 (From/Both: auto-reply instead)
        "unsubscribe": bool(fr or pi),  # A.3.2
        "subscribed": bool(po),  # A.3.3
        "unsubscribed": bool(to or po),  # A.3.4
    }[kind]


def view(s):
    to, fr, po, _ = FLAGS[s]
    sub = {(0, 0): "none", (1, 0): "to", (0, 1): "from", (1, 1): "both"}[(to, fr)]
    return sub, ("subscribe" if po else "none")


SECTION = {
    "subscribe": ("A.2.1/A.3.1", "§3.1", "request a subscription"),
    "unsubscribe": ("A.2.2/A.3.2", "§3.3", "unsubscribe"),
    "subscribed": ("A.2.3/A.3.3", "§3.1.5", "approve"),
    "unsubscribed": ("A.2.4/A.3.4", "§3.2", "deny or cancel"),
}


def scenario(kind, s):
    new = outbound(kind, s)
    b_old, b_new = mirror(s), mirror(new)
    deliver = delivered(kind, b_old)
    appx, sec, verb = SECTION[kind]
    steps = [
        "login alice/phone",
        "login bob/desktop",
        f'state alice/phone bob/desktop "{s}"',
        f"alice/phone sends <presence to='{{bob}}' type='{kind}'/>",
        "alice/phone syncs",  # the server has processed the stanza before any quiet window starts
    ]
    if deliver:
        steps.append(f"bob/desktop receives presence type={kind} from={{alice}}")
    else:
        steps.append(f"bob/desktop receives nothing matching presence type={kind} from={{alice}}")
    # When alice already has a subscription (To/Both), bob's server auto-replies "subscribed"
    # (§3.1.3), but alice's server then has no pending-out and, by A.3.3, does not deliver it:
    # the client sees nothing either way, so nothing is asserted about that reply.
    if view(new) != view(s):
        sub, ask = view(new)
        steps.append(f"alice/phone receives roster push for {{bob}} subscription={sub} ask={ask}")
    if view(b_new) != view(b_old):
        sub, ask = view(b_new)
        steps.append(f"bob/desktop receives roster push for {{alice}} subscription={sub} ask={ask}")
    elif kind in ("subscribed", "unsubscribed") and not deliver:
        # §3.1.6 / §3.2.3: an inbound stanza the server must ignore changes nothing, pushes nothing.
        steps.append("bob/desktop receives nothing matching roster push for {alice}")
    if kind == "subscribed" and FLAGS[s][3]:
        steps.append("bob/desktop receives presence type=available from={alice/phone}")  # §3.1.5
    if kind == "unsubscribe" and FLAGS[s][0]:
        steps.append("alice/phone receives presence type=unavailable from={bob/desktop}")  # §3.3.3
    if kind == "unsubscribed" and FLAGS[s][1]:
        steps.append("bob/desktop receives presence type=unavailable from={alice/phone}")  # §3.2.2
    sub, ask = view(new)
    steps.append(f"alice/phone roster shows {{bob}} subscription={sub} ask={ask}")
    sub, ask = view(b_new)
    steps.append(f"bob/desktop roster shows {{alice}} subscription={sub} ask={ask}")
    name = f"A {kind} from {s} -> {new}"
    return {
        "name": name,
        "rfc": f"RFC 6121 {appx}, {sec}",
        "steps": steps,
    }


def dump(kind):
    appx, sec, verb = SECTION[kind]
    out = [
        "# Generated by conformance/gen_appendix_a.py from the RFC 6121 Appendix A tables; edit the generator.",
        f'rfc: "RFC 6121 {appx}"',
        f'title: "alice sends {kind} ({verb}) to bob from each of the nine subscription states"',
        "scenarios:",
    ]
    for s in STATES:
        sc = scenario(kind, s)
        out.append(f'  - name: "{sc["name"]}"')
        out.append(f'    rfc: "{sc["rfc"]}"')
        out.append("    actors: {alice: [phone], bob: [desktop]}")
        out.append("    steps:")
        for st in sc["steps"]:
            q = '"' + st.replace("\\", "\\\\").replace('"', '\\"') + '"' if ('"' in st or ": " in st or st.startswith("{")) else st
            out.append(f"      - {q}")
    return "\n".join(out) + "\n"


def main():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")
    for i, kind in enumerate(["subscribe", "unsubscribe", "subscribed", "unsubscribed"], 1):
        path = os.path.join(here, f"rfc6121-A{i}-{kind}.yaml")
        with open(path, "w") as fh:
            fh.write(dump(kind))
        print(path)


if __name__ == "__main__":
    main()
