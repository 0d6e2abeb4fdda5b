"""One run, many kinds of peer: the run's shared settings, published in the DHT by its peers, adopted or checked by
every peer that joins.

A config key is either a *run setting* (``shared=True`` in config/sections.py: the model, tokenizer, data source,
inner lr schedule, the outer setup, codec, group sizes, run id, rounds, seed), which every peer of a run must hold equal, or
a *machine setting* (device, micro-batch and gradient accumulation, threads, network, timeouts, paths), each
machine's own. Every peer publishes its run settings under ``{safe_run_id}.config`` (net/dht.py). A peer that
joins reads them before building its model:

* a run setting it set itself (in a config file or on the command line) must equal the run's, or it is refused
  with one line naming the first differing key (exit code 2);
* every run setting it did not set is taken from the run, and the ones that changed are logged;
* a peer that gave initial peers and no run setting but ``run.run_id`` expects to find the run: it waits up to
  ``network.join_timeout`` for a peer to publish the settings, then gives up (exit code 2).

The pure rules (:func:`first_difference`, :func:`adopt_settings`, :func:`run_settings_of`) are tested without a DHT.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Any, Optional

from p2p_diloco.config import (Config, ConfigError, check_config, copy_config, set_value, shared_keys,
                               shared_settings, show_value)

logger = logging.getLogger("p2p_diloco")


def first_difference(cfg: Config, run: dict[str, Any], given: Optional[set[str]]) -> Optional[str]:
    """One line naming the first run setting this peer set (``given``; None: all of them) to another value than
    the run's ``run`` settings, or None if they agree. Keys the run does not publish (an older peer's) are skipped."""
    mine = shared_settings(cfg)
    for key in shared_keys():
        if key in run and (given is None or key in given) and mine[key] != run[key]:
            return (f"{key}: this peer has {show_value(mine[key])}, run {cfg.run.run_id!r} has {show_value(run[key])} "
                    f"(published by its peers); drop the setting to adopt the run's value, or use another run.run_id")
    return None


def adopt_settings(cfg: Config, run: dict[str, Any]) -> tuple[Config, list[str]]:
    """A copy of ``cfg`` with every run setting taken from ``run``, and the keys whose value changed. A key this
    version does not know (a newer peer's setting) is skipped and reported as ``?key``."""
    adopted, changed = copy_config(cfg), []
    known = set(shared_keys())
    for key, value in run.items():
        if key not in known:
            changed.append(f"?{key}")
        elif shared_settings(adopted)[key] != value:
            set_value(adopted, key, value)
            changed.append(key)
    check_config(adopted)
    return adopted, changed


def run_settings_of(published: list[dict]) -> Optional[dict[str, Any]]:
    """The settings most of the run's peers publish (ties: the smallest JSON text), or None if none does."""
    texts = Counter(json.dumps(p["settings"], sort_keys=True) for p in published
                    if isinstance(p, dict) and isinstance(p.get("settings"), dict))
    if not texts:
        return None
    best = max(texts, key=lambda t: (texts[t], [-ord(ch) for ch in t]))
    return json.loads(best)


def expects_run(cfg: Config, given: Optional[set[str]]) -> bool:
    """True if this peer joins an existing run to take its settings: initial peers, and no run setting given but
    the run id."""
    return bool(cfg.network.initial_peers) and given is not None and not (set(shared_keys()) & given) - {"run.run_id"}


def settle(cfg: Config, dht, given: Optional[set[str]], log: logging.Logger = logger) -> Config:
    """The config this peer runs with: its own, checked against the run's published settings and completed by
    them. Raises ConfigError (one line, exit code 2) on a mismatch, or when a peer that expects the run finds none."""
    from p2p_diloco.net.dht import read_run_settings

    wait = expects_run(cfg, given)
    deadline = time.monotonic() + cfg.network.join_timeout
    while True:
        run = run_settings_of(read_run_settings(dht, cfg.run.run_id, cfg.averaging.request_timeout))
        if run is not None or not wait:
            break
        if time.monotonic() > deadline:
            raise ConfigError(f"run.run_id: no peer of run {cfg.run.run_id!r} published its settings within "
                              f"{cfg.network.join_timeout:.0f} s; start the run with its run config (--config)")
        time.sleep(1.0)  # the settings live in the DHT: there is no event to wait on, so poll
    if run is None:
        log.info(f"run {cfg.run.run_id!r}: no peer publishes settings yet; starting it with ours")
        return cfg
    problem = first_difference(cfg, run, given)
    if problem:
        raise ConfigError(problem)
    adopted, changed = adopt_settings(cfg, run)
    if changed:
        log.info(f"run {cfg.run.run_id!r}: adopted its settings " + ", ".join(
            k if k.startswith("?") else f"{k}={show_value(shared_settings(adopted)[k])}" for k in changed)
                 + (" (?: unknown to this version, ignored)" if any(k.startswith("?") for k in changed) else ""))
    else:
        log.info(f"run {cfg.run.run_id!r}: our settings are the run's")
    return adopted
