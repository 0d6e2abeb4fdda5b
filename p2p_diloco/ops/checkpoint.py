"""Local checkpoints: atomic save and resume of everything a peer needs to continue a run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(run_dir: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``run_dir/checkpoint.pt`` atomically: a crash leaves the previous checkpoint intact."""
    path = Path(run_dir) / CHECKPOINT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # the rename below must never expose a half-written file
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The last checkpoint saved in ``run_dir``, or None if there is none."""
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
