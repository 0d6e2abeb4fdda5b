"""Peers of different speeds: synchronous DiLoCo (fixed H) against DyLU, rebasing of late work and Delayed Nesterov.

Local swarms of 4 peers (tiny model, embedded corpus, one torch thread each) whose inner steps are stretched by
``fault.slowdown`` 1, 1, 2 and 4 (a peer sleeps (F - 1) x each step's compute time after it). Methods:

* ``sync``: every peer runs H inner steps per round (``diloco.dylu=false``) and every round waits for the slowest
  (a matchmaking window long enough for it): synchronous DiLoCo, the reference;
* ``dylu``: DyLU, the fastest peer runs about H and the others their share, within the round's shared time budget
  (README, "DyLU"); late work dropped (``max_staleness=0``);
* ``dylu+rebase``: the same, with late work rebased (``max_staleness=4``, the default);
* ``dylu+rebase+dn``: the same with Delayed Nesterov (N = 4, c = 0);
* ``dylu/own-steps-lr``: ``dylu+rebase`` with the lr schedule counting each peer's own steps (``inner.lr_clock=steps``,
  the default since this measurement) instead of the run's progress (``rounds``, which every other method sets);
* ``fixed-H/drop``, ``fixed-H/rebase``, ``fixed-H/rebase+dn``: H for every peer and the default matchmaking window
  (10 s): slow peers arrive after the others averaged and fetch the run's state; their work is dropped, rebased, or
  rebased and applied with Delayed Nesterov: the measurement behind the ``max_staleness`` default.

Every method uses the outer step it was measured with (Nesterov, lr 0.7, momentum 0.9: the defaults then) and the
demo's inner settings, with the lr schedule's cosine decay ending at the method's last round, and
``averaging.min_group_size = 3``, a majority of the 4 peers: with groups of 2 allowed, two late peers could average
among themselves and commit the same round as the other two (a split the roster repairs at the next round, but not after the last). ``sync`` runs ``--rounds``
rounds; the others ``--rounds`` x 4 / (1 + 1 + 1/2 + 1/4), rounded up (about equal tokens). Per run: the wall time;
the tokens all peers trained; the final eval loss (mean over peers of θ_global's held-out loss, equal bits on every
peer); sync's eval loss at the same wall time (its last round committed by then: equal wall time); the eval loss at
sync's token count (interpolated between rounds; "–" if the run trained fewer tokens); the wall time at which the
eval loss first reached sync's final loss ("–" if never); and each peer's idle share: the time it spent in
matchmaking (waiting for the others) over its rounds' wall time, rounds 2 on. Each figure is the median of
``--runs`` runs; the methods alternate within each repetition, so that the machine's load falls on all alike. Run:

    nice -n 10 python benchmarks/heterogeneous.py [--runs 3] [--rounds 6] [--inner-steps 30] [--method sync ...]
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import tempfile
from pathlib import Path

from p2p_diloco.config import load_config
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import DEMO_DEFAULTS, run_swarm, write_peer_config

SLOWDOWNS = [1.0, 1.0, 2.0, 4.0]
# the outer defaults when the figures of benchmarks/heterogeneous.md were measured
MEASURED_OUTER = {"diloco.outer_lr": 0.7, "diloco.outer_momentum": 0.9}
ROUNDS_CLOCK = {"inner.lr_clock": "rounds"}  # what these methods were measured with (the default was then)
REBASE = {"diloco.max_staleness": 4}
DN = {"diloco.outer_optimizer": "delayed_nesterov", "diloco.dn_delay": 4}
METHODS = {
    "sync": {"diloco.dylu": False, "averaging.matchmaking_time": 120.0, "averaging.request_timeout": 5.0,
             **ROUNDS_CLOCK},
    "dylu": {"diloco.max_staleness": 0, **ROUNDS_CLOCK},
    "dylu+rebase": {**REBASE, **ROUNDS_CLOCK},
    "dylu+rebase+dn": {**REBASE, **DN, **ROUNDS_CLOCK},
    "dylu/own-steps-lr": {**REBASE, "inner.lr_clock": "steps"},
    "fixed-H/drop": {"diloco.dylu": False, "diloco.max_staleness": 0, **ROUNDS_CLOCK},
    "fixed-H/rebase": {"diloco.dylu": False, **REBASE, **ROUNDS_CLOCK},
    "fixed-H/rebase+dn": {"diloco.dylu": False, **REBASE, **DN, **ROUNDS_CLOCK},
}


def run_once(method: str, rounds: int, inner_steps: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"hetero-{method.replace('/', '-')}-"))
    cfg = load_config(defaults={**DEMO_DEFAULTS, "averaging.min_group_size": 3, **MEASURED_OUTER, **METHODS[method]})
    rc = run_swarm(len(SLOWDOWNS), rounds, inner_steps, str(run_dir), write_peer_config(run_dir, cfg),
                   slowdowns=SLOWDOWNS, timeout=1800, echo=lambda s: None)
    summary = json.loads((run_dir / "summary.json").read_text())
    if rc != 0 or len(summary["rounds"]) < rounds:  # reported in the table, not averaged in
        agree = sum(len(set(r["global_params_sha256"].values())) == 1 for r in summary["rounds"])
        return {"method": method, "run_dir": str(run_dir),
                "failed": f"exit {rc}, {len(summary['rounds'])} of {rounds} rounds, hashes agree in {agree}"}
    records = {f"peer{i}": read_jsonl(run_dir / f"peer{i}" / "metrics.jsonl") for i in range(len(SLOWDOWNS))}
    return {"method": method, "run_dir": str(run_dir), **curve(records), "idle": idle_shares(records)}


def curve(records: dict[str, list[dict]]) -> dict:
    """The run's eval loss per committed round against wall time and tokens trained so far (all peers)."""
    rounds = [r for recs in records.values() for r in recs if r.get("event") == "round"]
    t0 = min(r["time"] - r["time/round_s"] for r in rounds)
    points = []
    for n in sorted({r["round"] for r in rounds if r["committed"]}):
        done = [r for r in rounds if r["committed"] and r["round"] == n]
        evals = [r["eval/loss"] for r in done if r.get("eval/loss") is not None]
        t = min(r["time"] for r in done)
        tokens = sum(r["train/tokens"] for r in rounds if r["time"] <= t + 1e-6 or (r["committed"] and r["round"] <= n))
        points.append((t - t0, tokens, statistics.mean(evals)))
    wall = max(r["time"] for r in rounds) - t0
    return {"points": points, "wall_s": wall, "tokens": sum(r["train/tokens"] for r in rounds),
            "final_loss": points[-1][2]}


def idle_shares(records: dict[str, list[dict]]) -> dict[str, float]:
    out = {}
    for name, recs in records.items():
        rows = [r for r in recs if r.get("event") == "round" and r["round"] > 1]
        wall = sum(r["time/round_s"] for r in rows)
        out[name] = sum(r["outer/allreduce_s"] - r["outer/allreduce_only_s"] for r in rows) / wall if wall else 0.0
    return out


def loss_at_tokens(points, tokens: float):
    prev = (0, 0, None)
    for t, tok, loss in points:
        if tok >= tokens:
            if prev[2] is None:
                return loss
            return prev[2] + (loss - prev[2]) * (tokens - prev[1]) / (tok - prev[1])
        prev = (t, tok, loss)
    return None


def time_to_loss(points, target: float):
    return next((t for t, _, loss in points if loss <= target), None)


STOPPED = []  # set by SIGTERM: the running swarm is ended (run_swarm catches the interrupt) and no other starts


def _interrupt(signum, frame):
    STOPPED.append(signum)
    raise KeyboardInterrupt


def _at(rs, tokens: float, reference: float) -> str:
    """Median eval loss of runs ``rs`` at ``tokens``, and its change against ``reference``."""
    loss = _median(loss_at_tokens(r["points"], tokens) for r in rs)
    return f"{loss:.4f} ({100 * (loss / reference - 1):+.1f}%)"


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x, fmt="{:.3f}"):
    return "–" if x is None else fmt.format(x)


def loss_at_time(points, t: float):
    """The eval loss a run had reached at wall time ``t`` (its last committed round by then); None before its first."""
    reached = [loss for when, _, loss in points if when <= t]
    return reached[-1] if reached else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="repetitions; figures are medians (default 3)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of sync DiLoCo (default 6)")
    parser.add_argument("--inner-steps", type=int, default=30, help="H (default 30)")
    parser.add_argument("--method", action="append", choices=list(METHODS), help="methods (default: all); sync "
                        "is always run, as the reference")
    parser.add_argument("--out", default=None, help="also write every run's figures to this JSON file")
    parser.add_argument("--table", default=None, metavar="JSON", help="print the table of runs saved with --out, "
                        "running nothing")
    args = parser.parse_args()
    other_rounds = math.ceil(args.rounds * len(SLOWDOWNS) / sum(1 / s for s in SLOWDOWNS))
    if args.table:
        runs = json.loads(Path(args.table).read_text())
    else:
        runs = run_all(["sync"] + [m for m in (args.method or METHODS) if m != "sync"], args, other_rounds)
        if args.out:
            Path(args.out).write_text(json.dumps(runs, indent=1))
    print_table(runs, {m: args.rounds if m == "sync" else other_rounds for m in runs})


def run_all(methods: list[str], args, other_rounds: int) -> dict[str, list[dict]]:
    signal.signal(signal.SIGTERM, _interrupt)  # a TERM ends the running swarm's processes too, as Ctrl+C does
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.runs):
        for m in methods:
            r = run_once(m, args.rounds if m == "sync" else other_rounds, args.inner_steps)
            if STOPPED:
                raise SystemExit("stopped (SIGTERM)")
            runs[m].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "points"}), flush=True)
            if args.out:  # after every run, so that an interrupted benchmark keeps what it measured
                Path(args.out).write_text(json.dumps(runs, indent=1))
    return runs


def print_table(runs: dict[str, list[dict]], rounds: dict[str, int]) -> None:
    ok = {m: [r for r in rs if "failed" not in r] for m, rs in runs.items()}
    sync = ok["sync"]
    target, sync_tokens = _median(r["final_loss"] for r in sync), _median(r["tokens"] for r in sync)
    sync_wall = _median(r["wall_s"] for r in sync)
    common = min(r["tokens"] for rs in ok.values() for r in rs)  # every run got this far: equal tokens for all
    print(f"\nsync's final eval loss (the target): {target:.4f}; its tokens {sync_tokens:.0f}, "
          f"wall {sync_wall:.0f} s; tokens every run reached: {common:.0f}\n")
    print("| method | rounds | wall s (x sync) | tokens (x sync) | final eval loss | sync's eval loss at this wall "
          "time | eval loss at sync's tokens (vs sync) | eval loss at the tokens every run reached (vs sync) | "
          "wall s to sync's final loss (x sync's wall) | idle share peer0 / peer1 / peer2 / peer3 (slowdown 1 / 1 / "
          "2 / 4) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sync_common = _median(loss_at_tokens(r["points"], common) for r in sync)
    for m, rs in ok.items():
        failed = [r["failed"] for r in runs[m] if "failed" in r]
        print(_row(m, rounds[m], rs, sync, target, sync_tokens, sync_wall, failed, common, sync_common) if rs else
              f"| {m} | every run failed: {'; '.join(failed)} |")


def _row(m, rounds, rs, sync, target, sync_tokens, sync_wall, failed, common, sync_common) -> str:
    wall, tokens = _median(r["wall_s"] for r in rs), _median(r["tokens"] for r in rs)
    sync_then = _median(loss_at_time(s["points"], wall) for s in sync)
    at_tokens = _median(loss_at_tokens(r["points"], sync_tokens) for r in rs)
    reach = [time_to_loss(r["points"], target) for r in rs]
    reached = sum(x is not None for x in reach)
    reach_m = _median(reach) if reached * 2 > len(reach) else None
    idle = " / ".join(f"{100 * _median(r['idle'][p] for r in rs):.1f}%" for p in sorted(rs[0]["idle"]))
    rel = f" ({100 * (at_tokens / target - 1):+.1f}%)" if at_tokens is not None else ""
    reach_text = f"{_f(reach_m, '{:.0f}')}{f' ({reach_m / sync_wall:.2f})' if reach_m is not None else ''}"
    return (f"| {m} | {rounds} | {wall:.0f} ({wall / sync_wall:.2f}) | {tokens / sync_tokens:.2f} | "
            f"{_median(r['final_loss'] for r in rs):.4f} | {_f(sync_then, '{:.4f}')} | "
            f"{_f(at_tokens, '{:.4f}')}{rel} | {_at(rs, common, sync_common)} | "
            f"{reach_text} [{reached}/{len(reach)} reached] | {idle} |"
            + (f" {len(failed)} run(s) failed: {'; '.join(failed)}" if failed else ""))


if __name__ == "__main__":
    main()
