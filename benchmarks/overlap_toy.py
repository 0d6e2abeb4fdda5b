"""Overlap on a noisy quadratic: why a round-late average needs a small outer momentum (benchmarks/uplinks.md 2.2).

M workers minimize ½‖θ‖² (θ ∈ R^50, θ_0 = 10·1). A round's inner steps move a worker's θ_local a share ``c`` of the
way to the optimum, plus noise. The outer step, the overlap bookkeeping and the order of operations are the real
ones (p2p_diloco.train.outer.OuterNesterov, p2p_diloco.train.overlap.Overlap, as benchmarks/uplink_convergence.py
drives them); only the inner loop is a model. Printed: ‖θ_global‖ after ``--rounds`` rounds (the last all-reduce
committed), for overlap none / delayed / eager, per outer momentum β and share c. Seconds to run. Run:

    python benchmarks/overlap_toy.py [--rounds 15] [--lr 0.7]
"""

from __future__ import annotations

import argparse

import torch

from common import table
from p2p_diloco.train.outer import OuterNesterov
from p2p_diloco.train.overlap import Overlap


def distance(mode: str, c: float, rounds: int, lr: float, momentum: float, workers: int = 4) -> float:
    torch.manual_seed(0)
    theta = [torch.full((50,), 10.0)]
    outer = OuterNesterov(theta, lr, momentum)
    local = [[theta[0].clone()] for _ in range(workers)]
    overlaps = [Overlap(mode, [theta[0].shape]) for _ in range(workers)] if mode != "none" else None
    in_flight = None
    for _ in range(rounds):
        works = []
        for i in range(workers):
            local[i][0] -= c * local[i][0] + 0.1 * torch.randn(50)  # the round's inner steps
            work = [theta[0] - local[i][0]]
            if overlaps is not None:
                overlaps[i].work(theta, local[i], work)
            works.append(work)
        if overlaps is None:
            outer.step(theta, [sum(w[0] for w in works) / workers])
            for l in local:
                l[0].copy_(theta[0])
            continue
        if in_flight is not None:
            outer.step(theta, in_flight)
        for ov, work, l in zip(overlaps, works, local):
            ov.advance(work, in_flight is not None, 1 / workers, outer.step_response)
            ov.restart(l, theta)
        in_flight = [sum(ov.sent[0] for ov in overlaps) / workers]
    if in_flight is not None:
        outer.step(theta, in_flight)
    return theta[0].norm().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.7, help="outer learning rate")
    args = parser.parse_args()
    rows = []
    for momentum in (0.9, 0.5, 0.0):
        for c in (0.2, 0.5, 0.9):
            rows.append([momentum, c, *(f"{distance(m, c, args.rounds, args.lr, momentum):.3f}"
                                       for m in ("none", "delayed", "eager"))])
    print(f"‖θ_global‖ after {args.rounds} rounds (start: {10 * 50 ** 0.5:.1f}); outer lr {args.lr}, 4 workers\n")
    print(table(["outer momentum", "share c of the way per round", "none", "delayed", "eager"], rows))


if __name__ == "__main__":
    main()
