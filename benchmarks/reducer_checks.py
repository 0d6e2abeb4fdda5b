"""Cost of the reducer checks (``averaging.verify_parts``): round time with the checks on, as a ratio to off.

Two measurements, each on this machine under its current load, with on and off interleaved so that load cancels:
  * all-reduce: 3 peer processes average a vector of ``--params`` values (scaled fp16 on the wire) with one
    Averager per setting, alternating on and off ``--reps`` times; per setting, the median over repetitions of the
    slowest peer's all-reduce time (the group formed -> the result checked, digests exchanged when on);
  * swarm: a local swarm (3 peers, tiny model) trains ``--rounds`` rounds, ``--runs`` runs per setting alternating;
    per setting, the median over runs of each run's median round time (``time/round_s``) and all-reduce time
    (``outer/allreduce_only_s``);
  * digest exchange: in the all-reduce measurement, the time from a member's own digests being ready to its verdict
    (calls, waiting for the slowest member, comparison), median over members and repetitions.
Run:

    nice -n 10 python benchmarks/reducer_checks.py [--params 1e6 --params 10e6] [--reps 5] [--runs 3] [--rounds 6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics

from common import demo_config, rounds_of, swarm_records, table

from p2p_diloco.ops.procs import join_or_kill

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _timed_exchange(exchanges) -> None:
    """Time each digest exchange (from our digests ready to the verdict) in the averager process, into ``exchanges``."""
    import time

    from p2p_diloco.net.averaging.verify import PartVerifier

    verify = PartVerifier._verify_parts

    async def timed(self, *args):
        begun = time.perf_counter()
        try:
            await verify(self, *args)
        finally:
            exchanges.put(time.perf_counter() - begun)

    PartVerifier._verify_parts = timed


def _worker(index: int, initial_peers: list[str], values: int, reps: int, results, exchanges) -> None:
    import torch

    from p2p_diloco.config import AveragingConfig, NetworkConfig
    from p2p_diloco.net.averaging import Averager, Contribution
    from p2p_diloco.net.dht import start_dht

    torch.set_num_threads(1)
    _timed_exchange(exchanges)  # before the averagers fork their processes
    dht = start_dht(NetworkConfig(initial_peers=initial_peers, host_maddrs=LOOPBACK))
    shapes = [torch.Size([values])]
    averagers = {on: Averager(dht, AveragingConfig(matchmaking_time=5, request_timeout=2, verify_parts=on),
                              f"bench-verify-{on}", shapes, expected_group_size=3) for on in (True, False)}
    try:
        for rep in range(reps):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                with averagers[on].pseudo_grads() as buffers:
                    buffers[0].copy_(torch.randn(values) * 1e-3)
                result = averagers[on].average(Contribution(f"p{index}", 0, "d", 100), 100)
                results.put((on, rep, index, result.ok, result.allreduce_seconds))
    finally:
        for a in averagers.values():
            a.close()
        dht.shutdown()


def allreduce_cost(values: int, reps: int) -> tuple[dict[bool, float], float]:
    """Median over repetitions of the slowest peer's all-reduce time, per setting; and the median digest exchange."""
    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    ctx = mp.get_context("fork")
    results, exchanges = ctx.Queue(), ctx.Queue()
    boot = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    procs = [ctx.Process(target=_worker, args=(i, visible_maddrs(boot), values, reps, results, exchanges)) for i in range(3)]
    try:
        for p in procs:
            p.start()
        slowest: dict[tuple, float] = {}
        for _ in range(3 * 2 * reps):
            on, rep, _, ok, seconds = results.get(timeout=600)
            if not ok:
                raise RuntimeError(f"an all-reduce failed (verify_parts={on}, repetition {rep})")
            slowest[on, rep] = max(slowest.get((on, rep), 0.0), seconds)
        exchange = statistics.median(exchanges.get(timeout=10) for _ in range(3 * reps))
        return {on: statistics.median(slowest[on, r] for r in range(reps)) for on in (True, False)}, exchange
    finally:
        join_or_kill(procs, timeout=30)
        boot.shutdown()


def swarm_cost(runs: int, rounds: int, inner_steps: int) -> dict[bool, tuple[float, float]]:
    per_run: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for run in range(runs):
        for on in ((True, False) if run % 2 == 0 else (False, True)):
            cfg = demo_config(**{"averaging.verify_parts": on, "averaging.matchmaking_time": 5.0,
                                 "run.checkpoint_every": 0, "model.seq_len": 64, "inner.batch_size": 4})
            records = swarm_records(3, rounds, inner_steps, cfg, f"verify-{on}")
            committed = [r for recs in records.values() for r in rounds_of(recs) if r["committed"]]
            per_run[on].append((statistics.median(r["time/round_s"] for r in committed),
                                statistics.median(r["outer/allreduce_only_s"] for r in committed)))
    return {on: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v)) for on, v in per_run.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, action="append", help="values averaged (default 1e6 and 10e6)")
    ap.add_argument("--reps", type=int, default=5, help="all-reduces per setting")
    ap.add_argument("--runs", type=int, default=3, help="swarm runs per setting (0: skip the swarm)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per swarm run")
    ap.add_argument("--inner-steps", type=int, default=10, help="inner steps per round")
    args = ap.parse_args()
    rows = []
    for values in args.params or [1e6, 10e6]:
        t, exchange = allreduce_cost(int(values), args.reps)
        rows.append([f"all-reduce, {values / 1e6:g}M values, 3 peers", f"{t[False]:.3f}", f"{t[True]:.3f}",
                     f"{t[True] / t[False]:.2f}", f"{exchange * 1e3:.1f}"])
        print(rows[-1], flush=True)
    if args.runs:
        t = swarm_cost(args.runs, args.rounds, args.inner_steps)
        for i, what in enumerate(("round", "all-reduce")):
            rows.append([f"swarm, tiny model, 3 peers: {what} time", f"{t[False][i]:.3f}", f"{t[True][i]:.3f}",
                         f"{t[True][i] / t[False][i]:.2f}", ""])
            print(rows[-1], flush=True)
    print(table(["measured (median)", "off s", "on s", "on / off", "digest exchange ms"], rows))


if __name__ == "__main__":
    main()
