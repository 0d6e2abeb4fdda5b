"""ops/standing.py: a peer the run commits without says so once in its log (and once when it is back), and counts
it in a Prometheus gauge; a peer alone, or one whose failures the run shares, says nothing."""

from __future__ import annotations

import logging

import pytest

from p2p_diloco.config import load_config
from p2p_diloco.ops.metrics import build_sink, read_jsonl
from p2p_diloco.ops.standing import MISSED_ROUNDS_WARN, Standing
from p2p_diloco.ops.telemetry import Telemetry

pytestmark = pytest.mark.timeout(60)


def _round(committed: bool, ours: int, run: int, error: str = "AllreduceException: could not find a group") -> dict:
    return {"event": "round", "peer": "p0", "round": ours, "committed": committed, "run/round": run,
            "error": None if committed else error}


def _said(standing: Standing, records) -> list:
    return [said for said in map(standing.observe, records) if said is not None]


def test_standing_warns_once_when_the_run_commits_without_us_and_once_when_back():
    s = Standing()
    records = [_round(True, 5, 5), _round(False, 5, 5), _round(False, 5, 6), _round(False, 5, 7)]
    assert _said(s, records) == [] and s.missed == 2  # two rounds missed: under the threshold
    (level, line), = _said(s, [_round(False, 8, 8, "HelperDied: p2pd of the DHT died\nsecond line")])  # caught up
    assert level == logging.WARNING and s.missed == MISSED_ROUNDS_WARN
    assert line.startswith("NOT IN THE RUN: the run committed 3 round(s) without this peer (the run is at round 8, "
                           "this peer last committed round 5; 4 attempt(s) failed, the last: HelperDied: p2pd")
    assert "second line" not in line
    assert _said(s, [_round(False, 8, 9), _round(False, 8, 12)]) == [] and s.missed == 7  # said once
    (level, line), = _said(s, [_round(True, 13, 12)])
    assert level == logging.INFO and s.missed == 0
    assert line == ("back in the run: round 13 committed with this peer, after the run committed 7 round(s) "
                    "without it (6 attempt(s) failed)")
    assert _said(s, [_round(False, 13, 13), _round(False, 13, 14), _round(False, 13, 15)]) == []
    assert _said(s, [_round(False, 13, 16)])[0][0] == logging.WARNING  # out again: said again


def test_standing_is_quiet_when_the_run_does_not_commit_either():
    s = Standing()
    # a peer alone (its roster holds only itself), or a run whose every group fails: the run's round stands still
    assert _said(s, [_round(False, 0, 0)] * 10) == [] and s.missed == 0
    # a peer that started late counts from the run's round at its first attempt, not from round 0
    late = Standing()
    assert _said(late, [_round(False, 40, 40), _round(False, 40, 41)]) == [] and late.missed == 1
    # records of other events and malformed rounds are ignored
    assert _said(late, [{"event": "rebase", "round": 99}, {"event": "round", "round": "x", "run/round": 99},
                        {"event": "round", "round": 41, "run/round": None, "committed": False}]) == []
    assert late.missed == 1


def test_standing_reaches_the_peers_log_and_its_metrics(tmp_path, caplog):
    cfg = load_config(overrides={"run.run_dir": str(tmp_path)})
    sink = build_sink(cfg, tmp_path, "p0")
    telemetry = Telemetry()
    records = [_round(True, 2, 2)] + [_round(False, 2, run) for run in (2, 3, 4, 5)] + [_round(True, 6, 5)]
    with caplog.at_level(logging.INFO, logger="p2p_diloco"):
        for i, record in enumerate(records):
            sink.log(record)
            telemetry.observe(record)
            if i == 4:
                assert telemetry.registry.get_sample_value("p2p_diloco_missed_rounds") == 3
                assert telemetry.registry.get_sample_value("p2p_diloco_uncommitted_rounds") == 4
    sink.close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "p2p_diloco"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO]
    assert lines[0][1].startswith("NOT IN THE RUN: the run committed 3 round(s) without this peer")
    assert telemetry.registry.get_sample_value("p2p_diloco_missed_rounds") == 0
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == len(records)  # the records still reach the file


def test_status_names_the_peers_the_run_commits_without():
    from p2p_diloco.net.consensus import PeerStatus
    from p2p_diloco.ops.status import describe_run, render

    roster = [PeerStatus(name=f"peer{i}", peer_id=f"id{i}", round=r, digest=f"d{r}")
              for i, r in enumerate((16, 16, 15, 12, 10))]
    roster.append(PeerStatus(name="gone", peer_id="id9", round=2, digest="d2", leaving=True))
    run = describe_run("run_abc", roster)
    assert [p["rounds_behind"] for p in run["peers"]] == [14, 0, 0, 1, 4, 6]  # by name: gone, peer0..peer4
    table = render({"run_id": "r", "time": 0.0, "runs": [run]})
    assert table.splitlines()[-1] == ("  NOT IN THE RUN (round 16): peer3 at round 12, 4 behind, peer4 at round 10, "
                                      "6 behind")
    up_to_date = describe_run("run_abc", roster[:3])
    assert "NOT IN THE RUN" not in render({"run_id": "r", "time": 0.0, "runs": [up_to_date]})
    # a peer that holds the run's round by downloading it every round, without committing any: its own count
    roster[1].missed_rounds = 5
    roster[2].missed_rounds = 2  # under the threshold: not named
    table = render({"run_id": "r", "time": 0.0, "runs": [describe_run("run_abc", roster[:3])]})
    assert table.splitlines()[-1] == "  NOT IN THE RUN (round 16): peer1 at round 16, committed none of the last 5 " \
                                     "(downloads them)"


def test_a_peer_publishes_the_rounds_the_run_committed_without_it():
    """The count its log warns about (ops/standing.py) is what its roster entry carries (peer.py _report)."""
    from types import SimpleNamespace

    from p2p_diloco.ops.metrics import FanOut
    from p2p_diloco.ops.standing import StandingSink
    from p2p_diloco.peer import Peer

    sink = StandingSink(logging.getLogger("test"))
    peer = SimpleNamespace(metrics=FanOut([sink]))
    for run_round in (6, 7, 8, 9):  # our round stays 5; the run commits 6..9 without us
        sink.log({"event": "round", "round": 5, "committed": False, "run/round": run_round})
    assert Peer._missed_rounds(peer) == 3
    sink.log({"event": "round", "round": 10, "committed": True, "run/round": 10})
    assert Peer._missed_rounds(peer) == 0


def test_metrics_jsonl_rotates_and_its_readers_read_both_files(tmp_path):
    from p2p_diloco.ops.health import tail_records
    from p2p_diloco.ops.metrics import JsonlSink, rotated

    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path, rotate_bytes=2000)
    for i in range(200):  # about 100 bytes each: 20,000 bytes written in all
        sink.log({"event": "round", "round": i, "committed": True, "pad": "x" * 40})
        assert path.stat().st_size <= 2000 and (not rotated(path).exists() or rotated(path).stat().st_size <= 2000)
    sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.jsonl.1"]  # bounded: 2 files
    rounds = [r["round"] for r in read_jsonl(path)]
    assert rounds == list(range(rounds[0], 200)) and 15 <= len(rounds) <= 40  # in order, the newest kept
    # the health probe reads the end: just after a rotation, it reaches into the rotated file
    path.write_text(path.read_text().splitlines(keepends=True)[-1])  # one record since the rotation
    both = [r["round"] for r in read_jsonl(path)]
    tail = [r["round"] for r in tail_records(path, tail_bytes=500)]
    assert tail[-1] == 199 and 3 <= len(tail) <= 5 and tail == both[-len(tail):]


def test_the_runs_round_is_the_latest_credible_one_not_a_strangers_claim():
    """A well-formed roster entry claiming round 10^9 (tests/attacks: the roster attacker) is not the run's round:
    a peer that fails a few attempts does not say the run committed 999,999,998 rounds without it."""
    import types

    from p2p_diloco.net.consensus import PeerStatus
    from p2p_diloco.peer import Peer

    me = PeerStatus("a", "A", 2, "x")
    live = [me, PeerStatus("b", "B", 3, "y"), PeerStatus("c", "C", 3, "y"), PeerStatus("s", "S", 10 ** 9, "z")]
    peer = types.SimpleNamespace(membership=types.SimpleNamespace(status=lambda: me))
    assert Peer._run_round(peer, live) == 3
    assert Peer._run_round(types.SimpleNamespace(membership=None), live) == 10 ** 9  # outside a swarm: no roster
