"""Join cost: how long a joining peer takes to download θ_global and the outer momentum from a donor, against the
time the link itself needs.

Two processes, each in its own network namespace on a bridge (benchmarks/netlab.py): a donor serving the state of
a model preset (fp32 θ_global + momentum, exactly what a peer serves) and a joiner downloading it through the same
code path as a real join (``Averager.download_state``), then checking its sha256 against the donor's digest. The
link is first left unshaped (a veth pair: the transfer is bound by CPU), then shaped with ``tc tbf`` to each
``--rate``. Reports the median of ``--reps`` downloads, the bound (state bytes / link rate) and their ratio. Needs
root for ``ip netns``. Run:

    sudo python benchmarks/join_cost.py [--preset tiny --preset 150m] [--rate 1000 --rate 100] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import median, table
from netlab import NetLab, Worker, answer_commands


def _shapes(preset: str):
    import torch
    from transformers import AutoModelForCausalLM

    from p2p_diloco.config import ModelConfig
    from p2p_diloco.train.model import load_model_config

    config = load_model_config(ModelConfig(name=preset), vocab_size=32000 if preset != "tiny" else 256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [p.shape for p in model.parameters()]


def worker(args) -> None:
    """The donor (``--role donor``) or the joiner, inside its namespace."""
    import torch

    from p2p_diloco.net.averaging import Averager
    from p2p_diloco.config import AveragingConfig, NetworkConfig
    from p2p_diloco.net.dht import start_dht, visible_maddrs
    from p2p_diloco.train.outer import state_digests

    torch.set_num_threads(1)
    out, sys.stdout = sys.stdout, sys.stderr  # only answers go to the coordinator
    shapes = _shapes(args.preset)
    dht = start_dht(NetworkConfig(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.address}/tcp/0"]))
    averager = Averager(dht, AveragingConfig(state_timeout=900), "joinbench", shapes)
    if args.role == "donor":
        params = [torch.randn(s) for s in shapes]
        momentum = [torch.randn(s) for s in shapes]
        _, digest = state_digests(params, momentum)
        averager.serve_state(lambda: ({"round": 1, "digest": digest, "name": "donor"},
                                      [t.clone() for t in (*params, *momentum)]), round_=1)
        out.write(json.dumps({"maddrs": visible_maddrs(dht), "peer_id": averager.peer_id}) + "\n")
        out.flush()
        handlers = {}
    else:
        def download(donor: str) -> dict:
            start = time.perf_counter()
            fetched = averager.download_state([donor])
            seconds = time.perf_counter() - start
            if fetched is None:
                return {"ok": False}
            metadata, tensors, _ = fetched
            ok = state_digests(tensors[:len(shapes)], tensors[len(shapes):])[1] == metadata["digest"]
            return {"ok": ok, "seconds": seconds, "verify_s": time.perf_counter() - start - seconds,
                    "bytes": sum(t.numel() * t.element_size() for t in tensors)}
        handlers = {"download": download}
        out.write(json.dumps({"ready": True}) + "\n")
        out.flush()
    answer_commands(handlers, out)
    averager.close()
    dht.shutdown()


def measure(preset: str, rates, reps: int, log_dir: Path) -> list[dict]:
    rows = []
    base = [sys.executable, __file__, "--worker", "--preset", preset]
    with NetLab(2) as lab:
        donor = Worker([*lab.exec_prefix(0), *base, "--role", "donor", "--address", lab.address(0)],
                       str(log_dir / f"donor-{preset}.log"))
        joiner = None
        try:
            hello = donor.read()
            joiner = Worker([*lab.exec_prefix(1), *base, "--role", "joiner", "--address", lab.address(1),
                             "--initial-peers", json.dumps(hello["maddrs"])], str(log_dir / f"joiner-{preset}.log"))
            joiner.read()
            for rate in rates:
                lab.set_rate(rate)
                runs = []
                for _ in range(reps):
                    joiner.send(cmd="download", donor=hello["peer_id"])
                    runs.append(joiner.read())
                ok = [r for r in runs if r["ok"]]
                row = {"preset": preset, "rate": rate, "ok": f"{len(ok)}/{reps}"}
                if ok:
                    row.update(bytes=ok[0]["bytes"], seconds=median(r["seconds"] for r in ok),
                               verify_s=median(r["verify_s"] for r in ok))
                    row["bound_s"] = row["bytes"] * 8 / (rate * 1e6) if rate else None
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for w in (joiner, donor):
                if w is not None:
                    w.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", help="model preset(s) to measure (default: tiny and 150m)")
    parser.add_argument("--rate", type=float, action="append",
                        help="link rate(s), Mbit/s, measured after the unshaped link (default 1000 and 100)")
    parser.add_argument("--reps", type=int, default=3, help="downloads per setting (default 3)")
    parser.add_argument("--log-dir", default="/tmp/join-cost", help="workers' logs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", type=json.loads, default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.preset = args.preset[0]  # one for a worker
        return worker(args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.preset or ["tiny", "150m"]:
        rows += measure(preset, [None, *(args.rate or [1000, 100])], args.reps, log_dir)
    print(table(["preset", "state (θ_global + momentum, fp32)", "link", "download s", "bound s (bytes / rate)",
                 "download / bound", "digest check s", "MB/s", "ok"],
                [[r["preset"], f"{r['bytes'] / 1e6:.1f} MB", f"{r['rate']:g} Mbit/s" if r["rate"] else "unshaped",
                  f"{r['seconds']:.2f}", f"{r['bound_s']:.2f}" if r["bound_s"] else "–",
                  f"{r['seconds'] / r['bound_s']:.2f}" if r["bound_s"] else "–", f"{r['verify_s']:.2f}",
                  f"{r['bytes'] / r['seconds'] / 1e6:.1f}", r["ok"]] if "seconds" in r else
                 [r["preset"], "", r["rate"], "failed", "", "", "", "", r["ok"]] for r in rows]))


if __name__ == "__main__":
    main()
