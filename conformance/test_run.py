"""Offline tests of the runner's step parsing and stanza matching (no server needed).

Run: python3 -m pytest conformance/test_run.py   (or: python3 conformance/test_run.py)
"""

import glob
import os
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import yaml  # noqa: E402

import gen_appendix_a  # noqa: E402
import run  # noqa: E402


class FakeClient:
    bare = "alice@d.example"


def el(xml: str) -> ET.Element:
    return ET.fromstring(xml.replace("<presence", "<presence xmlns='jabber:client'", 1).replace(
        "<iq", "<iq xmlns='jabber:client'", 1))


def test_bare_from_pattern_rejects_full_jid_sender():
    p = run.parse_pattern("presence type=subscribe from=bob@d.example")
    assert p.matches(el("<presence type='subscribe' from='bob@d.example'/>"), FakeClient())
    assert not p.matches(el("<presence type='subscribe' from='bob@d.example/desk'/>"), FakeClient())


def test_wildcard_from_pattern_needs_a_resource():
    p = run.parse_pattern("presence from=bob@d.example/*")
    assert p.matches(el("<presence from='bob@d.example/desk'/>"), FakeClient())
    assert not p.matches(el("<presence from='bob@d.example'/>"), FakeClient())
    assert not p.matches(el("<presence from='bobby@d.example/desk'/>"), FakeClient())


def test_available_means_no_type_attribute():
    p = run.parse_pattern("presence type=available")
    assert p.matches(el("<presence/>"), FakeClient())
    assert not p.matches(el("<presence type='unavailable'/>"), FakeClient())


def test_quoted_status_with_spaces_matches_child_text():
    p = run.parse_pattern('presence status="out for lunch" show=away')
    assert p.matches(el("<presence><show>away</show><status>out for lunch</status></presence>"), FakeClient())
    assert not p.matches(el("<presence><show>away</show><status>out</status></presence>"), FakeClient())


def test_roster_push_from_another_entity_is_not_a_push():
    p = run.parse_pattern("roster push for bob@d.example subscription=none ask=subscribe")
    item = "<query xmlns='jabber:iq:roster'><item jid='bob@d.example' ask='subscribe'/></query>"
    assert p.matches(el(f"<iq type='set' id='1'>{item}</iq>"), FakeClient())
    assert p.matches(el(f"<iq type='set' id='1' from='alice@d.example'>{item}</iq>"), FakeClient())
    assert not p.matches(el(f"<iq type='set' id='1' from='mallory@d.example'>{item}</iq>"), FakeClient())


def test_ask_none_requires_absent_attribute():
    p = run.parse_pattern("roster push for bob@d.example ask=none")
    with_ask = "<iq type='set'><query xmlns='jabber:iq:roster'><item jid='bob@d.example' ask='subscribe'/></query></iq>"
    assert not p.matches(el(with_ask), FakeClient())


def test_sends_step_keeps_xml_whitespace_but_normalises_the_rest():
    assert run.normalize_step("  bob/*   receives   presence  ") == "bob/* receives presence"
    step = run.normalize_step("a/p sends <presence><status>two  spaces</status></presence>")
    assert step.endswith("<status>two  spaces</status></presence>")


def test_every_scenario_step_parses():
    here = os.path.dirname(os.path.abspath(__file__))
    for f in glob.glob(os.path.join(here, "scenarios", "*.yaml")):
        doc = yaml.safe_load(open(f))
        for sc in doc["scenarios"]:
            assert sc.get("name") and sc.get("rfc") and sc.get("actors"), f
            for raw in sc["steps"]:
                step = run.normalize_step(str(raw))
                assert any(rx.match(step) for _, rx in run.STEP_RES), f"{f}: {step}"
                m = run.STEP_RES[[k for k, _ in run.STEP_RES].index("receives")][1].match(step)
                if m and " receives " in step and not step.startswith("state "):
                    pat = m.group("pat").replace("nothing matching ", "")
                    run.parse_pattern(pat)  # raises on unknown kinds


def msg(xml: str) -> ET.Element:
    return ET.fromstring(xml.replace("<message", "<message xmlns='jabber:client'", 1))


BL = "urn:xmpp:blocking"


def test_child_items_and_item_inspect_the_named_payload():
    p = run.parse_pattern("iq type=result child={urn:xmpp:blocking}blocklist items=1 item=bob@d.example")
    one = el(f"<iq type='result'><blocklist xmlns='{BL}'><item jid='bob@d.example'/></blocklist></iq>")
    assert p.matches(one, FakeClient())
    assert not p.matches(el(f"<iq type='result'><blocklist xmlns='{BL}'/></iq>"), FakeClient())
    two = el(f"<iq type='result'><blocklist xmlns='{BL}'><item jid='bob@d.example'/><item jid='c@d.example'/></blocklist></iq>")
    assert not p.matches(two, FakeClient())
    other = el(f"<iq type='result'><blocklist xmlns='{BL}'><item jid='carol@d.example'/></blocklist></iq>")
    assert not p.matches(other, FakeClient())
    wrong_ns = el("<iq type='result'><blocklist xmlns='urn:other'><item jid='bob@d.example'/></blocklist></iq>")
    assert not p.matches(wrong_ns, FakeClient())


def test_empty_payload_matches_items_zero_only():
    p = run.parse_pattern("iq child={urn:xmpp:blocking}unblock items=0")
    assert p.matches(el(f"<iq type='set'><unblock xmlns='{BL}'/></iq>"), FakeClient())
    assert not p.matches(el(f"<iq type='set'><unblock xmlns='{BL}'><item jid='b@d.example'/></unblock></iq>"), FakeClient())


def test_item_condition_without_child_is_a_scenario_error():
    p = run.parse_pattern("iq item=bob@d.example")
    try:
        p.matches(el("<iq type='result'/>"), FakeClient())
    except run.ScenarioError:
        return
    raise AssertionError("item= without child= must be rejected")


def test_attribute_conditions_compare_integers():
    last = "<iq type='result'><query xmlns='jabber:iq:last' seconds='{}'/></iq>"
    zero = run.parse_pattern("iq child={jabber:iq:last}query @seconds=0")
    assert zero.matches(el(last.format(0)), FakeClient())
    assert not zero.matches(el(last.format(4)), FakeClient())
    at_least = run.parse_pattern("iq child={jabber:iq:last}query @seconds>=2")
    assert at_least.matches(el(last.format(2)), FakeClient())
    assert not at_least.matches(el(last.format(1)), FakeClient())
    assert not at_least.matches(el(last.format("soon")), FakeClient())
    absent = run.parse_pattern("iq child={jabber:iq:last}query @seconds=none")
    assert absent.matches(el("<iq type='result'><query xmlns='jabber:iq:last'/></iq>"), FakeClient())
    assert not absent.matches(el(last.format(0)), FakeClient())


def test_app_error_needs_the_application_condition_inside_error():
    p = run.parse_pattern("message type=error error=not-acceptable app-error={urn:xmpp:blocking:errors}blocked")
    stanzas = "urn:ietf:params:xml:ns:xmpp-stanzas"
    with_app = (f"<message type='error'><error type='cancel'><not-acceptable xmlns='{stanzas}'/>"
                "<blocked xmlns='urn:xmpp:blocking:errors'/></error></message>")
    without = f"<message type='error'><error type='cancel'><not-acceptable xmlns='{stanzas}'/></error></message>"
    assert p.matches(msg(with_app), FakeClient())
    assert not p.matches(msg(without), FakeClient())


def test_from_self_means_no_from_or_the_own_bare_jid():
    p = run.parse_pattern("iq type=set from=self child={urn:xmpp:blocking}block")
    body = f"<block xmlns='{BL}'><item jid='b@d.example'/></block>"
    assert p.matches(el(f"<iq type='set'>{body}</iq>"), FakeClient())
    assert p.matches(el(f"<iq type='set' from='alice@d.example'>{body}</iq>"), FakeClient())
    assert not p.matches(el(f"<iq type='set' from='alice@d.example/pc'>{body}</iq>"), FakeClient())
    assert not p.matches(el(f"<iq type='set' from='mallory@d.example'>{body}</iq>"), FakeClient())


def test_block_push_is_acknowledged_only_from_the_own_account():
    body = f"<block xmlns='{BL}'><item jid='b@d.example'/></block>"
    assert run.is_block_push(el(f"<iq type='set' id='p'>{body}</iq>"), "alice@d.example")
    assert not run.is_block_push(el(f"<iq type='set' id='p' from='m@d.example'>{body}</iq>"), "alice@d.example")
    assert not run.is_block_push(el(f"<iq type='result' id='p'>{body}</iq>"), "alice@d.example")


def test_feature_condition_reads_disco_feature_vars():
    disco = "http://jabber.org/protocol/disco#info"
    p = run.parse_pattern("iq type=result feature=jabber:iq:last")
    yes = el(f"<iq type='result'><query xmlns='{disco}'><feature var='jabber:iq:last'/></query></iq>")
    no = el(f"<iq type='result'><query xmlns='{disco}'><feature var='urn:xmpp:ping'/></query></iq>")
    assert p.matches(yes, FakeClient())
    assert not p.matches(no, FakeClient())


def test_last_activity_must_grow_by_the_measured_interval():
    assert run.last_activity_grew(3, 5, 2.0, 2.1)
    assert run.last_activity_grew(3, 4, 2.0, 2.1)  # truncation can lose one second
    assert not run.last_activity_grew(3, 3, 2.0, 2.1)  # frozen value
    assert not run.last_activity_grew(0, 0, 2.0, 2.1)  # "online" both times
    assert not run.last_activity_grew(3, 9, 2.0, 2.1)  # more time passed than was measured
    assert not run.last_activity_grew(-1, 1, 2.0, 2.1)


def test_namespaced_child_is_not_taken_for_a_template():
    class Opts:
        domain = "d.example"
    sc = run.Scenario({"name": "t", "actors": {"alice": ["pc"]}}, "f.yaml", "", 1, Opts(), "x")
    sc.accounts["alice"] = ("alice_x", "pw")
    assert sc.expand("child={urn:xmpp:blocking}block item={alice}") == "child={urn:xmpp:blocking}block item=alice_x@d.example"


def test_a_cluster_spreads_actors_and_their_resources_over_the_nodes():
    class Opts:
        domain = "d.example"
        ports = [1, 2]
    actors = {"alice": ["phone", "pc"], "bob": ["pc"], "carol": ["pc"]}
    sc = run.Scenario({"name": "t", "actors": actors}, "f.yaml", "", 1, Opts(), "x")
    assert [sc.port_of("alice", "phone"), sc.port_of("alice", "pc")] == [1, 2]
    assert [sc.port_of("bob", "pc"), sc.port_of("carol", "pc")] == [2, 1]
    Opts.ports = [7]
    assert {sc.port_of(a, r) for a, rs in actors.items() for r in rs} == {7}


# RFC 6121 Appendix A.3 (inbound) transcribed as literal tables, independent of the generator's
# flag arithmetic for A.2 (outbound): only states that change are listed.
INBOUND = {
    "subscribe": {"None": "None + Pending In", "None + Pending Out": "None + Pending Out+In",
                  "To": "To + Pending In"},
    "unsubscribe": {"None + Pending In": "None", "None + Pending Out+In": "None + Pending Out",
                    "To + Pending In": "To", "From": "None", "From + Pending Out": "None + Pending Out",
                    "Both": "To"},
    "subscribed": {"None + Pending Out": "To", "None + Pending Out+In": "To + Pending In",
                   "From + Pending Out": "Both"},
    "unsubscribed": {"None + Pending Out": "None", "None + Pending Out+In": "None + Pending In",
                     "To": "None", "To + Pending In": "None + Pending In", "From + Pending Out": "From",
                     "Both": "From"},
}


def test_outbound_transitions_agree_with_the_inbound_tables():
    g = gen_appendix_a
    for kind, table in INBOUND.items():
        for s in g.STATES:
            receiver_before = g.mirror(s)
            receiver_after = table.get(receiver_before, receiver_before)
            assert g.mirror(g.outbound(kind, s)) == receiver_after, (kind, s)
            # A.3: a stanza is delivered exactly when it changes the receiver's state
            assert g.delivered(kind, receiver_before) == (receiver_after != receiver_before), (kind, s)


def test_generated_files_are_up_to_date():
    here = os.path.dirname(os.path.abspath(__file__))
    for i, kind in enumerate(["subscribe", "unsubscribe", "subscribed", "unsubscribed"], 1):
        with open(os.path.join(here, "scenarios", f"rfc6121-A{i}-{kind}.yaml")) as fh:
            assert fh.read() == gen_appendix_a.dump(kind), f"re-run gen_appendix_a.py ({kind})"


if __name__ == "__main__":
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print("ok  ", name)
            except AssertionError as e:
                failed += 1
                print("FAIL", name, e)
    sys.exit(1 if failed else 0)
