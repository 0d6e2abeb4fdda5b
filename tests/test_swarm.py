"""Whole swarms of real processes on loopback, through the `p2p-diloco swarm` command."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import HIVEMIND_SOCKET_DIR, hivemind_sockets, sockets_left

from p2p_diloco.ops.metrics import read_jsonl


def _swarm(run_dir, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "p2p_diloco", "swarm", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _assert_rounds_agree(summary, rounds, group_size):
    assert [r["round"] for r in summary["rounds"]] == list(range(1, rounds + 1))
    for r in summary["rounds"]:
        assert r["group_size"] == group_size
        hashes = r["global_params_sha256"]
        assert len(hashes) == group_size, f"round {r['round']}: only {sorted(hashes)} committed"
        assert len(set(hashes.values())) == 1, f"round {r['round']}: θ_global differs between peers: {hashes}"


@pytest.mark.timeout(300)
def test_three_peers_agree_after_every_round_learn_and_leave_nothing(tmp_path, process_tag):
    socks_before = hivemind_sockets()
    pymp_before = set(glob.glob(os.path.join(os.environ["TMPDIR"], "pymp-*")))  # the suite's (conftest)
    out = _swarm(tmp_path, "--peers", "3", "--rounds", "3", "--inner-steps", "15", "--no-report")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    _assert_rounds_agree(summary, rounds=3, group_size=3)
    assert summary["rounds"][-1]["eval_loss"] < summary["initial_eval_loss"] - 1.0
    assert all(r["bytes_sent"] > 0 and r["allreduce_s"] > 0 for r in summary["rounds"])
    assert sorted(p["name"] for p in summary["peers"]) == ["peer0", "peer1", "peer2"]
    assert all(p["rounds_completed"] == 3 and p["peer_id"] for p in summary["peers"])
    # what a member pays per round (benchmarks/scale.py's cost table): at most 4 digest messages per other member
    # (our call and its answer, its call and ours; those after our verdict are not counted), each one 32-byte hash
    # of the sender's digests when the averages agree (the digests per reducer go only where they differ)
    for r in (r for r in read_jsonl(tmp_path / "peer0" / "metrics.jsonl") if r.get("event") == "round"):
        assert 1 <= r["outer/check_messages"] <= 8, r
        assert r["outer/check_bytes"] == 32 * r["outer/check_messages"], r
        assert r["net/roster_reads"] >= 1 and r["net/roster_entries"] <= 3 * r["net/roster_reads"], r
        # a commit stores our signed commit record (round, digest) before the roster shows the round: one small value
        assert 0 < r["net/certificate_bytes"] < 1000 and r["net/certificate_store_s"] > 0, r
    assert "one θ_global on 3 of 3 peers" in out.stdout and "FORK" not in out.stdout  # the per-round table
    # process_tag's teardown asserts that no peer, DHT, averager or p2pd process is left; and peers that stopped
    # normally leave no file either: no p2pd client socket in /tmp, no multiprocessing folder in TMPDIR
    left = sockets_left(socks_before)
    assert not left, f"sockets left in {HIVEMIND_SOCKET_DIR}: {sorted(left)}"
    assert set(glob.glob(os.path.join(os.environ["TMPDIR"], "pymp-*"))) <= pymp_before, "multiprocessing folders left"


@pytest.mark.timeout(300)
def test_a_run_larger_than_target_group_size_ends_each_round_on_one_theta(tmp_path, process_tag):
    """Four peers with groups of at most two configured: every round is committed by one group larger than that
    target, a quorum (3 of 4) at least, with one digest on every peer that holds it (hivemind's matchmaking used to
    split such a run into groups of two that committed different θ_global, or to fail every group larger than the
    target). A peer that a loaded machine makes late for a round's group repairs from it: that is allowed, a second
    group is not."""
    out = _swarm(tmp_path, "--peers", "4", "--rounds", "2", "--inner-steps", "6", "--no-report",
                 "--averaging.target_group_size=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2], summary["rounds"]
    assert summary["forked_rounds"] == [], summary
    for r in summary["rounds"]:
        assert r["group_size"] >= 3 and r["committed_by"] >= 3, f"round {r['round']}: a group of the target size"
        assert len(set(r["global_params_sha256"].values())) == 1, r
    assert "FORK" not in out.stdout and "one θ_global on" in out.stdout


@pytest.mark.timeout(300)
def test_kill_each_round_kills_a_sender_and_a_member_before_the_checks_and_replaces_them(tmp_path, process_tag):
    """Seed 5 of --kill-each-round on 3 peers and 4 rounds: peer2 dies as a sender in round 2, peer1 once every
    average arrived in round 3, before the reducer checks. Fresh peers take their places, no round holds two
    θ_global, and the survivors lose no round: the sender's death makes them run round 2's all-reduce again among
    themselves (averaging.survive_losses), and a death before the checks leaves the averages already received."""
    out = _swarm(tmp_path, "--peers", "3", "--rounds", "4", "--inner-steps", "6", "--no-report",
                 "--kill-each-round", "5")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    kills = [(e["peer"], e["phase"]) for e in summary["events"] if e["kind"] == "kill"]
    assert kills == [("peer2", "sending"), ("peer1", "checks")], summary["events"]
    joins = [e["peer"] for e in summary["events"] if e["kind"] == "join"]
    assert joins == ["new0", "new1"], summary["events"]
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3, 4] and summary["forked_rounds"] == []
    assert all(len(set(r["global_params_sha256"].values())) == 1 for r in summary["rounds"])
    assert any("new0" in r["global_params_sha256"] for r in summary["rounds"]), "the replacement never committed"
    assert "FORK" not in out.stdout
    survivor = read_jsonl(tmp_path / "peer0" / "metrics.jsonl")
    attempts = [(r["round"] + (not r["committed"]), r["committed"]) for r in survivor if r.get("event") == "round"]
    assert [n for n, ok in attempts if ok] == [1, 2, 3, 4]
    # the rounds a member died in are not lost: round 2 (a sender) never; round 3 (before the checks) unless the
    # survivor's group was peer1 and itself alone, where a pair cannot tell a dead partner from a cut link and the
    # majority rule fails the round (net/averaging/verify.py). Round 4's first attempt may be lost: new1, joined at
    # round 3, can reach the leader after its window closed (a late arrival, not a death)
    failed = [(r["round"] + 1, r.get("error") or "") for r in survivor
              if r.get("event") == "round" and not r["committed"]]
    assert all(n != 2 for n, _ in failed), f"a survivor failed the round a sender died in: {failed}"
    # and without waiting for the dead sender to start (the swarm's 15 s sender timeout): losing the dead member's
    # parts as a reducer stops the survivors' own reducers at once, so their retry starts within seconds
    round2 = next(r for r in survivor if r.get("event") == "round" and r["committed"] and r["round"] == 2)
    assert round2["outer/allreduce_s"] < 15.0, f"the survivors waited out the sender timeout: {round2}"
    assert all("only 1 of the group's 2 members" in why for n, why in failed if n == 3), f"round 3 lost: {failed}"
    assert summary["rounds"][1]["committed_by"] == 2 and "peer2" not in summary["rounds"][1]["global_params_sha256"]
    assert "running it again among them" in (tmp_path / "peer0.log").read_text()


@pytest.mark.timeout(300)
def test_restarted_swarm_resumes_from_checkpoints(tmp_path, process_tag):
    first = _swarm(tmp_path, "--peers", "2", "--rounds", "2", "--inner-steps", "8", "--no-report")
    assert first.returncode == 0, first.stdout[-3000:]
    after_first = json.loads((tmp_path / "summary.json").read_text())["rounds"][-1]["global_params_sha256"]

    second = _swarm(tmp_path, "--peers", "2", "--rounds", "4", "--inner-steps", "8", "--no-report")
    assert second.returncode == 0, second.stdout[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    _assert_rounds_agree(summary, rounds=4, group_size=2)
    assert summary["rounds"][1]["global_params_sha256"] == after_first
    for name in ("peer0", "peer1"):
        assert "resumed at round 2" in (tmp_path / f"{name}.log").read_text()
        records = read_jsonl(tmp_path / name / "metrics.jsonl")
        committed = [r["round"] for r in records if r.get("event") == "round" and r["committed"]]
        assert committed == [1, 2, 3, 4], "the restarted peer must continue at round 3, not start over"


@pytest.mark.timeout(180)
def test_interrupted_swarm_leaves_no_process(tmp_path, process_tag):
    # started as a script's background job is, with SIGINT ignored (inherited through exec): SIGINT still stops it
    command = [sys.executable, "-m", "p2p_diloco", "swarm", "--run-dir", str(tmp_path), "--peers", "2",
               "--rounds", "50", "--inner-steps", "10"]
    proc = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait until the first round is in the table: every process is up and averaging
        if line.strip().startswith("1 "):
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert "interrupted" in rest and proc.returncode == 130, (proc.returncode, rest[-2000:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] and summary["rounds"][0]["round"] == 1


@pytest.mark.timeout(30)
def test_the_table_counts_the_peers_in_each_round_not_every_process_started(tmp_path):
    """A kill-each-round run: peer2 killed holding round 2, new0 joined at round 3. Round 3 began with peer0, peer1
    and peer2 (lost in it); new0 counts from round 4. Before, every process ever started was the denominator."""
    from types import SimpleNamespace

    from p2p_diloco.ops.swarm_rounds import RoundTable, held_rounds

    held = {"peer0": [0, 1, 2, 3, 4], "peer1": [0, 1, 2, 3, 4], "peer2": [0, 1, 2], "new0": [3, 4]}
    peers = {}
    for name, rounds in held.items():
        (tmp_path / name).mkdir()
        events = [{"event": "start" if name != "new0" else "join", "round": rounds[0]}]
        events += [{"event": "round", "committed": True, "round": r} for r in rounds[1:]]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
        peers[name] = SimpleNamespace(run_dir=tmp_path / name)
    record = {"committed": True, "outer/group_size": 2, "train/loss": 1.0, "outer/allreduce_s": 1.0,
              "outer/bytes_sent": 1, "global_params_sha256": "ab" * 32}
    rows = []
    rounds = {3: {"peer0": record, "peer1": record}, 4: {n: record for n in held if n != "peer2"}}
    RoundTable(rows.append).update(rounds, {n: float("inf") for n in held}, final=True, held=held_rounds(peers))
    assert "on 2 of 3 peers" in rows[1] and "on 3 of 3 peers" in rows[2], rows


def test_a_large_local_swarm_gets_slower_network_timings_unless_the_user_sets_them():
    """At 32 peers on 2 cores the demo's loopback timings overloaded the machine's DHT (round 1 never formed); past
    LARGE_SWARM peers the swarm's defaults are the slower ones it committed every round with. Flags still win."""
    from p2p_diloco.config import load_config
    from p2p_diloco.ops.swarm import DEMO_DEFAULTS, LARGE_SWARM, demo_defaults

    assert demo_defaults(LARGE_SWARM) == DEMO_DEFAULTS
    big = load_config(defaults=demo_defaults(32))
    assert (big.averaging.roster_ttl, big.averaging.request_timeout, big.averaging.matchmaking_time) == (30, 10, 30)
    assert big.model.name == "tiny"  # the rest of the demo stays
    mine = load_config(overrides={"averaging.roster_ttl": "12"}, defaults=demo_defaults(32))
    assert mine.averaging.roster_ttl == 12
