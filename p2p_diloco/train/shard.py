"""A sharded multi-process peer (``inner.shard``): the K processes of one machine hold 1/K each of the parameters,
gradients and inner AdamW state (FSDP2's ``fully_shard``: each decoder layer a unit, the rest in the root unit),
instead of K full replicas (DistributedDataParallel, train/replica.py).

The rest of the peer sees one model, as with one process: rank 0 keeps θ_local's full fp32 values in **host** memory
(the *mirror*, the model that checkpoints, export and the pseudo-gradient read), never on a GPU. After
inner steps rank 0 refreshes the mirror from the shards (:func:`gather_into`: one parameter at a time, so a GPU holds
one full parameter at most, never the model), and after it changes θ_local (θ_global applied, a rebase) it pushes
the mirror to the shards (:func:`scatter_from`, the same way). The gradients are averaged over the ranks by the
reduce-scatter of the backward pass, as DDP's all-reduce averages them: the same inner step, sharded.
"""

from __future__ import annotations

from typing import Sequence

import torch

from p2p_diloco.config import Config, ConfigError


def check_shardable(cfg: Config) -> None:
    """The options a sharded peer does not take: one clear line each. (8-bit moments it takes: torchao's AdamW8bit
    keeps them as shards of the sharded parameters.)"""
    if cfg.inner.offload:
        raise ConfigError("inner.shard: the shards live on the GPUs; inner.offload is for one-process peers "
                          "(choose one of inner.shard and inner.offload)")


def shard_modules(root: torch.nn.Module, layers, device: torch.device) -> None:
    """FSDP2 over every process of the default group: each of ``layers`` (the decoder layers) its own unit, then
    ``root`` (the module whose forward computes the loss: the embeddings, final norm and head are its own)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers if layers is not None else ():
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)


def reshard(root: torch.nn.Module) -> None:
    """Every FSDP unit under ``root`` back to its shards: after a forward pass without backward (an evaluation) the
    root unit keeps its parameters gathered, and the module would then hold full parameters that the optimizer,
    the checkpoint and :func:`pairs` do not know."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def to_shapes(model: torch.nn.Module) -> None:
    """``model``'s parameters on the meta device (shapes without memory), each the same Parameter object, so that
    tied weights stay tied (a plain ``.to("meta")`` makes new ones and unties them)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def pairs(mirror: torch.nn.Module, sharded: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(mirror parameter, sharded parameter), matched by name (fully_shard keeps the names)."""
    host = dict(mirror.named_parameters())
    out = [(host[name], p) for name, p in sharded.named_parameters()]
    if len(out) != len(host):
        raise RuntimeError(f"inner.shard: {len(out)} sharded parameters for {len(host)} in the model")
    return out


@torch.no_grad()
def gather_into(matched: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
    """The shards' values into the mirror (rank 0's; the others only take part in each all-gather)."""
    for host, param in matched:
        full = param.full_tensor()  # one parameter, whole, on every rank's device
        if rank == 0:
            host.copy_(full)


@torch.no_grad()
def scatter_from(matched: Sequence[tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
    """Rank 0's mirror into every rank's shard, one parameter at a time."""
    from torch.distributed.tensor import distribute_tensor

    for host, param in matched:
        device = param.to_local().device
        source = host.to(device, param.dtype) if rank == 0 else torch.empty(host.shape, dtype=param.dtype,
                                                                               device=device)
        piece = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=0)
        param.to_local().copy_(piece.to_local())


MOMENTS_DIR = "inner-shards"  # in run.run_dir: each rank's shard of the inner AdamW state (torch.distributed.checkpoint)


TAG_FILE = "tag"  # in MOMENTS_DIR: names the checkpoint.pt it was written with (its "inner_shards")


def save_moments(model: torch.nn.Module, optimizer, run_dir) -> str:
    """Every rank writes its shard of the AdamW state (a collective: every rank calls it), beside rank 0's
    checkpoint.pt; written to a fresh folder, then swapped in, so a crash keeps the previous one whole. Returns (on
    rank 0; "" on the others) a fresh tag, written into the folder: rank 0's checkpoint.pt keeps it, and a resume
    reads the folder only if the tags match (a crash between the two writes leaves a folder of another round)."""
    import shutil
    import uuid
    from pathlib import Path

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    final = Path(run_dir) / MOMENTS_DIR
    fresh = final.with_name(f".{MOMENTS_DIR}.new")
    if dist.get_rank() == 0:
        shutil.rmtree(fresh, ignore_errors=True)
    dist.barrier()
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(fresh))
    tag = ""
    if dist.get_rank() == 0:  # dcp.save returns once every rank's shard and the metadata are written
        tag = uuid.uuid4().hex
        (fresh / TAG_FILE).write_text(tag)
        old = final.with_name(f".{MOMENTS_DIR}.old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        fresh.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return tag


def moments_tag(run_dir) -> str:
    """The tag of the AdamW shards saved in ``run_dir`` ("" if none)."""
    from pathlib import Path

    path = Path(run_dir) / MOMENTS_DIR
    if not (path / ".metadata").is_file() or not (path / TAG_FILE).is_file():
        return ""
    return (path / TAG_FILE).read_text().strip()


def load_moments(model: torch.nn.Module, optimizer, run_dir) -> bool:
    """Every rank reads its shard of the AdamW state saved by :func:`save_moments`; False if there is none (every
    rank sees the same folder: one machine)."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = Path(run_dir) / MOMENTS_DIR
    if not (path / ".metadata").is_file():
        return False
    optimizer.zero_grad(set_to_none=True)  # so that an optimizer without state gets it made, zeroed, to read into
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout to read into
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"])
    return True
