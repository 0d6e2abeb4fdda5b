"""All-reduce against the link limit: our canonical averaging round vs hivemind's DecentralizedAverager vs gloo.

N peer processes, each in its own network namespace on a bridge (benchmarks/netlab.py), every link shaped to the same
rate with ``tc tbf``, both ways. For each payload, each system averages one tensor of that many values across all N
peers; each timed round is preceded by an untimed warm-up. Reported per system (median over ``--reps`` rounds):

  * all-reduce s: from the group being formed to the last peer holding the result (max over peers); for gloo, the
    ``all_reduce`` call after a barrier;
  * round s (hivemind-based systems): the whole ``step`` call, matchmaking included;
  * bound s: 2(N-1)/N x payload bytes / link rate, the least time any all-reduce needs on these links (every value
    must leave and every average must reach each peer through its own link), with the payload at the codec's own
    bits per value (scales included), and all-reduce s / bound s ("ratio to sent");
  * fp32 bound s: the same bound for the payload in fp32, and all-reduce s / fp32 bound s ("ratio to fp32": below 1,
    the codec beats what any fp32 all-reduce could do on these links; the speedup a user sees);
  * wire MB: bytes each peer sent on its interface (median over peers, headers included), measured.

Systems: ``ours`` (p2p_diloco.net.averaging.Averager, codecs scaled_fp16, fp16, fp32, int8, int4), ``hivemind``
(``DecentralizedAverager``, fp16 and fp32) and ``gloo`` (``torch.distributed.all_reduce``, fp32 and fp16). Needs
root for ``ip netns``. Run:

    sudo python benchmarks/allreduce_link.py [--peers 2 --peers 4] [--rate 100 --rate 1000] [--params 10e6]
    sudo python benchmarks/allreduce_link.py --rate 100 --rate 20 --system ours:fp32 --system ours:scaled_fp16 \
        --system ours:int8 --system ours:int4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import median, table
from netlab import NetLab, Worker, answer_commands, link_bytes

from p2p_diloco.net.averaging.wire import bits_per_value

SYSTEMS = [("ours", "scaled_fp16"), ("ours", "fp16"), ("ours", "fp32"), ("ours", "int8"), ("ours", "int4"),
           ("hivemind", "fp16"), ("hivemind", "fp32"), ("gloo", "fp16"), ("gloo", "fp32")]
GLOO_PORT = 29517


# ---------------------------------------------------------------------------------------------------- worker side
def worker(args) -> None:
    """One peer, inside its namespace: reads commands from stdin, answers one JSON line per command on stdout."""
    import torch
    import torch.distributed as dist
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression

    from p2p_diloco.net.averaging import Averager, Contribution
    from p2p_diloco.config import AveragingConfig, NetworkConfig
    from p2p_diloco.net.dht import start_dht, visible_maddrs

    class TimedAverager(DecentralizedAverager):
        """hivemind's averager unchanged, but reporting how long its all-reduce took (like ours does)."""

        async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
            start = time.perf_counter()
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            return {"gathered": gathered, "allreduce_seconds": time.perf_counter() - start}

    torch.set_num_threads(1)
    out = sys.stdout
    sys.stdout = sys.stderr  # only answers go to the coordinator
    say = lambda **kw: (out.write(json.dumps(kw) + "\n"), out.flush())  # noqa: E731
    n, rank, size = args.peers, args.rank, int(args.params)
    host = [f"/ip4/{args.address}/tcp/0"]
    dht = start_dht(NetworkConfig(initial_peers=args.initial_peers, host_maddrs=host))
    if rank == 0:
        say(maddrs=visible_maddrs(dht))
    payload = torch.randn(size, generator=torch.Generator().manual_seed(rank))
    cfg = dict(min_group_size=n, target_group_size=n, matchmaking_time=5.0, request_timeout=3.0,
               allreduce_timeout=900.0, next_chunk_timeout=120.0)
    averagers = {}
    for system, codec in args.systems:
        if system == "ours":
            averagers[system, codec] = Averager(dht, AveragingConfig(codec=codec, **cfg), f"bench-ours-{codec}",
                                                [payload.shape], expected_group_size=n)
        elif system == "hivemind":
            compression = Float16Compression() if codec == "fp16" else NoCompression()
            averagers[system, codec] = TimedAverager(
                [payload.clone()], dht, prefix=f"bench-hm-{codec}", start=True, target_group_size=n,
                min_group_size=n, min_matchmaking_time=5.0, request_timeout=3.0, allreduce_timeout=900.0,
                next_chunk_timeout=120.0, compression=compression, shutdown_timeout=5)
    if any(s == "gloo" for s, _ in args.systems):
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        dist.init_process_group("gloo", init_method=f"tcp://{args.gloo_master}:{GLOO_PORT}", rank=rank,
                                world_size=n)

    def run(system: str, codec: str) -> dict:
        tx0, _ = link_bytes()
        result = {"ok": True}
        if system == "gloo":
            tensor = payload.to(torch.float16 if codec == "fp16" else torch.float32)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            result["allreduce_s"] = result["round_s"] = time.perf_counter() - start
        elif system == "ours":
            averager = averagers[system, codec]
            with averager.pseudo_grads() as bufs:
                bufs[0].copy_(payload)
            res = averager.average(Contribution(name=f"p{rank}", round=0, digest="bench", tokens=1), 1.0)
            result.update(ok=res.ok and res.group_size == n, allreduce_s=res.allreduce_seconds, round_s=res.seconds,
                          error=res.error)
        else:
            start = time.perf_counter()
            try:
                gathered = averagers[system, codec].step(timeout=900.0)
                result.update(ok=gathered is not None and len(gathered["gathered"]) == n,
                              allreduce_s=gathered["allreduce_seconds"] if gathered else None)
            except Exception as e:
                result.update(ok=False, error=str(e)[:200])
            result["round_s"] = time.perf_counter() - start
        result["tx"] = link_bytes()[0] - tx0
        return result

    say(ready=True)
    answer_commands({"run": run}, out)
    for averager in averagers.values():
        (averager.close if isinstance(averager, Averager) else averager.shutdown)()
    if dist.is_initialized():
        dist.destroy_process_group()
    dht.shutdown()


# ---------------------------------------------------------------------------------------------------- coordinator
class Swarm:
    """N workers, one per namespace of ``lab``, driven in lockstep."""

    def __init__(self, lab: NetLab, params: float, systems, log_dir: Path):
        self.workers: list[Worker] = []
        base = [sys.executable, __file__, "--worker", "--peers", str(lab.n), "--params", str(params),
                "--gloo-master", lab.address(0), "--systems", json.dumps(systems)]
        initial: list[str] = []
        try:
            for rank in range(lab.n):
                self.workers.append(Worker([*lab.exec_prefix(rank), *base, "--rank", str(rank), "--address",
                                            lab.address(rank), "--initial-peers", json.dumps(initial)],
                                           str(log_dir / f"worker{rank}.log")))
                if rank == 0:
                    initial = self.workers[0].read()["maddrs"]
            for w in self.workers:
                assert w.read().get("ready"), "worker failed to start"
        except BaseException:
            self.close()
            raise

    def round(self, system: str, codec: str) -> list[dict]:
        for w in self.workers:
            w.send(cmd="run", system=system, codec=codec)
        return [w.read() for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.close()


def measure(lab: NetLab, rates, params: float, systems, reps: int, log_dir: Path) -> list[dict]:
    rows = []
    swarm = Swarm(lab, params, systems, log_dir)
    try:
        for rate in rates:
            lab.set_rate(rate)
            for system, codec in systems:
                swarm.round(system, codec)  # warm-up: connections, buffers
                runs = [swarm.round(system, codec) for _ in range(reps)]
                ok = [r for r in runs if all(x["ok"] for x in r)]
                bound_fp32 = 2 * (lab.n - 1) / lab.n * params * 32 / (rate * 1e6)
                bound = bound_fp32 * bits_per_value(codec) / 32
                row = {"peers": lab.n, "rate_mbit": rate, "params": params, "system": system, "codec": codec,
                       "ok_rounds": f"{len(ok)}/{reps}", "bound_s": bound, "bound_fp32_s": bound_fp32}
                if ok:
                    row.update(allreduce_s=median(max(x["allreduce_s"] for x in r) for r in ok),
                               round_s=median(max(x["round_s"] for x in r) for r in ok),
                               wire_mb=median(median(x["tx"] for x in r) for r in ok) / 1e6)
                    row["ratio"] = row["allreduce_s"] / bound
                    row["ratio_fp32"] = row["allreduce_s"] / bound_fp32
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        swarm.close()
        lab.set_rate(None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, action="append", help="N (default 2 and 4)")
    parser.add_argument("--rate", type=float, action="append", help="link rate, Mbit/s (default 100 and 1000)")
    parser.add_argument("--params", type=float, action="append", help="payload values (default 10e6)")
    parser.add_argument("--system", action="append", help="system:codec to run, e.g. ours:fp32 (default: all)")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds per setting (default 3)")
    parser.add_argument("--log-dir", default="/tmp/allreduce-link", help="workers' logs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", type=json.loads, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-master", help=argparse.SUPPRESS)
    parser.add_argument("--systems", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.params, args.peers = args.params[0], args.peers[0]  # one of each for a worker
        return worker(args)
    systems = [tuple(s.split(":")) for s in args.system] if args.system else SYSTEMS
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    start = time.perf_counter()
    for n in args.peers or [2, 4]:
        for params in args.params or [10e6]:
            with NetLab(n) as lab:
                rows += measure(lab, args.rate or [100, 1000], params, systems, args.reps, log_dir)
    print(f"\n{time.perf_counter() - start:.0f} s in all; median of {args.reps} rounds after a warm-up\n")
    print(table(["N", "link", "payload", "system", "wire", "all-reduce s", "round s", "bound s", "ratio to sent",
                 "fp32 bound s", "ratio to fp32", "wire MB sent per peer", "ok rounds"],
                [[r["peers"], f"{r['rate_mbit']:g} Mbit/s", f"{r['params'] / 1e6:g}M", r["system"], r["codec"],
                  f"{r['allreduce_s']:.2f}" if "allreduce_s" in r else "failed",
                  f"{r['round_s']:.2f}" if "round_s" in r else "", f"{r['bound_s']:.2f}",
                  f"{r['ratio']:.2f}" if "ratio" in r else "", f"{r['bound_fp32_s']:.2f}",
                  f"{r['ratio_fp32']:.2f}" if "ratio_fp32" in r else "",
                  f"{r['wire_mb']:.1f}" if "wire_mb" in r else "", r["ok_rounds"]] for r in rows]))


if __name__ == "__main__":
    main()
