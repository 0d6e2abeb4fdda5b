"""The Prometheus endpoint of a peer (``metrics.port``, p2p_diloco/ops/telemetry.py): the update from round records
without processes, the counters other code increments, the HTTP server's start and stop, a taken port refused
before start-up, and a live 2-peer swarm scraped while it runs."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.ops.faults import HOLD_FILE
from p2p_diloco.ops.swarm import LocalSwarm
from p2p_diloco.ops.telemetry import MAX_LABEL_CHARS, MAX_LABEL_SETS, PrometheusSink, Telemetry

NAMED = ("p2p_diloco_rounds_committed", "p2p_diloco_rounds_failed", "p2p_diloco_round_seconds",
         "p2p_diloco_inner_seconds", "p2p_diloco_matchmaking_seconds", "p2p_diloco_allreduce_seconds",
         "p2p_diloco_sent_bytes", "p2p_diloco_received_bytes", "p2p_diloco_train_loss", "p2p_diloco_eval_loss",
         "p2p_diloco_tokens_per_second", "p2p_diloco_group_size", "p2p_diloco_round",
         "p2p_diloco_last_commit_age_seconds", "p2p_diloco_uncommitted_rounds", "p2p_diloco_missed_rounds",
         "p2p_diloco_helper_restarts", "p2p_diloco_dropped_records")


def _round(committed: bool, round_: int, **extra) -> dict:
    """A round record as ops/records.py log_round writes it (the keys the telemetry reads, and a few it ignores)."""
    record = {"event": "round", "peer": "p0", "round": round_, "committed": committed, "outer/group_size": 2,
              "outer/peers": ["p0", "p1"], "train/loss": 3.5, "train/tokens": 1000, "train/inner_steps": 10,
              "outer/allreduce_s": 1.5, "outer/allreduce_only_s": 0.5, "outer/bytes_sent": 4000,
              "outer/bytes_received": 3000, "time/round_s": 6.0, "time/inner_s": 4.0, "train/tokens_per_s": 250.0,
              "train/mfu": None, "error": None if committed else "AllreduceException"}
    return {**record, **extra}


def _families(text: str) -> dict:
    """name -> {(sample name, labels as a sorted tuple): value}"""
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, sample: str = "", **labels) -> float:
    return families[name][(sample or name, tuple(sorted(labels.items())))]


def test_metrics_follow_the_round_records_without_processes():
    now = [1000.0]
    t = Telemetry(clock=lambda: now[0])
    t.observe({"event": "start", "peer": "p0", "round": 0, "eval/loss": 5.5})
    now[0] = 1010.0
    t.observe(_round(True, 1, **{"eval/loss": 4.0}))
    now[0] = 1020.0
    t.observe(_round(False, 1, **{"outer/group_size": 0, "outer/allreduce_only_s": 0.0, "outer/bytes_sent": 0,
                                  "outer/bytes_received": 0, "train/loss": 3.0}))
    t.observe({"event": "rebase", "peer": "p0", "round": 3, "from_round": 1})  # caught up with the run
    # the record drained after the last round (overlap): no inner steps, so no loss, speed or inner time from it
    t.observe(_round(True, 4, **{"train/inner_steps": 0, "train/tokens": 0, "train/tokens_per_s": 0.0,
                                 "train/loss": float("nan"), "time/inner_s": 0.0}))
    now[0] = 1050.0
    f = _families(generate_latest(t.registry).decode())
    assert set(NAMED) <= set(f), sorted(set(NAMED) - set(f))
    assert _value(f, "p2p_diloco_rounds_committed", "p2p_diloco_rounds_committed_total") == 2
    assert _value(f, "p2p_diloco_rounds_failed", "p2p_diloco_rounds_failed_total") == 1
    assert _value(f, "p2p_diloco_sent_bytes", "p2p_diloco_sent_bytes_total") == 8000
    assert _value(f, "p2p_diloco_received_bytes", "p2p_diloco_received_bytes_total") == 6000
    assert _value(f, "p2p_diloco_tokens", "p2p_diloco_tokens_total") == 2000
    assert _value(f, "p2p_diloco_round_seconds", "p2p_diloco_round_seconds_count") == 3
    assert _value(f, "p2p_diloco_round_seconds", "p2p_diloco_round_seconds_sum") == 18.0
    assert _value(f, "p2p_diloco_inner_seconds", "p2p_diloco_inner_seconds_count") == 2  # not the drained one
    assert _value(f, "p2p_diloco_matchmaking_seconds", "p2p_diloco_matchmaking_seconds_sum") == 1.0 + 1.5 + 1.0
    assert _value(f, "p2p_diloco_allreduce_seconds", "p2p_diloco_allreduce_seconds_count") == 2  # groups formed
    assert _value(f, "p2p_diloco_round_seconds", "p2p_diloco_round_seconds_bucket", le="5.0") == 0
    assert _value(f, "p2p_diloco_round_seconds", "p2p_diloco_round_seconds_bucket", le="10.0") == 3
    assert _value(f, "p2p_diloco_train_loss") == 3.0  # the failed round's; the drained record's NaN is skipped
    assert _value(f, "p2p_diloco_eval_loss") == 4.0
    assert _value(f, "p2p_diloco_tokens_per_second") == 250.0
    assert _value(f, "p2p_diloco_group_size") == 2
    assert _value(f, "p2p_diloco_round") == 4
    assert _value(f, "p2p_diloco_last_commit_timestamp_seconds") == 1020.0
    assert _value(f, "p2p_diloco_last_commit_age_seconds") == 30.0
    assert _value(f, "p2p_diloco_uncommitted_rounds") == 0  # the failed attempt was followed by a commit


def test_metrics_commit_age_counts_from_start_before_the_first_commit():
    now = [500.0]
    t = Telemetry(clock=lambda: now[0])
    t.observe(_round(False, 0))
    now[0] = 542.0
    f = _families(generate_latest(t.registry).decode())
    assert _value(f, "p2p_diloco_last_commit_age_seconds") == 42.0
    assert _value(f, "p2p_diloco_last_commit_timestamp_seconds") == 0
    t.observe(_round(False, 0))
    assert t.registry.get_sample_value("p2p_diloco_uncommitted_rounds") == 2


def test_metrics_counts_from_other_code_are_labelled_and_bounded():
    t = Telemetry()
    t.count_restart("p2pd")
    t.count_restart("p2pd")
    t.count_restart("dht")
    t.count_dropped_record("roster", "bad type")
    t.count_dropped_record("roster", "x" * 500 + "\n<script>")  # cut, and no raw newline reaches the text format
    for i in range(2 * MAX_LABEL_SETS):
        t.count_dropped_record("state", f"reason {i}")
    f = _families(generate_latest(t.registry).decode())
    assert _value(f, "p2p_diloco_helper_restarts", "p2p_diloco_helper_restarts_total", helper="p2pd") == 2
    assert _value(f, "p2p_diloco_helper_restarts", "p2p_diloco_helper_restarts_total", helper="dht") == 1
    dropped = {labels: v for (name, labels), v in f["p2p_diloco_dropped_records"].items()
               if name == "p2p_diloco_dropped_records_total"}
    assert dropped[(("kind", "roster"), ("reason", "bad type"))] == 1
    assert dropped[(("kind", "roster"), ("reason", "x" * MAX_LABEL_CHARS))] == 1
    assert len(dropped) == MAX_LABEL_SETS + 1  # the first 64 label sets, then one "other"
    assert sum(dropped.values()) == 2 + 2 * MAX_LABEL_SETS  # nothing lost, only lumped together
    assert dropped[(("kind", "other"), ("reason", "other"))] == 2 * MAX_LABEL_SETS - (MAX_LABEL_SETS - 2)


def test_metrics_module_functions_count_into_the_process_registry():
    from p2p_diloco.ops import telemetry

    before = telemetry.process_telemetry().registry.get_sample_value(
        "p2p_diloco_helper_restarts_total", {"helper": "averager"}) or 0
    telemetry.count_restart("averager")
    telemetry.count_dropped_record("roster", "too large")
    registry = telemetry.process_telemetry().registry
    assert registry.get_sample_value("p2p_diloco_helper_restarts_total", {"helper": "averager"}) == before + 1
    assert registry.get_sample_value("p2p_diloco_dropped_records_total", {"kind": "roster", "reason": "too large"}) >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        return _families(response.read().decode())


def test_metrics_endpoint_serves_the_sink_and_lets_go_of_its_port():
    port = _free_port()
    sink = PrometheusSink("127.0.0.1", port, peer="p0", run_id="r", telemetry=Telemetry())
    try:
        sink.log(_round(True, 1))
        f = _scrape(port)
        assert _value(f, "p2p_diloco_rounds_committed", "p2p_diloco_rounds_committed_total") == 1
        assert _value(f, "p2p_diloco_peer_info", peer="p0", run_id="r") == 1
    finally:
        sink.close()
    sink.close()  # twice is harmless
    with pytest.raises(urllib.error.URLError):
        _scrape(port, timeout=2)
    again = PrometheusSink("127.0.0.1", port, peer="p0", run_id="r", telemetry=Telemetry())  # a restart serves
    again.close()


@pytest.mark.timeout(60)
def test_metrics_taken_port_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "p2p_diloco", "peer", f"--metrics.port={port}",
                              f"--run.run_dir={tmp_path / 'peer'}", "--network.host_maddrs=/ip4/127.0.0.1/tcp/0"],
                             capture_output=True, text=True, timeout=50, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "metrics.port" in lines[0] and "already in use" in lines[0], out.stderr
    assert not (tmp_path / "peer").exists()  # refused before the peer started


@pytest.mark.timeout(60)
def test_metrics_port_given_to_a_whole_swarm_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "p2p_diloco", "swarm", "--run-dir", str(tmp_path),
                          "--metrics.port=9100"], capture_output=True, text=True, timeout=50,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "metrics.port" in out.stderr


PEER_ARGS = ["--model.name=tiny", "--model.seq_len=32", "--inner.batch_size=4", "--data.eval_batches=1",
             "--diloco.inner_steps=6", "--run.threads=1", "--run.progress=false", "--run.expected_peers=2",
             "--averaging.matchmaking_time=4", "--averaging.request_timeout=2", "--averaging.roster_ttl=6",
             "--run.run_id=metrics-test", "--run.checkpoint_every=0", "--run.rounds=4"]


def _release(hold: Path) -> None:
    """End a peer's ``hold:`` fault (ops/faults.py): it waits while its hold file exists."""
    deadline = time.monotonic() + 60
    while not hold.exists():
        assert time.monotonic() < deadline, f"{hold} never appeared"
        time.sleep(0.1)  # another process's file: polled
    hold.unlink()


def _wait_scrape(port: int, until, timeout: float, what: str, proc) -> dict:
    """Scrape until ``until(families)`` holds; the peer's process must stay alive meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the peer exited ({proc.returncode}) before {what}"
        try:
            families = _scrape(port)
            if until(families):
                return families
        except (urllib.error.URLError, ConnectionError):
            pass  # the endpoint starts once the peer has built its model
        time.sleep(0.5)  # another process's state, over HTTP: nothing to wait on but the next scrape
    raise AssertionError(f"timed out waiting for {what}")


def _committed(families: dict) -> float:
    return _value(families, "p2p_diloco_rounds_committed", "p2p_diloco_rounds_committed_total")


@pytest.mark.timeout(240)
def test_metrics_live_swarm_serves_the_named_metrics_and_they_move_as_rounds_commit(tmp_path, process_tag):
    ports = {"peer0": _free_port(), "peer1": _free_port()}
    swarm = LocalSwarm(tmp_path, peer_args=PEER_ARGS)
    try:
        swarm.start_bootstrap()
        # Rounds here can take a tenth of a second (CI: all 4 within one second, the peer gone before a second
        # scrape). So peer0 waits in round 2's inner steps until the first scrape, and peer1 in round 3's until the
        # scrapes are done: peer0 cannot commit round 3 without it (the quorum), nor end the run.
        holds = {"peer0": 2, "peer1": 3}
        for name, port in ports.items():
            swarm.start_peer(name, [f"--metrics.port={port}", f"--fault.inject=hold:inner:{holds[name]}"])
        proc = swarm.peers["peer0"].proc
        first = _wait_scrape(ports["peer0"], lambda f: _committed(f) >= 1, 150, "a committed round", proc)
        _release(tmp_path / "peer0" / HOLD_FILE)
        later = _wait_scrape(ports["peer0"], lambda f: _committed(f) > _committed(first), 90,
                             "a second committed round", proc)
        assert set(NAMED) <= set(later), sorted(set(NAMED) - set(later))
        assert _value(later, "p2p_diloco_peer_info", peer="peer0", run_id="metrics-test") == 1
        assert _value(later, "p2p_diloco_round") >= _committed(later)
        assert _value(later, "p2p_diloco_group_size") == 2
        assert _value(later, "p2p_diloco_sent_bytes", "p2p_diloco_sent_bytes_total") > \
            _value(first, "p2p_diloco_sent_bytes", "p2p_diloco_sent_bytes_total") > 0
        assert _value(later, "p2p_diloco_round_seconds", "p2p_diloco_round_seconds_count") >= 2
        assert 0 < _value(later, "p2p_diloco_train_loss") < 10 and 0 < _value(later, "p2p_diloco_eval_loss") < 10
        assert _value(later, "p2p_diloco_tokens_per_second") > 0
        assert 0 <= _value(later, "p2p_diloco_last_commit_age_seconds") < 120
        other = _wait_scrape(ports["peer1"], lambda f: _committed(f) >= 1, 60, "peer1's committed round",
                             swarm.peers["peer1"].proc)
        assert _value(other, "p2p_diloco_peer_info", peer="peer1", run_id="metrics-test") == 1
        _release(tmp_path / "peer1" / HOLD_FILE)
        for child in swarm.peers.values():  # both finish their rounds and exit cleanly, closing the endpoint
            assert child.proc.wait(timeout=120) == 0, child.log_path.read_text()[-3000:]
        with pytest.raises(urllib.error.URLError):
            _scrape(ports["peer0"], timeout=2)
    finally:
        swarm.close()
