"""Checks of a loaded config against this machine, made by the CLI before any daemon or DHT starts.

Each raises :class:`ConfigError` naming the key and the fix (one line, exit code 2), in a fraction of a second where
it can: the multiaddrs are parsed with hivemind's own multiaddr package, loaded without importing hivemind (3-6 s);
torch is imported only to check a CUDA device, huggingface_hub only for model.init_from. The same things are checked
again where they are used (net/dht.py, train/model.py, train/inner.py): these checks only move the error before the
slow start.
"""

from __future__ import annotations

import difflib
import errno
import importlib.machinery
import importlib.util
import os
import re
import socket
import sys
from pathlib import Path
from typing import Iterable

from p2p_diloco.config.fields import ConfigError
from p2p_diloco.config.sections import Config, MetricsConfig, ModelConfig, NetworkConfig

MADDR_KEYS = ("initial_peers", "host_maddrs", "announce_maddrs", "trusted_relays")
NEED_PEER_ID = ("initial_peers", "trusted_relays")  # addresses we dial: p2pd needs the peer id to dial them
EXAMPLE_ID = "12D3KooW..."


def check_network(net: NetworkConfig, listen: bool = True) -> None:
    """Every multiaddr of [network] parses, initial peers and relays carry ``/p2p/<peer id>``, and (``listen``) the
    concrete ports of ``host_maddrs`` are free on this machine."""
    for key in MADDR_KEYS:
        for maddr in getattr(net, key):
            protocols = _parse(f"network.{key}", maddr)
            if key in NEED_PEER_ID and "p2p" not in protocols:
                raise ConfigError(f"network.{key}: {maddr!r} has no peer id: append /p2p/<peer id>, as the node "
                                  f"prints its address (e.g. {maddr.rstrip('/')}/p2p/{EXAMPLE_ID})")
    if listen:
        for maddr in net.host_maddrs:
            _check_port_free(maddr)


def check_model(model: ModelConfig) -> None:
    """``model.init_from`` is an existing folder or a hub name that can be fetched (offline: one in the Hugging Face
    cache); without it, ``model.name`` is a preset or an existing path (init_from's architecture replaces it)."""
    if model.init_from is not None:
        _check_init_from(model.init_from)
    elif not Path(model.name).expanduser().exists():
        presets = _preset_names()
        if model.name not in presets:
            close = difflib.get_close_matches(model.name, presets, n=1)
            hint = f": did you mean {close[0]}?" if close else f" (presets: {', '.join(presets)})"
            raise ConfigError(f"model.name: no preset or config file '{model.name}'{hint}")


def check_device(device: str) -> None:
    """A CUDA ``run.device`` exists here (the other names are resolved at start: train/inner.py resolve_device)."""
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"run.device: {device!r} requested but CUDA is not available ({why}): use "
                          f"--run.device=cpu, or auto (cuda where present)")
    if match.group(1) is not None and int(match.group(1)) >= torch.cuda.device_count():
        raise ConfigError(f"run.device: {device!r} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                          f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}, or cuda")


def check_metrics(metrics: MetricsConfig) -> None:
    """The metrics endpoint's address can be bound here (ops/telemetry.py), when ``metrics.port`` turns it on."""
    if metrics.port:
        from p2p_diloco.ops.telemetry import check_endpoint  # prometheus_client: a fraction of a second

        check_endpoint(metrics.host, metrics.port)


def check_training(cfg: Config) -> None:
    """What a peer (or each peer of a swarm) would otherwise find only after its DHT started."""
    check_model(cfg.model)
    check_device(cfg.run.device)  # imports torch, for a CUDA device only


def only_sections(command: str, allowed: Iterable[str], sources: dict[str, str]) -> None:
    """Refuse keys outside ``allowed`` sections for a command that reads no others (``sources``: key -> where it
    was set, from load_config), naming them and where they came from."""
    allowed = tuple(allowed)
    others = {key: where for key, where in sources.items() if key.partition(".")[0] not in allowed}
    if others:
        names = "/".join(f"[{s}]" for s in allowed)
        raise ConfigError(f"{command}: reads only {names} keys, but {', '.join(others)} "
                          f"(from {', '.join(sorted(set(others.values())))}) set others: they belong to the peers' "
                          f"config (p2p-diloco peer); drop them here")


# ---------------------------------------------------------------------------------------------- helpers

def _parse(key: str, maddr: str) -> list[str]:
    """The protocol names of ``maddr``; ConfigError naming ``key`` if it is not a multiaddr."""
    example = f"expected e.g. /ip4/203.0.113.5/tcp/31337{'/p2p/' + EXAMPLE_ID if key.endswith(NEED_PEER_ID) else ''}"
    if not maddr.startswith("/"):
        raise ConfigError(f"{key}: not a multiaddr: {maddr!r} ({example})")
    try:
        parsed = _multiaddr_class()(maddr)
    except Exception as e:  # the multiaddr package raises several unrelated types
        reason = str(e).replace(f"Invalid MultiAddr {maddr!r} ", "") or type(e).__name__  # "protocol tcp: ..."
        raise ConfigError(f"{key}: invalid multiaddr {maddr!r}: {reason} ({example})") from None
    return [p.name for p in parsed.protocols()]


def _multiaddr_class():
    """hivemind's multiaddr package (hivemind/utils/multiaddr, self-contained) without importing hivemind, whose
    __init__ imports torch and the whole library; ``import hivemind.utils.multiaddr`` where it cannot be found."""
    name = "_p2p_diloco_multiaddr"
    if name not in sys.modules:
        spec = importlib.machinery.PathFinder.find_spec("hivemind")
        folder = Path(spec.submodule_search_locations[0]) / "utils" / "multiaddr" if spec else None
        if folder is None or not (folder / "__init__.py").is_file():
            from hivemind.utils.multiaddr import Multiaddr

            return Multiaddr
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].Multiaddr


def _check_port_free(maddr: str) -> None:
    """Bind the address and port of ``maddr`` (/ip4 or /ip6, /tcp or /udp, a port other than 0) and let go. p2pd
    fails on a port another program holds with a raw line of its own, after the slow start; on one a p2pd holds (a
    node already running here, or one left behind) it starts, both listening (SO_REUSEPORT), and the kernel splits
    the incoming connections between the two nodes: refused here too."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] not in ("tcp", "udp") or parts[4] == "0":
        return
    host, transport, port = parts[2], parts[3], int(parts[4])
    family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM if transport == "tcp" else socket.SOCK_DGRAM) as sock:
        if transport == "tcp":  # as p2pd does: a port whose last connections are in TIME_WAIT is free
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            advice = _bind_advice(e, parts, port)
            raise ConfigError(f"network.host_maddrs: cannot listen on {maddr}: {advice}") from None


def _bind_advice(error: OSError, parts: list[str], port: int) -> str:
    other = "/".join(parts[:4] + [str(port + 1 if port < 65535 else port - 1)] + parts[5:])
    if error.errno == errno.EADDRINUSE:
        return (f"{parts[3]} port {port} is already in use (a bootstrap node or peer already running here?): stop "
                f"that program, or listen on another port, e.g. --network.host_maddrs={other} (port 0: any free one)")
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"{parts[2]} is not an address of this machine: listen on /{parts[1]}/"
                f"{'0.0.0.0' if parts[1] == 'ip4' else '::'}/{parts[3]}/{port} and advertise the public address "
                f"with network.announce_maddrs")
    if error.errno == errno.EACCES:
        return f"permission denied (ports below 1024 need root): use e.g. --network.host_maddrs={other}"
    return os.strerror(error.errno) if error.errno else str(error)


def _check_init_from(source: str) -> None:
    if Path(source).expanduser().exists():
        return  # a local folder: train/model.py load_pretrained reads and checks it
    if source.startswith(("/", ".", "~")):
        raise ConfigError(f"model.init_from: no folder {source!r} (a folder saved with save_pretrained, or a Hugging "
                          f"Face hub name such as gpt2)")
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(source, "config.json")
    except ValueError:  # huggingface_hub's HFValidationError: not a valid repository id
        raise ConfigError(f"model.init_from: {source!r} is neither a folder here nor a Hugging Face hub model name "
                          f"(such as gpt2 or HuggingFaceTB/SmolLM2-135M)") from None
    offline = constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in ("1", "ON", "YES",
                                                                                                   "TRUE")
    if offline and not isinstance(cached, str):
        raise ConfigError(f"model.init_from: hub model {source!r} is not in the Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE forbids downloading it: download it once "
                          f"online (huggingface-cli download {source}), or set model.init_from to a local folder")


def _preset_names() -> list[str]:
    from p2p_diloco.train.presets import PRESETS  # plain data: no torch

    return list(PRESETS)
