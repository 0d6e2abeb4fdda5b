"""Clean stops whatever the signal (issue 28, item 3): SIGTERM or SIGINT, to a peer's process or to its whole process
group, at each phase of its life (start-up, state download, inner steps, matchmaking, all-reduce) and to the bootstrap
node, ends it within 15 s with no process of its group left; a clean stop leaves a checkpoint that loads and holds a
θ_global the peer logged; a second signal, or a stop stuck for STOP_GRACE_S, ends it at once with 128 + the signal.

One swarm serves the module: a bootstrap node and two anchor peers (a0, a1) that train together until the last test
stops them; each test's peer (a victim, started two at a time) is parked in its phase by the test-only fault
``hold:PHASE:0`` (ops/faults.py: the peer waits in that phase, at its first occurrence, until the harness removes its
``hold`` file), signalled there, then released.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.config import load_config
from p2p_diloco.ops.checkpoint import load_checkpoint
from p2p_diloco.ops.faults import HOLD_FILE
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.procs import group_members
from p2p_diloco.ops.stop import STOP_GRACE_S
from p2p_diloco.ops.swarm import DEMO_DEFAULTS, LocalSwarm, write_peer_config
from p2p_diloco.train.outer import state_digests

STOP_BOUND_S = 15.0
SMALL = {"inner.batch_size": 2, "model.seq_len": 32, "data.eval_batches": 1, "diloco.inner_steps": 6,
         "averaging.matchmaking_time": 3.0, "averaging.request_timeout": 1.0, "averaging.next_chunk_timeout": 5.0,
         "averaging.allreduce_timeout": 20.0, "run.checkpoint_every": 1,
         "diloco.dylu": False}  # every round runs its H inner steps: a hold at step H/2 always comes
TIMES: dict[str, float] = {}  # what each stop took, printed at the end (pytest -s) for the record


# each test's peer and its flags, and the peers started with it (beside the anchors: four peers at most)
VICTIMS = {"v-start": [], "v-download": ["--fault.inject=hold:download:0", "--run.join_after_round=1"],
           "v-inner": ["--fault.inject=hold:inner:0"], "v-match": ["--fault.inject=hold:matchmaking:0"],
           "v-allreduce": ["--fault.inject=hold:allreduce:0"], "v-twice": ["--fault.inject=hold:inner:0"],
           "v-stuck": ["--fault.inject=hold:inner:0"]}
WAVES = [("v-download", "v-inner"), ("v-start",), ("v-match", "v-allreduce"), ("v-twice", "v-stuck")]


class Swarm:
    def __init__(self, root: Path):
        cfg = load_config(defaults={**DEMO_DEFAULTS, **SMALL})
        self.local = LocalSwarm(root, peer_args=write_peer_config(root, cfg))
        self.root = root

    def start(self) -> None:
        self.local.start_bootstrap()
        for name in ("a0", "a1"):  # slowed down (sleeps between steps): they leave the CPU to the others
            self.local.start_peer(name, ["--run.expected_peers=2", "--fault.slowdown=3"])
        self.victim(WAVES[0][0])  # the first wave starts with them (v-download joins once round 1 is committed)
        wait_for(lambda: committed(self.root / "a0") >= 1, 240, "the anchors' first round", self)

    def victim(self, name: str):
        """The test's peer, started now with the rest of its wave unless an earlier test started it."""
        if name not in self.local.peers:
            for other in next(w for w in WAVES if name in w):
                if other not in self.local.peers:
                    self.local.start_peer(other, ["--run.expected_peers=1", *VICTIMS[other]])
        return self.local.peers[name]

    def diagnose(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.root.glob("*.log")))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, module_process_tag):
    s = Swarm(tmp_path_factory.mktemp("stop"))
    try:
        s.start()
        yield s
    finally:
        s.local.close()
        if TIMES:
            print("\nstop times: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMES.items()))


def wait_for(condition, timeout: float, what: str, swarm: Swarm) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{swarm.diagnose()}"
        time.sleep(0.05)  # other processes' files are what there is to watch


def committed(run_dir: Path) -> int:
    return max((r["round"] for r in read_jsonl(run_dir / "metrics.jsonl")
                if r.get("event") == "round" and r["committed"]), default=0)


def send(child, sig: int, group: bool) -> None:
    if group:
        os.killpg(child.proc.pid, sig)
    else:
        child.proc.send_signal(sig)


def stop_time(child, sig: int, group: bool, release: Path | None = None, label: str = "") -> tuple[float, int]:
    """Signal ``child`` (then release its hold); seconds until it exited and nothing of its group is left."""
    began = time.monotonic()
    send(child, sig, group)
    if release is not None:
        release.unlink()
    try:
        code = child.proc.wait(timeout=STOP_BOUND_S + 15)
    except subprocess.TimeoutExpired:
        code = None
    while group_members(child.proc.pid) and time.monotonic() - began < STOP_BOUND_S + 15:
        time.sleep(0.02)  # the kernel ends the helpers (PDEATHSIG) just after the peer
    took = time.monotonic() - began
    TIMES[label or child.name] = took
    log = child.log_path.read_text()[-3000:]
    assert code is not None, f"{child.name} still running {STOP_BOUND_S + 15:.0f} s after {sig.name}:\n{log}"
    left = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in group_members(child.proc.pid)}
    assert not left, f"{child.name}: processes of its group left after it exited: {left}"
    assert took < STOP_BOUND_S, f"{child.name} took {took:.1f} s to stop on {sig.name}:\n{log}"
    return took, code


def assert_clean(child, code: int) -> None:
    """Exit 0 after a checkpoint that loads and holds a θ_global the peer itself logged for the saved round."""
    log = child.log_path.read_text()
    assert code == 0, f"{child.name} exited {code}:\n{log[-3000:]}"
    assert "stopping after the current step" in log
    saved = load_checkpoint(child.run_dir)
    assert saved is not None, f"{child.name} left no checkpoint"
    digest, _ = state_digests(saved["global_params"], [])
    logged = {(r["round"], r["global_params_sha256"]) for r in read_jsonl(child.run_dir / "metrics.jsonl")
              if r.get("global_params_sha256") and (r.get("event") != "round" or r["committed"])}
    assert (saved["round"], digest) in logged, f"checkpoint of round {saved['round']}: θ_global never logged"


def health(child):
    return subprocess.run([sys.executable, "-m", "p2p_diloco", "health", "--run-dir", str(child.run_dir)],
                          capture_output=True, text=True, timeout=60)


def hold_of(child) -> Path:
    return child.run_dir / HOLD_FILE


# ------------------------------------------------------------------------------------------------ a checkpoint write

WRITER = """
import os, signal, sys, threading, time
from p2p_diloco.ops.stop import on_stop_signals, unhurried
on_stop_signals(threading.Event(), grace_s=0.5)
os.kill(os.getpid(), signal.SIGTERM)  # the stop begins; its deadline is 0.5 s away
with unhurried("the checkpoint's write"):
    print("writing", flush=True)
    time.sleep(3.0)  # a large model's checkpoint
    open(sys.argv[1], "w").write("whole")
time.sleep(60)  # a stuck rest of the stop
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("again", [False, True], ids=["deadline", "second-signal"])
def test_stop_deadline_lets_a_checkpoint_write_finish_and_a_second_signal_does_not(tmp_path, process_tag, again):
    out = tmp_path / "written"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout.readline().strip() == "writing"
    began = time.monotonic()
    if again:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    took, log = time.monotonic() - began, proc.stdout.read()
    assert code == 128 + signal.SIGTERM, log
    if again:  # at once, the write cut short
        assert took < 2.5 and not out.exists() and "got SIGTERM again: exiting now" in log, log
    else:  # past the deadline, but only once the write is whole
        assert 2.0 < took < 10 and out.read_text() == "whole", (took, log)
        assert "waits for the checkpoint's write to finish" in log, log


# ------------------------------------------------------------------------------------------------ the phases

@pytest.mark.timeout(300)
def test_stop_during_state_download_sigterm_to_the_process(swarm):
    joiner = swarm.victim("v-download")
    wait_for(hold_of(joiner).exists, 200, "v-download's state download", swarm)
    assert "fetching state" in joiner.log_path.read_text()
    _, code = stop_time(joiner, signal.SIGTERM, group=False, release=hold_of(joiner),
                        label="state download (TERM, process)")
    assert_clean(joiner, code)


@pytest.mark.timeout(300)
def test_stop_during_inner_steps_sigint_to_the_group(swarm):
    victim = swarm.victim("v-inner")
    wait_for(hold_of(victim).exists, 200, "v-inner's inner steps", swarm)
    _, code = stop_time(victim, signal.SIGINT, group=True, release=hold_of(victim), label="inner steps (INT, group)")
    assert_clean(victim, code)


@pytest.mark.timeout(300)
def test_stop_during_start_up_sigterm_to_the_group(swarm):
    victim = swarm.victim("v-start")
    wait_for(lambda: victim.log_path.exists() and victim.log_path.read_text().strip(), 200, "v-start's first line",
             swarm)
    _, code = stop_time(victim, signal.SIGTERM, group=True, label="start-up (TERM, group)")
    log = victim.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "stopped while starting" in log and "joined run" not in log, log[-3000:]


@pytest.mark.timeout(300)
def test_stop_during_matchmaking_sigterm_to_the_group(swarm):
    victim = swarm.victim("v-match")
    wait_for(hold_of(victim).exists, 200, "v-match's matchmaking", swarm)
    _, code = stop_time(victim, signal.SIGTERM, group=True, release=hold_of(victim),
                        label="matchmaking (TERM, group)")
    assert_clean(victim, code)


@pytest.mark.timeout(300)
def test_stop_during_the_allreduce_sigterm_to_the_group(swarm):
    victim = swarm.victim("v-allreduce")
    wait_for(hold_of(victim).exists, 200, "v-allreduce's all-reduce", swarm)
    _, code = stop_time(victim, signal.SIGTERM, group=True, release=hold_of(victim), label="all-reduce (TERM, group)")
    assert_clean(victim, code)


@pytest.mark.timeout(300)
def test_stop_twice_ends_at_once_and_a_stuck_stop_ends_by_itself(swarm):
    twice = swarm.victim("v-twice")
    wait_for(hold_of(twice).exists, 200, "v-twice's inner steps", swarm)
    began = time.monotonic()
    send(twice, signal.SIGTERM, group=False)  # held: the clean stop cannot go on
    wait_for(lambda: "stopping after the current step" in twice.log_path.read_text(), 10, "the first TERM", swarm)
    took, code = stop_time(twice, signal.SIGTERM, group=False, label="second signal (TERM, process)")
    assert code == 128 + signal.SIGTERM and "got SIGTERM again: exiting now" in twice.log_path.read_text()
    assert took < 3 and time.monotonic() - began < STOP_GRACE_S

    stuck = swarm.victim("v-stuck")
    wait_for(hold_of(stuck).exists, 200, "v-stuck's inner steps", swarm)
    took, code = stop_time(stuck, signal.SIGINT, group=True, label="stuck stop (INT, group)")  # never released
    assert code == 128 + signal.SIGINT, stuck.log_path.read_text()[-3000:]
    assert STOP_GRACE_S <= took < STOP_BOUND_S
    assert f"did not end within {STOP_GRACE_S:.0f} s: exiting now" in stuck.log_path.read_text()


@pytest.mark.timeout(300)
def test_stop_training_anchors_and_the_bootstrap(swarm):
    """Last: the anchors while they train (INT to a0's group, TERM to a1 alone), then the bootstrap node (TERM to its
    group); then a second bootstrap node, INT to its process."""
    a0, a1 = swarm.local.peers["a0"], swarm.local.peers["a1"]
    alive = health(a0)  # p2p-diloco health on a live peer's folder, then on a stopped one's
    assert alive.returncode == 0 and alive.stdout.startswith("healthy: round "), alive
    _, code = stop_time(a0, signal.SIGINT, group=True, label="training (INT, group)")
    assert_clean(a0, code)
    gone = health(a0)
    assert gone.returncode == 1 and gone.stdout.startswith("unhealthy: no peer running"), gone
    _, code = stop_time(a1, signal.SIGTERM, group=False, label="training (TERM, process)")
    assert_clean(a1, code)
    _, code = stop_time(swarm.local.bootstrap, signal.SIGTERM, group=True, label="bootstrap (TERM, group)")
    assert code == 0 and "bootstrap node stopped" in swarm.local.bootstrap.log_path.read_text()

    other = LocalSwarm(swarm.root / "boot2")
    other.run_dir.mkdir()
    other.start_bootstrap()
    try:
        _, code = stop_time(other.bootstrap, signal.SIGINT, group=False, label="bootstrap (INT, process)")
        assert code == 0
    finally:
        other.close()
