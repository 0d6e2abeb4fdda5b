"""``p2p-diloco swarm``: a bootstrap node and N peers as separate processes on 127.0.0.1, and the run's summary.

Every child runs in its own process group (its DHT process, averager process and p2pd included), and every group is
ended by PID when the swarm finishes, fails or is interrupted.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, TextIO

from p2p_diloco.config import dump_toml
from p2p_diloco.errors import first_line, printable
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.procs import stop_groups
from p2p_diloco.ops.swarm_rounds import (RoundTable, collect_rounds, hashes_agree, held_rounds, progress,
                                         write_summary)

__all__ = ["DEMO_DEFAULTS", "LocalSwarm", "collect_rounds", "demo_defaults", "run_swarm", "write_peer_config",
           "write_summary"]

# The demo: the tiny model on the embedded corpus, tuned to learn visibly within a few minutes on 2 CPU cores.
DEMO_DEFAULTS = {
    "model.name": "tiny",
    "inner.lr": 1e-3,
    "inner.warmup_steps": 20,
    "inner.batch_size": 8,
    "run.threads": 1,
    "run.progress": False,
    "averaging.matchmaking_time": 10.0,
    "averaging.request_timeout": 3.0,
    "averaging.next_chunk_timeout": 15.0,
    "averaging.roster_ttl": 6.0,  # loopback: a heartbeat every 2 s is cheap, and a dead peer stops counting soon
    "run.sample_prompt": "Return the ",  # the embedded corpus is Python's docstrings: many of them start like this
}
# Beyond LARGE_SWARM peers on one machine the demo's loopback timings (a heartbeat every 2 s, 3 s requests, a 10 s
# window) overload it: at 32 peers on 2 cores (load 40-68) roster reads timed out in part, peers named different
# leaders and round 1 never formed in 10 minutes (benchmarks/scale.md). With the library's roster TTL, 10 s requests
# and a 30 s window, the same 32 committed every round on all 32. A user's config or flags still win.
LARGE_SWARM = 16
LARGE_SWARM_DEFAULTS = {"averaging.roster_ttl": 30.0, "averaging.request_timeout": 10.0,
                        "averaging.matchmaking_time": 30.0}


def demo_defaults(peers: int) -> dict:
    """The demo's defaults for a local swarm of ``peers``: :data:`DEMO_DEFAULTS`, with slower network timings beyond
    :data:`LARGE_SWARM` peers."""
    return {**DEMO_DEFAULTS, **(LARGE_SWARM_DEFAULTS if peers > LARGE_SWARM else {})}


LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# keys the swarm sets for each peer, and the swarm flag (if any) to use instead
SET_BY_SWARM = {"run.rounds": "--rounds", "diloco.inner_steps": "--inner-steps",
                "run.expected_peers": "--peers", "run.name": None, "run.run_dir": "--run-dir",
                "network.initial_peers": None, "network.host_maddrs": None, "fault.slowdown": "--slowdown"}


@dataclass
class ChaosPlan:
    """What ``--chaos SEED`` does: faults armed in initial peers, and actions taken after a round is committed."""
    faults: dict[str, str] = field(default_factory=dict)              # peer name -> fault.inject
    # (after round, kind, peer); kind: join (process started at launch, joins at that round), join_cold (process
    # started at that round), leave (SIGTERM), kill_bootstrap (SIGKILL), cont (SIGCONT to a peer frozen by a stall
    # fault), restart (a second process for a peer that stops on its own, started at launch on the same run folder:
    # it joins at that round, resuming from the checkpoint the first one left; it replaces the first once that exited)
    actions: list[tuple[int, str, str]] = field(default_factory=list)
    peer_args: dict[str, list[str]] = field(default_factory=dict)    # peer name -> more flags (e.g. fault.attack)
    replace: bool = False  # a fresh peer (new0, new1, ...) joins in the place of each peer killed by its fault


def plan_chaos(seed: int, num_peers: int, rounds: int) -> ChaosPlan:
    """A seeded plan with a kill during an all-reduce, a kill during inner steps or matchmaking, a kill of a donor
    while it serves state to a joiner, a graceful leave, two joins and one bootstrap kill, in an order that keeps at
    least two peers alive (fewer removals on small swarms). Pure: the same seed gives the same plan."""
    if num_peers < 3 or rounds < 6:
        raise ValueError("--chaos needs --peers >= 3 and --rounds >= 6")
    rng = random.Random(seed)
    names = [f"peer{i}" for i in range(num_peers)]
    join1, join2 = rng.randint(1, 2), rng.randint(3, 4)
    plan = ChaosPlan()
    # donors are tried in order of name: peer0 is the first donor a joiner asks, so it is the one that dies serving
    plan.faults["peer0"] = f"kill:serving:{join1 + 1}"
    others = names[1:]
    rng.shuffle(others)
    plan.faults[others[0]] = f"kill:allreduce:{rng.randint(2, 3)}"
    removals = 2
    if num_peers >= 4:  # 4 removals against 2 joins leave 2 of 4 peers alive
        plan.faults[others[1]] = f"kill:{rng.choice(['inner', 'matchmaking'])}:{rng.randint(4, 5)}"
        removals += 1
    plan.actions += [(join1, "join", "join0"), (join2, "join", "join1"),
                     (rng.randint(5, max(5, rounds - 2)), "leave", others[removals - 1]),
                     (rng.randint(2, rounds - 2), "kill_bootstrap", "bootstrap")]
    plan.actions.sort()
    return plan


KILL_PHASES = ("inner", "matchmaking", "sending", "allreduce", "checks")  # --kill-each-round draws from these


def plan_kill_each_round(seed: int, num_peers: int, rounds: int) -> ChaosPlan:
    """``--kill-each-round SEED``: from round 2 to the one before the last, one member SIGKILLed in every round at a
    seeded phase (ops/faults.py: inner steps, matchmaking, as a sender, as a reducer mid-serving, before the reducer
    checks); the swarm starts a fresh peer in its place (``replace``), so that N holds. Each member dies at most
    once. Pure: the same seed gives the same plan."""
    if rounds < 3 or num_peers < rounds - 1:
        raise ValueError("--kill-each-round needs --rounds >= 3 and --peers >= rounds - 1 (one victim per round from "
                         "round 2 to the one before the last)")
    rng = random.Random(seed)
    victims = rng.sample([f"peer{i}" for i in range(num_peers)], rounds - 2)
    plan = ChaosPlan(replace=True)
    for round_, victim in zip(range(2, rounds), victims):
        plan.faults[victim] = f"kill:{rng.choice(KILL_PHASES)}:{round_}"
    return plan


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    run_dir: Optional[Path] = None
    log_file: Optional[TextIO] = None


@dataclass
class LocalSwarm:
    """Starts and ends the processes of one local swarm; knows nothing about training."""
    run_dir: Path
    peer_args: list[str] = field(default_factory=list)  # extra arguments for every peer (config file, overrides)
    bootstrap: Optional[Child] = None
    peers: dict[str, Child] = field(default_factory=dict)
    spares: dict[str, Child] = field(default_factory=dict)  # restarts waiting to replace a peer of the same name
    initial_peers: list[str] = field(default_factory=list)
    # child name ("bootstrap" or a peer's) -> command prefix, e.g. ["ip", "netns", "exec", NS] (benchmarks/netlab.py)
    exec_prefix: dict[str, list[str]] = field(default_factory=dict)

    def start_bootstrap(self, timeout: float = 60.0, extra_args: list[str] = ()) -> list[str]:
        """Start the bootstrap node; return its multiaddrs once it printed them (or raise after ``timeout``)."""
        log_path = self.run_dir / "bootstrap.log"
        proc = subprocess.Popen(
            [*self.exec_prefix.get("bootstrap", []), sys.executable, "-m", "p2p_diloco", "bootstrap",
             f"--network.host_maddrs={LOOPBACK}", f"--network.identity_path={self.run_dir / 'bootstrap.key'}",
             *extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True)
        self.bootstrap = Child("bootstrap", proc, log_path)
        ready = threading.Event()
        maddrs: list[str] = []

        def tee():  # copy the bootstrap's output to its log; note its addresses as they appear
            with open(log_path, "w") as log:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if line.strip().startswith("/ip4/"):
                        maddrs.append(line.strip())
                    if line.startswith("join with"):
                        ready.set()
            ready.set()

        threading.Thread(target=tee, daemon=True).start()
        if not ready.wait(timeout) or not maddrs:
            raise RuntimeError(f"the bootstrap node did not start within {timeout:.0f} s (see {log_path})")
        self.initial_peers = maddrs
        return maddrs

    def live_maddrs(self) -> list[str]:
        """Addresses to join through: the bootstrap node's while it lives, then every live peer's."""
        maddrs = list(self.initial_peers) if self.bootstrap and self.bootstrap.proc.poll() is None else []
        for child in self.peers.values():
            path = child.run_dir / "maddrs.txt"
            if child.proc.poll() is None and path.is_file():
                maddrs += [m for m in path.read_text().split() if m]
        return maddrs

    def start_peer(self, name: str, extra_args: list[str] = (), spare: bool = False) -> Child:
        run_dir = self.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / f"{name}.log"
        log_file = open(log_path, "a")
        args = [*self.exec_prefix.get(name, []), sys.executable, "-m", "p2p_diloco", "peer",
                "--initial-peers", ",".join(self.live_maddrs()),
                f"--run.name={name}", f"--run.run_dir={run_dir}", f"--network.host_maddrs={LOOPBACK}",
                *self.peer_args, *extra_args]
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        child = Child(name, proc, log_path, run_dir, log_file)
        (self.spares if spare else self.peers)[name] = child
        return child

    def swap_in_spares(self) -> list[str]:
        """Spares whose peer has exited take its place; returns their names."""
        ready = [n for n, c in self.spares.items() if n not in self.peers or self.peers[n].proc.poll() is not None]
        for name in ready:
            old = self.peers.get(name)
            if old is not None and old.log_file is not None:
                old.log_file.close()
            self.peers[name] = self.spares.pop(name)
        return ready

    def close(self) -> None:
        """End every process group we started (SIGTERM, then SIGKILL after a grace period)."""
        children = list(self.peers.values()) + list(self.spares.values()) + ([self.bootstrap] if self.bootstrap else [])
        stop_groups([child.proc.pid for child in children])
        for child in children:
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if child.log_file is not None:
                child.log_file.close()


def write_peer_config(run_dir: str | Path, cfg) -> list[str]:
    """Write the effective peer config once for all peers; return the peer arguments that load it. A
    ``network.secret`` goes to a 0600 file of its own that the config names (config/secrets.py), never into it."""
    from p2p_diloco.config.secrets import secret_via_file, write_private

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = write_private(run_dir / "peer-config.toml", dump_toml(secret_via_file(cfg, run_dir)))
    return [f"--config={path}"]


def run_swarm(num_peers: int, rounds: int, inner_steps: int, run_dir: str, peer_args: list[str],
              timeout: Optional[float] = None, chaos: Optional[int] = None, plan: Optional[ChaosPlan] = None,
              kill_each_round: Optional[int] = None,
              slowdowns: Optional[list[float]] = None, echo=print, report: bool = False,
              bootstrap_args: Sequence[str] = ()) -> int:
    """Run a whole swarm to completion; write ``run_dir/summary.json``; return 0 if every peer finished cleanly
    (or was failed on purpose by ``chaos`` or ``plan``) and every round's θ_global hashes agree, 130 if interrupted. ``slowdowns[i]``:
    ``fault.slowdown`` of peer i (a slower machine; peers past the list run at full speed). ``report``: then print a
    sample of the final θ_global and write the plots (:func:`report_run`), unless interrupted."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if plan is None:
        plan = (plan_chaos(chaos, num_peers, rounds) if chaos is not None
                else plan_kill_each_round(kill_each_round, num_peers, rounds) if kill_each_round is not None
                else ChaosPlan())
    swarm = LocalSwarm(run_dir, peer_args=[f"--run.rounds={rounds}", f"--diloco.inner_steps={inner_steps}",
                                           f"--run.expected_peers={num_peers}", *peer_args])
    table = RoundTable(echo)
    events = EventLog(echo)
    start = time.monotonic()
    interrupted = False
    try:
        maddrs = swarm.start_bootstrap(extra_args=list(bootstrap_args))  # e.g. a private run's secret
        echo(f"bootstrap node at {maddrs[0]}")
        for i in range(num_peers):
            name = f"peer{i}"
            fault = plan.faults.get(name)
            slow = slowdowns[i] if slowdowns and i < len(slowdowns) else 1.0
            swarm.start_peer(name, ([f"--fault.inject={fault}"] if fault else [])
                             + ([f"--fault.slowdown={slow}"] if slow != 1.0 else []) + plan.peer_args.get(name, []))
            if fault:
                events.add("armed", name, fault)
        # joiners start now (a process needs seconds to import and build its model) and stay out of the run until
        # the round of their action: then they join it, fetching its state like any newcomer
        for after_round, kind, name in plan.actions:
            if kind == "join":
                swarm.start_peer(name, ["--run.expected_peers=1", f"--run.join_after_round={after_round}"])
            elif kind == "restart":
                swarm.start_peer(name, ["--run.expected_peers=1", f"--run.join_after_round={after_round}",
                                        "--fault.inject=none"], spare=True)
        echo(f"{num_peers} peers started; logs and metrics in {run_dir}")
        pending = list(plan.actions)
        while True:
            rounds_seen = collect_rounds(swarm.peers)
            table.update(rounds_seen, progress(swarm.peers), held=held_rounds(swarm.peers))
            latest = max(rounds_seen, default=0)
            while pending and pending[0][0] <= latest:
                _act(swarm, events, *pending.pop(0))
            for name in swarm.swap_in_spares():
                events.add("restart", name, "a new process, from its checkpoint")
            for killed in events.note_exits(swarm.peers, plan.faults):
                if plan.replace and killed in plan.faults:  # N holds: a newcomer joins the run going on
                    fresh = f"new{sum(n.startswith('new') for n in swarm.peers)}"
                    swarm.start_peer(fresh, ["--run.expected_peers=1"])
                    events.add("join", fresh, f"in place of {killed}, new process")
            stalled = {n for n, f in plan.faults.items() if f.startswith("stall:")} - events.thawed  # never exit
            if not swarm.spares and all(c.proc.poll() is not None for n, c in swarm.peers.items() if n not in stalled):
                break  # every peer is done (actions still pending can no longer happen)
            if timeout is not None and time.monotonic() - start > timeout:
                echo(f"swarm: timed out after {timeout:.0f} s; stopping peers")
                break
            time.sleep(0.5)  # polling the peers' metrics files to print rounds as they commit
    except KeyboardInterrupt:
        interrupted = True
        echo("swarm: interrupted; stopping every process")
    finally:
        swarm.close()
        events.note_exits(swarm.peers, plan.faults)
        summary = write_summary(run_dir, swarm.peers, events.events)
        table.update(collect_rounds(swarm.peers), progress(swarm.peers), final=True, held=held_rounds(swarm.peers))
    exit_codes = {name: c.proc.returncode for name, c in swarm.peers.items()}
    # peers failed on purpose end by SIGKILL: their own (kill) or the swarm's at close (stall)
    failed = {n: c for n, c in exit_codes.items() if c != 0 and not (c == -signal.SIGKILL and n in plan.faults)}
    echo(f"swarm: {len(summary['rounds'])} rounds in {time.monotonic() - start:.0f} s; summary in "
         f"{run_dir / 'summary.json'}" + (f"; peers that failed: {failed}" if failed else ""))
    if report and not interrupted and summary["rounds"]:
        report_run(run_dir, swarm.peers, echo)
    if summary["forked_rounds"]:
        echo(f"swarm: θ_global FORKED in round(s) {summary['forked_rounds']}: two groups committed different bytes")
    if interrupted:
        return 130  # as a shell reports a command ended by Ctrl+C: not a finished run, whatever its rounds
    return 0 if not failed and all(hashes_agree(r) for r in summary["rounds"]) else 1


def report_run(run_dir: Path, peers: dict[str, Child], echo) -> None:
    """What a newcomer wants to see after a run: the text sample the peers logged from the final θ_global
    (``run.sample_every``), and the plots (when matplotlib is installed). Neither may fail the run."""
    from p2p_diloco.ops.plot import MISSING_MATPLOTLIB, matplotlib_available, write_plots

    samples = [r for child in peers.values() for r in read_jsonl(child.run_dir / "metrics.jsonl")
               if r.get("event") == "sample"]
    if samples:
        last = max(samples, key=lambda r: r["round"])
        echo(f"sample from θ_global of round {last['round']} (logged by {last['peer']}; seed 0; more with "
             f"p2p-diloco generate --run-dir {run_dir} --prompt TEXT):")
        echo("  " + printable(last["prompt"] + last["text"]).replace("\n", "\n  "))
    if not matplotlib_available():
        echo(f"plots: skipped ({MISSING_MATPLOTLIB})")
        return
    try:
        paths = write_plots(run_dir)
        echo(f"plots: {', '.join(p.name for p in paths)} in {run_dir}")
    except Exception as e:  # noqa: BLE001
        echo(f"plots: failed: {first_line(e)}")


def _act(swarm: LocalSwarm, events: "EventLog", after_round: int, kind: str, name: str) -> None:
    if kind == "join":  # started at launch with --run.join_after_round: it joins by itself now
        events.add("join", name, f"after round {after_round}")
    elif kind == "join_cold":  # a process started only now, from the addresses of whoever is alive now
        swarm.start_peer(name, ["--run.expected_peers=1"])
        events.add("join", name, f"after round {after_round}, new process")
    elif kind == "leave":
        child = swarm.peers.get(name)
        if child is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)  # the peer finishes its step, announces it leaves, saves, exits
            events.add("leave", name, "graceful (SIGTERM)")
    elif kind == "cont":
        child = swarm.peers.get(name)
        if child is not None and child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGCONT)  # the stall froze the peer's whole process group
            events.thawed.add(name)
            events.add("cont", name, "thawed (SIGCONT)")
    elif kind == "kill_bootstrap":
        if swarm.bootstrap is not None and swarm.bootstrap.proc.poll() is None:
            os.killpg(swarm.bootstrap.proc.pid, signal.SIGKILL)
            events.add("kill", "bootstrap", "bootstrap node (SIGKILL)")


class EventLog:
    """The swarm's record of what happened to whom: summary.json's "events"."""

    def __init__(self, echo):
        self.echo, self.start, self.events, self._exited = echo, time.monotonic(), [], set()
        self.thawed: set[str] = set()  # stalled peers sent SIGCONT: they run (and exit) again

    def add(self, kind: str, peer: str, phase: Optional[str]) -> None:
        event = {"time_s": round(time.monotonic() - self.start, 2), "kind": kind, "peer": peer, "phase": phase}
        self.events.append(event)
        self.echo(f"event: {kind} {peer}" + (f" ({phase})" if phase else ""))

    def note_exits(self, peers: dict[str, Child], faults: dict[str, str]) -> list[str]:
        """Record the peers killed since the last call (kind ``kill``, with the phase of their fault); return them."""
        killed = []
        for name, child in list(peers.items()):
            code = child.proc.poll()
            if code == -signal.SIGKILL and name not in self._exited:
                self._exited.add(name)
                phase = faults[name].split(":")[1] if name in faults else None
                self.add("kill", name, phase)
                killed.append(name)
        return killed
