"""A stranger's roster entries at an open run's round (issue 24): rounds committed by a 2-peer run before, during
and after one DHT node publishes roster entries under N generated keys at the run's current round.

Each entry is well-formed and signed in its own key's name, so the records seam accepts it. When the quorum counted
the roster's entries at a member's round (``consensus.electorate``), they raised that count until no group of the
real peers held more than half of it, and the run stalled for as long as they lived; the quorum is now counted
over the group that committed the round before (``count_quorum`` in net/averaging/contribution.py). About 3
minutes. Run:

    python benchmarks/quorum_inflation.py [--sybils 4] [--attack-s 60]

Measured (benchmarks/robustness.md 9.5), `--sybils 4 --attack-s 60`, the development machine: at 2c9e17e 18 rounds
during the attack (median 3.34 s between commits, 0.38 s before it: the leader waits out its 3 s window for the
group the roster announces); at 2ac93ba, before the change, none after the entries caught up with the run's round.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ["--network.host_maddrs=/ip4/127.0.0.1/tcp/0", "--network.identity_path=none", "--run.progress=false",
           "--run.threads=1", "--inner.batch_size=2", "--inner.grad_accum=1", "--averaging.matchmaking_time=3",
           "--averaging.request_timeout=2", "--averaging.roster_ttl=6", "--run.checkpoint_every=0",
           "--data.eval_batches=1", "--model.seq_len=32", "--diloco.inner_steps=4", "--run.rounds=100000"]
RUN_ID = "quorum-inflation"
ENTRY_TTL_S = 30.0
AFTER_S = 60.0  # after the entries expired: time for the attempt under way to end and the next to commit


class SybilEntries:
    """Runs in the attacker's DHT process: one signed roster entry per key, on the nodes nearest the roster key (also
    used by tests/attacks/roster_attacker.py)."""

    def __init__(self, key: str, identities: list, round_: int, digest: str, finished: bool = False):
        self.key, self.identities, self.round, self.digest = key, identities, round_, digest
        self.finished = finished  # "finished the run" records (at round_) instead of roster entries

    def _value(self, i: int, subkey: str) -> dict:
        from p2p_diloco.net.consensus import PeerStatus

        if self.finished:
            return {"name": f"done{i}", "round": self.round}
        return asdict(PeerStatus(name=f"s{i}", peer_id=subkey, round=self.round, digest=self.digest))

    async def __call__(self, _dht, node) -> int:
        from hivemind.dht.routing import DHTID
        from hivemind.utils.timed_storage import get_dht_time

        from p2p_diloco.net.security.identity import seal

        key_id, ser, expiration = DHTID.generate(source=self.key), node.protocol.serializer, get_dht_time() + ENTRY_TTL_S
        subkeys = [identity.peer_id_b58 for identity in self.identities]
        sealed = [seal(identity, key_id.to_bytes(), ser.dumps(subkey), ser.dumps(self._value(i, subkey)), expiration)
                  for i, (identity, subkey) in enumerate(zip(self.identities, subkeys))]
        nearest = await node.find_nearest_nodes([key_id], exclude_self=True)
        stored = 0
        for peer in nearest[key_id].values():
            answer = await node.protocol.call_store(peer, [key_id] * len(sealed), sealed, expiration, subkeys=subkeys)
            stored += sum(bool(ok) for ok in answer or [])
        return stored


def latest_round(dht, key: str, exclude: set) -> tuple[int, str] | None:
    """The highest round and its digest among the run's own roster entries."""
    from p2p_diloco.net import records

    found = dht.get(key, latest=True)
    entries = records.valid_entries("roster", found.value, lambda e: e.value) if found is not None else []
    own = [(s.round, s.digest) for s in entries if s.peer_id not in exclude]
    return max(own) if own else None


def _committed(run_dir: Path) -> list[tuple[float, int]]:
    from p2p_diloco.ops.metrics import read_jsonl

    path = run_dir / "metrics.jsonl"
    return [(r["time"], r["round"]) for r in read_jsonl(path) if r.get("event") == "round" and r["committed"]] \
        if path.exists() else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sybils", type=int, default=4)
    p.add_argument("--attack-s", type=float, default=60.0)
    args = p.parse_args()

    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.net.keys import read_run_index, roster_key
    from p2p_diloco.net.security.identity import Identity
    from p2p_diloco.ops.procs import stop_groups

    work = Path(tempfile.mkdtemp(prefix="quorum-inflation-"))
    procs, attacker = [], None
    try:
        with open(work / "bootstrap.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "p2p_diloco", "bootstrap", MACHINE[0]], stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        bootstrap = None
        while bootstrap is None:
            time.sleep(0.5)  # the bootstrap prints its address when its node is up: poll its log
            found = re.search(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", (work / "bootstrap.log").read_text())
            bootstrap = found.group(0) if found else None
        for name in ("a", "b"):
            with open(work / f"{name}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "p2p_diloco", "peer", "--config", str(ROOT / "peers" / "cpu-test.toml"),
                     "--initial-peers", bootstrap, f"--run.run_id={RUN_ID}", f"--run.name={name}",
                     f"--run.run_dir={work / name}", "--run.expected_peers=2", *MACHINE],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        attacker = start_dht(NetworkConfig(initial_peers=[bootstrap], host_maddrs=[MACHINE[0].split("=")[1]],
                                           join_timeout=20.0))
        while len(_committed(work / "a")) < 5:
            time.sleep(0.5)  # the peers report through their metrics files: 5 rounds at the run's own pace first
        prefixes = read_run_index(attacker, RUN_ID, timeout=5)
        key = roster_key(prefixes[0])
        identities = [Identity.generate() for _ in range(args.sybils)]
        mine = {identity.peer_id_b58 for identity in identities}
        start = time.time()
        while time.time() < start + args.attack_s:
            latest = latest_round(attacker, key, mine)
            if latest is not None:
                attacker.run_coroutine(SybilEntries(key, identities, *latest))
            time.sleep(1.0)  # follow the run's round
        end = time.time()
        time.sleep(ENTRY_TTL_S + AFTER_S)  # the entries expire, and the attempt under way (its window doubled at each
        # attempt without quorum, up to 8x) ends: the run goes on
        rounds = _committed(work / "a")
        phases = {"before": [t for t, _ in rounds if t < start], "during": [t for t, _ in rounds if start <= t < end],
                  "after": [t for t, _ in rounds if t >= end + ENTRY_TTL_S]}  # once its entries expired
        print(f"{args.sybils} Sybil entries following the run's round for {args.attack_s:.0f} s (one DHT node):")
        for phase, times in phases.items():
            gaps = sorted(b - a for a, b in zip(times, times[1:]))
            median = f", median {gaps[len(gaps) // 2]:.2f} s between commits" if gaps else ""
            print(f"  {phase:>6}: {len(times)} rounds committed{median}")
        no_quorum = [line for line in (work / "a.log").read_text().splitlines() if "NoQuorum" in line]
        if no_quorum:
            print(f"  peer a, {len(no_quorum)} attempts without quorum, e.g.: {no_quorum[0][:160]}")
        print(f"  logs: {work}")
    finally:
        if attacker is not None:
            attacker.shutdown()
        stop_groups([proc.pid for proc in procs])
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally: no peer left behind
    sys.exit(main())
