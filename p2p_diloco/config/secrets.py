"""The run's secret at rest: never in clear in what a run writes or shows (checkpoints, the W&B config, a swarm's
peer config, a child's command line), and in files only its owner can read.

``network.secret`` given on the command line or in a config is kept in memory; whatever is written for later (a
checkpoint's config, the W&B config) holds :data:`REDACTED` in its place, and a child process that needs it (a
swarm's peers and bootstrap node) reads it from a file created with mode 0600 (``network.secret_file``), never from
its argv, which any user of the machine can read in /proc.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

REDACTED = "<redacted>"
SECRET_FILE = "network.secret"  # in a swarm's run folder: what its children read


def redacted(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config as a dict (``Config.to_dict()``, ``asdict(cfg)``) with ``network.secret`` replaced by
    :data:`REDACTED` if it is set."""
    out = copy.deepcopy(config)
    network = out.get("network")
    if isinstance(network, dict) and network.get("secret") is not None:
        network["secret"] = REDACTED
    return out


def write_private(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path``, readable and writable by its owner only (0600), whatever the umask; an existing
    file is made 0600 before anything is written to it."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path


def secret_via_file(cfg, folder: str | os.PathLike):
    """``cfg`` itself if it holds no ``network.secret``; else a copy that names a 0600 file in ``folder`` holding
    the secret (``network.secret_file``) instead of the secret, for configs and command lines given to children."""
    if cfg.network.secret is None:
        return cfg
    path = write_private(Path(folder) / SECRET_FILE, cfg.network.secret + "\n")
    out = copy.deepcopy(cfg)
    out.network.secret, out.network.secret_file = None, str(path.resolve())
    return out
