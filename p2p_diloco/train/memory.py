"""Memory options of one machine's inner loop: the loss without the full fp32 logits, the AdamW moments in 8 bits,
and torch.compile by regions. All are machine settings: they change how much memory a step takes and how fast it
runs, not what the run computes (up to rounding), so members of one run may choose differently.

  * ``model.loss_chunk`` (tokens): the causal-LM loss over chunks of the flattened [batch x seq] positions, each
    chunk's logits computed, reduced and dropped, then recomputed in the backward (torch.utils.checkpoint). The
    model's own loss keeps the whole micro-batch's logits, in bf16 and again in fp32 (about T·V·6 bytes per
    sequence: ~300 MiB at 1024 tokens and 50k entries); chunked, one chunk's exist at a time. Cost: the head's
    matrix product runs once more in the backward (2·V·d FLOPs per token).
  * ``inner.optimizer_state = "8bit"``: torchao's AdamW8bit, the moments block-wise quantized to 8 bits (2 bytes
    per parameter instead of 8; tensors under 4096 values stay fp32). Its update runs through torch.compile, on
    the CPU too (a C++ compiler is needed there).
  * ``inner.offload``: the AdamW moments, an fp32 master copy and the gradient sums in host memory (train/offload.py).
  * ``run.compile``: each decoder layer compiled on its own (regional compilation): the layers share one compiled
    graph, so compiling takes seconds instead of minutes; the loss's chunk is compiled too (with ``model.loss_chunk``
    0, the whole micro-batch's head, upcast and cross-entropy in one compiled function, which keeps no fp32 logits).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutput

from p2p_diloco.config import ConfigError

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk: logits in the autocast dtype (as the head computes them), upcast to fp32
    for the loss (as Hugging Face's loss does)."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                          chunk_fn=_chunk_loss) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden`` [B, T, d] under the head ``weight`` [V, d] against ``labels``
    [B, T] (shifted here, as the model's loss shifts them; -100 positions ignored), over chunks of ``chunk_tokens``
    positions whose logits are recomputed in the backward (0: all at once): equal to the model's own loss up to
    rounding."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    if chunk_tokens <= 0 or chunk_tokens >= flat.shape[0]:  # one chunk: nothing to recompute
        return chunk_fn(flat, weight, targets) / count
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        total = total + checkpoint(chunk_fn, flat[start:stop], weight, targets[start:stop], use_reentrant=False)
    return total / count


class ChunkedLossLM(torch.nn.Module):
    """A causal LM whose forward returns the chunked loss (``.loss``) instead of the logits; its parameters are the
    model's own (DDP and torch.compile wrap this module in the model's place)."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int):
        super().__init__()
        check_chunkable(model)
        self.lm, self.chunk_tokens, self.chunk_fn = model, chunk_tokens, _chunk_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, use_cache: bool = False) -> CausalLMOutput:
        hidden = self.lm.base_model(input_ids=input_ids, use_cache=use_cache).last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        return CausalLMOutput(loss=chunked_cross_entropy(hidden, weight, labels, self.chunk_tokens, self.chunk_fn))


def check_chunkable(model: torch.nn.Module) -> None:
    """The chunked loss computes ``hidden @ head.T`` and nothing else: refuse models whose logits are more."""
    config, head = model.config, model.get_output_embeddings()
    extra = [k for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
             if getattr(config, k, None) not in (None, 1, 1.0)]
    if head is None or getattr(head, "bias", None) is not None or extra:
        raise ConfigError(f"model.loss_chunk: {type(model).__name__} computes its logits otherwise than "
                          f"hidden @ head.T ({', '.join(extra) or 'head bias'}); use model.loss_chunk = 0")


def loss_module(model: torch.nn.Module, chunk_tokens: int, compiled: bool = False) -> torch.nn.Module:
    """What computes the training loss: :class:`ChunkedLossLM` on the model when ``chunk_tokens`` is set, or when
    the loss is to be compiled (then in one chunk: the compiled head and loss keep no fp32 logits either); else the
    model itself."""
    return ChunkedLossLM(model, chunk_tokens) if chunk_tokens or compiled else model


def compile_regions(model: torch.nn.Module, loss: torch.nn.Module) -> None:
    """torch.compile each decoder layer (one compiled graph serves them all) and the loss's chunk (``loss`` from
    :func:`loss_module` with ``compiled``); a model without a list of layers is compiled whole."""
    layers = decoder_layers(model)
    if layers is None:
        model.compile()
    else:
        for layer in layers:
            layer.compile()
    if isinstance(loss, ChunkedLossLM):
        loss.chunk_fn = torch.compile(_chunk_loss)


def decoder_layers(model: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    base = getattr(model, "base_model", None)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return layers
    return None


def make_optimizer(groups: list[dict], state: str, lr: float, betas: tuple[float, float],
                   device: torch.device, offload: bool = False):
    """The inner AdamW over ``groups`` (each with its weight decay): fp32 moments (fused on CUDA) or, with
    ``state`` "8bit", torchao's AdamW8bit; with ``offload``, either one on host copies (train/offload.py). Raises
    ConfigError naming inner.optimizer_state without torchao."""
    if offload:
        from p2p_diloco.train.offload import HostAdamW

        cpu = torch.device("cpu")
        return HostAdamW(groups, lambda host: _make(host, state, lr, betas, cpu, fused_cpu=True), device)
    return _make(groups, state, lr, betas, device)


def _make(groups: list[dict], state: str, lr: float, betas: tuple[float, float], device: torch.device,
          fused_cpu: bool = False) -> torch.optim.Optimizer:
    if state == "8bit":
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            raise ConfigError("inner.optimizer_state: '8bit' needs the torchao package: "
                              "pip install 'p2p-diloco[adamw8bit]' (or torchao)") from None
        return AdamW8bit(groups, lr=lr, betas=betas)
    # fused: one kernel for the whole update on CUDA (and one pass on the host for offload); None: torch's default
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.type == "cuda" or fused_cpu or None)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate: in place where the optimizer keeps it as a tensor (torchao's, whose compiled
    update reads it from there: a new float would be refused)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
