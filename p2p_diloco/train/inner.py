"""The local inner loop: AdamW steps on one peer's own batches. No network.

In DiLoCo the inner optimizer state is local and never synced; it lives across rounds while the parameters are
reset to θ_global at the start of each round. Reset them in place (``p.data.copy_(...)``) so the optimizer keeps
referring to the model's parameters.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from p2p_diloco.config import ConfigError, InnerConfig
from p2p_diloco.train.memory import make_optimizer, set_lr


def lr_at(step: float, cfg: InnerConfig, total_steps: Optional[int]) -> float:
    """Learning rate of inner step ``step`` (0-based, counted over the whole run, not per round; a fractional step
    under ``inner.lr_clock = "rounds"``, see train/dylu.py).

    Linear warm-up reaching ``cfg.lr`` at step ``warmup_steps - 1``, then cosine decay to ``cfg.lr *
    cfg.min_lr_ratio`` at step ``total_steps`` (warm-up included) and constant beyond it; constant ``cfg.lr``
    after warm-up when ``total_steps`` is None. Pure.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if total_steps is None:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def schedule_total_steps(cfg: InnerConfig, rounds: Optional[int], inner_steps: int) -> Optional[int]:
    """``total_steps`` for :func:`lr_at` from the config: warm-up + ``cfg.cosine_steps`` when set, else
    ``rounds * inner_steps`` (run.rounds x diloco.inner_steps), else None (constant lr after warm-up)."""
    if cfg.cosine_steps is not None:
        return cfg.warmup_steps + cfg.cosine_steps
    return None if rounds is None else rounds * inner_steps


@dataclass
class StepResult:
    """What one inner step did."""
    loss: float  # mean training loss over the step's micro-batches, nats per token
    tokens: int  # tokens processed (all micro-batches)
    lr: float  # learning rate used
    grad_norm: Optional[float] = None  # global gradient norm before clipping; None when clipping is off


class InnerTrainer:
    """AdamW on ``model`` (whose parameters must already be on ``device``), stepping the lr schedule.

    Weight decay applies to matrices and embeddings only; norm gains (1-D tensors) are not decayed (nanoGPT's rule).
    bf16 autocast and fused AdamW on CUDA; fp32 and torch's default AdamW on the CPU; AdamW with 8-bit moments with
    ``cfg.optimizer_state`` "8bit" (train/memory.py), on host copies with ``cfg.offload`` (train/offload.py).
    ``step_count`` counts inner steps done and drives the schedule. ``forward`` is the module that computes the loss, when it wraps ``model``
    (DistributedDataParallel on a multi-GPU peer: then gradients are averaged over the ranks at the last
    micro-batch of each step).
    """

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig, device: torch.device,
                 total_steps: Optional[int], forward: Optional[torch.nn.Module] = None, sharded: bool = False):
        self.model, self.cfg, self.device, self.total_steps = model, cfg, device, total_steps
        self.sharded = sharded  # inner.shard: parameters and AdamW moments are this rank's shards (train/shard.py)
        self.forward = forward if forward is not None else model
        self.step_count = 0
        self.optimizer = make_optimizer(_param_groups(model, cfg.weight_decay), cfg.optimizer_state, cfg.lr,
                                        (cfg.beta1, cfg.beta2), device, offload=cfg.offload)

    def step(self, next_batch: Callable[[], torch.Tensor], position: Optional[float] = None) -> StepResult:
        """One inner step over ``cfg.grad_accum`` micro-batches from ``next_batch`` (LongTensor [B, T]). The lr is
        that of schedule step ``position`` if given (the run's progress), else of ``step_count`` (our own steps)."""
        lr = lr_at(self.step_count if position is None else position, self.cfg, self.total_steps)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss, tokens = self._accumulate(next_batch)
        grad_norm = None
        if self.cfg.grad_clip is not None:
            # offloaded: the gradients are on the host by now
            params = getattr(self.optimizer, "host_parameters", self.model.parameters)()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):  # sharded parameters: the norm over every rank's shards
                grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.step_count += 1
        # note: the one CPU-GPU sync point of a step (loss and norm fetched together)
        if grad_norm is None:
            return StepResult(loss.item(), tokens, lr)
        loss_value, norm_value = torch.stack([loss, grad_norm.float().to(loss.device)]).tolist()
        return StepResult(loss_value, tokens, lr, norm_value)

    def _accumulate(self, next_batch: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
        total = torch.zeros((), device=self.device)
        tokens = 0
        for i in range(self.cfg.grad_accum):
            x = next_batch().to(self.device, non_blocking=True)
            with self._no_sync(last=i == self.cfg.grad_accum - 1):
                with autocast(self.device):
                    # labels = inputs: the model shifts them internally for next-token prediction
                    loss = self.forward(input_ids=x, labels=x, use_cache=False).loss / self.cfg.grad_accum
                loss.backward()
            total += loss.detach().float()
            tokens += x.numel()
        return total, tokens

    def _no_sync(self, last: bool):
        """DDP averages gradients at every backward unless told not to: only the last micro-batch's should."""
        if last or not hasattr(self.forward, "no_sync"):
            return contextlib.nullcontext()
        return self.forward.no_sync()

    def state_dict(self) -> dict:
        """AdamW moments and ``step_count`` (the parameters belong to the caller's checkpoint). A sharded peer's
        moments are spread over its ranks: each saves its own (train/shard.py save_moments)."""
        if self.sharded:
            return {"step_count": self.step_count}
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" in state and not self.sharded:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing (fp32) elsewhere."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean next-token loss (nats per token) of ``model`` over ``batches``, in eval mode; restores the mode."""
    if not batches:
        raise ValueError("evaluate: no batches")
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), device=device)
        for x in batches:
            x = x.to(device, non_blocking=True)
            with autocast(device):
                total += model(input_ids=x, labels=x, use_cache=False).loss.float()
        return total.item() / len(batches)  # note: one sync for the whole evaluation
    finally:
        model.train(was_training)


def resolve_device(name: str, local_rank: Optional[int] = None) -> torch.device:
    """RunConfig.device -> torch.device: 'auto' is cuda when available, else cpu. ``local_rank`` (a rank of a
    multi-GPU peer) picks cuda:local_rank for 'auto' and 'cuda'. Raises ConfigError naming run.device for an unknown
    name or a CUDA device that is not there."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if local_rank is not None and name == "cuda":
        name = f"cuda:{local_rank}"
    elif local_rank is not None and name.startswith("cuda:"):
        raise ConfigError(f"run.device: {name!r} names one GPU, but this peer runs one process per GPU; use 'auto' "
                          f"or 'cuda' (rank r uses cuda:LOCAL_RANK)")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"run.device: expected auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"run.device: {name!r} but only {torch.cuda.device_count()} CUDA device(s)")
    return device


class RoundSteps:
    """One round's inner steps as a peer runs them: losses, tokens, each step's time (compute, and the sleep of
    ``fault.slowdown``), whether an all-reduce was exchanging parts in the background when it began, and the
    progress bar (None: none)."""

    def __init__(self, bar):
        self.bar, self.losses, self.tokens, self.times, self.background = bar, [], 0, [], []

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def seconds(self) -> float:
        return sum(self.times)

    @property
    def last_step_s(self) -> float:
        return self.times[-1] if self.times else 0.0

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def add(self, loss: float, tokens: int, seconds: float, background: bool = False) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        self.times.append(seconds)
        self.background.append(background)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def probe_rate(self) -> Optional[tuple[int, int, float]]:
        """(steps, tokens, seconds) of the steps so far without the first (it carries one-off start-up costs)."""
        if self.steps < 2:
            return (self.steps, self.tokens, self.seconds) if self.steps else None
        return self.steps - 1, self.tokens * (self.steps - 1) // self.steps, sum(self.times[1:])

    def background_split(self) -> dict:
        """Median step time with an all-reduce running in the background and without, and how many steps had one;
        the round's first step (one-off costs of a fresh round) counts in neither."""
        split = {True: [], False: []}
        for seconds, background in zip(self.times[1:], self.background[1:]):
            split[background].append(seconds)
        return {"train/step_s_background": statistics.median(split[True]) if split[True] else None,
                "train/step_s_alone": statistics.median(split[False]) if split[False] else None,
                "train/steps_background": len(split[True])}

    def plan(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.total = steps

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
