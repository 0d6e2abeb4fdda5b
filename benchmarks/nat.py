"""Home peers behind NAT: all-reduce time and wire bytes, direct vs client mode vs relayed, on asymmetric links.

An emulated internet (netlab.py): every home host sits behind its own NAT router on a link of
``--down``/``--up`` Mbit/s (default 100/20); cloud hosts and the relay (a ``p2p-diloco bootstrap`` node, public,
serving circuit relay v2) have symmetric ``--cloud`` Mbit/s links. N = 3 peers average one tensor of ``--params``
fp32 values (scaled_fp16 on the wire, like a peer's pseudo-gradient) with p2p_diloco's Averager:

  * direct:  three homes whose routers forward a port (public hosts on home links): every peer a full node;
  * client:  a cloud peer and two NATed homes in client mode: the cloud peer reduces everything;
  * relayed: three NATed homes, each reachable only through the relay: all traffic crosses the relay;
  * mixed:   a cloud peer and two NATed, relayed homes: homes reach the cloud directly, each other via the relay.

Per setting (median of ``--reps`` rounds after a warm-up): all-reduce s (group formed to the last peer holding the
result), the link bound (the least time these links allow: the busiest link's bytes over its rate, from the
butterfly's traffic with equal shares among reducers; the home uplink is the bound), their ratio, the MB each peer
sent on its interface and the MB the relay forwarded (measured on interfaces, headers included). Then what a model
of ``--model-params`` parameters would do against the relay's limits per relayed connection, which the relay itself
reports (circuit v2 RESERVE). ``--relay-data-limit`` lowers the relay's limit to watch a relayed connection being
reset (``--scenario relayed --reps 6 --relay-data-limit 45e6``: one round in four fails). Needs root
(``ip netns``) and nftables. Run:

    sudo python benchmarks/nat.py [--params 10e6] [--down 100 --up 20] [--reps 3] [--scenario relayed]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import median, table
from netlab import Internet, Worker, answer_commands, link_bytes

SCENARIOS = {  # name -> [(host kind, network settings)]; kinds: home (NAT), forwarded (public, home link), cloud
    "direct": [("forwarded", "public"), ("forwarded", "public"), ("forwarded", "public")],
    "client": [("cloud", "public"), ("home", "client"), ("home", "client")],
    "relayed": [("home", "private"), ("home", "private"), ("home", "private")],
    "mixed": [("cloud", "public"), ("home", "private"), ("home", "private")],
}
BYTES_PER_VALUE = 2  # scaled_fp16


# ---------------------------------------------------------------------------------------------------- worker side
def worker(args) -> None:
    """One peer inside its host: joins like a peer (net/nat.py), then averages on command."""
    import torch

    from p2p_diloco.config import AveragingConfig, NetworkConfig
    from p2p_diloco.net import nat
    from p2p_diloco.net.averaging import Averager, Contribution

    torch.set_num_threads(1)
    out, sys.stdout = sys.stdout, sys.stderr  # only answers go to the coordinator
    size, n = int(args.params), 3
    net = NetworkConfig(initial_peers=[args.relay], host_maddrs=["/ip4/0.0.0.0/tcp/31337"],
                        reachability="public" if args.setting == "public" else "private",
                        client_mode=args.setting == "client")
    dht, choice, _ = nat.join(net, size * BYTES_PER_VALUE)
    averager = Averager(dht, AveragingConfig(min_group_size=n, target_group_size=n, matchmaking_time=5.0,
                                             request_timeout=3.0, allreduce_timeout=900.0, next_chunk_timeout=120.0),
                        f"natbench-{args.scenario}", [torch.Size([size])], client_mode=choice.mode == "client",
                        expected_group_size=n)
    payload = torch.randn(size, generator=torch.Generator().manual_seed(args.rank))

    def run() -> dict:
        with averager.pseudo_grads() as bufs:
            bufs[0].copy_(payload)
        tx0, rx0 = link_bytes()
        res = averager.average(Contribution(name=f"p{args.rank}", round=0, digest="bench", tokens=1), 1.0)
        tx1, rx1 = link_bytes()
        return {"ok": res.ok and res.group_size == n, "allreduce_s": res.allreduce_seconds, "tx": tx1 - tx0,
                "rx": rx1 - rx0, "error": res.error}

    out.write(json.dumps({"mode": choice.mode}) + "\n")
    out.flush()
    answer_commands({"run": run}, out)
    averager.close()
    dht.shutdown()


# ---------------------------------------------------------------------------------------------------- coordinator
class Relay:
    """A p2p-diloco bootstrap node (public, serving the relay) in ``host``; ``maddr`` to join through."""

    def __init__(self, host, log_path: Path, data_limit: int, time_limit: float):
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*host.exec_prefix, sys.executable, "-m", "p2p_diloco", "bootstrap",
                                      "--network.host_maddrs=/ip4/0.0.0.0/tcp/31337",
                                      f"--network.identity_path={log_path.parent / 'relay.key'}",
                                      f"--network.relay_data_limit={data_limit}",
                                      f"--network.relay_time_limit={time_limit}"],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True)
        self.maddr, self.limits_line = "", ""
        for line in self.proc.stdout:
            self._log.write(line)
            if line.startswith("relay:"):
                self.limits_line = line.strip()
            if line.strip().startswith(f"/ip4/{host.address}/"):
                self.maddr = line.strip()
            if line.startswith("join with"):
                break
        if not self.maddr:
            raise RuntimeError(f"the relay did not start (see {log_path})")

    def close(self) -> None:
        from p2p_diloco.ops.procs import stop_groups

        stop_groups([self.proc.pid])
        self.proc.wait()
        self._log.close()


def bound_s(scenario: str, params: float, down: float, up: float, cloud: float) -> float:
    """Least all-reduce time on these links: butterfly traffic with equal shares among reducers, the relay
    carrying what passes between two relayed peers; the busiest link (bytes / rate) sets it."""
    peers = SCENARIOS[scenario]
    payload = params * BYTES_PER_VALUE * 8  # bits
    reducers = [i for i, (_, s) in enumerate(peers) if s != "client"]
    share = {i: (1 / len(reducers) if i in reducers else 0.0) for i in range(len(peers))}
    relayed = {i for i, (kind, s) in enumerate(peers) if kind == "home" and s == "private"}
    up_bits, down_bits, relay_bits = [0.0] * len(peers), [0.0] * len(peers), 0.0
    for i in range(len(peers)):
        for j in range(len(peers)):
            if i == j:
                continue
            bits = (share[j] + share[i]) * payload  # i's part of j's share, and i's average of its own share
            up_bits[i] += bits
            down_bits[j] += bits
            if i in relayed and j in relayed:
                relay_bits += bits
    rates = [(cloud, cloud) if kind == "cloud" else (up, down) for kind, _ in peers]
    times = [max(u / (r_up * 1e6), d / (r_down * 1e6)) for u, d, (r_up, r_down) in zip(up_bits, down_bits, rates)]
    return max(times + [relay_bits / (cloud * 1e6)])


def measure(net: Internet, relay: Relay, scenario: str, args, log_dir: Path) -> dict:
    workers = []
    try:
        for rank, (kind, setting) in enumerate(SCENARIOS[scenario]):
            host = net.hosts[f"{kind}{rank}"]
            workers.append(Worker([*host.exec_prefix, sys.executable, __file__, "--worker", "--rank", str(rank),
                                   "--scenario", scenario, "--setting", setting, "--relay", relay.maddr,
                                   "--params", str(args.params)], str(log_dir / f"{scenario}-{rank}.log")))
        modes = [w.read()["mode"] for w in workers]
        rounds = []
        for _ in range(args.reps + 1):  # the first is a warm-up: connections, buffers
            tx0, rx0 = relay_link_bytes(net)
            for w in workers:
                w.send(cmd="run")
            answers = [w.read() for w in workers]
            tx1, rx1 = relay_link_bytes(net)
            rounds.append((answers, (tx1 - tx0 + rx1 - rx0) / 2))
    finally:
        for w in workers:
            w.close()
    ok = [(a, r) for a, r in rounds[1:] if all(x["ok"] for x in a)]
    committed = "".join("+" if all(x["ok"] for x in a) else "-" for a, _ in rounds[1:])
    row = {"scenario": scenario, "modes": modes, "ok": f"{len(ok)}/{args.reps} ({committed})",
           "bound_s": bound_s(scenario, args.params, args.down, args.up, args.cloud)}
    if ok:
        row.update(allreduce_s=median(max(x["allreduce_s"] for x in a) for a, _ in ok),
                   sent_mb=median(median(x["tx"] for x in a) for a, _ in ok) / 1e6,
                   relay_mb=median(r for _, r in ok) / 1e6)
        row["ratio"] = row["allreduce_s"] / row["bound_s"]
    else:
        row["errors"] = sorted({x.get("error") or "" for a, _ in rounds for x in a})[:3]
    print(json.dumps(row), flush=True)
    return row


def relay_link_bytes(net: Internet) -> tuple[int, int]:
    out = subprocess.run([*net.hosts["relay"].exec_prefix, "cat", "/sys/class/net/eth0/statistics/tx_bytes",
                          "/sys/class/net/eth0/statistics/rx_bytes"], capture_output=True, text=True, check=True)
    tx, rx = out.stdout.split()
    return int(tx), int(rx)


def big_model_lines(limits_line: str, model_params: float, up: float, data_limit: int, time_limit: float) -> list[str]:
    """What a payload of ``model_params`` fp16 values does against the relay's limits, for relayed homes."""
    payload = model_params * BYTES_PER_VALUE
    lines = [f"relay (as it answered a RESERVE): {limits_line}",
             f"a {model_params / 1e9:g}B-parameter model: {payload / 1e9:.1f} GB per all-reduce payload (fp16)"]
    for n in (2, 4):
        per_direction = 2 * payload / n  # between two relayed peers, each way, per round (equal shares)
        round_s = 2 * (n - 1) / n * payload * 8 / (up * 1e6)  # each home uploads 2(N-1)/N x payload
        by_data = data_limit / per_direction
        by_time = time_limit / round_s
        lines.append(f"N={n} relayed homes: {per_direction / 1e9:.2f} GB each way per relayed connection per round; "
                     f"a round needs at least {round_s / 60:.1f} min at {up:g} Mbit/s up; a relayed connection is "
                     f"reset after {data_limit / 2**30:.3g} GiB ({by_data:.2f} rounds) or {time_limit / 60:g} min "
                     f"({by_time:.2f} rounds): the round in flight then fails, so "
                     + (f"about one round in {int(min(by_data, by_time)) + 1} is lost" if min(by_data, by_time) >= 1
                        else "every round fails"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=10e6, help="values averaged (default 10e6)")
    parser.add_argument("--down", type=float, default=100, help="home download, Mbit/s (default 100)")
    parser.add_argument("--up", type=float, default=20, help="home upload, Mbit/s (default 20)")
    parser.add_argument("--cloud", type=float, default=100, help="cloud and relay links, Mbit/s each way (default 100)")
    parser.add_argument("--scenario", action="append", help=f"one of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds per scenario (default 3)")
    parser.add_argument("--model-params", type=float, default=1e9, help="model for the relay-limit analysis")
    parser.add_argument("--relay-data-limit", type=float, default=1 << 32,
                        help="bytes a relayed connection carries each way before the relay resets it (default 4 GiB)")
    parser.add_argument("--relay-time-limit", type=float, default=1800,
                        help="seconds a relayed connection lasts before the relay resets it (default 1800)")
    parser.add_argument("--log-dir", default="/tmp/nat-bench", help="workers' logs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.scenario = args.scenario[0]
        return worker(args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    scenarios = args.scenario or list(SCENARIOS)
    start, rows = time.perf_counter(), []
    with Internet() as net:
        net.add_public("relay")
        net.shape("relay", args.cloud, args.cloud)
        for name, (kind, _) in {f"{k}{i}": (k, s) for sc in scenarios for i, (k, s) in enumerate(SCENARIOS[sc])}.items():
            (net.add_home if kind == "home" else net.add_public)(name)
            net.shape(name, *((args.cloud, args.cloud) if kind == "cloud" else (args.down, args.up)))
        relay = Relay(net.hosts["relay"], log_dir / "relay.log", int(args.relay_data_limit), args.relay_time_limit)
        try:
            rows = [measure(net, relay, scenario, args, log_dir) for scenario in scenarios]
        finally:
            relay.close()
    print(f"\n{time.perf_counter() - start:.0f} s in all; median of {args.reps} rounds after a warm-up; "
          f"{args.params / 1e6:g}M values, homes {args.down:g}/{args.up:g} Mbit/s, cloud and relay {args.cloud:g}\n")
    print(table(["setting", "modes", "all-reduce s", "bound s", "ratio", "MB sent per peer", "MB via relay",
                 "committed (+) per round"],
                [[r["scenario"], "/".join(r["modes"]), f"{r['allreduce_s']:.2f}" if "allreduce_s" in r else "failed",
                  f"{r['bound_s']:.2f}", f"{r['ratio']:.2f}" if "ratio" in r else "",
                  f"{r['sent_mb']:.1f}" if "sent_mb" in r else "", f"{r['relay_mb']:.1f}" if "relay_mb" in r else "",
                  r["ok"]] for r in rows]))
    print()
    for line in big_model_lines(relay.limits_line, args.model_params, args.up, int(args.relay_data_limit),
                                args.relay_time_limit):
        print(f"- {line}")


if __name__ == "__main__":
    main()
