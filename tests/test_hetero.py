"""Mixed speeds and late peers in one swarm of real processes: DyLU gives a slower peer fewer inner steps and rounds
still commit on every peer with equal θ_global; a peer frozen (SIGSTOP) for several rounds and one restarted from an
older checkpoint both rebase their local work onto the run's θ_global, contribute it, and agree on every round."""

from __future__ import annotations

import json
import threading

import pytest

from p2p_diloco.config import load_config
from p2p_diloco.ops.faults import HOLD_FILE
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import DEMO_DEFAULTS, ChaosPlan, run_swarm, write_peer_config

ROUNDS = 7
BACK_BY = 5  # peer0 and peer1 wait in round 6's inner steps until both late peers are back and hold round 5


@pytest.mark.timeout(420)
def test_dylu_and_late_peers_rebase_while_every_round_agrees(tmp_path, process_tag):
    cfg = load_config(defaults={**DEMO_DEFAULTS, "inner.batch_size": 4, "model.seq_len": 64, "data.eval_batches": 2,
                                "averaging.matchmaking_time": 5.0, "averaging.next_chunk_timeout": 10.0,
                                "averaging.roster_ttl": 6.0, "diloco.max_staleness": 10})
    # halfway through round 2, peer2 freezes (SIGSTOP) and peer3 stops gracefully (its checkpoint holds half a
    # round of work on round 1's θ_global); after round 4 peer2 is thawed, and a second process for peer3, started
    # at launch, resumes from that checkpoint (a restart). Rounds here can take under a second: unheld, the others
    # could end the run while a late peer is still catching up (CI: peer3 fetched round 4, then round 5, then round
    # 7, the last). So peer0 and peer1 wait in round 6's inner steps until both have rebased and hold round 5.
    plan = ChaosPlan(faults={"peer2": "stall:inner:2", "peer3": "term:inner:2",
                             "peer0": f"hold:inner:{BACK_BY + 1}", "peer1": f"hold:inner:{BACK_BY + 1}"},
                     actions=[(4, "restart", "peer3"), (4, "cont", "peer2")])
    done = threading.Event()
    releaser = threading.Thread(target=_release_when_rebased, args=(tmp_path, done), daemon=True)
    releaser.start()
    try:
        rc = run_swarm(4, ROUNDS, 20, str(tmp_path), write_peer_config(tmp_path, cfg), plan=plan, slowdowns=[1, 4],
                       timeout=360, echo=lambda s: None)
    finally:
        done.set()
        releaser.join(timeout=10)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0, _diagnose(tmp_path, summary)
    assert [r["round"] for r in summary["rounds"]] == list(range(1, ROUNDS + 1))
    for r in summary["rounds"]:
        assert len(set(r["global_params_sha256"].values())) == 1, f"round {r['round']} differs: {r}"

    rounds = {name: _rounds(tmp_path, name) for name in ("peer0", "peer1", "peer2", "peer3")}
    # DyLU: the 4x slower peer runs fewer inner steps, and both commit every round until the late peers come back
    # (then a group may close before the slow peer arrives: it rebases and rejoins like them)
    assert all(n in rounds["peer0"] and n in rounds["peer1"] for n in range(1, 5)), (rounds["peer0"], rounds["peer1"])
    # (DyLU's plan H_i from the measured speeds, over rounds 2-4 together; the steps a peer actually runs also follow
    # the round's time budget, which CPU contention among the test's processes on 2 cores can stretch or cut. At 3x
    # one CI run planned 0.78 of the fast peer's steps for the slow one, where 1/3 is expected (the cause, contention
    # falling unevenly on the two, was not confirmed): at 4x, 0.25 is expected against the 0.7 asserted)
    planned = {name: [rounds[name][n]["train/planned_steps"] for n in range(2, 5)] for name in ("peer0", "peer1")}
    assert sum(planned["peer1"]) < 0.7 * sum(planned["peer0"]), f"planned steps per round (fast, slow): {planned}"
    # the frozen and the restarted peer kept their work: rebased, then contributed it and committed with the run
    for name, work_round in (("peer2", 1), ("peer3", 1)):
        rebases = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r.get("event") == "rebase"]
        assert rebases and rebases[0]["work_round"] == work_round and rebases[0]["staleness"] >= 2, (name, rebases)
        after = [n for n in rounds[name] if n > rebases[0]["round"]]
        assert after, f"{name} never committed after rebasing"
        assert name in rounds[name][min(after)]["outer/peers"]  # its rebased work is in that average
    assert "resumed at round 1" in (tmp_path / "peer3.log").read_text()


def _release_when_rebased(tmp_path, done: threading.Event) -> None:
    """Remove peer0's and peer1's hold files once both are held and peer2 and peer3 have rebased and hold round
    BACK_BY's θ_global, rebased onto it or committed (or when the test ends; a hold also ends after HOLD_MAX_S)."""
    holds = [tmp_path / name / HOLD_FILE for name in ("peer0", "peer1")]

    def back(name: str) -> bool:
        records = read_jsonl(tmp_path / name / "metrics.jsonl")
        held = [r["round"] for r in records if r.get("event") == "rebase" or r.get("event") == "round" and r["committed"]]
        return any(r.get("event") == "rebase" for r in records) and max(held, default=0) >= BACK_BY

    while not done.is_set():
        if back("peer2") and back("peer3") and all(h.exists() for h in holds):
            for h in holds:
                h.unlink()
            return
        done.wait(0.2)  # the peers' metrics files and hold files: other processes' files, polled


def _rounds(tmp_path, name):
    return {r["round"]: r for r in read_jsonl(tmp_path / name / "metrics.jsonl")
            if r.get("event") == "round" and r["committed"]}


def _diagnose(tmp_path, summary) -> str:
    logs = {p.name: p.read_text()[-2000:] for p in sorted(tmp_path.glob("*.log"))}
    return json.dumps(summary.get("events"), indent=1) + "\n" + "\n".join(f"== {k}\n{v}" for k, v in logs.items())
