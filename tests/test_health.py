"""``p2p-diloco health`` on fabricated run folders: a live peer process named by peer.pid, and the end of its
metrics.jsonl. (Against a live swarm: tests/test_stop.py, before and after the anchors stop.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.ops.health import MIN_AGE_S, PID_FILE, START_AGE_S, TAIL_BYTES, check, pid_file

NOW = 1_800_000_000.0


@pytest.fixture
def peer_process(process_tag):
    """A live process whose command line names p2p_diloco, as a peer's does."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "p2p_diloco", "peer"])
    deadline = time.monotonic() + 60
    while b"p2p_diloco" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # until its exec is done (the
        assert time.monotonic() < deadline, "the test's process did not start"  # check reads its command line)
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def _folder(tmp_path, pid: int, started: float, rounds=()) -> str:
    (tmp_path / PID_FILE).write_text(json.dumps({"pid": pid, "started": started}))
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"time": started, "event": "start", "round": 0}) + "\n")
        for t, round_, ok, seconds in rounds:
            f.write(json.dumps({"time": t, "event": "round", "round": round_, "committed": ok,
                                "time/round_s": seconds}) + "\n")
    return str(tmp_path)


def _rounds(start: float, count: int, every: float, committed=True):
    return [(start + i * every, i + 1, committed, every) for i in range(count)]


def test_healthy_while_rounds_commit_and_unhealthy_once_they_stop(tmp_path, peer_process):
    rounds = _rounds(NOW - 3000, 50, 60.0)  # the last commit 60 s before NOW; rounds of 60 s: bound 5 x 60
    run_dir = _folder(tmp_path, peer_process.pid, NOW - 3100, rounds)
    assert check(run_dir, now=NOW).healthy
    assert "round 50 committed 60 s ago; bound 300 s" in check(run_dir, now=NOW).reason
    late = check(run_dir, now=NOW + 400)  # no commit for 460 s
    assert not late.healthy and late.reason.startswith("unhealthy: round 50 committed 460 s ago")
    assert check(run_dir, max_age=600, now=NOW + 400).healthy  # --max-age overrides the derived bound


def test_failed_rounds_count_and_the_bound_follows_the_round_time(tmp_path, peer_process):
    commits = _rounds(NOW - 1000, 10, 10.0)
    failing = [(NOW - 890 + 10 * i, 11, False, 10.0) for i in range(80)]  # alone since: every round fails
    run_dir = _folder(tmp_path, peer_process.pid, NOW - 1100, commits + failing)
    verdict = check(run_dir, now=NOW)
    assert not verdict.healthy, verdict.reason  # 5 x 10 s is below the floor: bound MIN_AGE_S
    assert f"bound {MIN_AGE_S:.0f} s" in verdict.reason and "(80 rounds tried since, none committed)" in verdict.reason


def test_a_restarted_peer_counts_from_its_start_not_from_old_commits(tmp_path, peer_process):
    old = _rounds(NOW - 90_000, 5, 60.0)  # yesterday's process
    run_dir = _folder(tmp_path, peer_process.pid, NOW - 100, old)
    verdict = check(run_dir, now=NOW)
    assert verdict.healthy and "no round committed since it started 100 s ago" in verdict.reason
    assert not check(run_dir, now=NOW + 400).healthy  # 5 x 60 s later still nothing


def test_a_starting_peer_has_the_start_up_bound(tmp_path, peer_process):
    run_dir = _folder(tmp_path, peer_process.pid, NOW - 60)
    assert check(run_dir, now=NOW).healthy
    verdict = check(run_dir, now=NOW - 60 + START_AGE_S + 1)
    assert not verdict.healthy and f"bound {START_AGE_S:.0f} s" in verdict.reason


def test_no_peer_a_dead_one_or_another_program_under_its_pid_is_unhealthy(tmp_path, process_tag):
    assert "no peer.pid" in check(tmp_path, now=NOW).reason
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # not a peer
    try:
        run_dir = _folder(tmp_path, other.pid, NOW - 10, _rounds(NOW - 5, 1, 1.0))
        assert check(run_dir, now=NOW).reason == f"unhealthy: the peer (pid {other.pid} in {PID_FILE}) is not running"
    finally:
        other.kill()
        other.wait()
    assert not check(run_dir, now=NOW).healthy  # the pid is gone now
    (tmp_path / PID_FILE).write_text("{not json")
    assert "is unreadable" in check(run_dir, now=NOW).reason


def test_only_the_end_of_a_long_metrics_file_is_read_and_bad_lines_are_skipped(tmp_path, peer_process):
    run_dir = _folder(tmp_path, peer_process.pid, NOW - 10_000, _rounds(NOW - 9000, 100, 60.0))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "note", "pad": "x" * TAIL_BYTES}) + "\n")  # the old rounds fall out of the tail
        f.write("[1, 2]\n" + json.dumps({"time": "soon", "event": "round", "committed": True}) + "\n")
        f.write(json.dumps({"time": NOW - 30, "event": "round", "round": 101, "committed": True,
                            "time/round_s": 60.0}) + "\n")
        f.write('{"time": 1, "event": "rou')  # a torn last line
    verdict = check(run_dir, now=NOW)
    assert verdict.healthy and "round 101 committed 30 s ago" in verdict.reason
    assert f"bound {MIN_AGE_S * 2.5:.0f} s" in verdict.reason  # only round 101's time in the tail: 5 x 60


def test_pid_file_is_removed_after_the_block_unless_a_newer_peer_took_it(tmp_path):
    with pid_file(tmp_path):
        assert json.loads((tmp_path / PID_FILE).read_text())["pid"] > 0
    assert not (tmp_path / PID_FILE).exists()
    with pid_file(tmp_path):
        (tmp_path / PID_FILE).write_text(json.dumps({"pid": 1, "started": time.time()}))  # a newer peer's
    assert (tmp_path / PID_FILE).exists()


def _health(*args):
    return subprocess.run([sys.executable, "-m", "p2p_diloco", "health", *args], capture_output=True, text=True,
                          timeout=60)


def test_health_command_exit_codes(tmp_path, peer_process):
    run_dir = _folder(tmp_path, peer_process.pid, time.time() - 10, _rounds(time.time() - 5, 1, 2.0))
    ok = _health("--run-dir", run_dir)
    assert ok.returncode == 0 and ok.stdout.startswith("healthy: round 1 committed"), ok
    late = _health("--run-dir", run_dir, "--max-age", "1")
    assert late.returncode == 1 and late.stdout.startswith("unhealthy: ") and len(late.stdout.splitlines()) == 1
    for bad in (["--run-dir", str(tmp_path / "nope")], ["--run-dir", run_dir, "--max-age", "0"]):
        out = _health(*bad)
        assert out.returncode == 2 and out.stderr.startswith("p2p-diloco: error: --"), out
