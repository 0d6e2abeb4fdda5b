"""PURE: model FLOPs per token and model FLOPs utilization (MFU). Imports torch only.

The convention is PaLM's (appendix B), as nanoGPT and INTELLECT-1 use it, so our MFU compares with theirs:

    FLOPs per trained token = 6·N + 12·L·d_attn·T

with N the parameters that multiply activations (every matrix: attention, MLP and the output head; the input
embedding only when tied to the head, where it counts once, as the head; not the norms), L the layers, d_attn the
attention width (heads x head dim), T the sequence length. 6·N is the forward (2·N) and backward (4·N) of the
matrix products; 12·L·d_attn·T the attention scores and their weighted sum (4·T·d_attn forward per layer, counted as
if unmasked, as the convention does). Recomputation under gradient checkpointing is not counted: MFU measures the
model's work, not the hardware's.
"""

from __future__ import annotations

from typing import Optional

import torch

PEAK_BF16_TFLOPS = {
    # dense bf16 tensor-core peak with fp32 accumulation, per GPU (vendor data sheets); matched by substring of
    # torch.cuda.get_device_name(), first match wins, so the more specific names come first
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM; the NVL variant is listed at 835
    "A100": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10": 125.0,
    "RTX 6000 Ada": 364.0,
    "RTX A6000": 155.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}
"""Peak dense bf16 TFLOPS by device name; ``run.peak_tflops`` gives it for a device not listed."""


def matmul_params(model: torch.nn.Module) -> int:
    """N of the formula: parameters of every matrix, minus the input embedding when it is not tied to the head."""
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and embedding is not None and head.weight is embedding
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and (tied or p is not embedding))


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Model FLOPs (forward and backward) per trained token of ``model`` at ``seq_len`` tokens per sequence."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_width = config.num_attention_heads * head_dim
    return 6.0 * matmul_params(model) + 12.0 * config.num_hidden_layers * attention_width * seq_len


def peak_flops(device: torch.device, peak_tflops: Optional[float] = None) -> Optional[float]:
    """The device's peak dense bf16 FLOP/s: ``peak_tflops`` when given, else from :data:`PEAK_BF16_TFLOPS` by
    the CUDA device's name; None for a CPU or an unlisted device (then no MFU is reported)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def mfu(tokens_per_s: float, flops_per_token_: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization: achieved model FLOP/s over the peak; None without a peak."""
    if not peak:
        return None
    return tokens_per_s * flops_per_token_ / peak
