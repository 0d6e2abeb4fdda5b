"""Reachability without a swarm: the pure decision rule (net/reachability.py), the circuit v2 messages we exchange
with relays (net/nat.py, checked against protobuf itself), and the emulated internet (benchmarks/netlab.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from p2p_diloco.net.nat import encode_reserve, parse_hop_message
from p2p_diloco.net.reachability import (DEFAULT_RELAY_LIMIT, Findings, RelayInfo, choose_mode, explain_no_group,
                                         is_public_ip, relay_problem)
from p2p_diloco.ops.faults import parse_fault

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the lab is not installed
from netlab import Internet, unavailable_reason  # noqa: E402

MB = 1 << 20
BIG = RelayInfo("/ip4/192.0.0.100/tcp/31337/p2p/QmRelay", 1800, 4 << 30)
SMALL = RelayInfo("/ip4/192.0.0.100/tcp/31337/p2p/QmRelay", *DEFAULT_RELAY_LIMIT)


def findings(setting="auto", client_mode=False, nat=None, public_address=False, relay=None, payload=20 * MB,
             public_network=True):
    return Findings(setting, client_mode, nat, public_address, public_network, relay, payload)


@pytest.mark.parametrize("case, mode", [
    (findings(nat="public"), "public"),
    (findings(nat="private", relay=BIG), "relayed"),
    (findings(nat="private", relay=SMALL), "client"),       # 128 KiB per relayed connection: useless
    (findings(nat="private"), "client"),                    # no reservation
    (findings(nat=None, public_address=True), "public"),    # no verdict: trust a public address
    (findings(nat="unknown", relay=BIG), "relayed"),        # no verdict, private address: as if private
    (findings(setting="public", nat="private"), "public"),  # the operator knows better
    (findings(setting="private", relay=BIG), "relayed"),
    (findings(client_mode=True, nat="public", relay=BIG), "client"),
    (findings(public_network=False), "public"),             # a LAN or loopback swarm: AutoNAT cannot tell
])
def test_choose_mode(case, mode):
    choice = choose_mode(case)
    assert choice.mode == mode
    assert "\n" not in choice.reason and choice.reason


def test_a_relay_must_carry_two_rounds_of_payload():
    assert relay_problem(None, MB) == "no relay reservation"
    assert relay_problem(BIG, 1000 * MB) is None
    assert relay_problem(BIG, 3 << 30) is not None  # a 1.5B-parameter fp16 payload: reset within a round or two
    assert "128 KiB (2 min)" in relay_problem(SMALL, MB)
    assert relay_problem(SMALL, 50 << 10) is None  # a toy payload would pass even the small relay


def test_the_explanation_names_cause_and_fix_only_when_nobody_can_accept_connections():
    line = explain_no_group("client", ["client", "client"], "no relay reservation")
    assert line.startswith("no group can form: all 2 live peer(s) are behind NAT") and "\n" not in line
    assert "no relay reservation" in line and "forward a TCP port" in line and "run a relay" in line
    assert "add a peer with a public address" in line
    assert explain_no_group("client", ["client", "relayed"], None) is None
    assert explain_no_group("client", ["client", "unknown"], None) is None  # a peer of an older version
    assert explain_no_group("relayed", ["relayed", "relayed"], None) is None


def test_public_addresses_as_libp2p_sees_them():
    assert is_public_ip("8.8.8.8") and is_public_ip("192.0.0.100") and is_public_ip("2001:db8::1")
    for host in ("10.1.2.3", "192.168.1.2", "100.64.0.1", "127.0.0.1", "192.0.0.10", "203.0.113.5", "fe80::1",
                 "not-an-ip"):
        assert not is_public_ip(host), host


def _hop_classes():
    """HopMessage and Limit of libp2p's circuit v2 (circuit.proto), built with protobuf itself as a reference."""
    proto = descriptor_pb2.FileDescriptorProto(name="circuit_test.proto", package="circuit_test", syntax="proto2")
    limit = proto.message_type.add(name="Limit")
    limit.field.add(name="duration", number=1, type=13, label=1)  # uint32
    limit.field.add(name="data", number=2, type=4, label=1)       # uint64
    hop = proto.message_type.add(name="HopMessage")
    hop.field.add(name="type", number=1, type=5, label=1)          # the enum, as an int32 on the wire
    hop.field.add(name="limit", number=4, type=11, label=1, type_name=".circuit_test.Limit")
    hop.field.add(name="status", number=5, type=5, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    get = message_factory.GetMessageClass
    return get(pool.FindMessageTypeByName("circuit_test.HopMessage")), get(pool.FindMessageTypeByName("circuit_test.Limit"))


def test_circuit_v2_messages_match_protobuf():
    Hop, _ = _hop_classes()
    reserve = encode_reserve()
    assert reserve[0] == len(reserve) - 1
    request = Hop.FromString(reserve[1:])
    assert request.HasField("type") and request.type == 0  # RESERVE, present on the wire
    for duration, data in ((1800, 4 << 30), DEFAULT_RELAY_LIMIT):
        answer = Hop(type=2, status=100)
        answer.limit.duration, answer.limit.data = duration, data
        assert parse_hop_message(answer.SerializeToString()) == (100, duration, data)
    assert parse_hop_message(Hop(type=2, status=200).SerializeToString()) == (200, None, None)


def test_hold_fault_parses():
    fault = parse_fault("hold:allreduce:4", main_pid=1, hold_path="/tmp/x/hold")
    assert (fault.action, fault.phase, fault.round, fault.hold_path) == ("hold", "allreduce", 4, "/tmp/x/hold")


@pytest.mark.timeout(60)
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"emulated internet unavailable: {unavailable_reason()}")
def test_emulated_internet_nat_blocks_inbound_allows_outbound_and_is_removed():
    server = "import socket;s=socket.socket();s.bind(('0.0.0.0',5555));s.listen();s.settimeout(5);c,a=s.accept();print(a[0])"
    client = "import socket,sys;s=socket.socket();s.settimeout(2);s.connect((sys.argv[1],5555))"
    with Internet() as net:
        cloud, home = net.add_public("cloud"), net.add_home("home")
        net.shape("home", down_mbit=100, up_mbit=20)
        namespaces = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        assert {cloud.namespace, home.namespace, home.router} <= namespaces
        listening = subprocess.Popen([*cloud.exec_prefix, sys.executable, "-c", server], stdout=subprocess.PIPE,
                                     text=True)
        out = _run_until_ok([*home.exec_prefix, sys.executable, "-c", client, cloud.address])
        assert listening.communicate(timeout=10)[0].strip() == home.address  # seen as its router's address
        inbound = subprocess.Popen([*home.exec_prefix, sys.executable, "-c", server], stdout=subprocess.PIPE)
        out = subprocess.run([*cloud.exec_prefix, sys.executable, "-c", client, home.address], capture_output=True)
        assert out.returncode != 0  # no connection into a home
        inbound.kill()
        inbound.wait()
        qdiscs = subprocess.run(["ip", "netns", "exec", home.router, "tc", "qdisc"], capture_output=True, text=True)
        assert "rate 20Mbit" in qdiscs.stdout and "rate 100Mbit" in qdiscs.stdout
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"nl{net.tag}" not in left


def _run_until_ok(cmd: list[str]) -> subprocess.CompletedProcess:
    for _ in range(50):  # the server may not listen yet: it is another process
        out = subprocess.run(cmd, capture_output=True)
        if out.returncode == 0:
            return out
    raise AssertionError(out.stderr)


def test_a_relayed_peer_renews_its_reservation_after_a_failed_round_and_says_when_a_renewal_failed(monkeypatch):
    """Exchange._renew_relay: a renewal per failed attempt, of the relay the peer reserved at; one that came back
    refused is said the next time; a DHT that cannot take the request (its process died) raises nothing into the
    round loop; a peer that is not relayed renews nothing."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from p2p_diloco.net import nat
    from p2p_diloco.net.exchange import Exchange

    asked, outcomes = [], []

    def renew(dht, relay):
        asked.append(relay.relay)
        if dht == "dead":
            raise BrokenPipeError("the DHT's process is gone")
        future = Future()
        future.set_result(outcomes.pop(0))
        return future

    monkeypatch.setattr(nat, "renew_reservation", renew)
    said = []
    log = SimpleNamespace(warning=said.append, debug=lambda *_: None)
    relay = RelayInfo("/ip4/192.0.0.100/tcp/31337/p2p/12D3KooWRelay", 1800, 4 << 30)
    exchange = Exchange.__new__(Exchange)  # its relay bookkeeping alone
    exchange.peer, exchange._renewal = SimpleNamespace(relay=relay, dht="alive", log=log), None

    outcomes[:] = [None, (1800, 4 << 30), (1800, 4 << 30)]  # refused, then granted twice
    exchange._renew_relay()
    assert asked == [relay.relay] and not said
    exchange._renew_relay()  # the refusal before is said now
    assert len(asked) == 2 and len(said) == 1 and "could not be renewed" in said[0] and relay.relay in said[0]
    exchange._renew_relay()
    assert len(asked) == 3 and len(said) == 1

    exchange.peer.dht = "dead"
    exchange._renew_relay()  # raises nothing
    assert len(asked) == 4 and exchange._renewal is None

    exchange.peer.relay = None  # public or client mode
    exchange._renew_relay()
    assert len(asked) == 4
