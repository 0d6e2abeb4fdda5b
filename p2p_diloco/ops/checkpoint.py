"""Local checkpoints: atomic save and resume of everything a peer needs to continue a run."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from p2p_diloco.config import ConfigError

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
    """The last checkpoint saved in ``run_dir``, or None if there is none. ConfigError (one line) if the file holds
    anything but tensors and plain values (:func:`read_checkpoint`)."""
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        return None
    return read_checkpoint(path)


def read_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's contents, read with ``weights_only=True``: tensors, dicts, lists, tuples, numbers, strings,
    never an arbitrary pickle. A run folder may come from someone else (an export, a shared run): unpickling
    arbitrary objects would run their code. ConfigError (one line) for a file that is refused or unreadable."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # torch's message is a page; the line naming what it refused will do
        why = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                   "not a plain checkpoint")
        raise ConfigError(f"{path}: refused: it holds objects other than tensors and plain values, whose loading "
                          f"could run code ({why[:160]})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable checkpoint ({str(e).strip().splitlines()[0][:160]})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: not a checkpoint of this program (a {type(saved).__name__})")
    return saved
