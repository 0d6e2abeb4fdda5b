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
       choices: tuple = (), shared: bool = False) -> Any:
    """A config field with its documentation and validation attached as metadata.

    ``shared``: a run setting, which every peer of a run must hold equal (published in the DHT; a joiner adopts the
    run's value or is refused, see :func:`first_difference`); otherwise a setting of this machine alone. A new field
    that changes what peers compute together (the model, the data, the math of a round) must be ``shared=True``.
    """
    meta = {"help": help, "unit": unit, "check": check, "rule": rule, "choices": choices, "shared": shared}
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
    name: str = _f("tiny", "preset (tiny, 60m, 150m, 400m, 1b) or a path to a Hugging Face config.json or its folder",
                   shared=True)
    seq_len: int = _f(128, "sequence length of a training sample", "tokens", _positive, "must be > 0", shared=True)
    init_from: Optional[str] = _f(None, "start from a pretrained Hugging Face checkpoint: a local folder (saved with "
                                  "save_pretrained; offline) or a hub name (downloaded once into the Hugging Face "
                                  "cache); its weights are θ_global at round 0 on every peer, its architecture "
                                  "replaces model.name, and data.tokenizer='auto' takes its tokenizer. A run-wide "
                                  "setting: peers check before round 1 that they start from the same bytes",
                                  shared=True)
    gradient_checkpointing: bool = _f(False, "recompute each layer's activations in the backward pass instead of "
                                      "keeping them: about a third more compute for much less memory (larger "
                                      "micro-batches; see peers/*.toml). A per-machine choice: results are the same")


@dataclass
class DataConfig:
    """Where token batches come from. Each peer reads its own order, derived from its name and the seed."""
    dataset: str = _f("embedded", "'embedded' (1 MB offline corpus built from Python's own docs), 'stdlib' (10 MB: "
                      "the docs and the standard library's source), a local .txt/.json/.jsonl/.parquet file or "
                      "folder, or a Hugging Face hub dataset name", shared=True)
    dataset_config: Optional[str] = _f(None, "hub dataset configuration (subset) name, e.g. 'en' for allenai/c4",
                                       shared=True)
    split: str = _f("train", "dataset split to train on", shared=True)
    text_field: str = _f("text", "name of the text column", shared=True)
    streaming: bool = _f(True, "stream hub datasets instead of downloading them whole (local files: see "
                          "stream_files)")
    tokenizer: str = _f("auto", "'byte' (256-symbol byte-level tokenizer), a Hugging Face tokenizer name or path, or "
                        "'auto': model.init_from's own tokenizer when that is set, else 'byte'", shared=True)
    eval_fraction: float = _f(0.02, "share of the data held out for evaluation (local data; hub streams hold out "
                              "their first documents)", "fraction", lambda x: 0 < x < 0.5, "must be in (0, 0.5)",
                              shared=True)
    eval_batches: int = _f(4, "batches in one held-out evaluation", "batches", _positive, "must be > 0", shared=True)
    seed: int = _f(0, "seed mixed with the peer name to pick each peer's data order", shared=True)
    stream_files: bool = _f(False, "read a local file or folder through the same streamed reader as hub datasets "
                            "(shuffle buffer, packed documents) instead of loading it whole: for local corpora larger "
                            "than memory, e.g. hub files downloaded beforehand on an offline machine")
    prefetch_batches: int = _f(8, "batches of streamed data tokenized ahead on a background thread, so tokenizing "
                               "overlaps the inner steps; 0: tokenize in the training loop", "batches",
                               _non_negative, "must be >= 0")
    tokenizer_threads: int = _f(1, "threads tokenizing streamed documents (Hugging Face tokenizers release the GIL, "
                                "so each uses a core); raise it when one core cannot keep up with the GPU (see "
                                "BENCHMARKS.md)", "threads", _positive, "must be > 0")


@dataclass
class InnerConfig:
    """The local AdamW loop (inner steps). Defaults follow the DiLoCo paper (Table 5)."""
    lr: float = _f(4e-4, "peak AdamW learning rate", "", _positive, "must be > 0", shared=True)
    weight_decay: float = _f(0.1, "AdamW weight decay", "", _non_negative, "must be >= 0", shared=True)
    beta1: float = _f(0.9, "AdamW beta1", "", lambda x: 0 <= x < 1, "must be in [0, 1)", shared=True)
    beta2: float = _f(0.95, "AdamW beta2", "", lambda x: 0 <= x < 1, "must be in [0, 1)", shared=True)
    warmup_steps: int = _f(1000, "linear learning-rate warm-up", "inner steps", _non_negative, "must be >= 0",
                           shared=True)
    cosine_steps: Optional[int] = _f(None, "inner steps over which the lr decays by cosine after warm-up; None: "
                                     "run.rounds x diloco.inner_steps, or constant if rounds is None",
                                     "inner steps", _positive, "must be > 0", shared=True)
    min_lr_ratio: float = _f(0.1, "floor of the cosine decay, as a share of lr", "fraction",
                             lambda x: 0 <= x <= 1, "must be in [0, 1]", shared=True)
    batch_size: int = _f(8, "sequences per micro-batch", "sequences", _positive, "must be > 0")
    grad_accum: int = _f(1, "micro-batches accumulated per inner step", "micro-batches", _positive, "must be > 0")
    grad_clip: Optional[float] = _f(1.0, "clip the inner gradient to this global norm; None: no clipping", "",
                                    _positive, "must be > 0", shared=True)
    lr_clock: str = _f("steps", "what the lr schedule's step counts: 'steps': this peer's own inner steps (measured "
                       "better with DyLU: BENCHMARKS.md section 9); 'rounds': the run's progress, round x H plus the "
                       "share of this round's steps done, so every peer is at the same point of the schedule whatever "
                       "its speed", choices=("rounds", "steps"), shared=True)


@dataclass
class DiLoCoConfig:
    """The outer loop: H inner steps, then an all-reduce of pseudo-gradients and an outer step on θ_global."""
    inner_steps: int = _f(500, "H: inner steps between two all-reduces", "inner steps", _positive, "must be > 0",
                          shared=True)
    outer_optimizer: str = _f("nesterov", "outer update rule applied to the averaged pseudo-gradient; "
                              "delayed_nesterov: Delayed Nesterov (Asynchronous Local-SGD, Alg. 3), for runs whose "
                              "rounds mix contributions of different staleness", choices=("nesterov", "sgd",
                                                                                         "delayed_nesterov"),
                              shared=True)
    outer_lr: FloatOrAuto = _f(AUTO, "ε: outer learning rate; 'auto': train/outer.py auto_outer of run.expected_peers "
                               "and H (0.5 for every M and H measured, BENCHMARKS.md §10), resolved at start and "
                               "published with the run's settings", "", lambda x: x == AUTO or x > 0,
                               "must be > 0 or 'auto'", shared=True)
    outer_momentum: FloatOrAuto = _f(AUTO, "β: outer momentum; 'auto': auto_outer's (0.5; BENCHMARKS.md §10: the "
                                     "papers' 0.9, tuned over hundreds of rounds, ended 9-32 % above it at 20 "
                                     "rounds)", "", lambda x: x == AUTO or 0 <= x < 1, "must be in [0, 1) or 'auto'",
                                     shared=True)
    weight_by_tokens: bool = _f(True, "weight each peer's pseudo-gradient by the tokens it processed (else equally)",
                                shared=True)
    dylu: bool = _f(True, "Dynamic Local Updates: the fastest live peer runs inner_steps (H) per round, every other "
                    "peer floor(its speed / the fastest's x H), so rounds end together; speeds are measured and "
                    "published in the roster (equal peers: every peer runs about H)", shared=True)
    min_inner_steps: int = _f(1, "fewest inner steps a peer runs in a round under DyLU (also bounds what a peer "
                              "publishing an absurd speed can do to the others)", "inner steps", _positive,
                              "must be > 0", shared=True)
    max_staleness: int = _f(4, "a peer that fetches the run's state because it fell behind keeps (rebases onto the "
                            "new θ_global) the local work it did since its last commit if that work began at most "
                            "this many rounds before the run's round; older work is dropped; 0: always drop",
                            "rounds", _non_negative, "must be >= 0", shared=True)
    dn_delay: Optional[int] = _f(None, "N of Delayed Nesterov: contributions per momentum update; set it to the "
                                 "number of peers you expect in a round (required with delayed_nesterov)",
                                 "contributions", _positive, "must be > 0", shared=True)
    dn_c: float = _f(0.0, "c of Delayed Nesterov, in [0, 1/N]: share of the momentum applied at every arrival "
                     "(0: only at momentum updates)", "", _non_negative, "must be >= 0", shared=True)
    overlap: str = _f("none", "hide a round's all-reduce behind the next round's inner steps: its average is "
                      "committed one round late; delayed: θ_local keeps the work not yet averaged; eager: θ_local "
                      "starts from the outer step with our fresh contribution in place of our stale one (arXiv "
                      "2502.12996)", choices=("none", "delayed", "eager"), shared=True)


@dataclass
class AveragingConfig:
    """The fault-tolerant all-reduce. Every wait is bounded by one of the timeouts below."""
    codec: str = _f("scaled_fp16", "wire format of pseudo-gradients: scaled_fp16 and fp16 send 16 bits per value, "
                    "int8 8.125 and int4 or e3m0 4.5 (one fp32 scale per block of 256 or 64 values)",
                    choices=("scaled_fp16", "fp16", "fp32", "int8", "int4", "e3m0"), shared=True)
    min_group_size: int = _f(2, "fewest peers (this one included) a round needs to commit; alone, a peer keeps "
                             "training and retries next round", "peers", _positive, "must be > 0", shared=True)
    target_group_size: int = _f(64, "most peers averaged in one group", "peers", _positive, "must be > 0", shared=True)
    matchmaking_time: float = _f(10.0, "how long to gather a group before an all-reduce; raise on slow or busy "
                                 "links", "s", _positive, "must be > 0")
    allreduce_timeout: float = _f(120.0, "whole all-reduce, after the group formed; raise for large models on "
                                  "slow links (about 4 x payload / bandwidth)", "s", _positive, "must be > 0")
    next_chunk_timeout: float = _f(30.0, "longest silence from a peer while streaming a part before it is "
                                   "declared dead", "s", _positive, "must be > 0")
    request_timeout: float = _f(5.0, "one DHT or matchmaking request; keep below matchmaking_time", "s",
                                _positive, "must be > 0")
    part_size_bytes: int = _f(2 ** 19, "streaming chunk of a part", "bytes", _positive, "must be > 0", shared=True)
    state_timeout: float = _f(120.0, "one donor's whole state transfer to a joining or repairing peer, before the "
                              "next donor is tried; raise for large models on slow links", "s", _positive,
                              "must be > 0")
    state_attempts: int = _f(3, "donors tried before a state download gives up (it is retried next round)",
                             "donors", _positive, "must be > 0")
    roster_ttl: float = _f(30.0, "how long a peer's roster entry outlives its last heartbeat; a dead peer stops "
                           "counting after this", "s", _positive, "must be > 0")
    average_codec: Optional[str] = _f(None, "wire format of the averages reducers send back; None: codec",
                                      choices=("scaled_fp16", "fp16", "fp32", "int8", "int4", "e3m0"), shared=True)
    error_feedback: bool = _f(False, "add what the codec lost of this peer's last committed contribution to its "
                              "next one (local state, checkpointed; one more copy of the model in memory)")


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
    reachability: str = _f("auto", "can others dial this node? auto: ask peers to dial it back (p2pd's AutoNAT), "
                           "then take part as a public node, through a relay, or in client mode; public: skip the "
                           "check (a bootstrap node also serves as a relay); private: behind NAT, skip the check",
                           choices=("auto", "public", "private"))
    trusted_relays: list[str] = _f([], "multiaddrs of relays to reserve a slot at when others cannot dial this node "
                                   "(a p2p-diloco bootstrap node on a public host is one); empty: the initial peers",
                                   check=lambda maddrs: all(m.startswith("/") and "/p2p/" in m for m in maddrs),
                                   rule="expected multiaddrs with a peer id, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
    reachability_timeout: float = _f(40.0, "how long reachability=auto waits for AutoNAT's verdict (p2pd asks "
                                     "peers to dial back 15 s after start)", "s", _positive, "must be > 0")
    relay_data_limit: int = _f(1 << 32, "a relayed connection through this node is reset after carrying this many "
                               "bytes each way (a round in flight then fails); raise it on a bootstrap node relaying "
                               "big models", "bytes", _positive, "must be > 0")
    relay_time_limit: float = _f(1800.0, "a relayed connection through this node is reset after this long (a round "
                                 "in flight then fails); raise it for rounds longer than a few minutes", "s",
                                 _positive, "must be > 0")


@dataclass
class RunConfig:
    """Identity of the run and of this peer, length, logging and checkpoints."""
    run_id: str = _f("p2p-diloco", "name shared by all peers of one training run (peers of other runs ignore it)",
                     shared=True)
    name: Optional[str] = _f(None, "this peer's name in logs and metrics; None: hostname-pid")
    run_dir: str = _f("runs/default", "folder for metrics.jsonl and checkpoints of this peer")
    rounds: Optional[int] = _f(None, "rounds (outer steps) to train; None: until stopped", "rounds",
                               _positive, "must be > 0", shared=True)
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
    seed: int = _f(0, "seed of the initial θ_global (must match across peers) and of dropout", shared=True)
    compile: bool = _f(False, "torch.compile the model (the first inner step then takes minutes; later ones are "
                       "faster, mostly on GPUs); a per-machine choice")
    peak_tflops: Optional[float] = _f(None, "peak dense bf16 TFLOPS of one device, for the MFU in the metrics; "
                                      "None: known GPUs are looked up by name (train/flops.py), others get no MFU",
                                      "TFLOPS", _positive, "must be > 0")
    rank_timeout: float = _f(3600.0, "multi-GPU peers (torchrun): longest wait of one process for another of the "
                             "same peer; ranks > 0 wait for rank 0 while it averages or fetches state, so keep it "
                             "above those waits. A rank that dies is noticed at once, not after this", "s",
                             _positive, "must be > 0")
    export_every: int = _f(0, "write θ_global as a Hugging Face folder to run_dir/exports/round-NNNNNN every K "
                           "committed rounds (kept: 'p2p-diloco export --round' reads them); 0: never", "rounds",
                           _non_negative, "must be >= 0")
    sample_every: int = _f(0, "log a short text sample of θ_global (run.sample_prompt continued by 100 tokens, seed "
                           "0) as a metrics record every K committed rounds; 0: never", "rounds", _non_negative,
                           "must be >= 0")
    sample_prompt: str = _f("The ", "the prompt of those samples")
    tensorboard: bool = _f(False, "also write metrics as TensorBoard event files to run_dir/tensorboard",
                           check=lambda on: not on or _installed("tensorboard"),
                           rule="needs the tensorboard package: pip install 'p2p-diloco[tensorboard]'")
    wandb_project: Optional[str] = _f(None, "also log metrics to this Weights & Biases project (files under "
                                      "run_dir/wandb); None: off", check=lambda _: _installed("wandb"),
                                      rule="needs the wandb package: pip install 'p2p-diloco[wandb]'")
    wandb_mode: str = _f("offline", "W&B mode: offline writes locally and never touches the network (upload "
                         "later with 'wandb sync'); online streams to the W&B server", choices=("offline", "online"))


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (optional extras are checked on load)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


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
    inject: Optional[str] = _f(None, "'kill:PHASE:ROUND', 'stall:PHASE:ROUND' (SIGSTOP), 'term:PHASE:ROUND' (a "
                               "graceful stop) or 'hold:PHASE:ROUND' (wait until run_dir/hold is removed), PHASE one "
                               "of inner, matchmaking, allreduce, serving",
                               check=_valid_fault,
                               rule="expected ACTION:PHASE:ROUND, e.g. kill:allreduce:3")
    slowdown: float = _f(1.0, "stretch every inner step by this factor, sleeping (F - 1) x its compute time after "
                         "it, so a peer behaves like a slower machine (heterogeneity tests and benchmarks)", "x",
                         lambda x: x >= 1, "must be >= 1")


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
    if meta.get("choices") and coerced is not None and coerced not in meta["choices"]:
        raise ConfigError(f"{dotted}: expected one of {', '.join(meta['choices'])}, got {coerced!r}")
    if meta.get("check") is not None and coerced is not None and not meta["check"](coerced):
        raise ConfigError(f"{dotted}: {meta['rule']}, got {coerced!r}")
    setattr(section, key, coerced)


# ---------------------------------------------------------------------------------------------- public API

def load_config(path: Optional[str | Path | list] = None, overrides: Optional[dict[str, str]] = None,
                defaults: Optional[dict[str, Any]] = None, given: Optional[set[str]] = None) -> Config:
    """Field defaults, then typed ``defaults`` (a subcommand's own), then the TOML file(s) at ``path`` (a later file
    wins over an earlier one), then ``overrides`` (strings from the command line): each layer wins over the ones
    before it. ``given``, if passed, receives the dotted keys that the files and overrides set."""
    cfg = Config()
    for dotted, value in (defaults or {}).items():
        _set(cfg, dotted, value, from_text=False)
    paths = [] if path is None else list(path) if isinstance(path, (list, tuple)) else [path]
    for one in paths:
        for dotted, value in _read_toml(Path(one)):
            _set(cfg, dotted, value, from_text=False)
            if given is not None:
                given.add(dotted)
    for dotted, value in (overrides or {}).items():
        _set(cfg, dotted, value, from_text=True)
        if given is not None:
            given.add(dotted)
    _check_consistency(cfg)
    return cfg


def _read_toml(path: Path) -> list[tuple[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    items = []
    for section_name, section in data.items():
        if not isinstance(section, dict):
            raise ConfigError(f"unknown config key '{section_name}' (put keys under a [section])"
                              if section_name not in SECTIONS else f"{section_name}: expected a table")
        items += [(f"{section_name}.{key}", value) for key, value in section.items()]
    return items


def _check_consistency(cfg: Config) -> None:
    if cfg.averaging.min_group_size > cfg.averaging.target_group_size:
        raise ConfigError("averaging.min_group_size: must not exceed averaging.target_group_size")
    if cfg.averaging.request_timeout >= cfg.averaging.matchmaking_time:
        raise ConfigError("averaging.request_timeout: must be below averaging.matchmaking_time")
    d = cfg.diloco
    if d.min_inner_steps > d.inner_steps:
        raise ConfigError("diloco.min_inner_steps: must not exceed diloco.inner_steps")
    if d.outer_optimizer == "delayed_nesterov" and d.dn_delay is None:
        raise ConfigError("diloco.dn_delay: required with diloco.outer_optimizer=delayed_nesterov (the number of "
                          "peers you expect in a round)")
    if d.overlap == "eager" and d.outer_optimizer not in ("nesterov", "sgd"):
        raise ConfigError(f"diloco.overlap: eager needs an outer step linear in the average (nesterov or sgd), not "
                          f"diloco.outer_optimizer={d.outer_optimizer}")
    if d.dn_delay is not None and d.dn_c > 1 / d.dn_delay:
        raise ConfigError(f"diloco.dn_c: must be in [0, 1/dn_delay] = [0, {1 / d.dn_delay:g}], got {d.dn_c!r}")


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
    """Every key with its type, default (a subcommand's own ``defaults`` included), unit, whether it is a run setting
    (shared by every peer of a run; the others are machine settings) and help, for ``--help``."""
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
            scope = "  run setting" if f.metadata.get("shared") else ""
            lines.append(f"  --{section_name}.{f.name}={_show(default)}  ({_type_name(hints[f.name])}){unit}{scope}")
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


# ---------------------------------------------------------------------------------------------- run vs machine

def shared_keys() -> list[str]:
    """Dotted keys of every run setting (``shared`` fields), in section and field order."""
    return [f"{name}.{f.name}" for name, tp in SECTIONS.items() for f in dataclasses.fields(tp)
            if f.metadata.get("shared")]


def shared_settings(cfg: Config) -> dict[str, Any]:
    """The run settings of ``cfg``: what every peer of the run must hold equal (JSON-able values)."""
    return {key: _get(cfg, key) for key in shared_keys()}


def _get(cfg: Config, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    value = getattr(getattr(cfg, section), key)
    return list(value) if isinstance(value, list) else value


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set one key of ``cfg`` from a typed value (as from TOML), validated as on load."""
    _set(cfg, dotted, value, from_text=False)


def copy_config(cfg: Config) -> Config:
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name)) for name in SECTIONS})


def check_config(cfg: Config) -> None:
    """The checks across keys that :func:`load_config` makes (after changing a loaded config)."""
    _check_consistency(cfg)


def show_value(value: Any) -> str:
    return _show(value)


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


def config_from_dict(data: dict) -> Config:
    """The inverse of :meth:`Config.to_dict` (e.g. the config saved in a checkpoint), validated like a file."""
    flat = {f"{section}.{key}": value for section, values in data.items() for key, value in values.items()}
    return load_config(defaults=flat)
