"""One run, many kinds of peer: the run's shared settings, published in the DHT by its peers, adopted or checked by
every peer that joins.

A config key is either a *run setting* (``shared=True`` in config/sections.py: the model, tokenizer, data source,
inner lr schedule, the outer setup, codec, group sizes, run id, rounds, seed), which every peer of a run must hold equal, or
a *machine setting* (device, micro-batch and gradient accumulation, threads, network, timeouts, paths), each
machine's own. Every peer publishes its run settings under ``{safe_run_id}.config`` (net/keys.py). A peer that
joins reads them before building its model:

* a run setting it set itself (in a config file or on the command line) must equal the run's, or it is refused
  with one line naming the first differing key (exit code 2);
* every run setting it did not set is taken from the run, and the ones that changed are logged;
* a peer that gave initial peers and no run setting but ``run.run_id`` expects to find the run: it waits up to
  ``network.join_timeout`` for a peer to publish the settings, then gives up (exit code 2).

Anyone who reaches a DHT node can publish settings under the run's key, as many entries as it holds keys (issue 24,
finding 4), so which settings a joiner takes is decided here, never by votes alone:

* **the spec hash** (:func:`spec_hash`: 16 hex characters of sha256 over every run setting) is printed by every
  peer (``run spec ...``); a joiner given ``run.spec_hash`` takes only settings that hash to it, whatever the
  other entries say, and waits for them up to ``network.join_timeout``;
* without it, the settings most entries publish among those that agree with what this peer set, but a joiner never
  takes from the DHT (:func:`refusals`) a local path or a model config file (model.name, data.dataset,
  data.tokenizer), a checkpoint to load (model.init_from), a defence weaker than its own (:data:`WEAKER`) or a size
  or rate above :data:`LIMITS`: it is refused with one line naming them (exit code 2), and may set them itself or
  give the spec hash;
* every value taken is checked as if this peer had set it (config/load.py's checks);
* the run's DHT prefix carries :func:`run_fingerprint`, which covers the whole spec: peers holding other settings
  (another spec published under the same run id) never average with the run.

The pure rules (:func:`first_difference`, :func:`adopt_settings`, :func:`choose_settings`, :func:`refusals`,
:func:`spec_hash`) are tested without a DHT.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from p2p_diloco.config import (Config, ConfigError, check_config, copy_config, set_value, shared_keys,
                               shared_settings, show_value)

logger = logging.getLogger("p2p_diloco")

SPEC_HASH_CHARS = 16  # 64 bits: a second spec with the same hash costs ~2^64 sha256 evaluations

LIMITS: dict[str, float] = {
    "model.seq_len": 8192, "data.eval_batches": 1024, "averaging.part_size_bytes": 64 << 20,
    "averaging.centered_clip_iters": 100, "inner.lr": 0.01, "inner.weight_decay": 1.0, "diloco.outer_lr": 2.0}
"""The largest value of a size or rate a joiner takes from the DHT without the spec hash (memory, time, divergence);
a run above them gives its joiners its spec hash, or they set the value themselves."""

WEAKER: dict[str, Callable[[Any, Any], bool]] = {
    "averaging.aggregator": lambda ours, run: run == "mean" and ours != "mean",
    "averaging.verify_parts": lambda ours, run: ours and not run,
    "averaging.suspect_rounds": lambda ours, run: run < ours,
    "averaging.max_weight_ratio": lambda ours, run: run > ours,
    "averaging.max_share": lambda ours, run: run > ours,
    "averaging.clip_multiple": lambda ours, run: run > ours,
    "averaging.trim_fraction": lambda ours, run: run < ours,
    "inner.grad_clip": lambda ours, run: ours is not None and (run is None or run > ours)}
"""The defences, and when the run's value is weaker than this peer's own (the default where it set none): taken
from the DHT only with the spec hash."""

_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")


def spec_hash(settings: Mapping[str, Any]) -> str:
    """The run spec's hash: sha256 over the run settings as sorted JSON, its first 16 hex characters."""
    text = json.dumps(dict(settings), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:SPEC_HASH_CHARS]


def run_fingerprint(setup: str, cfg: Config) -> str:
    """The fingerprint in the run's DHT prefix: ``setup`` (model shape, wire codec, outer rule) and the whole spec."""
    return hashlib.sha256(f"{setup}|{spec_hash(shared_settings(cfg))}".encode()).hexdigest()[:12]


def first_difference(cfg: Config, run: dict[str, Any], given: Optional[set[str]]) -> Optional[str]:
    """One line naming the first run setting this peer set (``given``; None: all of them) to another value than
    the run's ``run`` settings, or None if they agree. Keys the run does not publish (an older peer's) are skipped."""
    mine = shared_settings(cfg)
    for key in shared_keys():
        if key in run and (given is None or key in given) and mine[key] != run[key]:
            return (f"{key}: this peer has {show_value(mine[key])}, run {cfg.run.run_id!r} has {_shown(run[key])} "
                    f"(published by its peers); drop the setting to adopt the run's value, or use another run.run_id")
    return None


def adopt_settings(cfg: Config, run: dict[str, Any]) -> tuple[Config, list[str]]:
    """A copy of ``cfg`` with every run setting taken from ``run``, and the keys whose value changed. A key this
    version does not know (a newer peer's setting) is skipped and reported as ``?key``."""
    adopted, changed = copy_config(cfg), []
    known = set(shared_keys())
    try:
        for key, value in run.items():
            if key not in known:
                changed.append(f"?{_shown(key, 40)}")
            elif shared_settings(adopted)[key] != value:
                set_value(adopted, key, value)
                changed.append(key)
        check_config(adopted)
    except ConfigError as e:
        raise ConfigError(f"{_shown(str(e), 300)} (published by the peers of run {cfg.run.run_id!r})") from None
    return adopted, changed


def refusals(cfg: Config, adopted: Config, changed: list[str]) -> list[str]:
    """What of ``adopted`` (``cfg`` completed by the run's settings, ``changed``: the keys taken) a peer without the
    spec hash must not take from the DHT, each as ``key=value (why)``; [] if none."""
    ours, run = shared_settings(cfg), shared_settings(adopted)
    out = []
    for key in changed:
        if key not in run:
            continue
        why = _reference(key, run[key])
        if why is None and key in WEAKER and WEAKER[key](ours[key], run[key]):
            why = f"weaker than this peer's {show_value(ours[key])}"
        if why is None and key in LIMITS and isinstance(run[key], (int, float)) and run[key] > LIMITS[key]:
            why = f"above the limit {LIMITS[key]:g} for settings from the DHT"
        if why is not None:
            out.append(f"{key}={_shown(run[key])} ({why})")
    return out


def _reference(key: str, value: Any) -> Optional[str]:
    """Why ``value`` of ``key`` names something to read or download that a joiner must choose itself, or None."""
    if key == "model.init_from":
        return None if value is None else "a checkpoint to load"
    if key not in ("model.name", "data.dataset", "data.tokenizer") or not isinstance(value, str):
        return None
    from p2p_diloco.train.data import OFFLINE_CORPORA
    from p2p_diloco.train.presets import PRESETS

    builtin = {"model.name": PRESETS, "data.dataset": OFFLINE_CORPORA, "data.tokenizer": ("byte", "auto")}[key]
    if value in builtin:
        return None
    if key == "model.name":
        return "a config file, not a preset"
    if _local(value):
        return "a local path"
    return None if _HUB_NAME.fullmatch(value) and ".." not in value else "neither built in nor a hub name"


def _local(value: str) -> bool:
    """Would the loaders read ``value`` from this machine's disk (data.py, tokenizers.py: an existing path first)?"""
    if value.startswith(("/", ".", "~")) or "\\" in value or value.count("/") > 1:
        return True
    try:
        return Path(value).expanduser().exists()
    except (OSError, ValueError):  # a name no file system holds
        return False


def _shown(value: Any, limit: int = 80) -> str:
    """A value read from the DHT as it may reach a terminal: control characters stripped, shortened."""
    from p2p_diloco.net.records import clean_text

    text = clean_text(show_value(value), 10 * limit)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def choose_settings(cfg: Config, published: list[dict], given: Optional[set[str]]) -> Optional[dict[str, Any]]:
    """The run's settings among the ``published`` entries: with ``run.spec_hash``, the ones that hash to it (None
    if no entry does); else the ones most entries publish among those that agree with every key this peer set
    (``given``; None: all), or among all if none agrees (then :func:`first_difference` names the difference)."""
    specs = [p["settings"] for p in published if isinstance(p, dict) and isinstance(p.get("settings"), dict)]
    if cfg.run.spec_hash is not None:
        return next((dict(s) for s in specs if spec_hash(s) == cfg.run.spec_hash), None)
    agreeing = [s for s in specs if first_difference(cfg, s, given) is None]
    return run_settings_of([{"settings": s} for s in agreeing or specs])


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
    them. Raises ConfigError (one line, exit code 2) on a mismatch, on settings a peer without the spec hash must not
    take from the DHT, or when a peer that expects the run finds none (or none of its spec hash)."""
    from p2p_diloco.net.keys import read_run_settings

    wanted = cfg.run.spec_hash
    wait = expects_run(cfg, given) or (wanted is not None and wanted != spec_hash(shared_settings(cfg)))
    deadline = time.monotonic() + cfg.network.join_timeout
    while True:
        published = read_run_settings(dht, cfg.run.run_id, cfg.averaging.request_timeout)
        run = choose_settings(cfg, published, given)
        if run is not None or not wait:
            break
        if time.monotonic() > deadline:
            raise ConfigError(_not_found(cfg, published))
        time.sleep(1.0)  # the settings live in the DHT: there is no event to wait on, so poll
    if run is None:
        log.info(f"run {cfg.run.run_id!r}: no peer publishes settings yet; starting it with ours")
        return _announced(cfg, log)
    problem = first_difference(cfg, run, given)
    if problem:
        raise ConfigError(problem)
    adopted, changed = adopt_settings(cfg, run)
    refused = [] if wanted is not None else refusals(cfg, adopted, changed)
    if refused:
        raise ConfigError(f"run {cfg.run.run_id!r}: its published settings hold what a peer takes from the DHT only "
                          f"with the run's spec hash (run.spec_hash, from 'run spec ...' in its first peer's log) or "
                          f"when it sets them itself: " + "; ".join(refused))
    if changed:
        log.info(f"run {cfg.run.run_id!r}: adopted its settings " + ", ".join(
            k if k.startswith("?") else f"{k}={_shown(shared_settings(adopted)[k])}" for k in changed)
                 + (" (?: unknown to this version, ignored)" if any(k.startswith("?") for k in changed) else "")
                 + (f" (spec {wanted}, as given)" if wanted else ""))
    else:
        log.info(f"run {cfg.run.run_id!r}: our settings are the run's")
    return _announced(adopted, log)


def _not_found(cfg: Config, published: list[dict]) -> str:
    within = f"within {cfg.network.join_timeout:.0f} s"
    if cfg.run.spec_hash is None:
        return (f"run.run_id: no peer of run {cfg.run.run_id!r} published its settings {within}; start the run with "
                f"its run config (--config)")
    others = sorted({spec_hash(p["settings"]) for p in published if isinstance(p.get("settings"), dict)})
    seen = f" (entries of {len(others)} other spec(s): {', '.join(others[:3])})" if others else ""
    return (f"run.spec_hash: no peer of run {cfg.run.run_id!r} published settings of spec {cfg.run.spec_hash} "
            f"{within}{seen}; check the hash and run.run_id")


def _announced(cfg: Config, log: logging.Logger) -> Config:
    digest = spec_hash(shared_settings(cfg))
    log.info(f"run {cfg.run.run_id!r}: run spec {digest} (a joiner given --run.spec_hash={digest} takes exactly these "
             f"settings, whatever else the DHT holds)")
    return cfg
