"""A peer's θ_local and inner steps, on one device or on the K GPUs of one machine: one peer, K processes.

The peer calls :class:`Replica` for everything that touches θ_local: an inner step, θ_local ← θ_global, δ, and the
round's throughput figures. With one process that is the model on its device. With K processes (started by torchrun,
one per GPU) rank 0 is the peer: it alone talks to the swarm and holds θ_global and the outer momentum; ranks > 0
run :meth:`Replica.follow`, obeying commands that rank 0 broadcasts over a gloo control group:

  STEP  one inner step on every rank (with rank 0's learning-rate schedule position, if it gives one);
        DistributedDataParallel averages the gradients, so θ_local and the AdamW state stay identical on all ranks;
        each rank reads its own data order; loss and tokens are summed over the ranks
  LOAD  θ_local ← rank 0's θ_local (after a commit, a state download, or any change rank 0 makes to θ_local): one
        broadcast of the flat parameter buffer
  DATA  each rank sends its data reader's position to rank 0, for rank 0's checkpoint
  PULL  (inner.shard) every rank takes part in gathering the shards into rank 0's host copy of θ_local
  SAVE, RESTORE  (inner.shard) every rank writes (reads) its shard of the AdamW state, for rank 0's checkpoint
  EVAL  (inner.shard) every rank evaluates a share of the held-out batches through its shards
  STOP  leave the loop

With ``inner.shard`` the K processes hold 1/K each of the parameters, gradients and AdamW state (FSDP2,
train/shard.py) instead of K replicas; LOAD then scatters rank 0's host copy of θ_local to the shards, and rank 0
gathers them back (PULL) before it reads θ_local after inner steps.

A rank that dies breaks the group: the next collective of the others fails at once (its connections close), rank 0
stops like any failing peer (it announces that it leaves), and torchrun ends the rest. The swarm sees one peer.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from p2p_diloco.config import Config, ConfigError, RunConfig
from p2p_diloco.train.data import Data, build_data
from p2p_diloco.train.flops import flops_per_token, mfu, peak_flops
from p2p_diloco.train.inner import (InnerTrainer, StepResult, autocast, evaluate, resolve_device,
                                    schedule_total_steps)
from p2p_diloco.train.memory import compile_regions, decoder_layers, loss_module
from p2p_diloco.train.shard import (check_shardable, gather_into, load_moments, pairs, reshard, save_moments,
                                    moments_tag, scatter_from, shard_modules, to_shapes)
from p2p_diloco.train.model import build_model
from p2p_diloco.train.transfer import DeltaTransfer, flat_view, flatten_parameters, load_params

STEP, LOAD, DATA, STOP, PULL, SAVE, RESTORE, EVAL = range(8)


@dataclasses.dataclass
class Ranks:
    """This process's place in a multi-process peer (torchrun's environment)."""
    rank: int
    world: int
    local_rank: int
    control: Any  # gloo process group: commands and per-step sums, on the host


def join_ranks(run: RunConfig) -> Optional[Ranks]:
    """Join the peer's process group when started by torchrun with more than one process; None otherwise.

    The gradients go over NCCL between GPUs (gloo between CPU processes); commands over gloo in every case. Every
    wait is bounded by ``run.rank_timeout``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's protocol, read at start, not a behaviour flag
    if world <= 1:
        return None
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = run.device != "cpu" and torch.cuda.is_available()
    timeout = timedelta(seconds=run.rank_timeout)
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    return Ranks(dist.get_rank(), world, local_rank, control)


@dataclasses.dataclass
class Training:
    """What every rank builds the same way: device, data, model, inner loop. With ``inner.shard`` on several
    processes, ``model`` is the host copy of θ_local and ``shards`` the sharded model the inner loop trains."""
    device: torch.device
    data: Data
    model: torch.nn.Module
    inner: InnerTrainer
    shards: Optional[torch.nn.Module] = None


def build_training(cfg: Config, name: str, ranks: Optional[Ranks]) -> Training:
    """Device, this rank's data (rank r > 0 reads the order of ``name/rank{r}``), the model on the device and the
    inner loop (:func:`build_inner`). Every rank must call it at the same point: DDP's set-up is a collective."""
    device = resolve_device(cfg.run.device, ranks.local_rank if ranks else None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast (none in the hot path)
        torch.backends.cudnn.allow_tf32 = True
    data_name = name if ranks is None or ranks.rank == 0 else f"{name}/rank{ranks.rank}"
    data = build_data(cfg.data, cfg.model.seq_len, cfg.inner.batch_size, data_name, cfg.model.init_from)
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    if cfg.inner.shard and ranks is not None:
        import copy

        trained = copy.deepcopy(model)  # the host copy stays: θ_local's full values, read by the rest of the peer
        return Training(device, data, model, build_inner(cfg, trained, device, ranks), shards=trained)
    return Training(device, data, model, build_inner(cfg, model, device, ranks))


def build_inner(cfg: Config, model: torch.nn.Module, device: torch.device, ranks: Optional[Ranks]) -> InnerTrainer:
    """The inner loop on ``model`` (on the host or on ``device``; moved there) with this machine's memory options:
    gradient checkpointing, the parameters made one flat buffer on the device, the chunked loss, torch.compile by
    regions (train/memory.py), DDP around the loss's module on a multi-process peer, AdamW (8-bit moments, or on the
    host, if configured)."""
    if cfg.inner.offload and ranks is not None:
        raise ConfigError("inner.offload: a multi-process peer averages its gradients on the GPUs; offload is for "
                          "one-process peers (drop --nproc-per-node or inner.offload)")
    sharded = cfg.inner.shard and ranks is not None
    if sharded:
        check_shardable(cfg)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not sharded:  # sharded: fully_shard moves each unit's parameters and buffers, sharded, one unit at a time
        flatten_parameters(model, device)
        model.to(device)  # buffers, and parameters that could not be flattened
    loss = loss_module(model, cfg.model.loss_chunk, compiled=cfg.run.compile)
    if cfg.run.compile:
        compile_regions(model, loss)
    forward = loss if loss is not model else None
    if sharded:
        shard_modules(loss, decoder_layers(model), device)
    elif ranks is not None:
        from torch.nn.parallel import DistributedDataParallel

        # buffers (rotary frequencies) are computed identically everywhere: no per-step broadcast of them;
        # gradients as views of DDP's buckets: no second copy of them (4 bytes per parameter)
        forward = DistributedDataParallel(loss, device_ids=[device.index] if device.type == "cuda" else None,
                                          broadcast_buffers=False, gradient_as_bucket_view=True)
    total = schedule_total_steps(cfg.inner, cfg.run.rounds, cfg.diloco.inner_steps)
    return InnerTrainer(model, cfg.inner, device, total, forward=forward, sharded=sharded)


def share_setup(name: str, cfg: Config, ranks: Optional[Ranks]) -> tuple[str, Config]:
    """Rank 0's peer name and config, on every rank: ranks > 0 derive their data order from the name, and build
    exactly rank 0's model and inner loop even where rank 0's config was completed at start (e.g. from the run)."""
    if ranks is None:
        return name, cfg
    import torch.distributed as dist

    box = [name, cfg]
    dist.broadcast_object_list(box, src=0, group=ranks.control)
    return box[0], box[1]


class Replica:
    """θ_local of this peer and its inner steps, over ``ranks`` (None: this one process)."""

    def __init__(self, training: Training, ranks: Optional[Ranks], cfg: Config):
        self.model, self.inner, self.device, self.ranks = training.model, training.inner, training.device, ranks
        self.shards = training.shards  # inner.shard: the sharded model; self.model is then θ_local on the host
        if self.shards is not None and ranks.rank > 0:
            to_shapes(self.model)  # only rank 0 reads the host copy; the others need its shapes (scatter_from)
        self._params = list(self.model.parameters())
        self._pairs = pairs(self.model, self.shards) if self.shards is not None else []
        self._stale = False  # sharded: inner steps changed the shards since rank 0's host copy was refreshed
        self.run_dir = cfg.run.run_dir  # a sharded peer's AdamW shards are saved there, beside the checkpoint
        self.transfer = DeltaTransfer(self._params)
        self.flops_per_token = flops_per_token(self.model, cfg.model.seq_len)
        self.peak = peak_flops(self.device, cfg.run.peak_tflops)

    @property
    def params(self) -> list[torch.Tensor]:
        """θ_local on rank 0: the model's parameters (sharded: the host copy, refreshed from the shards first)."""
        self.refresh()
        return self._params

    def gathered(self) -> list[torch.Tensor]:
        """Sharded: θ_local gathered from the shards now, whatever the host copy held (checks, benchmarks)."""
        self._stale = self.shards is not None
        return self.params

    def evaluate(self, batches: Sequence[torch.Tensor]) -> float:
        """Mean loss of θ_local over ``batches`` (the peer calls it when θ_local is θ_global). Sharded: on the GPUs,
        each rank a share of the batches through its shards (command EVAL)."""
        if self.shards is None:
            return evaluate(self.model, batches, self.device)
        self._command(EVAL, len(batches))
        return self._evaluate_shards(batches)

    def refresh(self) -> None:
        """Sharded: bring rank 0's host copy of θ_local up to date with the shards (after inner steps)."""
        if self._stale:
            self._command(PULL)
            gather_into(self._pairs, 0)
            self._stale = False

    @property
    def world(self) -> int:
        return self.ranks.world if self.ranks is not None else 1

    # ------------------------------------------------------------------------------------------------ rank 0
    def step(self, next_batch: Callable[[], torch.Tensor], position: Optional[float] = None) -> StepResult:
        """One inner step (on every rank); loss averaged and tokens summed over the ranks. ``position``: the
        learning-rate schedule's position for :meth:`InnerTrainer.step`, when the caller sets it."""
        self._command(STEP, position)
        self._stale = self.shards is not None
        return self._step(next_batch, position)

    def load(self, global_params: Sequence[torch.Tensor]) -> None:
        """θ_local ← θ_global on every rank."""
        load_params(self._params, global_params)
        self._stale = False  # every value of the host copy was just written
        self.broadcast_local()

    def broadcast_local(self) -> None:
        """Rank 0's θ_local to every rank: call it after changing θ_local on rank 0 by any other means."""
        self.refresh()  # sharded: a host copy older than the shards must not overwrite them
        self._command(LOAD)
        self._broadcast_params()

    def pseudo_gradient(self, global_params: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """δ = θ_global − θ_local into ``out`` (host fp32): θ_local is the same on every rank, rank 0's is used."""
        self.refresh()
        self.transfer.pseudo_gradient(global_params, out)

    def save_moments(self) -> Optional[str]:
        """Sharded: every rank writes its shard of the AdamW state into run_dir; the shards' tag, for rank 0's
        checkpoint (a one-process or DDP peer's moments are in that checkpoint, InnerTrainer.state_dict: None)."""
        if self.shards is None:
            return None
        self._command(SAVE)
        return save_moments(self.shards, self.inner.optimizer, self.run_dir)

    def restore_moments(self, tag: Optional[str]) -> bool:
        """Sharded: every rank reads its shard of the AdamW state back, if run_dir holds the shards tagged ``tag``
        (the checkpoint's); False if not (none saved, or saved with another checkpoint: the AdamW state starts anew)."""
        if self.shards is None or not tag or moments_tag(self.run_dir) != tag:
            return False
        self._command(RESTORE)
        return load_moments(self.shards, self.inner.optimizer, self.run_dir)

    def data_states(self) -> list[dict]:
        """The data positions of ranks 1..K-1 (for rank 0's checkpoint); [] for a one-process peer."""
        if self.ranks is None:
            return []
        import torch.distributed as dist

        states: list = [None] * self.world
        try:
            self._command(DATA)
            dist.gather_object(None, states, dst=0, group=self.ranks.control)
        except RuntimeError:  # a rank died: its position is lost (it restarts its data order on resume)
            return []
        return states[1:]

    def round_stats(self, tokens: int, seconds: float) -> dict:
        """Throughput of a round's inner steps: tokens/s (all ranks), MFU (if the device's peak is known), peak
        device memory on rank 0 since the last call (CUDA only)."""
        tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        stats = {"train/tokens_per_s": tokens_per_s,
                 "train/mfu": mfu(tokens_per_s, self.flops_per_token, self.peak and self.peak * self.world)}
        if self.device.type == "cuda":
            stats["device/peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
            torch.cuda.reset_peak_memory_stats(self.device)
        return stats

    def close(self) -> None:
        """Tell ranks > 0 to stop (they may be gone already) and leave the process group."""
        if self.ranks is None:
            return
        try:
            self._command(STOP)
        except RuntimeError:  # a rank died: the group is broken, nobody is left to tell
            pass
        self.leave_group()

    def leave_group(self) -> None:
        """Drop DDP, then the process group. In this order: a process group freed with DDP's last reference (under
        the GIL) waits for gloo's thread, which may itself wait for the GIL to free a tensor: a deadlock at exit."""
        import torch.distributed as dist

        self.inner.forward = getattr(self.inner.forward, "module", self.inner.forward)  # the loss module stays
        gc.collect()
        dist.destroy_process_group()
        self.ranks = None

    # ------------------------------------------------------------------------------------------------ ranks > 0
    def follow(self, data: Data) -> None:
        """Ranks > 0: obey rank 0 until it says STOP (a broken group raises instead)."""
        import torch.distributed as dist

        while True:
            message = torch.zeros(2, dtype=torch.float64)
            dist.broadcast(message, src=0, group=self.ranks.control)
            command, value = int(message[0].item()), message[1].item()
            if command == STEP:
                self._step(data.train.next_batch, None if value != value else value)  # NaN: no position given
            elif command == LOAD:
                self._broadcast_params()
            elif command == DATA:
                dist.gather_object(data.train.state_dict(), None, dst=0, group=self.ranks.control)
            elif command == PULL:
                gather_into(self._pairs, self.ranks.rank)
            elif command == SAVE:
                save_moments(self.shards, self.inner.optimizer, self.run_dir)
            elif command == RESTORE:
                load_moments(self.shards, self.inner.optimizer, self.run_dir)
            elif command == EVAL:
                self._evaluate_shards(data.eval_batches[:int(value)])
            else:
                return

    # ------------------------------------------------------------------------------------------------ both
    def _command(self, command: int, value: Optional[float] = None) -> None:
        if self.ranks is not None:
            import torch.distributed as dist

            message = torch.tensor([command, float("nan") if value is None else value], dtype=torch.float64)
            dist.broadcast(message, src=0, group=self.ranks.control)

    def _step(self, next_batch: Callable[[], torch.Tensor], position: Optional[float] = None) -> StepResult:
        out = self.inner.step(next_batch) if position is None else self.inner.step(next_batch, position)
        if self.ranks is None:
            return out
        import torch.distributed as dist

        total = torch.tensor([out.loss, float(out.tokens)], dtype=torch.float64)
        dist.all_reduce(total, group=self.ranks.control)
        return dataclasses.replace(out, loss=total[0].item() / self.world, tokens=int(total[1].item()))

    @torch.no_grad()
    def _evaluate_shards(self, batches: Sequence[torch.Tensor]) -> float:
        """Every rank evaluates batches[rank::K] through its shards; as many forward passes on every rank (each one's
        collectives need all), a rank with one batch fewer runs one more and drops it. The mean over all batches."""
        import torch.distributed as dist

        rank, world = self.ranks.rank, self.world
        mine, passes = batches[rank::world], -(-len(batches) // world)
        model, total = self.inner.forward, torch.zeros(2, dtype=torch.float64)
        was_training = model.training
        model.eval()
        try:
            for i in range(passes):
                x = (mine[i] if i < len(mine) else batches[0]).to(self.device, non_blocking=True)
                with autocast(self.device):
                    loss = model(input_ids=x, labels=x, use_cache=False).loss.float()
                if i < len(mine):
                    total += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
        finally:
            model.train(was_training)
            reshard(model)  # the root unit stays gathered after a forward pass without its backward
        dist.all_reduce(total, group=self.ranks.control)
        return total[0].item() / max(1.0, total[1].item())

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        if self.ranks is None:
            return
        import torch.distributed as dist

        if self.shards is not None:
            scatter_from(self._pairs, self.ranks.rank)
            return
        flat = flat_view(self._params)
        for tensor in [flat] if flat is not None else [p.detach() for p in self._params]:
            dist.broadcast(tensor, src=0)
