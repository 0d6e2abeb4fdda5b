"""The GPU inner loop against a plain PyTorch loop: tokens/s, MFU and peak memory per preset, measured alternately in
the same run (made to run on a GPU machine; ``--device cpu --presets tiny`` is a quick smoke run anywhere).

  * plain: this process; the preset built by the peer's own code (same weights), moved to the device; bf16 autocast,
    ``torch.optim.AdamW`` (fused on CUDA) with the peer's hyperparameters, gradient clipping, ``loss.item()`` each
    step, batches drawn beforehand; ``--warmup`` untimed steps, then ``--steps`` timed ones (nanoGPT's loop);
  * peer: a real peer process (``p2p-diloco swarm --peers 1``: DHT, averager and p2pd running) doing two rounds of
    ``--steps`` inner steps; its figures are the second round's record (``train/tokens_per_s``, ``train/mfu``,
    ``device/peak_memory_gb``), so one-off start-up costs stay out as they do for the plain loop.

Both use the same data: the embedded corpus through a byte-level BPE trained here and padded with unused tokens to
``--vocab`` entries, so the output layer costs what gpt2's 50257-token vocabulary costs. MFU: 6·N + 12·L·d·T FLOPs
per token over the device's bf16 peak (p2p_diloco/train/flops.py). Micro-batches default to the memory model's
(benchmarks/memory_model.py, 80 GB column); ``--batch 400m=8`` overrides one. ``--swarm-check`` also runs a
2-peer swarm on the device (two processes sharing it) and checks that θ_global digests agree after every round.
Target: peer / plain >= 0.97.

A second table times a round's two transfers for each preset's parameters: δ = θ_global − θ_local into host buffers
and θ_local ← θ_global, one tensor at a time (the reference, p2p_diloco/train/outer.py) against the bulk path the
peer uses (p2p_diloco/train/transfer.py: flat device buffer, pinned host memory, pipelined pieces).

Run:

    python benchmarks/gpu.py [--presets tiny,150m,400m,1b] [--steps 30] [--reps 3] [--swarm-check]
    python benchmarks/gpu.py --device cpu --presets tiny --seq-len 128 --steps 10 --reps 1   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import torch

from common import demo_config, median, rounds_of, swarm_records, table

from p2p_diloco.train.data import build_data
from p2p_diloco.train.flops import flops_per_token, mfu, peak_flops
from p2p_diloco.train.inner import autocast

BATCH_80GB = {"tiny": 64, "60m": 64, "150m": 32, "400m": 32, "1b": 16}
"""Default micro-batches at 1024 tokens: the memory model's 80 GB figures rounded down to a power of two."""


def bpe_padded(folder: Path, vocab: int) -> str:
    """A byte-level BPE trained on the embedded corpus, padded with unused tokens to ``vocab`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from p2p_diloco.train.corpus import embedded_documents

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(embedded_documents(), trainers.BpeTrainer(
        vocab_size=min(vocab, 32000), special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    tok.add_tokens([f"<unused{i}>" for i in range(vocab - len(tok))])
    tok.save_pretrained(str(folder))
    return str(folder)


def config_for(args, preset: str, batch: int, tokenizer: str):
    return demo_config(**{"model.name": preset, "model.seq_len": args.seq_len, "inner.batch_size": batch,
                          "data.tokenizer": tokenizer, "run.device": args.device, "inner.warmup_steps": 100,
                          "averaging.min_group_size": 1, "run.eval_every": 0, "run.checkpoint_every": 0,
                          "run.threads": args.threads, "data.eval_batches": 1,
                          "model.gradient_checkpointing": preset in args.checkpointing})


def plain_loop(cfg, steps: int, warmup: int) -> dict:
    """tokens/s, MFU and peak memory (GiB, CUDA only) of a bare loop with the peer's model and hyperparameters."""
    from p2p_diloco.train.model import build_model  # imports transformers: not needed for --help

    device = torch.device(cfg.run.device)
    data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, "plain")
    batches = [data.train.next_batch().to(device) for _ in range(warmup + steps)]
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed).to(device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.inner.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.inner.lr,
                            betas=(cfg.inner.beta1, cfg.inner.beta2), fused=device.type == "cuda" or None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = 0.0
    for i, x in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        with autocast(device):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the peer's loop syncs once per step too
    tokens_per_s = steps * batches[0].numel() / (time.perf_counter() - start)
    out = {"tokens_per_s": tokens_per_s,
           "mfu": mfu(tokens_per_s, flops_per_token(model, cfg.model.seq_len), peak_flops(device)),
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None}
    del model, opt, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the peer process needs the memory next
    return out


def peer_loop(cfg, steps: int, tag: str) -> dict:
    records = swarm_records(1, 2, steps, cfg, tag)
    r = [r for r in rounds_of(records["peer0"]) if r["committed"]][-1]
    return {"tokens_per_s": r["train/tokens_per_s"], "mfu": r.get("train/mfu"),
            "peak_gib": r.get("device/peak_memory_gb")}


def transfer_times(cfg, vocab: int, reps: int) -> dict:
    """Median seconds of δ and of θ_local ← θ_global for the preset's parameters: per tensor vs bulk."""
    from p2p_diloco.train.model import build_model
    from p2p_diloco.train.outer import load_into, pseudo_gradient
    from p2p_diloco.train.transfer import DeltaTransfer, flatten_parameters, host_copy, load_params

    device = torch.device(cfg.run.device)
    model = build_model(cfg.model, vocab, cfg.run.seed).to(device)
    flatten_parameters(model)
    params = list(model.parameters())
    global_params = host_copy(params, pin=device.type == "cuda")
    out = [torch.empty_like(g, pin_memory=False) for g in global_params]
    transfer = DeltaTransfer(params)

    def timed(fn) -> float:
        times = []
        for _ in range(reps + 1):  # the first call allocates staging buffers and warms caches: not counted
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return median(times[1:])

    result = {"delta_ref": timed(lambda: pseudo_gradient(global_params, params, out)),
              "delta_bulk": timed(lambda: transfer.pseudo_gradient(global_params, out)),
              "load_ref": timed(lambda: load_into(params, global_params)),
              "load_bulk": timed(lambda: load_params(params, global_params))}
    return result  # its tensors are freed on return; main() empties the CUDA cache


def swarm_check(cfg, steps: int) -> str:
    """Two peers sharing the device, 3 rounds: do their θ_global digests agree after every round?"""
    records = swarm_records(2, 3, steps, cfg, "gpu-swarm")
    by_round: dict[int, set] = {}
    for recs in records.values():
        for r in rounds_of(recs):
            if r["committed"]:
                by_round.setdefault(r["round"], set()).add(r["global_params_sha256"])
    agree = all(len(d) == 1 for d in by_round.values()) and len(by_round) == 3
    return f"2-peer swarm on {cfg.run.device}: {len(by_round)} rounds, digests {'agree' if agree else 'DIFFER'}"


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def gib(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--presets", default="tiny,150m,400m,1b", help="comma-separated presets")
    parser.add_argument("--batch", action="append", default=[], metavar="PRESET=B",
                        help="micro-batch of a preset (default: the memory model's 80 GB figure)")
    parser.add_argument("--checkpointing", default="", help="comma-separated presets trained with gradient "
                        "checkpointing (default none)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default 50257, gpt2's)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of the plain loop (default 5)")
    parser.add_argument("--reps", type=int, default=3, help="measurements of each (default 3)")
    parser.add_argument("--threads", type=int, default=4, help="torch CPU threads per process (default 4)")
    parser.add_argument("--swarm-check", action="store_true", help="also run a 2-peer swarm on the device")
    parser.add_argument("--transfers-only", action="store_true", help="only the table of round transfers")
    args = parser.parse_args()
    args.checkpointing = set(filter(None, args.checkpointing.split(",")))
    batches = {**BATCH_80GB, **{k: int(v) for k, v in (b.split("=") for b in args.batch)}}
    torch.set_num_threads(args.threads)
    rows, notes, moves = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        tokenizer = bpe_padded(Path(tmp) / "bpe", args.vocab)
        for preset in args.presets.split(","):
            cfg = config_for(args, preset, batches[preset], tokenizer)
            t = transfer_times(cfg, args.vocab, args.reps)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()  # the next process on the device needs the memory
            moves.append([preset, f"{t['delta_ref']:.3f}", f"{t['delta_bulk']:.3f}", f"{t['load_ref']:.3f}",
                          f"{t['load_bulk']:.3f}", args.reps])
            if args.transfers_only:
                continue
            plain, peer = [], []
            for rep in range(args.reps):
                plain.append(plain_loop(cfg, args.steps, args.warmup))
                peer.append(peer_loop(cfg, args.steps, f"gpu-{preset}"))
                print(f"{preset} rep {rep}: plain {plain[-1]['tokens_per_s']:.0f}, peer {peer[-1]['tokens_per_s']:.0f} "
                      f"tokens/s", flush=True)
            best = {k: median(r["tokens_per_s"] for r in runs) for k, runs in (("plain", plain), ("peer", peer))}
            rows.append([preset, f"{batches[preset]} x {args.seq_len}", f"{best['plain']:.0f}", f"{best['peer']:.0f}",
                         f"{best['peer'] / best['plain']:.3f}", pct(plain[-1]["mfu"]), pct(peer[-1]["mfu"]),
                         gib(plain[-1]["peak_gib"]), gib(peer[-1]["peak_gib"]), args.reps])
            if args.swarm_check:
                notes.append(swarm_check(cfg, args.steps))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {device}; vocabulary {args.vocab}; {args.steps} timed steps")
    if rows:
        print(table(["preset", "batch", "plain tokens/s", "peer tokens/s", "peer / plain", "MFU plain", "MFU peer",
                     "peak GiB plain", "peak GiB peer", "runs"], rows))
    print(table([f"preset (vocab {args.vocab})", "δ per tensor s", "δ bulk s", "θ_local ← θ_global per tensor s",
                 "θ_local ← θ_global bulk s", "runs"], moves))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
