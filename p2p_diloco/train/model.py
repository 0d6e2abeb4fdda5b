"""Build the causal language model every peer trains: from a preset or a local Hugging Face config (never
downloads), or from a pretrained checkpoint's weights (``model.init_from``: a local folder, or a hub name downloaded
once into the Hugging Face cache).

Every peer must start from bit-identical θ_global, so :func:`build_model` is a pure function of
``(cfg, vocab_size, seed)``: it seeds a forked torch RNG, builds the model in fp32 on the CPU, and leaves the
caller's global RNG state untouched; a checkpoint is read as fp32 whatever its stored dtype (an exact conversion
from bf16 or fp16). :func:`model_fingerprint` lets peers check that they train the same model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from p2p_diloco.config import ConfigError, ModelConfig
from p2p_diloco.errors import first_line
from p2p_diloco.train.presets import PRESETS

DEFAULT_VOCAB_SIZE = 32000
"""Vocabulary of the DiLoCo paper's models (Table 1); presets take the tokenizer's size instead when given one."""


def preset_config(name: str, vocab_size: int = DEFAULT_VOCAB_SIZE, seq_len: int = 0) -> LlamaConfig:
    """The LlamaConfig of preset ``name``; ``max_position_embeddings`` is raised to ``seq_len`` (tokens) if needed."""
    kwargs = dict(PRESETS[name], vocab_size=vocab_size)
    kwargs["max_position_embeddings"] = max(kwargs["max_position_embeddings"], seq_len)
    return LlamaConfig(**kwargs)


def load_model_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """Resolve ``cfg.name`` to a transformers config, reading local files only.

    Raises ConfigError naming model.name when it is neither a preset nor an existing path, when the file's
    vocabulary is smaller than the tokenizer's ``vocab_size``, or when it cannot hold ``cfg.seq_len`` positions.
    """
    if cfg.name in PRESETS:
        return preset_config(cfg.name, vocab_size, cfg.seq_len)
    path = Path(cfg.name).expanduser()
    if not path.exists():
        raise ConfigError(f"model.name: no preset or config file '{cfg.name}' (presets: {', '.join(PRESETS)})")
    model_config = _read_hf_config(path, cfg.name)
    _check_hf_config(model_config, cfg, vocab_size)
    return model_config


def _read_hf_config(path: Path, name: str) -> PretrainedConfig:
    if path.is_file():
        return _config_from_json(path, name)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.name: cannot read a Hugging Face config from '{name}': {first_line(e)}") from None


def _config_from_json(path: Path, name: str) -> PretrainedConfig:
    """A config.json file (any file name): dispatch on its ``model_type`` like AutoConfig does."""
    try:
        data = json.loads(path.read_text())
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model.name: cannot read a Hugging Face config from '{name}': {first_line(e)}") from None


def _check_hf_config(model_config: PretrainedConfig, cfg: ModelConfig, vocab_size: int,
                     key: str = "model.name") -> None:
    source = cfg.init_from if key == "model.init_from" else cfg.name
    model_vocab = getattr(model_config, "vocab_size", None)
    if model_vocab is not None and model_vocab < vocab_size:
        raise ConfigError(f"{key}: '{source}' has vocab_size {model_vocab}, smaller than the tokenizer's "
                          f"{vocab_size} (see data.tokenizer)")
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and max_pos < cfg.seq_len:
        raise ConfigError(f"{key}: '{source}' has max_position_embeddings {max_pos} < model.seq_len "
                          f"{cfg.seq_len}")



def _dtype_kwarg() -> str:
    # transformers 5 renamed from_config's torch_dtype to dtype (the old name still works there, with a warning)
    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A freshly initialized fp32 causal LM on the CPU, bit-identical for equal ``(cfg, vocab_size, seed)``.

    ``vocab_size`` is the tokenizer's size (presets use it as is; HF configs must be at least as large).
    The global torch RNG state is the same after the call as before it. Raises ConfigError naming model.name.
    With ``cfg.init_from`` set, the checkpoint's weights instead (:func:`load_pretrained`); ``seed`` is unused.
    """
    if cfg.init_from is not None:
        return load_pretrained(cfg, vocab_size)
    model_config = load_model_config(cfg, vocab_size)
    # fork_rng: the result must not depend on RNG draws made by other code, nor disturb them
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa",
                                                 **{_dtype_kwarg(): torch.float32})
    return model


def load_pretrained(cfg: ModelConfig, vocab_size: int) -> PreTrainedModel:
    """The causal LM saved at ``cfg.init_from`` (a local folder, or a hub name: downloaded once into the Hugging Face
    cache; with ``HF_HUB_OFFLINE=1`` only the cache is read), in fp32 on the CPU, with SDPA attention.

    Raises ConfigError naming model.init_from when it cannot be loaded, when its vocabulary is smaller than the
    tokenizer's ``vocab_size``, or when it cannot hold ``cfg.seq_len`` positions."""
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, attn_implementation="sdpa",
                                                     **{_dtype_kwarg(): torch.float32})
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.init_from: cannot load '{cfg.init_from}': {first_line(e)}") from None
    _check_hf_config(model.config, cfg, vocab_size, key="model.init_from")
    return model


def model_fingerprint(model: PreTrainedModel) -> str:
    """16 hex characters identifying the architecture: config (sorted JSON) plus every parameter's name,
    shape and dtype. Independent of the weights' values and of the transformers version and file location."""
    config = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "_commit_hash", "_attn_implementation_autoset"):
        config.pop(volatile, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        h.update(f"\n{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


def weights_digest(model: torch.nn.Module) -> str:
    """16 hex characters of sha256 over every parameter's name and raw bytes: equal iff the weights are bit-identical.

    Why: seeded initialization is deterministic per machine, but CPU random kernels may differ between CPU
    families (e.g. vectorized normal sampling), so peers should compare this digest before their first round.
    Cost: one pass over the weights (a few seconds for 1B parameters).
    """
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter values (tied weights count once)."""
    return sum(p.numel() for p in model.parameters())
