"""The config sections: every key of a run with its type, default, unit, help text and check."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Optional

from p2p_diloco.config.fields import AUTO, FloatOrAuto, _f, _non_negative, _positive


@dataclass
class ModelConfig:
    """The causal language model every peer of a run trains (identical on all peers)."""
    name: str = _f("tiny", "preset (tiny, small, 60m, 150m, 400m, 1b, 3b) or a path to a Hugging Face config.json "
                   "or its folder",
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
    loss_chunk: int = _f(0, "compute the training loss over chunks of this many token positions, recomputing each "
                         "chunk's logits in the backward, so that the fp32 logits of a whole micro-batch (about "
                         "seq_len x vocabulary x 6 bytes per sequence) never exist at once; 1024 is a good value. 0: "
                         "the model's own loss (with run.compile: head and loss compiled as one function, which keeps "
                         "no fp32 logits either). A per-machine choice: results equal up to rounding",
                         "tokens", _non_negative, "must be >= 0")


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
                                "benchmarks/gpu.md 5.3)", "threads", _positive, "must be > 0")


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
    optimizer_state: str = _f("fp32", "the inner AdamW's moments: fp32 (8 bytes per parameter) or 8bit (torchao's "
                              "AdamW8bit, block-wise quantized: 2 bytes per parameter; needs the torchao package). A "
                              "per-machine choice: members of one run may differ", choices=("fp32", "8bit"),
                              check=lambda state: state != "8bit" or _installed("torchao"),
                              rule="8bit needs the torchao package: pip install 'p2p-diloco[adamw8bit]' (or torchao)")
    offload: bool = _f(False, "keep the inner AdamW's moments, an fp32 master copy of the parameters and the "
                       "gradient sums in host memory and run its update on the CPU: the GPU keeps the fp32 "
                       "parameters and the activations only (a 3B model on a 24 GB card; 16 bytes per parameter of "
                       "host memory, 10 with 8-bit moments). Slower steps: raise inner.grad_accum to spread the update. A "
                       "per-machine choice; one-process peers only")
    shard: bool = _f(False, "a peer of several processes (--nproc-per-node K) shards the parameters, gradients "
                     "and inner AdamW state over its K GPUs (FSDP2) instead of holding K full replicas (DDP): each "
                     "GPU holds 1/K of 16 bytes per parameter (10 with 8-bit moments); rank 0 keeps θ_local's full "
                     "values in host memory. Not with inner.offload. "
                     "A per-machine choice; no effect on a one-process peer (train/shard.py)")
    lr_clock: str = _f("steps", "what the lr schedule's step counts: 'steps': this peer's own inner steps (measured "
                       "better with DyLU: benchmarks/heterogeneous.md 6.2); 'rounds': the run's progress, round x "
                       "H plus the share of this round's steps done, so every peer is at the same point of the "
                       "schedule whatever its speed", choices=("rounds", "steps"), shared=True)


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
                               "and H (0.5 for every M and H measured, benchmarks/learning-quality.md 7.3), resolved "
                               "at start and published with the run's settings", "", lambda x: x == AUTO or x > 0,
                               "must be > 0 or 'auto'", shared=True)
    outer_momentum: FloatOrAuto = _f(AUTO, "β: outer momentum; 'auto': auto_outer's (0.5; "
                                     "benchmarks/learning-quality.md 7.3: the papers' 0.9, tuned over hundreds of "
                                     "rounds, ended 9-32 % above it at 20 rounds)", "",
                                     lambda x: x == AUTO or 0 <= x < 1, "must be in [0, 1) or 'auto'", shared=True)
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
    overlap_steps: int = _f(0, "with overlap delayed: settle the all-reduce in flight after this many inner steps "
                            "of the next round (tau of Streaming DiLoCo; a peer whose average has not arrived by "
                            "then waits for it there) instead of at that round's end; 0: at the round's end",
                            "inner steps", _non_negative, "must be >= 0", shared=True)


@dataclass
class AveragingConfig:
    """The fault-tolerant all-reduce. Every wait is bounded by one of the timeouts below."""
    codec: str = _f("scaled_fp16", "wire format of pseudo-gradients: scaled_fp16 and fp16 send 16 bits per value, "
                    "int8 8.125 and int4 or e3m0 4.5 (one fp32 scale per block of 256 or 64 values)",
                    choices=("scaled_fp16", "fp16", "fp32", "int8", "int4", "e3m0"), shared=True)
    min_group_size: int = _f(2, "fewest peers (this one included) a round needs to commit; alone, a peer keeps "
                             "training and retries next round", "peers", _positive, "must be > 0", shared=True)
    target_group_size: int = _f(64, "the group the first round gathers when run.expected_peers is not set; later "
                                "rounds gather every live peer (a run larger than this is not split: two groups "
                                "of one round could not both commit)", "peers", _positive, "must be > 0",
                                shared=True)
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
    aggregator: str = _f("mean", "how a reducer combines the members' copies of a part: mean (weighted by tokens), "
                         "or a robust rule bounding what a malicious member can do to the average: clipped_mean "
                         "(each copy clipped to clip_multiple x the median norm), centered_clip (CenteredClip from "
                         "there, centered_clip_iters times) or trimmed_mean (per value, the trim_fraction largest and "
                         "smallest dropped). Robust rules hold every member's copy of a part at once (group size x "
                         "part size of memory per reducer; see benchmarks/robustness.md 9.1)",
                         choices=("mean", "clipped_mean", "centered_clip", "trimmed_mean"), shared=True)
    clip_multiple: float = _f(2.0, "clipped_mean, centered_clip: τ, the clipping radius as a multiple of the median "
                              "norm (of the copies, or of their distances to the center)", "x", _positive,
                              "must be > 0", shared=True)
    centered_clip_iters: int = _f(3, "centered_clip: iterations from the clipped mean", "iterations", _positive,
                                  "must be > 0", shared=True)
    trim_fraction: float = _f(0.25, "trimmed_mean: share of the members whose values are dropped at each end, per "
                              "value (at least one value is kept)", "fraction", lambda x: 0 <= x < 0.5,
                              "must be in [0, 0.5)", shared=True)
    max_weight_ratio: float = _f(8.0, "a member's weight in the average is at most this x the median member's "
                                 "(a member claiming more tokens than it can have trained is bounded)", "x",
                                 lambda x: x >= 1, "must be >= 1", shared=True)
    suspect_rounds: int = _f(5, "a member a reducer names for a malformed contribution (NaN/Inf, a wrong shape or "
                             "weight) is left out of the average for this many rounds by every member that saw it "
                             "(doubled at each repeat); 0: never left out, each attempt fails one round",
                             "rounds", _non_negative, "must be >= 0", shared=True)
    verify_parts: bool = _f(True, "reducer checks: before committing a round, every member compares the sha256 of "
                            "the averaged parts it received from each reducer with every other member's; a reducer "
                            "that sent different bytes to different members fails the round and is named (cost: "
                            "benchmarks/robustness.md 9.3)", shared=True)
    survive_losses: bool = _f(True, "when a member dies before its group's all-reduce completes, the members left "
                              "run it again at once among themselves (same round, their quorum permitting) instead "
                              "of failing the round (net/averaging/survive.py)", shared=True)
    max_share: float = _f(2.0, "most of the vector one member reduces, as a multiple of an equal share (1 / the "
                          "members that can reduce): a declared bandwidth cannot get it more (up to one part more, "
                          "from part boundaries); 1: equal shares", "x equal share", lambda x: x >= 1,
                          "must be >= 1", shared=True)


def _readable_secret(path: str) -> bool:
    """A secret file must be readable and non-empty: raises ConfigError with the reason (one line)."""
    from p2p_diloco.net.security.access import read_secret

    read_secret(None, path)
    return True


def _ed25519_peer_ids(peers: list) -> bool:
    from p2p_diloco.net.security.access import ed25519_public_key

    return all(isinstance(p, str) and ed25519_public_key(p) is not None for p in peers)


@dataclass
class NetworkConfig:
    """How this node reaches the swarm. Names mirror hivemind.DHT's arguments."""
    initial_peers: list[str] = _f([], "multiaddrs of any live node of the run (bootstrap or peer); several are "
                                  "safer; empty starts a new swarm")
    host_maddrs: list[str] = _f(["/ip4/0.0.0.0/tcp/0"], "multiaddrs to listen on (public peers: a fixed port, "
                                "e.g. /ip4/0.0.0.0/tcp/31337)")
    announce_maddrs: list[str] = _f([], "public multiaddrs to advertise (behind port forwarding or a cloud NAT)")
    identity_path: Optional[str] = _f(None, "private key file giving a stable peer id (created if missing, Ed25519; "
                                            "RSA files as hivemind writes them work too); none: a fresh key")
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
    secret: Optional[str] = _f(None, "the private run's shared secret: only nodes holding it can use the DHT, join "
                               "a group, send parts or download state (README: Private and open runs); visible in "
                               "'ps': prefer secret_file. None (and no secret_file): an open run, anyone who can "
                               "reach a peer may join")
    secret_file: Optional[str] = _f(None, "file holding the secret (surrounding whitespace ignored); read at start "
                                    "and again with every roster heartbeat, so that a new secret written to it "
                                    "replaces the old one without a restart", check=_readable_secret)
    revokers: list[str] = _f([], "a private run's revokers: Ed25519 peer ids (12D3KooW..., e.g. the bootstrap "
                             "node's, which it prints) one of which must sign a revocation ('p2p-diloco revoke' "
                             "signs with network.identity_path); every member and bootstrap must be given the same "
                             "list. Empty: no revocation is taken (a member cannot revoke the others either)",
                             check=_ed25519_peer_ids, rule="expected Ed25519 peer ids (12D3KooW...)")


@dataclass
class RunConfig:
    """Identity of the run and of this peer, length, logging and checkpoints."""
    run_id: str = _f("p2p-diloco", "name shared by all peers of one training run (peers of other runs ignore it)",
                     shared=True)
    name: Optional[str] = _f(None, "this peer's name in logs and metrics; None: hostname-pid")
    spec_hash: Optional[str] = _f(None, "the run's spec hash (16 hex characters, printed by its first peer: 'run "
                                  "spec ...'): join only the run whose published settings hash to it, adopting them "
                                  "whatever other DHT nodes publish; None: adopt what most peers publish, except "
                                  "local paths, model.init_from, weaker defences and values above the limits of "
                                  "net/run_settings.py",
                                  check=lambda h: len(h) == 16 and not h.strip("0123456789abcdef"),
                                  rule="must be 16 lowercase hex characters (the run's log: 'run spec ...')")
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
    export_keep: int = _f(0, "keep only the newest K of those folders (older ones are deleted after each export, so "
                          "a peer that runs for weeks keeps a bounded run folder); 0: keep them all", "folders",
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
                               "of inner, matchmaking, sending, allreduce, checks, serving, download; ROUND 0: the "
                               "first round that reaches PHASE (ops/faults.py)",
                               check=_valid_fault,
                               rule="expected ACTION:PHASE:ROUND, e.g. kill:allreduce:3")
    slowdown: float = _f(1.0, "stretch every inner step by this factor, sleeping (F - 1) x its compute time after "
                         "it, so a peer behaves like a slower machine (heterogeneity tests and benchmarks)", "x",
                         lambda x: x >= 1, "must be >= 1")
    attack: Optional[str] = _f(None, "make this member attack the run (security tests and benchmarks/robust.py): "
                               "nan (NaN in its contribution), shape (a part of the wrong size), weight (a weight "
                               "1000 x its tokens), flip (its pseudo-gradient x -1000), random (a random direction at "
                               "1000 x its norm), stale (the pseudo-gradient of 5 rounds ago), equivocate (as a "
                               "reducer, different averaged bytes to different peers), frame (as a reducer, refuse another "
                               "member's well-formed part as malformed), skew_reduce (as a reducer, serve everyone "
                               "-10 x the true average); None: an honest member",
                               choices=("nan", "shape", "weight", "flip", "random", "stale", "equivocate", "frame",
                                        "skew_reduce"))
    attack_from: int = _f(1, "the first round fault.attack strikes in", "round", _positive, "must be > 0")


@dataclass
class MetricsConfig:
    """This peer's Prometheus endpoint (ops/telemetry.py; the metrics: docs/guides/monitoring.md): off by default."""
    port: int = _f(0, "serve this peer's metrics in the Prometheus text format at http://HOST:PORT/metrics; 0: off",
                   "", lambda p: 0 <= p <= 65535, "must be a TCP port, 1 to 65535, or 0 (off)")
    host: str = _f("127.0.0.1", "address the metrics endpoint listens on: 127.0.0.1 serves this machine only, "
                   "0.0.0.0 every interface (the endpoint has no authentication)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)
