"""What a local swarm's peers logged, round by round: the live table and ``summary.json``.

A round's row is printed once every peer has settled it (committed it, fetched a later state, or exited), so that a
round two groups committed with different θ_global shows as a fork, with how many peers hold each digest, never as
``equal`` because the first group to log it agreed with itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from p2p_diloco.ops.metrics import read_jsonl

PROGRESS_EVENTS = ("round", "repair", "join")  # records whose "round" is a θ_global the peer then held


def collect_rounds(peers: dict) -> dict[int, dict[str, dict]]:
    """round → peer name → that peer's committed-round record, from the peers' metrics files."""
    rounds: dict[int, dict[str, dict]] = {}
    for name, child in peers.items():
        for rec in read_jsonl(child.run_dir / "metrics.jsonl"):
            if rec.get("event") == "round" and rec.get("committed"):
                rounds.setdefault(rec["round"], {})[name] = rec
    return rounds


def progress(peers: dict) -> dict[str, float]:
    """peer name → the latest round it has held θ_global of (committed, repaired or joined); an exited peer has
    settled every round (infinity)."""
    out = {}
    for name, child in peers.items():
        if child.proc.poll() is not None:
            out[name] = float("inf")
            continue
        out[name] = max((r["round"] for r in read_jsonl(child.run_dir / "metrics.jsonl")
                         if r.get("event") in PROGRESS_EVENTS and isinstance(r.get("round"), int)), default=-1)
    return out


def held_rounds(peers: dict) -> dict[str, tuple[int, int]]:
    """peer name → (first, last) round whose θ_global it held (started with, committed, repaired or joined)."""
    out = {}
    for name, child in peers.items():
        held = [r["round"] for r in read_jsonl(child.run_dir / "metrics.jsonl")
                if r.get("event") in PROGRESS_EVENTS + ("start",) and isinstance(r.get("round"), int)]
        if held:
            out[name] = (min(held), max(held))
    return out


def in_round(held: dict[str, tuple[int, int]], number: int) -> int:
    """How many peers were in the run when round ``number`` began: they held round ``number`` − 1 (a peer killed
    later counts, as a member lost; its replacement counts from the round after the one it joined at)."""
    return sum(1 for first, last in held.values() if first <= number - 1 <= last)


def digests_of(by_peer: dict[str, dict]) -> dict[str, list[str]]:
    """digest → the peers that committed the round with it, most holders first."""
    holders: dict[str, list[str]] = {}
    for name, rec in sorted(by_peer.items()):
        holders.setdefault(rec["global_params_sha256"], []).append(name)
    return dict(sorted(holders.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def agreement_text(by_peer: dict[str, dict], peers: int) -> str:
    """``one θ_global on 7 of 8 peers (ab12…)`` or ``FORK: 4 peers on ab12…, 3 on cd34…``."""
    holders = digests_of(by_peer)
    if len(holders) == 1:
        digest, names = next(iter(holders.items()))
        return f"one θ_global on {len(names)} of {peers} peers ({digest[:12]})"
    return "FORK: " + ", ".join(f"{len(names)} on {digest[:12]}" for digest, names in holders.items())


def write_summary(run_dir: Path, peers: dict, events: Optional[list[dict]] = None) -> dict:
    records = {name: read_jsonl(child.run_dir / "metrics.jsonl") for name, child in peers.items()}
    starts = [r for recs in records.values() for r in recs if r.get("event") == "start"]
    rounds = []
    for number, by_peer in sorted(collect_rounds(peers).items()):
        evals = [r["eval/loss"] for r in by_peer.values() if r.get("eval/loss") is not None]
        holders = digests_of(by_peer)
        rounds.append({
            "round": number,
            "group_size": max(r["outer/group_size"] for r in by_peer.values()),
            "committed_by": len(by_peer),
            "digests": {d: len(names) for d, names in holders.items()},  # more than one: the round forked
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
        "forked_rounds": [r["round"] for r in rounds if len(r["digests"]) > 1],
        "failed_attempts": sum(1 for recs in records.values() for r in recs
                               if r.get("event") == "round" and not r.get("committed")),
        "peers": [_peer_summary(name, recs) for name, recs in sorted(records.items())],
        "events": list(events or []) + _state_transfers(records),
    }
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(run_dir / "summary.json")
    return summary


def _state_transfers(records: dict[str, list[dict]]) -> list[dict]:
    """Joins and repairs the peers logged: who fetched which round's state, how many bytes, how fast."""
    first = min((r["time"] for recs in records.values() for r in recs if "time" in r), default=0.0)
    return [{"time_s": round(r["time"] - first, 2), "kind": f"state_{r['event']}", "peer": name,
             "phase": f"round {r['round']} from {r.get('donor')}: {r['state_bytes']} bytes in {r['seconds']:.2f} s"}
            for name, recs in records.items() for r in recs if r.get("event") in ("join", "repair")]


def _peer_summary(name: str, recs: list[dict]) -> dict:
    start = next((r for r in recs if r.get("event") == "start"), {})
    committed = [r for r in recs if r.get("event") == "round" and r.get("committed")]
    evals = [r["eval/loss"] for r in committed if r.get("eval/loss") is not None]
    return {"name": name, "peer_id": start.get("peer_id", ""),
            "rounds_completed": max((r["round"] for r in committed), default=0),
            "final_eval_loss": evals[-1] if evals else start.get("eval/loss")}


def hashes_agree(round_summary: dict) -> bool:
    return len(set(round_summary["global_params_sha256"].values())) == 1


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


class RoundTable:
    """Prints one row per round, in order, once every peer has settled it (:func:`progress`)."""

    def __init__(self, echo):
        self.echo, self.printed = echo, set()

    def update(self, rounds: dict[int, dict[str, dict]], settled: dict[str, float], final: bool = False,
               held: Optional[dict[str, tuple[int, int]]] = None) -> None:
        """``settled``: :func:`progress` of every peer of the swarm; ``final``: the swarm has ended, print the rest;
        ``held``: :func:`held_rounds`, for how many peers were in each round (else every peer ever started)."""
        if not self.printed:
            self.echo(f"{'round':>5} {'group':>5} {'train loss':>10} {'eval loss':>9} {'allreduce s':>11} "
                      f"{'MB sent':>8}  θ_global sha256 of the peers that committed it")
            self.printed.add(0)
        for number in sorted(rounds):
            if number in self.printed:
                continue
            if not final and any(reached < number for reached in settled.values()):
                break  # rows in order: a later round waits for this one
            self.printed.add(number)
            by_peer = rounds[number]
            group = max(r["outer/group_size"] for r in by_peer.values())
            evals = [r["eval/loss"] for r in by_peer.values() if r.get("eval/loss") is not None]
            eval_text = f"{_mean(evals):9.4f}" if evals else f"{'-':>9}"
            self.echo(f"{number:5d} {group:5d} {_mean([r['train/loss'] for r in by_peer.values()]):10.4f} "
                      f"{eval_text} {max(r['outer/allreduce_s'] for r in by_peer.values()):11.2f} "
                      f"{sum(r['outer/bytes_sent'] for r in by_peer.values()) / 1e6:8.2f}  "
                      f"{agreement_text(by_peer, in_round(held, number) if held else len(settled))}")
