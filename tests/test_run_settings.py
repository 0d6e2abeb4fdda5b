"""One run, many kinds of peer: run settings vs machine settings, published in the DHT, adopted or refused."""

from __future__ import annotations


import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.config import load_config, shared_keys, shared_settings
from p2p_diloco.net.run_settings import adopt_settings, expects_run, first_difference, run_settings_of
from p2p_diloco.ops.metrics import read_jsonl

PEERS = Path(__file__).parent.parent / "peers"


@pytest.mark.timeout(30)
def test_run_settings_are_what_peers_compute_together_and_machine_settings_the_rest():
    keys = set(shared_keys())
    for key in ("model.name", "model.seq_len", "data.dataset", "data.tokenizer", "inner.lr", "inner.lr_clock",
                "diloco.inner_steps", "diloco.outer_optimizer", "diloco.dn_delay", "diloco.max_staleness",
                "averaging.codec", "averaging.min_group_size", "averaging.part_size_bytes", "run.run_id",
                "run.seed", "run.rounds"):
        assert key in keys, key
    for key in ("inner.batch_size", "inner.grad_accum", "run.device", "run.threads", "run.name", "run.run_dir",
                "averaging.allreduce_timeout", "averaging.matchmaking_time", "network.client_mode",
                "fault.slowdown", "data.streaming"):
        assert key not in keys, key


@pytest.mark.timeout(30)
def test_machine_files_hold_machine_settings_only_and_layer_onto_the_run_file(monkeypatch):
    from p2p_diloco.config import sections

    # 8-bit moments need torchao, which this machine may lack (a machine's own check then refuses the file: tested in
    # test_memory_options); here the files are read as on a machine that has it
    monkeypatch.setattr(sections, "_installed", lambda module: True)
    for machine in sorted(PEERS.glob("machine-*.toml")):
        given: set[str] = set()
        load_config(machine, given=given)
        assert given and not given & set(shared_keys()), f"{machine.name} sets run settings: {given}"
    given = set()
    cfg = load_config([PEERS / "run-c4-400m.toml", PEERS / "machine-12gb.toml"], {"inner.lr": "1e-4"}, given=given)
    assert (cfg.model.name, cfg.inner.batch_size, cfg.inner.grad_accum, cfg.inner.lr) == ("400m", 2, 32, 1e-4)
    assert {"model.name", "inner.batch_size", "inner.lr"} <= given and "inner.beta1" not in given


@pytest.mark.timeout(30)
def test_a_set_run_setting_must_match_the_run_and_the_others_are_adopted():
    run = shared_settings(load_config(overrides={"model.seq_len": "64", "diloco.inner_steps": "40"}))
    mine = load_config(overrides={"model.seq_len": "32", "run.threads": "1"})
    problem = first_difference(mine, run, given={"model.seq_len", "run.threads"})
    assert problem.startswith("model.seq_len: this peer has 32, run 'p2p-diloco' has 64")
    assert first_difference(mine, run, given={"run.threads"}) is None  # not set by us: adopted, not compared
    assert first_difference(mine, run, given=None).startswith("model.seq_len")  # None: every key is ours
    adopted, changed = adopt_settings(mine, {**run, "future.key": 1})
    assert (adopted.model.seq_len, adopted.diloco.inner_steps, adopted.run.threads) == (64, 40, 1)
    assert changed == ["model.seq_len", "diloco.inner_steps", "?future.key"]
    assert mine.model.seq_len == 32  # the peer's own config is left alone


@pytest.mark.timeout(30)
def test_the_settings_most_peers_publish_win_and_joiners_without_run_settings_wait_for_them():
    a, b = {"model.name": "tiny"}, {"model.name": "60m"}
    assert run_settings_of([{"settings": a}, {"settings": b}, {"settings": a}, {"junk": 1}, "junk"]) == a
    assert run_settings_of([]) is None
    joiner = load_config(overrides={"network.initial_peers": "/ip4/1.2.3.4/tcp/1"})
    assert expects_run(joiner, {"run.run_id", "run.threads", "network.initial_peers"})
    assert not expects_run(joiner, {"run.run_id", "model.name"})  # it brings run settings: it may start the run
    assert not expects_run(load_config(), {"run.run_id"})  # no initial peers: a new swarm


def _peer(*args, **kwargs):
    machine = ["--network.host_maddrs=/ip4/127.0.0.1/tcp/0", "--network.identity_path=none", "--run.progress=false",
               "--run.threads=1", "--inner.batch_size=2", "--inner.grad_accum=1", "--averaging.matchmaking_time=5",
               "--averaging.request_timeout=2", "--averaging.roster_ttl=6", "--network.join_timeout=20"]
    return subprocess.Popen([sys.executable, "-m", "p2p_diloco", "peer", *args, *machine], text=True,
                            stdin=subprocess.DEVNULL, **kwargs)


@pytest.mark.timeout(180)
def test_two_machine_configs_of_one_run_average_together_and_a_mismatch_is_refused(tmp_path, process_tag):
    first = _peer("--config", str(PEERS / "cpu-test.toml"), "--config", str(PEERS / "machine-80gb.toml"),
                  "--run.name=a", f"--run.run_dir={tmp_path / 'a'}", "--run.expected_peers=2", "--run.rounds=2",
                  "--diloco.inner_steps=4", "--model.seq_len=32", "--data.eval_batches=1",
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    others = []
    try:
        for line in first.stdout:  # until it serves the run (and publishes its settings)
            if "joined run" in line:
                break
        maddr = (tmp_path / "a" / "maddrs.txt").read_text().split()[0]
        with open(tmp_path / "b.log", "w") as log:  # only machine settings and the run id
            others.append(_peer("--config", str(PEERS / "machine-12gb.toml"), "--run.run_id=cpu-test",
                                "--initial-peers", maddr, "--run.name=b", f"--run.run_dir={tmp_path / 'b'}",
                                stdout=log, stderr=subprocess.STDOUT))
        refused = _peer("--config", str(PEERS / "machine-24gb.toml"), "--run.run_id=cpu-test", "--model.seq_len=48",
                        "--initial-peers", maddr, f"--run.run_dir={tmp_path / 'c'}", stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE)
        others.append(refused)
        _, err = refused.communicate(timeout=60)
        assert refused.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("p2p-diloco: error: model.seq_len: this peer has 48, run "
                                                       "'cpu-test' has 32"), err
        first.stdout.read()  # drain: the peer logs to this pipe until it exits
        assert first.wait(timeout=120) == 0 and others[0].wait(timeout=60) == 0, (tmp_path / "b.log").read_text()
    finally:
        for proc in [first, *others]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = (tmp_path / "b.log").read_text()
    assert "adopted its settings" in log and "model.seq_len=32" in log and "diloco.inner_steps=4" in log
    by_peer = {}
    for name in ("a", "b"):
        rounds = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r.get("event") == "round"]
        by_peer[name] = {r["round"]: r for r in rounds if r["committed"]}
        assert sorted(by_peer[name]) == [1, 2], f"{name} committed {sorted(by_peer[name])}"
    for r in (1, 2):
        assert by_peer["a"][r]["outer/group_size"] == 2  # averaged together
        assert by_peer["a"][r]["global_params_sha256"] == by_peer["b"][r]["global_params_sha256"]
