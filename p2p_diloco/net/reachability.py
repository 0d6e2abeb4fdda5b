"""PURE decisions about reachability: how a peer takes part in the run, given what it found out about the network,
and why no group can form when none can. No network, no hivemind.

How a peer takes part (its ``mode``, published in the roster as ``reachability``):
  * ``public``  others can dial it: a full node (leads groups, reduces a share, serves state);
  * ``relayed`` others cannot dial it, but it holds a slot at a circuit relay (libp2p circuit v2) whose limits fit
    the run's payload: others reach it through the relay, so it is a full node too; peers it dials itself (public
    ones) it reaches directly, and only traffic between two unreachable peers crosses the relay;
  * ``client``  others cannot dial it and no usable relay: dial-out only (hivemind's client mode): it sends its
    pseudo-gradient and receives the average, reduces nothing, serves no state. A group needs at least one
    public or relayed peer.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional, Sequence

MODES = ("public", "relayed", "client")
SETTINGS = ("auto", "public", "private")
FIX = ("forward a TCP port to one peer and set its network.announce_maddrs, run a relay (p2p-diloco bootstrap on "
       "a public host, network.reachability=public) and list it in network.trusted_relays, or add a peer with a "
       "public address")
# hivemind 1.1.12's p2pd also runs go-libp2p's relay with its default limits; which relay serves is a start-up race
DEFAULT_RELAY_LIMIT = (120, 1 << 17)  # (seconds, bytes) per relayed connection


@dataclass(frozen=True)
class RelayInfo:
    """A reservation this peer holds at a relay, with the relay's limits per relayed connection."""
    relay: str                      # the relay's multiaddr (or peer id)
    duration_s: Optional[int]       # a relayed connection is reset after this long; None: no limit
    data_bytes: Optional[int]       # ... or after this many bytes in either direction; None: no limit


@dataclass(frozen=True)
class Findings:
    """What a peer knows when it decides how to take part."""
    setting: str                    # network.reachability: auto | public | private
    client_mode: bool               # network.client_mode: dial-out only, whatever was found
    nat_status: Optional[str]       # AutoNAT's verdict: public | private | unknown | None (no verdict in time)
    public_address: bool            # one of its listen or announced addresses is a public IP
    public_network: bool            # one of its initial peers has a public IP (else: a LAN, or a new swarm)
    relay: Optional[RelayInfo]      # its reservation at a relay, if it holds one
    payload_bytes: int              # bytes of one pseudo-gradient on the wire


@dataclass(frozen=True)
class Choice:
    mode: str                       # public | relayed | client
    reason: str                     # one line for the log: what was found, why this mode


def dialable(f: Findings) -> tuple[bool, str]:
    """Whether others can dial this peer, and how we know."""
    if f.setting == "public":
        return True, "network.reachability = public"
    if f.setting == "private":
        return False, "network.reachability = private"
    if not f.public_network:
        return True, "no initial peer has a public address: a private network (or a new swarm) where peers dial " \
                     "each other directly"
    if f.nat_status in ("public", "private"):
        return f.nat_status == "public", f"AutoNAT: peers {'dialed it back' if f.nat_status == 'public' else 'could not dial it back'}"
    guess = "it has a public address" if f.public_address else "it has no public address"
    return f.public_address, f"AutoNAT gave no verdict; {guess}"


def relay_problem(relay: Optional[RelayInfo], payload_bytes: int) -> Optional[str]:
    """Why ``relay`` cannot carry this run's all-reduce (None if it can). Between two relayed peers one relayed
    connection carries up to one payload each way per round; a relay that resets it sooner fails every round."""
    if relay is None:
        return "no relay reservation"
    if relay.data_bytes is not None and relay.data_bytes < 2 * payload_bytes:
        return (f"the relay {short_maddr(relay.relay)} resets a relayed connection after {_size(relay.data_bytes)} "
                f"({_duration(relay.duration_s)}), less than two rounds of this run's {_size(payload_bytes)} payload")
    return None


def choose_mode(f: Findings) -> Choice:
    """How to take part: public if others can dial us, else relayed if our relay can carry the payload, else
    client. ``network.client_mode = true`` always gives client."""
    if f.client_mode:
        return Choice("client", "network.client_mode = true: dial-out only")
    reachable, how = dialable(f)
    if reachable:
        return Choice("public", f"others can dial this peer ({how})")
    problem = relay_problem(f.relay, f.payload_bytes)
    if problem is None:
        return Choice("relayed", f"others cannot dial this peer ({how}); reachable through the relay "
                                 f"{short_maddr(f.relay.relay)} ({limits_text(f.relay)})")
    return Choice("client", f"others cannot dial this peer ({how}) and {problem}: dial-out only (client mode); "
                            f"a group needs a public or relayed peer")


def explain_no_group(my_mode: str, live_modes: Sequence[str], relay_issue: Optional[str]) -> Optional[str]:
    """One line naming why no group can form and the fix, when the cause is reachability: every live peer (this
    one included) is in client mode, so nobody can accept the others' connections. None otherwise. Peers of older
    versions publish no mode ("unknown") and count as reachable."""
    modes = list(live_modes) or [my_mode]
    if any(m != "client" for m in modes) or my_mode != "client":
        return None
    cause = f"; {relay_issue}" if relay_issue else ""
    return (f"no group can form: all {len(modes)} live peer(s) are behind NAT in client mode (dial-out only), so "
            f"none can accept the others' connections{cause}. Fix: {FIX}")


# go-multiaddr's manet.IsPublicAddr (the version in hivemind 1.1.12's p2pd): what libp2p counts as dialable from the
# internet for AutoNAT, relay addresses and hole punching
_NOT_PUBLIC = [ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",  # private
    "0.0.0.0/8", "192.0.0.0/26", "192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24",  # unroutable
    "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32",
    "::1/128", "fc00::/7", "fe80::/10", "ff00::/8")]


def is_public_ip(host: str) -> bool:
    """True for an IP address libp2p considers public (neither private nor reserved, by go-multiaddr's lists, so
    that 192.0.0.64-255, which the emulated internet of benchmarks/netlab.py uses, counts as public, as it does for
    p2pd)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return not any(ip.version == net.version and ip in net for net in _NOT_PUBLIC)


def short_maddr(maddr: str) -> str:
    """``/ip4/1.2.3.4/tcp/31337/p2p/QmLongPeerId`` as ``/ip4/1.2.3.4/tcp/31337/p2p/QmLongPe…``, for log lines."""
    address, sep, peer = maddr.rpartition("/p2p/")
    return f"{address}/p2p/{peer[:8]}…" if sep and len(peer) > 8 else maddr


def limits_text(relay: RelayInfo) -> str:
    if relay.data_bytes is None and relay.duration_s is None:
        return "no limits"
    return f"a relayed connection lasts {_duration(relay.duration_s)} and carries {_size(relay.data_bytes)} each way"


def _size(n: Optional[int]) -> str:
    if n is None:
        return "unlimited"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _duration(s: Optional[int]) -> str:
    if s is None:
        return "no time limit"
    return f"{s // 60} min" if s >= 60 and s % 60 == 0 else f"{s} s"
