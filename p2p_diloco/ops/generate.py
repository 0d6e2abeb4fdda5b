"""``p2p-diloco generate``: sampled continuations of a prompt from θ_global (a run folder) or an exported folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from p2p_diloco.config import ConfigError
from p2p_diloco.errors import first_line, printable
from p2p_diloco.ops.export import INFO_FILE, hf_tokenizer, load_global, quiet_transformers

SAMPLE_TOKENS = 100
"""Length of the samples peers log (``run.sample_every``) and the swarm prints after a run."""


@dataclass
class Generator:
    """A causal LM with its tokenizer, and where it came from (for the header of the output)."""
    model: torch.nn.Module
    tokenizer: object
    source: str


def load_generator(path: str | os.PathLike, device: str = "cpu") -> Generator:
    """θ_global of the latest checkpoint of a run folder (a peer's or a swarm's), or an exported Hugging Face
    folder (recognized by its config.json). ConfigError (one line) if ``path`` is neither."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"not found: {path}")
    if (path / "config.json").is_file():
        return _load_exported(path, device)
    loaded = load_global(path)
    tokenizer = hf_tokenizer(loaded.cfg, loaded.model.config.max_position_embeddings)
    return Generator(loaded.model.to(device), tokenizer, f"θ_global of round {loaded.round} ({loaded.source})")


def _load_exported(path: Path, device: str) -> Generator:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(path)).to(device).eval()
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a loadable Hugging Face folder: {first_line(e)}") from None
    info = json.loads((path / INFO_FILE).read_text()) if (path / INFO_FILE).is_file() else {}
    return Generator(model, tokenizer, f"{path}" + (f" (round {info['round']})" if "round" in info else ""))


def run_generate(path: str | os.PathLike, prompt: str, samples: int, max_new_tokens: int, temperature: float,
                 top_k: int, seed: int, device: str = "cpu", echo=print) -> None:
    """``p2p-diloco generate``: a header naming the model, then every sample (prompt included), terminal-safe."""
    from p2p_diloco.train.inner import resolve_device

    gen = load_generator(path, resolve_device(device))
    texts = sample(gen, prompt, samples, max_new_tokens, temperature, top_k, seed)
    echo(f"{gen.source}; temperature {temperature}, top-k {top_k}, seed {seed}")
    for i, text in enumerate(texts, 1):
        echo(f"--- sample {i}\n{printable(prompt + text)}")


@torch.no_grad()
def sample(gen: Generator, prompt: str, samples: int = 3, max_new_tokens: int = 100, temperature: float = 0.8,
           top_k: int = 50, seed: int = 0) -> list[str]:
    """``samples`` continuations of ``prompt`` (the prompt not repeated), drawn with ``seed``: the same call gives
    the same text on the same machine. Bounded by the model's context length."""
    from transformers import GenerationConfig

    ids = gen.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] == 0:
        raise ConfigError("--prompt: must not be empty")
    context = getattr(gen.model.config, "max_position_embeddings", None) or ids.shape[1] + max_new_tokens
    ids = ids[:, -max(1, context - max_new_tokens):].to(gen.model.device)  # keep the prompt's end if too long
    tok = gen.tokenizer
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k,
                              max_new_tokens=min(max_new_tokens, context - ids.shape[1]),
                              num_return_sequences=samples, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                              pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0))
    device = gen.model.device
    was_training = gen.model.training
    gen.model.eval()
    # seeded without disturbing the caller's RNG streams (a training peer's dropout, its data order)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), quiet_transformers():
        torch.manual_seed(seed)
        try:
            out = gen.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        finally:
            gen.model.train(was_training)
    return [tok.decode(seq[ids.shape[1]:], skip_special_tokens=True) for seq in out]
