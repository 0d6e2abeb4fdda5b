"""An outsider with the product's own DHT nodes (their own keys, no secret) that writes bad roster entries into an
open run (tests only).

    python tests/attacks/roster_attacker.py --bootstrap MADDR --run-id RUN --out report.json --stop STOP_FILE

It finds the run's prefix in the run index, then, until STOP_FILE exists, stores under ``{prefix}.roster``:
  * ``crash``: an entry signed by its first node, in its own name, whose ``"round"`` is the string ``"9"``;
  * ``sybil``: an unsigned entry under the subkey ``sybil-1`` (not a peer id) claiming round 10^9;
  * ``ahead``: a well-formed entry signed by its second node, in its own name, claiming round 10^9 and offering
    to serve that state;
  * ``inflate``: once the run committed a round, well-formed entries under ``--inflate`` generated keys at the run's
    latest round and digest, following it below ``--inflate-below`` (benchmarks/quorum_inflation.py: before the
    quorum was counted over the group that committed the round, they stalled the run; until the last round counted
    that group too, they made the peers stop one round short);
  * ``finished``: "finished the run" records at ``--finish-round`` under 8 other generated keys (before stop 40 every
    peer counted them against the peers still training, and stopped: `the run finished without us`).
The report names the attacker's peer ids and how many stores each DHT confirmed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
FAR = 10 ** 9


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--bootstrap", "--run-id", "--out", "--stop"):
        p.add_argument(name, required=True)
    p.add_argument("--inflate", type=int, default=4)
    p.add_argument("--inflate-below", type=int, default=1 << 30, help="inflate rounds below this one only")
    p.add_argument("--finish-round", type=int, default=0, help="claim 8 peers finished this round (0: no claim)")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout this script is in, not another

    from benchmarks.quorum_inflation import SybilEntries, latest_round
    from p2p_diloco.net.security.identity import Identity

    from hivemind.utils.timed_storage import get_dht_time

    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.net.consensus import PeerStatus
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.net.keys import finished_key, read_run_index, roster_key

    net = NetworkConfig(initial_peers=[args.bootstrap], host_maddrs=[LOOPBACK], join_timeout=20.0)
    first, second = start_dht(net), start_dht(net)
    sybils = [Identity.generate() for _ in range(args.inflate)]
    finishers = [Identity.generate() for _ in range(8 if args.finish_round else 0)]
    report = {"peer_ids": [str(first.peer_id), str(second.peer_id)], "stores": {}, "attempts": {}, "prefix": None,
              "inflated": [], "sybil_ids": [identity.peer_id_b58 for identity in sybils]}
    try:
        deadline = time.monotonic() + 120
        while not report["prefix"] and time.monotonic() < deadline and not os.path.exists(args.stop):
            prefixes = read_run_index(first, args.run_id, timeout=3)
            report["prefix"] = prefixes[0] if prefixes else None
            time.sleep(0.5)  # the run index lives in the DHT: nothing to wait on
        if not report["prefix"]:
            return 1
        key = roster_key(report["prefix"])

        def status(dht, round_, digest="e" * 64) -> dict:
            return asdict(PeerStatus(name="attacker", peer_id=str(dht.peer_id), round=round_, digest=digest))

        entries = {"crash": (first, str(first.peer_id), {**status(first, 0), "round": "9"}),
                   "sybil": (first, "sybil-1", {**status(first, FAR), "peer_id": "sybil-1"}),
                   "ahead": (second, str(second.peer_id), status(second, FAR))}
        ours, last = set(report["peer_ids"]) | set(report["sybil_ids"]), 0.0
        while not os.path.exists(args.stop) and time.monotonic() < deadline:
            if time.monotonic() > last + 2.0:  # re-store for peers that joined since (not handed to newcomers)
                last = time.monotonic()
                for name, (dht, subkey, value) in entries.items():
                    ok = dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + 60)
                    report["stores"][name] = report["stores"].get(name, 0) + int(bool(ok))  # some node took it
                    report["attempts"][name] = report["attempts"].get(name, 0) + 1
                if finishers:
                    done = SybilEntries(finished_key(report["prefix"]), finishers, args.finish_round, "", finished=True)
                    report["stores"]["finished"] = report["stores"].get("finished", 0) + second.run_coroutine(done)
            latest = latest_round(first, key, ours) if args.inflate else None
            if latest is not None and 1 <= latest[0] < args.inflate_below and latest[0] not in report["inflated"]:
                if second.run_coroutine(SybilEntries(key, sybils, *latest)):  # some node took them
                    report["inflated"].append(latest[0])
            with open(args.out, "w") as f:
                json.dump(report, f)
            time.sleep(0.3)  # follow the run's round: its roster lives in the DHT, nothing to wait on
    finally:
        with open(args.out, "w") as f:
            json.dump(report, f)
        first.shutdown()
        second.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
