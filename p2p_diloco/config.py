"""Typed run configuration: sections loaded from TOML, overridden by ``--section.key=value``.

Every field carries a help text and, where it has one, a unit; ``describe()`` renders them for ``--help``.
Unknown keys and ill-typed or out-of-range values raise :class:`ConfigError` naming the key, which the CLI turns
into a one-line message and exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


AUTO = "auto"
FloatOrAuto = Union[float, Literal["auto"]]
"""The type of a field whose value is a float, or "auto": derived from the run's other settings at start."""


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and fits on one line."""


def _f(default: Any, help: str, unit: str = "", check: Optional[Callable[[Any], bool]] = None, rule: str = "",
       choices: tuple = ()) -> Any:
    """A config field with its documentation and validation attached as metadata."""
    meta = {"help": help, "unit": unit, "check": check, "rule": rule, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _positive(x) -> bool:
    return x is None or x > 0


def _non_negative(x) -> bool:
    return x is None or x >= 0


@dataclass
class ModelConfig:
    """The causal language model every peer of a run trains (identical on all peers)."""
    name: str = _f("tiny", "preset (tiny, 60m, 150m, 400m, 1b) or a path to a Hugging Face config.json or its folder")
    seq_len: int = _f(128, "sequence length of a training sample", "tokens", _positive, "must be > 0")


@dataclass
class DataConfig:
    """Where token batches come from. Each peer reads its own order, derived from its name and the seed."""
    dataset: str = _f("embedded", "'embedded' (1 MB offline corpus built from Python's own docs), 'stdlib' (10 MB: "
                      "the docs and the standard library's source), a local .txt/.json/.jsonl/.parquet file or "
                      "folder, or a Hugging Face hub dataset name")
    dataset_config: Optional[str] = _f(None, "hub dataset configuration (subset) name, e.g. 'en' for allenai/c4")
    split: str = _f("train", "dataset split to train on")
    text_field: str = _f("text", "name of the text column")
    streaming: bool = _f(True, "stream hub datasets instead of downloading them whole (local files are never streamed)")
    tokenizer: str = _f("byte", "'byte' (256-symbol byte-level tokenizer) or a Hugging Face tokenizer name or path")
    eval_fraction: float = _f(0.02, "share of the data held out for evaluation (local data; hub streams hold out "
                              "their first documents)", "fraction", lambda x: 0 < x < 0.5, "must be in (0, 0.5)")
    eval_batches: int = _f(4, "batches in one held-out evaluation", "batches", _positive, "must be > 0")
    seed: int = _f(0, "seed mixed with the peer name to pick each peer's data order")


@dataclass
class InnerConfig:
    """The local AdamW loop (inner steps). Defaults follow the DiLoCo paper (Table 5)."""
    lr: float = _f(4e-4, "peak AdamW learning rate", "", _positive, "must be > 0")
    weight_decay: float = _f(0.1, "AdamW weight decay", "", _non_negative, "must be >= 0")
    beta1: float = _f(0.9, "AdamW beta1", "", lambda x: 0 <= x < 1, "must be in [0, 1)")
    beta2: float = _f(0.95, "AdamW beta2", "", lambda x: 0 <= x < 1, "must be in [0, 1)")
    warmup_steps: int = _f(1000, "linear learning-rate warm-up", "inner steps", _non_negative, "must be >= 0")
    cosine_steps: Optional[int] = _f(None, "inner steps over which the lr decays by cosine after warm-up; None: "
                                     "run.rounds x diloco.inner_steps, or constant if rounds is None",
                                     "inner steps", _positive, "must be > 0")
    min_lr_ratio: float = _f(0.1, "floor of the cosine decay, as a share of lr", "fraction",
                             lambda x: 0 <= x <= 1, "must be in [0, 1]")
    batch_size: int = _f(8, "sequences per micro-batch", "sequences", _positive, "must be > 0")
    grad_accum: int = _f(1, "micro-batches accumulated per inner step", "micro-batches", _positive, "must be > 0")
    grad_clip: Optional[float] = _f(1.0, "clip the inner gradient to this global norm; None: no clipping", "",
                                    _positive, "must be > 0")


@dataclass
class DiLoCoConfig:
    """The outer loop: H inner steps, then an all-reduce of pseudo-gradients and an outer step on θ_global."""
    inner_steps: int = _f(500, "H: inner steps between two all-reduces", "inner steps", _positive, "must be > 0")
    outer_optimizer: str = _f("nesterov", "outer update rule applied to the averaged pseudo-gradient",
                              choices=("nesterov", "sgd"))
    outer_lr: float = _f(0.7, "ε: outer learning rate", "", _positive, "must be > 0")
    outer_momentum: float = _f(0.9, "β: outer momentum", "", lambda x: 0 <= x < 1, "must be in [0, 1)")
    weight_by_tokens: bool = _f(True, "weight each peer's pseudo-gradient by the tokens it processed (else equally)")


@dataclass
class AveragingConfig:
    """The fault-tolerant all-reduce. Every wait is bounded by one of the timeouts below."""
    codec: str = _f("scaled_fp16", "wire format of pseudo-gradients (scaled_fp16 and fp16 send 16 bits per value)",
                    choices=("scaled_fp16", "fp16", "fp32"))
    min_group_size: int = _f(2, "fewest peers (this one included) a round needs to commit; alone, a peer keeps "
                             "training and retries next round", "peers", _positive, "must be > 0")
    target_group_size: int = _f(64, "most peers averaged in one group", "peers", _positive, "must be > 0")
    matchmaking_time: float = _f(10.0, "how long to gather a group before an all-reduce; raise on slow or busy "
                                 "links", "s", _positive, "must be > 0")
    allreduce_timeout: float = _f(120.0, "whole all-reduce, after the group formed; raise for large models on "
                                  "slow links (about 4 x payload / bandwidth)", "s", _positive, "must be > 0")
    next_chunk_timeout: float = _f(30.0, "longest silence from a peer while streaming a part before it is "
                                   "declared dead", "s", _positive, "must be > 0")
    request_timeout: float = _f(5.0, "one DHT or matchmaking request; keep below matchmaking_time", "s",
                                _positive, "must be > 0")
    part_size_bytes: int = _f(2 ** 19, "streaming chunk of a part", "bytes", _positive, "must be > 0")
    state_timeout: float = _f(120.0, "one donor's whole state transfer to a joining or repairing peer, before the "
                              "next donor is tried; raise for large models on slow links", "s", _positive,
                              "must be > 0")
    state_attempts: int = _f(3, "donors tried before a state download gives up (it is retried next round)",
                             "donors", _positive, "must be > 0")
    roster_ttl: float = _f(30.0, "how long a peer's roster entry outlives its last heartbeat; a dead peer stops "
                           "counting after this", "s", _positive, "must be > 0")


@dataclass
class NetworkConfig:
    """How this node reaches the swarm. Names mirror hivemind.DHT's arguments."""
    initial_peers: list[str] = _f([], "multiaddrs of any live node of the run (bootstrap or peer); several are "
                                  "safer; empty starts a new swarm")
    host_maddrs: list[str] = _f(["/ip4/0.0.0.0/tcp/0"], "multiaddrs to listen on (public peers: a fixed port, "
                                "e.g. /ip4/0.0.0.0/tcp/31337)")
    announce_maddrs: list[str] = _f([], "public multiaddrs to advertise (behind port forwarding or a cloud NAT)")
    identity_path: Optional[str] = _f(None, "private key file giving a stable peer id (created if missing)")
    client_mode: bool = _f(False, "dial out only (behind NAT); needs at least one public peer in the group")
    join_timeout: float = _f(30.0, "how long to wait for an initial peer to answer before giving up", "s",
                             _positive, "must be > 0")


@dataclass
class RunConfig:
    """Identity of the run and of this peer, length, logging and checkpoints."""
    run_id: str = _f("p2p-diloco", "name shared by all peers of one training run (peers of other runs ignore it)")
    name: Optional[str] = _f(None, "this peer's name in logs and metrics; None: hostname-pid")
    run_dir: str = _f("runs/default", "folder for metrics.jsonl and checkpoints of this peer")
    rounds: Optional[int] = _f(None, "rounds (outer steps) to train; None: until stopped", "rounds",
                               _positive, "must be > 0")
    eval_every: int = _f(1, "evaluate θ_global on held-out data every K rounds; 0: never", "rounds",
                         _non_negative, "must be >= 0")
    checkpoint_every: int = _f(1, "save a checkpoint every K rounds; 0: never", "rounds", _non_negative,
                               "must be >= 0")
    device: str = _f("auto", "'auto' (cuda if present), 'cpu', 'cuda' or 'cuda:N'")
    threads: Optional[int] = _f(None, "torch CPU threads; None: torch's default", "threads", _positive,
                                "must be > 0")
    progress: bool = _f(True, "show a progress bar for inner steps")
    expected_peers: int = _f(1, "before round 1, wait until this many peers (this one included) are in the run",
                             "peers", _positive, "must be > 0")
    expected_peers_timeout: float = _f(300.0, "give up waiting for expected_peers after this long and start",
                                       "s", _positive, "must be > 0")
    join_after_round: Optional[int] = _f(None, "stay out of the run (not in the roster, not averaging) until it "
                                         "reaches this round, then join it; the local swarm uses it to time joins",
                                         "rounds", _positive, "must be > 0")
    seed: int = _f(0, "seed of the initial θ_global (must match across peers) and of dropout")


def _valid_fault(text) -> bool:
    from p2p_diloco.ops.faults import parse_fault

    try:
        parse_fault(text, main_pid=0)
        return True
    except ValueError:
        return False


@dataclass
class FaultConfig:
    """Testing only: make this peer fail on purpose (see p2p_diloco/ops/faults.py)."""
    inject: Optional[str] = _f(None, "'kill:PHASE:ROUND' or 'stall:PHASE:ROUND', PHASE one of inner, matchmaking, "
                               "allreduce, serving", check=_valid_fault,
                               rule="expected ACTION:PHASE:ROUND, e.g. kill:allreduce:3")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    run: RunConfig = field(default_factory=RunConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


# ---------------------------------------------------------------------------------------------- value coercion

def _unwrap_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_name(tp) -> str:
    if tp == FloatOrAuto:
        return "float or 'auto'"
    base, optional = _unwrap_optional(tp)
    name = "list of strings" if typing.get_origin(base) is list else getattr(base, "__name__", str(base))
    return f"{name} or none" if optional else name


def _coerce(key: str, tp, value, from_text: bool):
    """Convert ``value`` (TOML-typed, or a string from the command line) to ``tp``; raise ConfigError otherwise."""
    base, optional = _unwrap_optional(tp)
    if isinstance(value, str) and optional and value.strip().lower() in ("none", "null", ""):
        return None  # TOML has no null: "none" stands for it in files too
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got none")
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if base == FloatOrAuto:
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        base = float
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if base is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(base) is list:
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad
    raise bad  # pragma: no cover - every field type is handled above


def _set(cfg: Config, dotted: str, value, from_text: bool) -> None:
    section_name, _, key = dotted.partition(".")
    if section_name not in SECTIONS or not key:
        raise ConfigError(f"unknown config key '{dotted}' (sections: {', '.join(SECTIONS)})")
    section = getattr(cfg, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"unknown config key '{dotted}' (keys of [{section_name}]: {', '.join(fields)})")
    f = fields[key]
    tp = typing.get_type_hints(type(section))[key]
    coerced = _coerce(dotted, tp, value, from_text)
    meta = f.metadata
    if meta.get("choices") and coerced not in meta["choices"]:
        raise ConfigError(f"{dotted}: expected one of {', '.join(meta['choices'])}, got {coerced!r}")
    if meta.get("check") is not None and coerced is not None and not meta["check"](coerced):
        raise ConfigError(f"{dotted}: {meta['rule']}, got {coerced!r}")
    setattr(section, key, coerced)


# ---------------------------------------------------------------------------------------------- public API

def load_config(path: Optional[str | Path] = None, overrides: Optional[dict[str, str]] = None,
                defaults: Optional[dict[str, Any]] = None) -> Config:
    """Field defaults, then typed ``defaults`` (a subcommand's own), then the TOML file at ``path``, then
    ``overrides`` (strings from the command line): each layer wins over the ones before it."""
    cfg = Config()
    for dotted, value in (defaults or {}).items():
        _set(cfg, dotted, value, from_text=False)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section_name, section in data.items():
            if not isinstance(section, dict):
                raise ConfigError(f"unknown config key '{section_name}' (put keys under a [section])"
                                  if section_name not in SECTIONS else f"{section_name}: expected a table")
            for key, value in section.items():
                _set(cfg, f"{section_name}.{key}", value, from_text=False)
    for dotted, value in (overrides or {}).items():
        _set(cfg, dotted, value, from_text=True)
    _check_consistency(cfg)
    return cfg


def _check_consistency(cfg: Config) -> None:
    if cfg.averaging.min_group_size > cfg.averaging.target_group_size:
        raise ConfigError("averaging.min_group_size: must not exceed averaging.target_group_size")
    if cfg.averaging.request_timeout >= cfg.averaging.matchmaking_time:
        raise ConfigError("averaging.request_timeout: must be below averaging.matchmaking_time")


def parse_overrides(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split ``--section.key=value`` / ``--section.key value`` from other arguments."""
    overrides: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            name, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(f"{name}: missing value")
                i += 1
                value = args[i]
            overrides[name.replace("-", "_")] = value
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


def describe(sections: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None) -> str:
    """Every key with its type, default (a subcommand's own ``defaults`` included), unit and help, for ``--help``."""
    lines = []
    defaults = load_config(defaults=defaults)
    for section_name, section_type in SECTIONS.items():
        if sections is not None and section_name not in sections:
            continue
        lines.append(f"[{section_name}]  {section_type.__doc__.strip()}")
        hints = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            default = getattr(getattr(defaults, section_name), f.name)
            unit = f" [{f.metadata['unit']}]" if f.metadata.get("unit") else ""
            choices = f" (one of: {', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else ""
            lines.append(f"  --{section_name}.{f.name}={_show(default)}  ({_type_name(hints[f.name])}){unit}")
            lines.append(f"      {f.metadata['help']}{choices}")
    return "\n".join(lines)


def _show(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def dump_toml(cfg: Config) -> str:
    """The whole config as TOML that :func:`load_config` reads back to an equal Config (None is written "none")."""
    lines = []
    for section_name in SECTIONS:
        lines.append(f"[{section_name}]")
        for key, value in dataclasses.asdict(getattr(cfg, section_name)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a valid TOML basic string
