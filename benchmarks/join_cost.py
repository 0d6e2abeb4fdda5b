"""Join cost: how long a joining peer takes to download θ_global and the outer momentum from a donor.

Two processes on loopback: a donor serving the state of a model preset (fp32 θ_global + momentum, exactly what a
peer serves) and a joiner that downloads it through the same code path as a real join (Averager.download_state),
verifies its digest, and reports bytes, seconds and the effective rate. Run:

    python benchmarks/join_cost.py --preset tiny --preset 150m
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _shapes(preset: str) -> list[torch.Size]:
    from p2p_diloco.config import ModelConfig
    from p2p_diloco.model import load_model_config
    from transformers import AutoModelForCausalLM

    config = load_model_config(ModelConfig(name=preset), vocab_size=32000 if preset != "tiny" else 256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [p.shape for p in model.parameters()]


def _donor(preset, maddr_queue, done):
    from p2p_diloco.averaging import Averager
    from p2p_diloco.config import AveragingConfig, NetworkConfig
    from p2p_diloco.dht import start_dht, visible_maddrs
    from p2p_diloco.outer import state_digests

    shapes = _shapes(preset)
    params = [torch.randn(s) for s in shapes]
    momentum = [torch.randn(s) for s in shapes]
    _, digest = state_digests(params, momentum)
    dht = start_dht(NetworkConfig(host_maddrs=LOOPBACK))
    averager = Averager(dht, AveragingConfig(state_timeout=600), "joinbench", shapes)
    averager.serve_state(lambda: ({"round": 1, "digest": digest, "name": "donor"},
                                  [t.clone() for t in (*params, *momentum)]), round_=1)
    maddr_queue.put((visible_maddrs(dht), averager.peer_id))
    done.wait()
    averager.close()
    dht.shutdown()


def measure(preset: str) -> dict:
    # fork the donor before this process imports hivemind (its objects do not survive a spawn's pickling)
    ctx = mp.get_context("fork")
    queue, done = ctx.Queue(), ctx.Event()
    donor = ctx.Process(target=_donor, args=(preset, queue, done))
    donor.start()
    from p2p_diloco.averaging import Averager
    from p2p_diloco.config import AveragingConfig, NetworkConfig
    from p2p_diloco.dht import start_dht
    from p2p_diloco.outer import state_digests

    try:
        maddrs, donor_id = queue.get(timeout=600)
        shapes = _shapes(preset)
        dht = start_dht(NetworkConfig(initial_peers=maddrs, host_maddrs=LOOPBACK))
        averager = Averager(dht, AveragingConfig(state_timeout=600), "joinbench", shapes)
        try:
            start = time.perf_counter()
            metadata, tensors, _ = averager.download_state([donor_id])
            seconds = time.perf_counter() - start
            n = len(shapes)
            assert state_digests(tensors[:n], tensors[n:])[1] == metadata["digest"], "digest mismatch"
            verify = time.perf_counter() - start - seconds
        finally:
            averager.close()
            dht.shutdown()
    finally:
        done.set()
        donor.join(timeout=60)
    size = sum(t.numel() * t.element_size() for t in tensors)
    params = sum(s.numel() for s in shapes)
    return {"preset": preset, "params": params, "state_bytes": size, "download_s": round(seconds, 2),
            "verify_s": round(verify, 2), "MB_per_s": round(size / seconds / 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", help="model preset(s) to measure (default: tiny and 150m)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| preset | parameters | state (θ_global + momentum, fp32) | download s | digest check s | MB/s |")
    print("|---|---|---|---|---|---|")
    for preset in args.preset or ["tiny", "150m"]:
        r = measure(preset)
        print(f"| {r['preset']} | {r['params'] / 1e6:.2f}M | {r['state_bytes'] / 1e6:.1f} MB | {r['download_s']} | "
              f"{r['verify_s']} | {r['MB_per_s']} |", flush=True)


if __name__ == "__main__":
    main()
