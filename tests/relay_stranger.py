"""A node without a private swarm's secret that wants the bootstrap's relay (tests only; test_nat runs it behind a
NAT of the emulated internet):

    python tests/relay_stranger.py --relay MADDR --seconds S --out result.json

It reserves a slot at the relay as any home peer would (p2pd's autorelay with the relay as its static relay, told
it is unreachable), and as an attacker would, dials the relay again whenever its connection is gone. Every 0.25 s
it notes whether it is connected to the relay and whether it holds a relayed address (its reservation); the JSON
report holds those samples, what happened, never what the stranger hoped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

SAMPLE_S = 0.25


async def watch(relay: str, seconds: float) -> dict:
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from p2p_diloco.net.dht import _configure_p2pd

    _configure_p2pd({})  # as our peers do: reserve at once, not after p2pd's 3-minute wait for relay candidates
    node = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"], initial_peers=[relay], force_reachability="private",
                            use_auto_relay=True, trusted_relays=[relay])
    relay_id = PeerID.from_base58(relay.split("/p2p/")[-1])
    relay_addr = Multiaddr(relay.split("/p2p/")[0])
    samples, start = [], time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            connected = relay_id in {info.peer_id for info in await node.list_peers()}
            relayed = any("/p2p-circuit" in str(m) for m in await node.get_visible_maddrs(latest=True))
            samples.append((round(time.monotonic() - start, 2), connected, relayed))
            if not connected:
                try:
                    await node._client.connect(relay_id, [relay_addr])
                except Exception:  # noqa: BLE001 - refused or still closing: try again at the next sample
                    pass
            await asyncio.sleep(SAMPLE_S)
    finally:
        await node.shutdown()
    return {"peer_id": node.peer_id.to_base58(), "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--relay", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report = asyncio.run(watch(args.relay, args.seconds))
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
