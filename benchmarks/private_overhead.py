"""The cost of a private run (network.secret_file): round time and all-reduce time of a 2-peer local swarm with and
without a secret, alternated in the same script (open, private, open, private, ...), median over the rounds of each
run, then the median of ``--reps`` runs, and the ratio private / open; also each run's wall time and its failed
round attempts (both peers), where a round lost to a fault of the private path shows.

What a secret adds per round: an HMAC-SHA256 over every DHT request and response (with a nonce check), the
membership proof in each join request and its check by the leader, every member's check of the group's proofs before
the all-reduce, and one read of the revocation list. Signed DHT records (net/security/identity.py) are in open runs too: their
CPU per record is measured apart (``--micro-only``). Run:

    nice -n 10 python benchmarks/private_overhead.py [--reps 3] [--rounds 5] [--inner-steps 20]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from common import demo_config, median, rounds_of, table

from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.swarm import run_swarm, write_peer_config


def one_run(private: bool, rounds: int, inner_steps: int, scratch: Path, tag: str) -> dict:
    run_dir = scratch / tag
    cfg = demo_config(**{"model.seq_len": 64, "inner.batch_size": 4, "data.eval_batches": 1, "run.eval_every": 0,
                         "diloco.dylu": False})  # a fixed H: rounds of both kinds do the same work
    bootstrap_args = []
    if private:
        secret = scratch / "secret"
        secret.write_text("benchmark secret\n")
        cfg.network.secret_file = str(secret)
        bootstrap_args = [f"--network.secret_file={secret}"]
    started = time.monotonic()
    rc = run_swarm(2, rounds, inner_steps, str(run_dir), write_peer_config(run_dir, cfg), timeout=600,
                   echo=lambda s: None, bootstrap_args=bootstrap_args)
    wall = time.monotonic() - started
    if rc != 0:
        raise RuntimeError(f"swarm {tag} failed (exit {rc}): {run_dir}")
    attempts = [r for p in sorted(run_dir.glob("peer*/metrics.jsonl")) for r in rounds_of(read_jsonl(p))]
    records = [r for r in attempts if r["committed"] and r["round"] > 1]  # round 1 includes start-up waits
    return {"wall_s": wall, "failed_rounds": sum(not r["committed"] for r in attempts),
            "round_s": median(r["time/round_s"] for r in records), "sync_s": median(r["time/sync_s"] for r in records),
            "inner_step_s": median(r["time/inner_s"] / max(1, r["train/inner_steps"]) for r in records),
            "inner_steps": median(r["train/inner_steps"] for r in records),
            "allreduce_s": median(r["outer/allreduce_s"] for r in records),
            "allreduce_only_s": median(r["outer/allreduce_only_s"] for r in records)}


def micro(n: int = 2000) -> dict:
    """CPU per DHT request and response (signed and checked, roster-sized) and per membership proof check."""
    import asyncio

    from hivemind.proto import dht_pb2

    from p2p_diloco.net.security.access import AccessKeys
    from p2p_diloco.net.security.auth import HMACAuthorizer

    authorizer, keys = HMACAuthorizer(AccessKeys.derive(b"secret")), AccessKeys.derive(b"secret", "run")

    async def exchange() -> None:
        node = dht_pb2.NodeInfo(node_id=b"n" * 20)
        request = dht_pb2.StoreRequest(keys=[b"k" * 20], subkeys=[b"s" * 60], values=[b"v" * 400],
                                       expiration_time=[1.0], in_cache=[False], peer=node)
        await authorizer.sign_request(request, None)
        assert await authorizer.validate_request(request)
        response = dht_pb2.StoreResponse(store_ok=[True], peer=node)
        await authorizer.sign_response(response, request)
        assert await authorizer.validate_response(response, request)

    async def many() -> float:
        start = time.perf_counter()
        for _ in range(n):
            await exchange()
        return (time.perf_counter() - start) / n

    per_message = asyncio.run(many())
    start = time.perf_counter()
    for _ in range(n):
        assert keys.verify(b"p" * 38, keys.proof(b"p" * 38))
    return {"dht_exchange_us": per_message * 1e6, "proof_check_us": (time.perf_counter() - start) / n * 1e6,
            **records_micro(n)}


def records_micro(n: int) -> dict:
    """CPU to sign (seal) and to check one roster-sized signed DHT record (net/security/identity.py), per key type; in open
    and private runs alike. hivemind's RSA identity files are 2048-bit; our own keys are Ed25519."""
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.net.security.identity import Identity, check_sealed, seal

    out = {}
    for kind, identity in (("ed25519", Identity.generate()), ("rsa2048", Identity(RSAPrivateKey()._private_key))):
        args = (b"k" * 32, b"s" * 54, b"v" * 400, 1234.5)
        start = time.perf_counter()
        for _ in range(n):
            sealed = seal(identity, *args)
        out[f"record_sign_{kind}_us"] = (time.perf_counter() - start) / n * 1e6
        start = time.perf_counter()
        for _ in range(n):
            assert check_sealed(identity.peer_id, args[0], args[1], sealed, args[3])
        out[f"record_check_{kind}_us"] = (time.perf_counter() - start) / n * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--micro-only", action="store_true", help="only the CPU of the checks and signatures")
    args = p.parse_args()
    print("CPU:", {k: f"{v:.1f} us" for k, v in micro().items()}, flush=True)
    if args.micro_only:
        return
    scratch = Path(tempfile.mkdtemp(prefix="private-overhead-"))
    results = {"open": [], "private": []}
    try:
        for rep in range(args.reps):
            for kind in ("open", "private"):
                results[kind].append(one_run(kind == "private", args.rounds, args.inner_steps, scratch,
                                             f"{kind}{rep}"))
                print(kind, rep, results[kind][-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    keys = ("wall_s", "failed_rounds", "round_s", "sync_s", "inner_step_s", "inner_steps", "allreduce_s",
            "allreduce_only_s")
    rows = []
    for key in keys:
        o, s = median(r[key] for r in results["open"]), median(r[key] for r in results["private"])
        rows.append([key, f"{o:.3f}", f"{s:.3f}", f"{s / o:.3f}" if o else "-"])
    print(table(["median of the runs (per round: committed rounds)", "open", "private", "private / open"], rows))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
