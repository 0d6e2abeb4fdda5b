"""Multi-GPU machines as one peer: the launcher (``p2p-diloco peer --nproc-per-node K`` runs torchrun) and the main
of ranks > 0 (:func:`run_follower`). The training side is :mod:`p2p_diloco.train.replica`.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

from p2p_diloco.config import Config
from p2p_diloco.ops.checkpoint import load_checkpoint
from p2p_diloco.ops.procs import die_with_parent


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs ``p2p-diloco <argv>`` as ``nproc`` processes of one peer on this machine:
    torchrun's single-node mode (a rendezvous on a free local port), ``--nproc-per-node`` removed from ``argv``."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            rest.append(arg)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "p2p_diloco", *rest]


def rank() -> Optional[int]:
    """This process's rank when torchrun started it as one of several; None otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return int(os.environ["RANK"])


def as_torchrun_worker() -> None:
    """First thing in a process started by torchrun: die with torchrun's agent (it starts each worker in a session
    of its own, so whoever ends the agent's process group would otherwise leave the workers running)."""
    die_with_parent()


def run_follower(cfg: Config) -> int:
    """Ranks > 0: build the same training as rank 0, take up rank 0's checkpoint if there is one, and follow rank
    0's commands until it says stop. Signals are left to rank 0, which stops the peer in order (it finishes the
    step, leaves the run, saves, then releases the ranks); a rank whose group breaks exits with an error."""
    from p2p_diloco.train.replica import Replica, build_training, join_ranks, share_setup

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ranks = join_ranks(cfg.run)
    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)
    name, cfg = share_setup("", cfg, ranks)  # rank 0's: the same model, data source and schedule
    training = build_training(cfg, name, ranks)
    replica = Replica(training, ranks, cfg)
    saved = load_checkpoint(cfg.run.run_dir)
    if saved is not None:  # rank 0 resumes from the same file (and refuses it if it is another run's)
        if replica.shards is None:  # sharded: this rank's host copy holds shapes only; rank 0 scatters θ_local
            training.model.load_state_dict(saved["model"])
        training.inner.load_state_dict(saved["inner"])
        states = saved.get("data_ranks") or []
        if len(states) >= ranks.rank:
            training.data.train.load_state_dict(states[ranks.rank - 1])
    try:
        replica.follow(training.data)
    finally:
        training.data.train.close()
    replica.leave_group()
    return 0
