"""What accountable reducers cost one member per round (issue 24, finding 6; net/averaging/attest.py, bounds.py). Run:

    python benchmarks/average_bounds.py [--values N] [--peers N] [--codec scaled_fp16]

Each member of a group of ``--peers`` does, per round, on top of the all-reduce it did before:
  * as a sender, for every part of its vector: decode its own encoded part, summarize it (min, max, sum per block of
    4,096 values) and sign the summary with the part (the signature alone was there before: timed apart);
  * as a reducer, for each of its 1/N of the parts and each other sender: check the seal (an Ed25519 verification)
    and the summary against the decoded part; then build the attestation it sends back with the average;
  * as a receiver, for each averaged part from another reducer: decode the attestation, verify every participant's
    signature and check the average against the bounds.
The script builds random parts of ``averaging.part_size_bytes`` (512 KiB) after the codec, runs these very
functions on them, and reports the best of 3 in CPU time (single thread). Bytes: the seals on parts sent to other reducers
and the attestations on averages sent to other members, as sent by one member (it receives as much).
"""

from __future__ import annotations

import argparse
import time

import torch
from hivemind.compression import CompressionInfo
from hivemind.utils import MSGPackSerializer

from p2p_diloco.net.averaging.attest import decode_entries, seal, unseal
from p2p_diloco.net.averaging.bounds import average_problem, parse_summary, summarize, summary_mismatch
from p2p_diloco.net.averaging.evidence import statement, tensor_digest
from p2p_diloco.net.averaging.wire import WireCodec, decode_part
from p2p_diloco.net.security.identity import Identity, verify

PART_BYTES = 2 ** 19  # averaging.part_size_bytes
GROUP = b"g" * 32


def _best(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()  # CPU time: what the work costs, not how long a busy machine made it wait
        fn()
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=int, default=460_000, help="model parameters (the tiny preset: about 0.46 M)")
    p.add_argument("--peers", type=int, default=4, help="members of the group (default 4)")
    p.add_argument("--codec", default="scaled_fp16", help="averaging.codec (default scaled_fp16)")
    args = p.parse_args()
    torch.set_num_threads(1)
    n = args.peers
    codec = WireCodec(args.codec, PART_BYTES)
    per_part = int(PART_BYTES / (4 * codec.estimate_compression_ratio(CompressionInfo.from_tensor(torch.zeros(1)))))
    sizes = [min(per_part, args.values - s) for s in range(0, args.values, per_part)]
    ids = [Identity.generate() for _ in range(n)]
    reducer = ids[0].peer_id
    g = torch.Generator().manual_seed(0)

    def encoded(size):
        x = torch.randn(size, generator=g) * 1e-3
        return codec.compress(x, CompressionInfo.from_tensor(x))

    parts = [encoded(s) for s in sizes]  # one member's vector, as it goes on the wire
    seals = []

    def send():  # a sender: decode, summarize, sign every part
        seals.clear()
        for i, msg in enumerate(parts):
            summary = summarize(decode_part(msg))
            sig = ids[1].sign(statement(GROUP, reducer, i, 1.0, tensor_digest(msg), summary))
            seals.append(seal(sig, summary))

    def sign_only():  # what signing cost before (evidence.py): the signature over the part alone
        for i, msg in enumerate(parts):
            ids[1].sign(statement(GROUP, reducer, i, 1.0, tensor_digest(msg)))

    t_send, t_sign = _best(send), _best(sign_only)
    share = max(1, round(len(parts) / n))  # the parts one member reduces
    decoded = [decode_part(m) for m in parts[:share]]
    entries = {}

    def reduce():  # a reducer: check each other sender's seal and summary, build the attestations
        for i in range(share):
            for s in range(1, n):
                sig, summary, key = unseal(seals[i])
                digest = tensor_digest(parts[i])
                verify(ids[1].peer_id, statement(GROUP, reducer, i, 1.0, digest, summary), sig, key)
                summary_mismatch(decoded[i], summary)
                entries.setdefault(i, {})[s] = [digest, summary, sig, key]
        return [MSGPackSerializer.dumps([[s, *entries[i][s]] for s in sorted(entries[i])]) for i in range(share)]

    t_reduce = _best(reduce)
    attestations = reduce()

    def receive():  # a receiver: every averaged part from the other reducers ((N - 1) / N of the vector)
        for _ in range(n - 1):
            for i in range(share):
                rows = decode_entries(attestations[i], n)
                claims = []
                for s, (digest, summary, sig, key) in rows.items():
                    verify(ids[1].peer_id, statement(GROUP, reducer, i, 1.0, digest, summary), sig, key)
                    claims.append((1.0, parse_summary(summary, decoded[i].numel())))
                average_problem(decoded[i], claims, "mean", 0.25, args.codec)

    t_receive = _best(receive)
    seal_bytes = sum(len(s) for s in seals) * (n - 1) // n  # seals on the parts sent to other reducers
    attest_bytes = sum(len(a) for a in attestations) * (n - 1)  # attestations on our averages, to each other member
    payload = sum(len(m.buffer) for m in parts)
    total = t_send - t_sign + t_reduce + t_receive
    print(f"{args.values} values, {n} peers, {args.codec}: {len(parts)} parts of {per_part} values; per member per "
          f"round: {total * 1e3:.1f} ms more CPU (summaries and seals {(t_send - t_sign) * 1e3:.1f} ms, as reducer "
          f"{t_reduce * 1e3:.1f} ms, as receiver {t_receive * 1e3:.1f} ms; the signatures alone were "
          f"{t_sign * 1e3:.1f} ms), {seal_bytes + attest_bytes} bytes more sent (seals {seal_bytes}, attestations "
          f"{attest_bytes}), {100 * (seal_bytes + attest_bytes) / (2 * payload * (n - 1) / n):.2f} % of the "
          f"{2 * payload * (n - 1) // n} bytes it sent before")


if __name__ == "__main__":
    main()
