"""``p2p-diloco export``: θ_global as a Hugging Face folder that ``transformers`` loads as it is.

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (written by transformers'
``save_pretrained``, through the safetensors library), the tokenizer's files, and ``p2p_diloco.json`` (run, round,
and the sha256 of θ_global's bytes: the same value every peer logged for that round).

The byte tokenizer has no file of its own: it is exported as a byte-level ``tokenizers`` tokenizer whose ids are
the UTF-8 byte values (:func:`byte_level_tokenizer`), so ``AutoTokenizer.from_pretrained`` encodes and decodes
exactly as training did. Other tokenizers are saved by transformers itself.

Where θ_global comes from: the newest ``checkpoint.pt`` in a peer's run folder or in any peer folder of a swarm's
run folder; for an earlier round (``--round``), a peer's own exports, ``run_dir/exports/round-NNNNNN``, written every
``run.export_every`` rounds (a checkpoint holds only its latest round).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.config import Config, ConfigError, config_from_dict
from p2p_diloco.errors import first_line
from p2p_diloco.ops.checkpoint import CHECKPOINT_NAME, read_checkpoint

EXPORTS_DIR = "exports"
INFO_FILE = "p2p_diloco.json"


@dataclass
class GlobalModel:
    """θ_global of one round, loaded into the model its run trains."""
    model: torch.nn.Module
    cfg: Config
    round: int
    source: Path


def export_path(run_dir: str | os.PathLike, round_: int) -> Path:
    return Path(run_dir) / EXPORTS_DIR / f"round-{round_:06d}"


# ---------------------------------------------------------------------------------------------- tokenizers

def byte_level_tokenizer(model_max_length: int):
    """Our 256-symbol byte tokenizer as a transformers fast tokenizer: id = UTF-8 byte value, no special tokens.

    Built from the ``tokenizers`` library's byte-level pieces (the GPT-2 scheme): the byte-level pre-tokenizer
    turns every byte into one printable character, the BPE model, with no merges, maps that character to the
    byte's value, and the byte-level decoder turns ids back into bytes and decodes them as UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_chars().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length)


def _byte_chars() -> dict[int, str]:
    """byte -> the printable character that stands for it in byte-level vocabularies (the GPT-2 table): bytes that
    are printable Latin-1 characters stand for themselves, the others take the code points from 256 on, in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def hf_tokenizer(cfg: Config, model_max_length: int):
    """The run's tokenizer (``data.tokenizer``; 'auto' is model.init_from's or the byte tokenizer) as a
    transformers tokenizer; ConfigError if it cannot be loaded."""
    from p2p_diloco.train.tokenizers import tokenizer_source

    name = tokenizer_source(cfg.data.tokenizer, cfg.model.init_from)
    if name == "byte":
        return byte_level_tokenizer(model_max_length)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: cannot load '{name}': {first_line(e)}") from None


# ---------------------------------------------------------------------------------------------- writing

def save_hf_folder(model: torch.nn.Module, cfg: Config, out: str | os.PathLike, info: Optional[dict] = None,
                   tokenizer=None) -> Path:
    """``model`` (holding θ_global) and the run's tokenizer as a Hugging Face folder at ``out``, written to a
    temporary folder first and renamed, so a crash never leaves half a folder; an existing ``out`` is replaced."""
    from p2p_diloco.train.outer import params_digest

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    max_length = getattr(model.config, "max_position_embeddings", None) or cfg.model.seq_len
    tokenizer = tokenizer if tokenizer is not None else hf_tokenizer(cfg, max_length)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with _special_tokens_of(model, tokenizer), quiet_transformers():
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    info = {"run_id": cfg.run.run_id, "global_params_sha256": params_digest(model.parameters()), **(info or {})}
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


@contextlib.contextmanager
def _special_tokens_of(model, tokenizer):
    """Write the tokenizer's BOS/EOS/PAD ids into the saved configs (none for the byte tokenizer, whose 256 ids are
    all bytes: the Llama defaults 1 and 2 would make generation stop at byte 0x02), leaving the model as it was."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}
    targets = [model.config] + ([model.generation_config] if getattr(model, "generation_config", None) else [])
    saved = [{k: getattr(t, k, None) for k in ids} for t in targets]
    try:
        for t in targets:
            for k, v in ids.items():
                setattr(t, k, v)
        yield
    finally:
        for t, old in zip(targets, saved):
            for k, v in old.items():
                setattr(t, k, v)


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars or advisory warnings from transformers while we save or load."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------- reading runs

def checkpoint_paths(run_dir: str | os.PathLike) -> list[Path]:
    """A peer's checkpoint, or every peer's of a swarm's run folder (one level down)."""
    run_dir = Path(run_dir)
    return sorted(p for p in [run_dir / CHECKPOINT_NAME, *run_dir.glob(f"*/{CHECKPOINT_NAME}")] if p.is_file())


def export_folders(run_dir: str | os.PathLike) -> dict[int, Path]:
    """round -> a folder written by ``run.export_every`` (the run's own, or any of its peers')."""
    run_dir = Path(run_dir)
    found = {}
    for folder in sorted([*run_dir.glob(f"{EXPORTS_DIR}/round-*"), *run_dir.glob(f"*/{EXPORTS_DIR}/round-*")]):
        try:
            found.setdefault(int(folder.name.split("-", 1)[1]), folder)
        except ValueError:
            continue
    return found


def prune_exports(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete this peer's own export folders (``run_dir/exports/round-*``) but the newest ``keep``; returns those
    deleted, oldest first. ``keep`` 0 keeps them all; a name that is not ``round-<int>`` is never touched."""
    if keep <= 0:
        return []
    own = {}
    for folder in Path(run_dir).glob(f"{EXPORTS_DIR}/round-*"):
        try:
            own[int(folder.name.split("-", 1)[1])] = folder
        except ValueError:
            continue
    old = [own[r] for r in sorted(own)[:-keep]]
    for folder in old:
        shutil.rmtree(folder, ignore_errors=True)
    return old


def _read_checkpoint(path: Path) -> dict:
    # mmap: reading the round does not load the AdamW state of a large model into memory
    return read_checkpoint(path, mmap=True)


def checkpoints_by_round(run_dir: str | os.PathLike) -> dict[int, tuple[Path, dict]]:
    """round -> (path, contents) of the checkpoints in ``run_dir`` (a peer's, or a swarm's peers'); peers that
    committed the same round hold the same θ_global, so one checkpoint per round is enough."""
    found: dict[int, tuple[Path, dict]] = {}
    for path in checkpoint_paths(run_dir):
        saved = _read_checkpoint(path)
        found.setdefault(int(saved["round"]), (path, saved))
    return found


def load_global(run_dir: str | os.PathLike) -> GlobalModel:
    """θ_global of the latest checkpoint in ``run_dir``, in the model its config builds (fp32, CPU, eval mode)."""
    checkpoints = checkpoints_by_round(run_dir)
    if not checkpoints:
        raise ConfigError(f"no checkpoint in {run_dir} (nor in its peer folders): not a run folder, or no round "
                          f"saved yet")
    return _global_model(*checkpoints[max(checkpoints)])


def _global_model(path: Path, saved: dict) -> GlobalModel:
    from p2p_diloco.train.model import build_model
    from p2p_diloco.train.outer import load_into
    from p2p_diloco.train.tokenizers import load_tokenizer

    try:
        cfg = config_from_dict(saved["config"])
    except ConfigError as e:  # a checkpoint of another version of this program
        raise ConfigError(f"{path}: its config does not load here: {e}") from None
    with quiet_transformers():
        vocab = load_tokenizer(cfg.data.tokenizer, cfg.model.init_from).vocab_size
        model = build_model(cfg.model, vocab, cfg.run.seed)
    params = saved["global_params"]
    if [tuple(p.shape) for p in model.parameters()] != [tuple(p.shape) for p in params]:
        raise ConfigError(f"{path}: θ_global does not fit the model its config builds")
    load_into(model.parameters(), params)
    return GlobalModel(model.eval(), cfg, int(saved["round"]), path)


# ---------------------------------------------------------------------------------------------- the command

def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, round_: Optional[int] = None) -> tuple[int, Path]:
    """Write θ_global of the latest round saved in ``run_dir`` (or of round ``round_``) to ``out``, from a
    checkpoint or a peer's export; returns (round, out). ConfigError (one line) for a missing run folder, nothing
    saved, an unknown round, or an ``out`` that is not empty."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ConfigError(f"run folder not found: {run_dir}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder")
    checkpoints, exports = checkpoints_by_round(run_dir), export_folders(run_dir)
    if not checkpoints and not exports:
        raise ConfigError(f"no checkpoint or export in {run_dir} (nor in its peer folders)")
    round_ = max({*checkpoints, *exports}) if round_ is None else round_
    if round_ in checkpoints:
        loaded = _global_model(*checkpoints[round_])
        save_hf_folder(loaded.model, loaded.cfg, out, info={"round": loaded.round, "source": str(loaded.source)})
    elif round_ in exports:
        shutil.copytree(exports[round_], out, dirs_exist_ok=True)
    else:
        have = ", ".join(str(r) for r in sorted({*checkpoints, *exports}))
        raise ConfigError(f"round {round_} not available in {run_dir} (saved rounds: {have}); a checkpoint holds "
                          f"only its latest round: keep earlier ones with run.export_every")
    return round_, out
