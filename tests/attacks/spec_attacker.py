"""An outsider with one DHT node (the product's own, its own key, no secret) and many keys, that publishes another run
spec under an open run's settings key as a Sybil majority (tests only).

    python tests/attacks/spec_attacker.py --bootstrap-file FILE --run-id RUN --change JSON --sybils N \
        --stop STOP_FILE

Once FILE exists it joins the DHT through the multiaddr on its first line (a peer's ``maddrs.txt``: the test starts
this process with the peer, so that both start up at once), reads the spec the run's peers publish, changes the
keys of ``--change`` (a JSON object, e.g. ``data.dataset`` set to a file on the victim's disk, ``inner.lr`` 400),
and until STOP_FILE exists stores that spec under N subkeys, each the PeerID of a key it generated, each record
signed by that key (so every check of the records seam passes: one node, many valid identities), on every DHT node
it finds near the key. After each pass it prints ``stored K`` (K: stores the other nodes confirmed) on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--bootstrap-file", "--run-id", "--change", "--stop"):
        p.add_argument(name, required=True)
    p.add_argument("--sybils", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout this script is in, not another

    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.net.keys import read_run_settings, run_settings_key
    from p2p_diloco.net.security.identity import Identity

    deadline = time.monotonic() + 600  # a safety: the test always writes STOP_FILE
    maddrs: list[str] = []
    while not maddrs and time.monotonic() < deadline:
        time.sleep(0.2)  # written by another process: nothing to wait on
        maddrs = Path(args.bootstrap_file).read_text().split() if os.path.exists(args.bootstrap_file) else []
    if not maddrs:
        print(f"no {args.bootstrap_file}", flush=True)
        return 1
    bootstrap = maddrs[0]
    dht = start_dht(NetworkConfig(initial_peers=[bootstrap], host_maddrs=[LOOPBACK], join_timeout=20.0))
    try:
        published = []
        while not published and time.monotonic() < deadline and not os.path.exists(args.stop):
            published = read_run_settings(dht, args.run_id, timeout=3)
            time.sleep(0.5)  # the settings live in the DHT: nothing to wait on
        if not published:
            print("no run settings found", flush=True)
            return 1
        spec = {**published[0]["settings"], **json.loads(args.change)}
        store = _Store(run_settings_key(args.run_id), [Identity.generate() for _ in range(args.sybils)], spec)
        while not os.path.exists(args.stop) and time.monotonic() < deadline:
            print(f"stored {dht.run_coroutine(store)}", flush=True)
            time.sleep(2.0)  # again for nodes that joined since (records are not handed to newcomers)
    finally:
        dht.shutdown()
    return 0


class _Store:
    """Runs in the attacker's DHT process: one signed record per identity, stored on every node near the key."""

    def __init__(self, key: str, identities: list, spec: dict):
        self.key, self.identities, self.spec = key, identities, spec

    async def __call__(self, _dht, node) -> int:
        from hivemind.dht.routing import DHTID
        from hivemind.utils.timed_storage import get_dht_time

        from p2p_diloco.net.security.identity import seal

        key_id, ser, expiration = DHTID.generate(source=self.key), node.protocol.serializer, get_dht_time() + 60
        subkeys = [identity.peer_id_b58 for identity in self.identities]
        value = ser.dumps({"settings": self.spec, "fingerprint": "0" * 12})
        sealed = [seal(identity, key_id.to_bytes(), ser.dumps(subkey), value, expiration)
                  for identity, subkey in zip(self.identities, subkeys)]
        nearest = await node.find_nearest_nodes([key_id], exclude_self=True)
        confirmed = 0
        for peer in nearest[key_id].values():
            answer = await node.protocol.call_store(peer, [key_id] * len(sealed), sealed, expiration, subkeys=subkeys)
            confirmed += sum(bool(ok) for ok in answer or [])
        return confirmed


if __name__ == "__main__":
    sys.exit(main())
