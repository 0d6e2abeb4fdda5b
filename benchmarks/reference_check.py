"""A real swarm against the exact in-process DiLoCo (p2p_diloco/train/reference.py): the same eval curve?

Runs ``p2p-diloco swarm`` (M peer processes, demo config, the given codec) and the in-process reference with the same
config (M replicas named like the swarm's peers, the codec emulated), and prints both curves of held-out loss after
every round and their largest difference. With the fp32 codec only the order in which the all-reduce sums the
contributions differs, so the curves agree to float rounding; with 16 bits on the wire, to the codec's error (the
reference emulates it per tensor, the all-reduce per streamed part). This is what makes the study's sweeps, which
run in the reference, stand for swarms. Run:

    python benchmarks/reference_check.py [--peers 4] [--h 10] [--rounds 10] [--codec fp32]
"""

from __future__ import annotations

import argparse

import torch

from common import demo_config, rounds_of, swarm_records

from p2p_diloco.train.reference import ReferenceDiLoCo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="peers (default 4)")
    parser.add_argument("--h", type=int, default=10, help="inner steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--codec", default="fp32", choices=("fp32", "fp16", "scaled_fp16"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = demo_config(**{"averaging.min_group_size": args.peers, "averaging.codec": args.codec,
                         "run.rounds": args.rounds, "diloco.inner_steps": args.h,
                         "diloco.dylu": False})  # H steps on every peer, as in the reference
    ref = ReferenceDiLoCo(cfg, args.peers, codec=None if args.codec == "fp32" else args.codec)
    reference = [ref.evaluate()]
    for _ in range(args.rounds):
        ref.run_round()
        reference.append(ref.evaluate())
    records = swarm_records(args.peers, args.rounds, args.h, cfg, f"refcheck-{args.peers}")["peer0"]
    swarm = [next(r for r in records if r.get("event") == "start")["eval/loss"]]
    swarm += [r["eval/loss"] for r in rounds_of(records) if r["committed"]]
    print("round  reference  swarm")
    for i, (a, b) in enumerate(zip(reference, swarm)):
        print(f"{i:5d}  {a:9.5f}  {b:9.5f}")
    print(f"max |difference| over {len(swarm)} evaluations: {max(abs(a - b) for a, b in zip(reference, swarm)):.2e}")


if __name__ == "__main__":
    main()
