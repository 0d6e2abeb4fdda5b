"""Records an outsider writes into an open run's roster (issue 24, findings 1-3), in a real swarm of 3 peer processes
with an outside DHT process of 2 nodes (the product's own, their own keys, no secret): an entry whose ``round`` is
the string "9", one under a subkey that is no peer id, one well-formed entry claiming round 10^9, and, once the run
committed a round, entries under 4 generated keys following the run's round (its last round too). Before records
were validated, the first made every peer exit with a TypeError within seconds; before the quorum was counted over
the group that committed the round before (net/averaging/contribution.py count_quorum), the last stalled the run
(no group held more than half of its members' roster views; at the run's last round, until stop 42, the peers stopped
one round short); and "finished the run" records under 8 more generated
keys, which before stop 40 made every peer stop at once (`the run finished without us`). Now every honest peer drops the bad ones (counted,
logged), stays alive, commits every round on one θ_global, and never downloads the attacker's state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.config import load_config
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import DEMO_DEFAULTS, run_swarm, write_peer_config

SMALL = {"inner.batch_size": 4, "model.seq_len": 32, "data.eval_batches": 1, "averaging.matchmaking_time": 4.0,
         "averaging.next_chunk_timeout": 10.0, "run.checkpoint_every": 0, "run.run_id": "attacked"}
ATTACKER = Path(__file__).with_name("roster_attacker.py")
PEERS, ROUNDS = 3, 4


def _diagnose(tmp_path: Path) -> str:
    logs = sorted(tmp_path.glob("peer*.log")) + [tmp_path / "attacker.log"]
    return "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in logs if p.exists())


@pytest.mark.timeout(300)
def test_bad_roster_entries_from_outside_neither_crash_nor_lead_the_run(tmp_path, process_tag):
    cfg = load_config(defaults={**DEMO_DEFAULTS, **SMALL})
    stop, report = tmp_path / "attacker.stop", tmp_path / "attacker.json"
    attacker: list[subprocess.Popen] = []

    def echo(line: str) -> None:  # the swarm prints its bootstrap's address first: the attacker joins through it
        if line.startswith("bootstrap node at ") and not attacker:
            log = open(tmp_path / "attacker.log", "w")
            attacker.append(subprocess.Popen(
                [sys.executable, str(ATTACKER), "--bootstrap", line.split()[-1], "--run-id", "attacked",
                 "--out", str(report), "--stop", str(stop), "--finish-round", str(ROUNDS)],
                stdout=log, stderr=subprocess.STDOUT))

    code = None
    try:
        code = run_swarm(PEERS, ROUNDS, 8, str(tmp_path), write_peer_config(tmp_path, cfg), timeout=200, echo=echo)
    finally:
        stop.touch()
        for proc in attacker:
            proc.wait(timeout=60)
    try:
        attack = json.loads(report.read_text())
        # every attack was made; the malformed ones may be refused on store by every node that holds the key (the
        # nodes nearest to it are the run's peers, whose validator refuses them, or the attacker's own, which keep
        # them: which, depends on the random peer ids); the well-formed claim is taken
        assert attack["prefix"] and all(attack["attempts"].get(k) for k in ("crash", "sybil", "ahead")), attack
        assert attack["stores"].get("ahead"), attack
        # rounds 2 to 4 were formed with the strangers' entries at their round (the attacker polls the roster 3
        # times a second), the last round too: before stop 42 it counted the roster, and the peers stopped at 3
        assert ROUNDS - 1 in attack["inflated"], attack  # entries at round 3 when the last round's group formed
        assert attack["stores"].get("finished"), attack  # 8 strangers claimed they finished the run
        assert code == 0, "a peer failed or the peers' θ_global differ"
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert len(summary["rounds"]) == ROUNDS
        for r in summary["rounds"]:
            hashes = r["global_params_sha256"]
            assert len(hashes) == PEERS and len(set(hashes.values())) == 1, f"round {r['round']}: {hashes}"
        attackers = set(attack["peer_ids"]) | set(attack["sybil_ids"]) | {"sybil-1"}
        for i in range(PEERS):
            records = read_jsonl(tmp_path / f"peer{i}" / "metrics.jsonl")
            committed = [r["round"] for r in records if r.get("event") == "round" and r["committed"]]
            assert committed == list(range(1, ROUNDS + 1)), f"peer{i} committed {committed}"
            assert not [r for r in records if r.get("event") in ("join", "repair")], f"peer{i} downloaded a state"
            log = (tmp_path / f"peer{i}.log").read_text()
            assert not any(a in line for a in attackers for line in log.splitlines() if "download" in line), \
                f"peer{i} tried to download from the attacker"
            assert "10000000" not in log, f"peer{i} took the claim of round 10^9 for the run's"
            assert "finished without us" not in log, f"peer{i} took the strangers' finished records for the run's end"
        seen = "\n".join((tmp_path / f"peer{i}.log").read_text() for i in range(PEERS))
        assert "round is not an integer" in seen or "refused on store" in seen, "no peer met the bad entries"
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_diagnose(tmp_path)}") from None
