"""A MEMORY MODEL of one GPU training the presets (no GPU was measured): the largest micro-batch that fits 24 GB and
80 GB, with and without gradient checkpointing. A GPU run must check it: benchmarks/gpu.py reports the real peak.

Per GPU, in bytes, for P parameters, micro-batch B, sequence length T, vocabulary V, hidden size d, L layers:

    static      16·P                    fp32 weights (4), fp32 gradients (4), AdamW moments (8); DDP adds nothing
                                        (gradients are views of its buckets)
    per batch   W                       bf16 copies of the weights that autocast makes and keeps for the backward
    activations B·A                     what autograd keeps for the backward, per sequence
    transient   B·T·V·6                 the gradient of the logits (fp32, then bf16) at the start of the backward
    overhead    1 GiB + 10 % of the rest  CUDA context and workspaces; allocator fragmentation

A and W are MEASURED here, on the CPU, with the preset's real shapes under bf16 autocast: every tensor autograd saves
is recorded by a ``saved_tensors_hooks`` pack hook (each storage once, parameters excluded), for 1 and 2 layers and
1 and 2 sequences of T tokens; A per layer and the rest (embeddings, head, loss) follow by difference, and A is
extrapolated to the preset's L layers. The CPU's SDPA kernel keeps what CUDA's flash kernel keeps (q, k, v, output,
log-sum-exp; no T x T matrix). With gradient checkpointing each layer keeps only its input (T·d fp32 per sequence)
and one layer's activations exist again during its recomputation.

Run:

    python benchmarks/memory_model.py [--seq-len 1024] [--vocab 50257]
"""

from __future__ import annotations

import argparse

import torch

from common import table

GIB = 2 ** 30
CONTEXT_BYTES = 1 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers: outside torch's allocator
FRAGMENTATION = 0.10  # share of the remaining memory the caching allocator cannot use


def saved_bytes(config, batch: int, seq_len: int) -> int:
    """Bytes of the tensors autograd saves in one forward of ``config`` (bf16 autocast, SDPA), parameters excluded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, config.vocab_size, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=x, labels=x, use_cache=False).loss
    return sum(storages.values())


def measure(name: str, vocab: int, seq_len: int) -> dict:
    """Per-sequence activations of the whole preset (A), the batch-independent saved part (W), and P."""
    from transformers import AutoModelForCausalLM

    from p2p_diloco.train.model import preset_config

    base = preset_config(name, vocab, seq_len)
    s = {}
    for layers in (1, 2):
        config = preset_config(name, vocab, seq_len)
        config.num_hidden_layers = layers
        for batch in (1, 2):
            s[layers, batch] = saved_bytes(config, batch, seq_len)
    per_seq = {layers: s[layers, 2] - s[layers, 1] for layers in (1, 2)}
    fixed = {layers: s[layers, 1] - per_seq[layers] for layers in (1, 2)}
    layer_act, layer_fixed = per_seq[2] - per_seq[1], fixed[2] - fixed[1]
    L = base.num_hidden_layers
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(base).parameters())
    return {"P": params, "L": L, "d": base.hidden_size, "layer_act": layer_act,
            "act": per_seq[1] + (L - 1) * layer_act, "rest_act": per_seq[1] - layer_act,
            "W": fixed[1] + (L - 1) * layer_fixed}


def per_sequence(m: dict, seq_len: int, vocab: int, checkpointing: bool) -> int:
    """Bytes that grow with each sequence of a micro-batch: kept activations and the logits' gradient."""
    transient = seq_len * vocab * 6
    if not checkpointing:
        return m["act"] + transient
    return m["rest_act"] + m["L"] * seq_len * m["d"] * 4 + m["layer_act"] + transient


def largest_batch(m: dict, capacity_gib: float, seq_len: int, vocab: int, checkpointing: bool) -> int:
    usable = (capacity_gib * GIB - CONTEXT_BYTES) * (1 - FRAGMENTATION) - 16 * m["P"] - m["W"]
    return max(0, int(usable // per_sequence(m, seq_len, vocab, checkpointing)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary (default 50257: gpt2's)")
    parser.add_argument("--presets", default="150m,400m,1b", help="comma-separated (default 150m,400m,1b)")
    args = parser.parse_args()
    from p2p_diloco.train.model import PRESETS  # imported after parsing: --help stays quick

    torch.set_num_threads(1)
    rows = []
    for name in args.presets.split(","):
        if name not in PRESETS:
            parser.error(f"unknown preset {name!r}")
        m = measure(name, args.vocab, args.seq_len)
        fits = [largest_batch(m, gib, args.seq_len, args.vocab, ckpt) for gib in (24, 80) for ckpt in (False, True)]
        rows.append([name, f"{m['P'] / 1e6:.0f}M", f"{16 * m['P'] / GIB:.1f}", f"{m['W'] / GIB:.2f}",
                     f"{per_sequence(m, args.seq_len, args.vocab, False) / GIB:.2f}",
                     f"{per_sequence(m, args.seq_len, args.vocab, True) / GIB:.2f}", *fits])
        print(f"{name}: measured per layer {m['layer_act'] / 2 ** 20:.0f} MiB/sequence, rest "
              f"{m['rest_act'] / 2 ** 20:.0f} MiB/sequence", flush=True)
    print(f"MEMORY MODEL (not a GPU measurement), T = {args.seq_len}, V = {args.vocab}, bf16 autocast, fp32 AdamW:")
    print(table(["preset", "P", "static 16·P GiB", "bf16 weights GiB", "GiB/sequence", "GiB/sequence, ckpt",
                 "B at 24 GB", "B at 24 GB, ckpt", "B at 80 GB", "B at 80 GB, ckpt"], rows))


if __name__ == "__main__":
    main()
