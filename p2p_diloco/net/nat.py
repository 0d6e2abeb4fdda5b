"""Joining the swarm from behind a NAT with hivemind 1.1.12's p2pd: AutoNAT's verdict, relay reservations and a
relay's limits, and the start-up that chooses how this peer takes part (decisions: net/reachability.py, pure).

What p2pd does (measured in emulated home networks, tests/test_nat.py; source: learning-at-home/go-libp2p-daemon
v0.5.0.hivemind1 on go-libp2p v0.32.1):
  * AutoNAT asks connected peers with a public address to dial it back, 15 s after start; a NATed peer learns
    "private" then, a public one "public" (only from a peer with another public IP);
  * once "private", it reserves a slot at its trusted relays (static relays: at once) and announces
    ``/p2p-circuit`` addresses through them; every stream may use a relayed connection;
  * every p2pd also runs a relay, with go-libp2p's default limits (2 min and 128 KiB per relayed connection); the
    configured one (30 min, 4 GiB, 16 circuits per peer) replaces it when the node becomes public, and when
    reachability is forced public the two race at start-up (measured: 4 of 8 starts kept the 128 KiB relay).
    ``relay_limits`` asks a relay for the limits it grants (a circuit v2 RESERVE), which tells them apart;
  * hole punching (DCUtR) starts only once 4 different public IPs have observed this peer's address (go-libp2p's
    ActivationThresh), so it plays no part in small runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple, Optional

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import NetworkConfig
from p2p_diloco.net.dht import DHT, nat_status, start_dht
from p2p_diloco.net.reachability import Choice, Findings, RelayInfo, choose_mode, is_public_ip, relay_problem

logger = logging.getLogger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
STATUS_OK = 100
RENEW_TIMEOUT_S = 10.0  # for a reservation's renewal, which opens at most one connection to the relay
RELAY_WAIT_S = 10.0  # after AutoNAT's "private", a reservation at a static relay takes well under a second


# ---------------------------------------------------------------------------------------------- start-up
class Probe(NamedTuple):
    dht: DHT
    status: Optional[str] = None       # AutoNAT's verdict, None if none came (or none was asked for)
    relay: Optional[RelayInfo] = None  # our relay reservation, if one was made
    probed: bool = False               # the DHT was started as a client to probe: a public peer restarts it


def probe(cfg: NetworkConfig, log: logging.Logger = logger) -> Probe:
    """Start this peer's DHT node and find out what decides how it takes part: AutoNAT's verdict and a relay
    reservation (network.reachability, network.client_mode). ``auto`` waits up to ``network.reachability_timeout``
    for the verdict. The DHT can read the run's keys at once; :func:`decide` settles the mode once the payload is
    known."""
    relays = list(cfg.trusted_relays or cfg.initial_peers)
    known = findings(cfg, None, None, 0)
    if cfg.client_mode or cfg.reachability == "public" or (cfg.reachability == "auto" and not known.public_network):
        return Probe(start_dht(cfg, client_mode=cfg.client_mode))  # nothing to find out (AutoNAT needs public peers)
    forced = "private" if cfg.reachability == "private" else None
    dht = start_dht(cfg, client_mode=True, force_reachability=forced, relays=relays)
    status = None
    if forced is None:
        log.info(f"reachability: waiting for AutoNAT (peers dial this peer back; up to "
                 f"{cfg.reachability_timeout:.0f} s)")
        status = nat_status(dht, timeout=cfg.reachability_timeout)
    relay = find_relay(dht, timeout=RELAY_WAIT_S) if status != "public" and relays else None
    return Probe(dht, status, relay, probed=True)


def decide(cfg: NetworkConfig, found: Probe, payload_bytes: int) -> tuple[DHT, Choice, Optional[str]]:
    """How the peer takes part, from :func:`probe`'s findings and the run's payload. Returns the DHT (restarted as
    a DHT server when the peer turned out public, about a second), the choice, and, for unreachable peers, why their
    relay cannot serve (for the per-round explanation)."""
    dht = found.dht
    choice = choose_mode(findings(cfg, found.status, found.relay, payload_bytes))
    if choice.mode == "public" and found.probed:
        dht.shutdown()  # found dialable: serve the DHT too
        dht = start_dht(cfg, client_mode=False)
    return dht, choice, None if choice.mode != "client" else relay_problem(found.relay, payload_bytes)


def findings(cfg: NetworkConfig, status, relay, payload_bytes: int) -> Findings:
    """What ``choose_mode`` decides on, from the config and what was found."""
    return Findings(setting=cfg.reachability, client_mode=cfg.client_mode, nat_status=status,
                    public_address=_any_public([*cfg.announce_maddrs, *cfg.host_maddrs]),
                    public_network=_any_public(cfg.initial_peers), relay=relay, payload_bytes=payload_bytes)


def _any_public(maddrs) -> bool:
    """True if one of these multiaddrs has a public IP or a DNS name (libp2p counts names as public)."""
    return any(m.startswith(("/dns", "/dnsaddr")) or (m.startswith(("/ip4/", "/ip6/")) and m.count("/") >= 2
                                                       and is_public_ip(m.split("/")[2])) for m in maddrs)


# ---------------------------------------------------------------------------------------------- relays
def circuit_maddrs(dht: hivemind.DHT) -> list[str]:
    """This node's addresses through relays (``.../p2p/RELAY/p2p-circuit/p2p/US``), freshly asked of p2pd."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True) if "/p2p-circuit" in str(m)]


def find_relay(dht: hivemind.DHT, timeout: float) -> Optional[RelayInfo]:
    """Wait up to ``timeout`` s for a relay reservation; return it with the limits that relay grants, or None."""
    deadline = time.monotonic() + timeout
    while True:
        circuits = circuit_maddrs(dht)
        if circuits or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # p2pd announces no event for new addresses: ask again
    for maddr in circuits:
        relay_maddr = maddr.split("/p2p-circuit")[0]
        limits = relay_limits(dht, relay_maddr.rsplit("/p2p/", 1)[1])
        if limits is not None:
            return RelayInfo(relay_maddr, *limits)
    return None


def relay_limits(dht: hivemind.DHT, relay_peer_id: str, timeout: float = 10.0):
    """(duration s, data bytes) a relay grants per relayed connection (None: unlimited), asked with a circuit v2
    RESERVE from this node; None if it refused or did not answer."""
    return dht.run_coroutine(_RelayLimitsQuery(relay_peer_id, timeout))


def renew_reservation(dht: hivemind.DHT, relay: RelayInfo):
    """Renew our reservation at ``relay`` in the background; returns the future of its limits (None: refused or
    unanswered). A relay serves a reserved peer through its live connection to it, and p2pd's autorelay, once a
    reservation failed, backs off from that relay for an hour: a home router that dropped its link for seconds left
    a relayed peer unreachable for the rest of a CI run. A RESERVE of our own dials the relay afresh if the old
    connection died (one stream; the relay renews a reservation it holds)."""
    return dht.run_coroutine(_RelayLimitsQuery(relay.relay.rsplit("/p2p/", 1)[-1], RENEW_TIMEOUT_S),
                             return_future=True)


class _RelayLimitsQuery:
    """Runs in the DHT's process, on its p2pd (picklable, unlike a closure)."""

    def __init__(self, relay_peer_id: str, timeout: float):
        self.relay_peer_id, self.timeout = relay_peer_id, timeout

    async def __call__(self, _dht, node):
        try:
            return await asyncio.wait_for(reserve(node.p2p, PeerID.from_base58(self.relay_peer_id)), self.timeout)
        except Exception as e:
            logger.debug(f"RESERVE at {self.relay_peer_id} failed: {e!r}")
            return None


async def reserve(p2p: P2P, relay: PeerID):
    """Send a circuit v2 RESERVE to ``relay``; return its (duration s, data bytes) limits, or None if refused."""
    _, reader, writer = await p2p.call_binary_stream_handler(relay, HOP_PROTOCOL)
    try:
        writer.write(encode_reserve())
        await writer.drain()
        length = await _read_uvarint(reader)
        status, duration, data = parse_hop_message(await reader.readexactly(length))
    finally:
        writer.close()
    return (duration, data) if status == STATUS_OK else None


def encode_reserve() -> bytes:
    """A length-delimited HopMessage{type: RESERVE} (circuit v2; RESERVE is 0, sent explicitly: proto3 optional)."""
    body = bytes([0x08, 0x00])
    return _uvarint(len(body)) + body


def parse_hop_message(body: bytes) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """(status, limit.duration, limit.data) of a HopMessage; absent fields are None."""
    fields = dict(_fields(body))
    limit = dict(_fields(fields[4])) if 4 in fields else {}
    return fields.get(5), limit.get(1), limit.get(2)


def _fields(buf: bytes):
    """(field number, value) of a protobuf message: varints as int, length-delimited fields as bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _decode_uvarint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _decode_uvarint(buf, pos)
        elif wire == 2:
            length, pos = _decode_uvarint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _decode_uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


async def _read_uvarint(reader: asyncio.StreamReader) -> int:
    value = shift = 0
    while True:
        byte = (await reader.readexactly(1))[0]
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value


# ---------------------------------------------------------------------------------------------- our own relay
def own_relay_limits(dht: hivemind.DHT, timeout: float = 20.0):
    """The limits this node's relay grants, asked by a throwaway p2pd (a relay cannot reserve at itself)."""
    return dht.run_coroutine(_OwnRelayQuery(timeout))


class _OwnRelayQuery:
    def __init__(self, timeout: float):
        self.timeout = timeout

    async def __call__(self, _dht, node):
        visible = [str(m).split("/p2p/")[0] for m in await node.get_visible_maddrs(latest=True)]
        # its own port on loopback too: announced public addresses may not loop back (cloud NAT)
        local = [f"/ip4/127.0.0.1/tcp/{m.split('/tcp/')[1].split('/')[0]}" for m in visible if "/tcp/" in m]
        helper = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client", auto_nat=False)
        try:
            addresses = [Multiaddr(m) for m in dict.fromkeys(local + visible)]
            await asyncio.wait_for(helper._client.connect(node.peer_id, addresses), self.timeout)
            return await asyncio.wait_for(reserve(helper, node.peer_id), self.timeout)
        except Exception as e:
            logger.warning(f"could not check this node's relay: {e!r}")
            return None
        finally:
            await helper.shutdown()
