"""What signing every part costs a sender (issue 24, finding 5; net/averaging/evidence.py), per round. Run:

    python benchmarks/signed_parts.py [--values N] [--peers N]

A sender signs each part it sends to another reducer: (N - 1) / N of its payload, cut into parts of
``averaging.part_size_bytes`` after the codec. The script builds the model's payload at 16 bits (scaled_fp16, the
default codec), cuts it into parts as the all-reduce would, and times part_statement + an Ed25519 signature over the
parts one sender sends, best of 5. Bytes on the wire: 64 per part (the signature).
"""

from __future__ import annotations

import argparse
import time

import torch
from hivemind.compression import serialize_torch_tensor

from p2p_diloco.net.averaging.evidence import part_statement
from p2p_diloco.net.security.identity import Identity

PART_BYTES = 2 ** 19  # averaging.part_size_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=int, default=460_000, help="model parameters (the tiny preset: about 0.46 M)")
    p.add_argument("--peers", type=int, default=3, help="members of the group (default 3)")
    args = p.parse_args()
    torch.set_num_threads(1)
    identity, reducer = Identity.generate(), Identity.generate().peer_id
    sent_values = args.values * (args.peers - 1) // args.peers
    per_part = PART_BYTES // 2  # 16-bit values
    parts = [serialize_torch_tensor(torch.randn(min(per_part, sent_values - start)).half())
             for start in range(0, sent_values, per_part)]
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for index, part in enumerate(parts):
            identity.sign(part_statement(b"g" * 32, reducer, index, 1.0, part))
        best = min(best, time.perf_counter() - started)
    print(f"{args.values} values, {args.peers} peers: {len(parts)} part(s) signed per sender per round, "
          f"{best * 1e3:.1f} ms, {64 * len(parts)} bytes of signatures")


if __name__ == "__main__":
    main()
