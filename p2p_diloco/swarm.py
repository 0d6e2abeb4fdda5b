"""``p2p-diloco swarm``: a bootstrap node and N peers as separate processes on 127.0.0.1, and the run's summary.

Every child runs in its own process group (its DHT process, averager process and p2pd included), and every group is
ended by PID when the swarm finishes, fails or is interrupted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

from p2p_diloco.metrics import read_jsonl
from p2p_diloco.procs import stop_groups

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
}
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# keys the swarm sets for each peer, and the swarm flag (if any) to use instead
SET_BY_SWARM = {"run.rounds": "--rounds", "diloco.inner_steps": "--inner-steps",
                "averaging.target_group_size": "--peers", "run.name": None, "run.run_dir": "--run-dir",
                "network.initial_peers": None, "network.host_maddrs": None}


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
    initial_peers: list[str] = field(default_factory=list)

    def start_bootstrap(self, timeout: float = 60.0) -> list[str]:
        """Start the bootstrap node; return its multiaddrs once it printed them (or raise after ``timeout``)."""
        log_path = self.run_dir / "bootstrap.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "p2p_diloco", "bootstrap", f"--network.host_maddrs={LOOPBACK}",
             f"--network.identity_path={self.run_dir / 'bootstrap.key'}"],
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

    def start_peer(self, name: str, extra_args: list[str] = ()) -> Child:
        run_dir = self.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / f"{name}.log"
        log_file = open(log_path, "a")
        args = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", ",".join(self.initial_peers),
                f"--run.name={name}", f"--run.run_dir={run_dir}", f"--network.host_maddrs={LOOPBACK}",
                *self.peer_args, *extra_args]
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        child = Child(name, proc, log_path, run_dir, log_file)
        self.peers[name] = child
        return child

    def close(self) -> None:
        """End every process group we started (SIGTERM, then SIGKILL after a grace period)."""
        children = list(self.peers.values()) + ([self.bootstrap] if self.bootstrap else [])
        stop_groups([child.proc.pid for child in children])
        for child in children:
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if child.log_file is not None:
                child.log_file.close()


def run_swarm(num_peers: int, rounds: int, inner_steps: int, run_dir: str, peer_args: list[str],
              timeout: Optional[float] = None, echo=print) -> int:
    """Run a whole swarm to completion; write ``run_dir/summary.json``; return 0 if every peer finished cleanly."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(run_dir, peer_args=[f"--run.rounds={rounds}", f"--diloco.inner_steps={inner_steps}",
                                           f"--averaging.target_group_size={num_peers}", *peer_args])
    table = RoundTable(echo)
    start = time.monotonic()
    exit_codes: dict[str, Optional[int]] = {}
    try:
        maddrs = swarm.start_bootstrap()
        echo(f"bootstrap node at {maddrs[0]}")
        for i in range(num_peers):
            swarm.start_peer(f"peer{i}")
        echo(f"{num_peers} peers started; logs and metrics in {run_dir}")
        while True:
            exit_codes = {name: c.proc.poll() for name, c in swarm.peers.items()}
            table.update(collect_rounds(swarm.peers))
            if all(code is not None for code in exit_codes.values()):
                break
            if timeout is not None and time.monotonic() - start > timeout:
                echo(f"swarm: timed out after {timeout:.0f} s; stopping peers")
                break
            time.sleep(0.5)  # polling the peers' metrics files to print rounds as they commit
    except KeyboardInterrupt:
        echo("swarm: interrupted; stopping every process")
    finally:
        swarm.close()
        exit_codes = {name: c.proc.returncode for name, c in swarm.peers.items()}
        summary = write_summary(run_dir, swarm.peers)
        table.update(collect_rounds(swarm.peers))
    failed = {n: c for n, c in exit_codes.items() if c != 0}
    echo(f"swarm: {len(summary['rounds'])} rounds in {time.monotonic() - start:.0f} s; summary in "
         f"{run_dir / 'summary.json'}" + (f"; peers that failed: {failed}" if failed else ""))
    return 0 if not failed and all(_hashes_agree(r) for r in summary["rounds"]) else 1


def collect_rounds(peers: dict[str, Child]) -> dict[int, dict[str, dict]]:
    """round → peer name → that peer's committed-round record, from the peers' metrics files."""
    rounds: dict[int, dict[str, dict]] = {}
    for name, child in peers.items():
        for rec in read_jsonl(child.run_dir / "metrics.jsonl"):
            if rec.get("event") == "round" and rec.get("committed"):
                rounds.setdefault(rec["round"], {})[name] = rec
    return rounds


def write_summary(run_dir: Path, peers: dict[str, Child]) -> dict:
    records = {name: read_jsonl(child.run_dir / "metrics.jsonl") for name, child in peers.items()}
    starts = [r for recs in records.values() for r in recs if r.get("event") == "start"]
    rounds = []
    for number, by_peer in sorted(collect_rounds(peers).items()):
        evals = [r["eval/loss"] for r in by_peer.values() if r.get("eval/loss") is not None]
        rounds.append({
            "round": number,
            "group_size": max(r["outer/group_size"] for r in by_peer.values()),
            "mean_train_loss": _mean([r["train/loss"] for r in by_peer.values()]),
            "eval_loss": _mean(evals) if evals else None,
            "allreduce_s": max(r["outer/allreduce_s"] for r in by_peer.values()),
            "bytes_sent": sum(r["outer/bytes_sent"] for r in by_peer.values()),
            "global_params_sha256": {name: r["global_params_sha256"] for name, r in sorted(by_peer.items())},
        })
    summary = {
        "run_id": next((s.get("run_id") for s in starts if s.get("run_id")), run_dir.name),
        "initial_eval_loss": _mean([s["eval/loss"] for s in starts]) if starts else None,
        "rounds": rounds,
        "peers": [_peer_summary(name, recs) for name, recs in sorted(records.items())],
    }
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(run_dir / "summary.json")
    return summary


def _peer_summary(name: str, recs: list[dict]) -> dict:
    start = next((r for r in recs if r.get("event") == "start"), {})
    committed = [r for r in recs if r.get("event") == "round" and r.get("committed")]
    evals = [r["eval/loss"] for r in committed if r.get("eval/loss") is not None]
    return {"name": name, "peer_id": start.get("peer_id", ""),
            "rounds_completed": max((r["round"] for r in committed), default=0),
            "final_eval_loss": evals[-1] if evals else start.get("eval/loss")}


def _hashes_agree(round_summary: dict) -> bool:
    return len(set(round_summary["global_params_sha256"].values())) == 1


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


class RoundTable:
    """Prints one row per round once every peer that committed it has logged it."""

    def __init__(self, echo):
        self.echo, self.printed = echo, set()

    def update(self, rounds: dict[int, dict[str, dict]]) -> None:
        if not self.printed:
            self.echo(f"{'round':>5} {'group':>5} {'train loss':>10} {'eval loss':>9} {'allreduce s':>11} "
                      f"{'MB sent':>8}  θ_global sha256 on every peer")
            self.printed.add(0)
        for number in sorted(rounds):
            by_peer = rounds[number]
            group = max(r["outer/group_size"] for r in by_peer.values())
            if number in self.printed or len(by_peer) < group:
                continue
            self.printed.add(number)
            evals = [r["eval/loss"] for r in by_peer.values() if r.get("eval/loss") is not None]
            hashes = {r["global_params_sha256"] for r in by_peer.values()}
            agree = f"equal ({next(iter(hashes))[:12]})" if len(hashes) == 1 else f"DIFFER: {len(hashes)} values"
            eval_text = f"{_mean(evals):9.4f}" if evals else f"{'-':>9}"
            self.echo(f"{number:5d} {group:5d} {_mean([r['train/loss'] for r in by_peer.values()]):10.4f} "
                      f"{eval_text} {max(r['outer/allreduce_s'] for r in by_peer.values()):11.2f} "
                      f"{sum(r['outer/bytes_sent'] for r in by_peer.values()) / 1e6:8.2f}  {agree}")
