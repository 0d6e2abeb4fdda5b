"""Run-spec takeover (issue 24, finding 4), in a real swarm of 2 peer processes with an outside DHT process: one node
with 3 keys of its own publishes, under the run's settings key, the run's spec with ``data.dataset`` set to a file on
the joiners' disk, ``inner.lr = 400`` and the reducer checks and exclusions off: a majority of 3 signed entries to
the first peer's 1. Before the fix a joiner with only the run id took that spec (and trained on the file, averaging
with the run, whose fingerprint covered none of it). Now a joiner without the spec hash is refused in one line
naming what it will not take from the DHT, and a joiner given the hash (printed by the first peer) takes the run's
spec and averages with the run every round."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest

from p2p_diloco.ops.metrics import read_jsonl

ATTACKER = Path(__file__).with_name("spec_attacker.py")
PEERS = Path(__file__).parents[2] / "peers"
ROUNDS = 2
MACHINE = ["--network.host_maddrs=/ip4/127.0.0.1/tcp/0", "--network.identity_path=none", "--run.progress=false",
           "--run.threads=1", "--inner.batch_size=2", "--inner.grad_accum=1", "--averaging.matchmaking_time=5",
           "--averaging.request_timeout=2", "--averaging.roster_ttl=6", "--network.join_timeout=20",
           "--run.checkpoint_every=0"]


def _start(args: list[str], log: Path, **kwargs) -> subprocess.Popen:
    with open(log, "w") as out:  # the child holds its own copy of the file
        return subprocess.Popen(args, text=True, stdin=subprocess.DEVNULL, stdout=out, **kwargs)


def _peer(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", "peer", *args, *MACHINE]


class _Tail:
    """Drains a process's stdout into a file on a thread; :meth:`wait_for` waits for a line matching a pattern."""

    def __init__(self, proc: subprocess.Popen, sink: Path):
        self.lines: list[str] = []
        self.sink, self.changed, self.ended = sink, threading.Condition(), False
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()

    def _drain(self, proc: subprocess.Popen) -> None:
        with open(self.sink, "w") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                with self.changed:
                    self.lines.append(line)
                    self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        def found():
            return next((m for m in map(re.compile(pattern).search, self.lines) if m), None)

        with self.changed:  # found() runs with the condition's lock held
            self.changed.wait_for(lambda: found() or self.ended, timeout)
            match = found()
        assert match, f"no line matching {pattern!r}:\n{''.join(self.lines)[-3000:]}"
        return match

    def search(self, pattern: str) -> Optional[re.Match]:
        """The first line read so far that matches ``pattern``, or None."""
        with self.changed:
            return next((m for m in map(re.compile(pattern).search, self.lines) if m), None)


@pytest.mark.timeout(900)  # 90 s on an idle 2-core machine, 480 s at load 30 (each start took minutes)
def test_sybil_run_specs_neither_redirect_a_joiner_nor_reach_its_files(tmp_path, process_tag):
    victim_file = tmp_path / "home" / "diary.txt"  # a file of the joiner's own, which the Sybil spec names
    victim_file.parent.mkdir()
    victim_file.write_text("private notes, never to leave this machine\n" * 200)
    change = {"data.dataset": str(victim_file), "inner.lr": 400.0, "averaging.verify_parts": False,
              "averaging.suspect_rounds": 0}
    stop = tmp_path / "attacker.stop"
    first = subprocess.Popen(_peer("--config", str(PEERS / "cpu-test.toml"), "--run.run_id=spec-attacked",
                                   "--run.name=a", f"--run.run_dir={tmp_path / 'a'}", "--run.expected_peers=2",
                                   "--run.expected_peers_timeout=900",  # it waits for b, started once c is refused
                                   f"--run.rounds={ROUNDS}", "--diloco.inner_steps=4", "--model.seq_len=32",
                                   "--data.eval_batches=1"),
                             text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    attacker = subprocess.Popen([sys.executable, str(ATTACKER), "--bootstrap-file", str(tmp_path / "a" / "maddrs.txt"),
                                 "--run-id", "spec-attacked", "--change", json.dumps(change), "--sybils", "3",
                                 "--stop", str(stop)],
                                text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    procs = [first, attacker]
    try:
        first_out = _Tail(first, tmp_path / "a.log")
        first_out.wait_for("joined run", 300)  # it serves the run and publishes its settings
        stored = _Tail(attacker, tmp_path / "attacker.log").wait_for(r"stored ([1-9]\d*)", 240)
        assert int(stored.group(1)) >= 3, stored.group(0)  # the first peer's node holds the 3 Sybil entries
        maddr = (tmp_path / "a" / "maddrs.txt").read_text().split()[0]
        joiner = ["--config", str(PEERS / "machine-12gb.toml"), "--run.run_id=spec-attacked", "--initial-peers", maddr]
        plain = _start(_peer(*joiner, "--run.name=c", f"--run.run_dir={tmp_path / 'c'}"), tmp_path / "c.log",
                       stderr=subprocess.PIPE)
        procs.append(plain)

        # without the hash: refused in one line naming what it will not take, before it reads any data. b starts only
        # after: a and b end their 2 rounds within seconds, and a is c's only initial peer (CI: c started as a left,
        # and found nobody to ask)
        _, err = plain.communicate(timeout=360)
        lines = err.strip().splitlines()
        assert plain.returncode == 2 and len(lines) == 1, f"{err[-2000:]}\n{(tmp_path / 'c.log').read_text()[-2000:]}"
        assert lines[0].startswith("p2p-diloco: error: run 'spec-attacked': its published settings hold what"), err
        for shown in (f"data.dataset={victim_file} (a local path)", "inner.lr=400.0 (above the limit",
                      "averaging.verify_parts=false (weaker", "averaging.suspect_rounds=0 (weaker"):
            assert shown in lines[0], lines[0]
        assert not (tmp_path / "c" / "metrics.jsonl").exists()  # it never started training

        # with the hash: the run's spec, whatever the votes; it averages with the run every round
        spec = first_out.search(r"run spec ([0-9a-f]{16})")  # logged before "joined run"
        assert spec is not None, "the first peer logged no run spec"
        second = _start(_peer(*joiner, f"--run.spec_hash={spec.group(1)}", "--run.name=b",
                              f"--run.run_dir={tmp_path / 'b'}"), tmp_path / "b.log", stderr=subprocess.STDOUT)
        procs.append(second)
        assert first.wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert second.wait(timeout=120) == 0, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        stop.touch()
        for proc in procs:
            try:
                proc.wait(timeout=30 if proc is procs[1] else 1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    log = (tmp_path / "b.log").read_text()
    assert f"(spec {spec.group(1)}, as given)" in log and f"run spec {spec.group(1)}" in log, log[-3000:]
    assert str(victim_file) not in log and "inner.lr=0.001" in log, log[-3000:]
    by_peer = {}
    for name in ("a", "b"):
        rounds = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r.get("event") == "round"]
        by_peer[name] = {r["round"]: r for r in rounds if r["committed"]}
        assert sorted(by_peer[name]) == list(range(1, ROUNDS + 1)), f"{name} committed {sorted(by_peer[name])}"
    for r in range(1, ROUNDS + 1):
        assert by_peer["a"][r]["outer/group_size"] == 2  # averaged together: the same spec, the same prefix
        assert by_peer["a"][r]["global_params_sha256"] == by_peer["b"][r]["global_params_sha256"]
