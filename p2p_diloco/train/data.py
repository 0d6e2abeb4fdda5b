"""Token batches for the inner loop: the offline corpora, local files, or Hugging Face hub datasets.

Every peer reads its own order of the same data, derived from ``(data.seed, peer name)`` by a stable hash, and
evaluates on the same held-out batches. Two readers implement :class:`TokenBatches`:

- :class:`WindowBatches` (offline corpora, local files, non-streamed hub data): the whole token stream is in memory;
  each batch is ``batch_size`` random windows of the training region. The held-out region is the stream's tail
  (offline corpora) or its last documents (files).
- :class:`StreamBatches` (streamed hub data, and local files with ``data.stream_files``): documents are shuffled
  through a buffer, tokenized and packed into consecutive windows, ahead of the training loop on a background thread
  (:mod:`p2p_diloco.train.prefetch`). The held-out documents are the stream's first ones and are skipped by training.

Both resume exactly from :meth:`TokenBatches.state_dict`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from p2p_diloco.config import ConfigError, DataConfig
from p2p_diloco.errors import first_line
from p2p_diloco.train.corpus import embedded_corpus, embedded_documents, stdlib_documents  # noqa: F401  (re-exported)
from p2p_diloco.train.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer  # noqa: F401

LOCAL_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""File extension -> ``datasets`` packaged builder for local data."""

OFFLINE_CORPORA = {"embedded": embedded_documents, "stdlib": stdlib_documents}
"""``data.dataset`` names of the corpora built from the Python installation (train/corpus.py): name -> documents."""

COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
"""Compression suffixes ``datasets`` decompresses on the fly (hub corpora such as allenai/c4 ship ``.json.gz``)."""

STREAM_SHUFFLE_BUFFER = 10_000
"""Documents held in the shuffle buffer of a streamed dataset (memory: this many documents)."""

ENCODE_CHUNK = 64
"""Documents of a stream tokenized in one go (split over ``data.tokenizer_threads``)."""


# ---------------------------------------------------------------------------------------------- batch readers

def peer_seed(seed: int, peer_name: str) -> int:
    """A stable 63-bit seed for ``peer_name``'s data order (sha256, unlike Python's per-process salted hash())."""
    digest = hashlib.sha256(f"{seed}\0{peer_name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2 ** 63 - 1)


class TokenBatches:
    """An endless reader of ``[batch_size, seq_len]`` int64 token batches, resumable from :meth:`state_dict`."""

    def __init__(self, seq_len: int, batch_size: int):
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.batches = 0  # batches returned so far

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one batch (``batch_size * seq_len``)."""
        return self.batch_size * self.seq_len

    def next_batch(self) -> torch.Tensor:
        """The next LongTensor ``[batch_size, seq_len]`` on the CPU."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything needed to continue with exactly the same batches (small; holds tensors, use torch.save)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the reader holds in the background (a prefetch thread); it can still be read after."""


class WindowBatches(TokenBatches):
    """Random windows of an in-memory token stream, drawn by a torch.Generator seeded from the peer's seed.

    ``tokens`` is the training region only (1-D int32); a window never crosses its end, so it never touches the
    held-out data. Note torch's CPU generator uses only the low 32 bits of the seed.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        super().__init__(seq_len, batch_size)
        if tokens.numel() < seq_len:
            raise ConfigError(f"data.dataset: {tokens.numel()} training tokens, fewer than model.seq_len {seq_len}")
        self.tokens = tokens
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len)

    def next_batch(self) -> torch.Tensor:
        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (self.batch_size,),
                               generator=self.generator)
        self.batches += 1
        return self.tokens[starts[:, None] + self._offsets].long()

    def state_dict(self) -> dict:
        return {"kind": "windows", "batches": self.batches, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "windows")
        self.batches = int(state["batches"])
        self.generator.set_state(state["generator"])


class StreamBatches(TokenBatches):
    """Consecutive windows of documents packed end to end from a shuffled ``datasets.IterableDataset``.

    Documents whose text hash is in ``held_out`` (the evaluation documents) are skipped. When the stream ends, the
    next epoch starts with a different shuffle. Position = (epoch, index of the current document in the shuffled
    epoch, tokens of it already used); resuming re-reads and discards the documents before it (network cost
    proportional to the documents consumed in this epoch).
    """

    def __init__(self, dataset, text_field: str, tokenizer: Tokenizer, seq_len: int, batch_size: int, seed: int,
                 held_out: frozenset[bytes] = frozenset(), buffer_size: int = STREAM_SHUFFLE_BUFFER,
                 tokenizer_threads: int = 1):
        super().__init__(seq_len, batch_size)
        self.dataset, self.text_field, self.tokenizer = dataset, text_field, tokenizer
        self.seed, self.held_out, self.buffer_size = seed, held_out, buffer_size
        self.tokenizer_threads = tokenizer_threads
        self._pool: Optional[ThreadPoolExecutor] = None
        self._position = (0, 0, 0)  # (epoch, document index, token offset) of the next unused token
        self._current: Optional[list] = None  # [epoch, index, tokens, offset] of a partly used document
        self._documents: Optional[Iterator[tuple[int, int, np.ndarray]]] = None

    def next_batch(self) -> torch.Tensor:
        batch = np.stack([self._take(self.seq_len) for _ in range(self.batch_size)])
        self.batches += 1
        return torch.from_numpy(batch).long()

    def state_dict(self) -> dict:
        epoch, index, offset = self._where()
        return {"kind": "stream", "batches": self.batches, "epoch": epoch, "docs": index, "offset": offset}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "stream")
        self.batches = int(state["batches"])
        self._position = (int(state["epoch"]), int(state["docs"]), int(state["offset"]))
        self._current, self._documents = None, None

    def _where(self) -> tuple[int, int, int]:
        if self._current is not None:
            epoch, index, _, offset = self._current
            return epoch, index, offset
        return self._position

    def _take(self, n: int) -> np.ndarray:
        parts = []
        while n > 0:
            if self._current is None:
                self._current = self._next_document()
            epoch, index, tokens, offset = self._current
            part = tokens[offset:offset + n]
            parts.append(part)
            n -= len(part)
            self._current[3] = offset + len(part)
            if self._current[3] == len(tokens):
                self._position, self._current = (epoch, index + 1, 0), None
        return np.concatenate(parts)

    def _next_document(self) -> list:
        if self._documents is None:
            epoch, index, offset = self._position
            self._documents = self._read(epoch, index)
            epoch, index, tokens = next(self._documents)
            # the resume offset applies only to the document the state pointed at
            return [epoch, index, tokens, offset if (epoch, index) == self._position[:2] else 0]
        epoch, index, tokens = next(self._documents)
        return [epoch, index, tokens, 0]

    def _read(self, epoch: int, skip: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(epoch, index in epoch, tokens) of every non-empty training document, from document ``skip`` on.

        Documents are tokenized ``ENCODE_CHUNK`` at a time, split over ``tokenizer_threads`` threads (the Rust
        tokenizer releases the GIL, so they run on as many cores); the order is kept."""
        texts = self._texts(epoch, skip)
        while chunk := list(itertools.islice(texts, ENCODE_CHUNK)):
            for (epoch, index, _), tokens in zip(chunk, self._encode([text for _, _, text in chunk])):
                yield epoch, index, tokens

    def _texts(self, epoch: int, skip: int) -> Iterator[tuple[int, int, str]]:
        """(epoch, index in epoch, text) of every non-empty training document, from document ``skip`` on."""
        while True:
            stream = self.dataset.shuffle(seed=self.seed, buffer_size=self.buffer_size)
            stream.set_epoch(epoch)  # a new shuffle every epoch
            found = False
            # islice, not IterableDataset.skip: a skipped stream of several shards does not keep the shuffle of
            # set_epoch (datasets 5.2: epochs >= 1 resumed in another order)
            for index, example in enumerate(itertools.islice(stream, skip, None), start=skip):
                text = _text_of(example, self.text_field)
                if text and _doc_hash(text) not in self.held_out:
                    found = True
                    yield epoch, index, text
            if not found and skip == 0:
                raise ConfigError("data.dataset: the stream has no training documents besides the held-out ones")
            epoch, skip = epoch + 1, 0

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.tokenizer_threads == 1:
            return self.tokenizer.encode_each(texts)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.tokenizer_threads, thread_name_prefix="tokenize")
        step = -(-len(texts) // self.tokenizer_threads)
        parts = self._pool.map(self.tokenizer.encode_each, [texts[i:i + step] for i in range(0, len(texts), step)])
        return [tokens for part in parts for tokens in part]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _check_kind(state: dict, kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"data state is for a {state.get('kind')!r} reader, this one is {kind!r}")


def _text_of(example: dict, text_field: str) -> Optional[str]:
    if text_field not in example:
        raise ConfigError(f"data.text_field: no column '{text_field}' (columns: {', '.join(sorted(example))})")
    return example[text_field]


def _doc_hash(text: str) -> bytes:
    return hashlib.sha1(text.encode("utf-8")).digest()


# ---------------------------------------------------------------------------------------------- building

@dataclass
class Data:
    """One peer's data: its training reader, the shared held-out batches, and the tokenizer."""
    train: TokenBatches
    eval_batches: list[torch.Tensor]  # data.eval_batches LongTensors [batch_size, seq_len], identical on all peers
    vocab_size: int
    tokenizer: Tokenizer


def build_data(data_cfg: DataConfig, seq_len: int, batch_size: int, peer_name: str,
               init_from: Optional[str] = None) -> Data:
    """Open ``data_cfg.dataset`` and return ``peer_name``'s reader plus the held-out batches. ``init_from`` is
    ``model.init_from`` (its tokenizer is the one ``data.tokenizer = 'auto'`` means).

    Raises ConfigError naming the data.* key at fault (missing file, missing column, too little data).
    """
    tokenizer = load_tokenizer(data_cfg.tokenizer, init_from)
    seed = peer_seed(data_cfg.seed, peer_name)
    source = _open_source(data_cfg)
    if data_cfg.dataset in OFFLINE_CORPORA:
        train, held = _split_tokens(tokenizer.encode_documents(list(OFFLINE_CORPORA[data_cfg.dataset]())), data_cfg)
    elif _is_streaming(source):
        return _stream_data(source, data_cfg, tokenizer, seq_len, batch_size, seed)
    else:
        train, held = _split_documents(source, data_cfg, tokenizer)
    reader = WindowBatches(train, seq_len, batch_size, seed)
    evals = _spread_windows(held, seq_len, batch_size, data_cfg.eval_batches)
    return Data(reader, evals, tokenizer.vocab_size, tokenizer)


def _open_source(cfg: DataConfig):
    """None for an offline corpus, else a ``datasets.Dataset`` or (streamed hub data) ``IterableDataset``."""
    if cfg.dataset in OFFLINE_CORPORA:
        return None
    path = Path(cfg.dataset).expanduser()
    if path.exists():
        return _load_local(path, cfg.dataset, streaming=cfg.stream_files)
    if _looks_like_path(cfg.dataset):
        raise ConfigError(f"data.dataset: no such file or folder '{cfg.dataset}'")
    import datasets

    try:
        return datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=cfg.streaming)
    except FileNotFoundError as e:  # datasets' DatasetNotFoundError subclasses it
        raise ConfigError(f"data.dataset: cannot open '{cfg.dataset}': {first_line(e)}") from None


def _looks_like_path(name: str) -> bool:
    # hub names are "owner/dataset" (one slash, no leading dot or slash), so a lone "/" cannot mean a path
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)
            or _file_kind(Path(name)) in LOCAL_BUILDERS)


def _file_kind(path: Path) -> str:
    """The extension that picks the builder, under a compression suffix: 'a.json.gz' -> '.json'."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def _load_local(path: Path, name: str, streaming: bool = False):
    """A local file, or every supported file in a folder (recursively, sorted): loaded whole, or (``streaming``)
    as an ``IterableDataset`` read by the same code as a streamed hub dataset."""
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and _file_kind(p) in LOCAL_BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(path).parts))
    builders = {LOCAL_BUILDERS.get(_file_kind(p)) for p in files}
    if not files or None in builders:
        raise ConfigError(f"data.dataset: '{name}' has no {'/'.join(LOCAL_BUILDERS)} file")
    if len(builders) > 1:
        raise ConfigError(f"data.dataset: '{name}' mixes file kinds ({', '.join(sorted(builders))}); keep one")
    import datasets

    return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train",
                                 streaming=streaming)


def _is_streaming(source) -> bool:
    import datasets

    return isinstance(source, datasets.IterableDataset)


def _split_tokens(tokens: np.ndarray, cfg: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(training region, held-out tail): the last ``eval_fraction`` of the token stream is held out."""
    held = math.ceil(len(tokens) * cfg.eval_fraction)
    stream = torch.from_numpy(tokens)
    return stream[:len(tokens) - held], stream[len(tokens) - held:]


def _split_documents(dataset, cfg: DataConfig, tokenizer: Tokenizer):
    """(training tokens, held-out tokens): the last ``eval_fraction`` of the documents (at least one) are held out."""
    if cfg.text_field not in dataset.column_names:
        raise ConfigError(f"data.text_field: no column '{cfg.text_field}' "
                          f"(columns: {', '.join(sorted(dataset.column_names))})")
    n = len(dataset)
    if n < 2:
        raise ConfigError(f"data.dataset: '{cfg.dataset}' has {n} document(s); needs 2 or more to hold one out")
    held = max(1, math.ceil(n * cfg.eval_fraction))
    return (_tokenize_rows(dataset.select(range(n - held)), cfg.text_field, tokenizer),
            _tokenize_rows(dataset.select(range(n - held, n)), cfg.text_field, tokenizer))


def _tokenize_rows(dataset, text_field: str, tokenizer: Tokenizer, rows_per_call: int = 4096) -> torch.Tensor:
    parts = [np.zeros(0, dtype=np.int32)]
    for rows in dataset.select_columns([text_field]).iter(batch_size=rows_per_call):
        parts.append(tokenizer.encode_documents([t for t in rows[text_field] if t]))
    return torch.from_numpy(np.concatenate(parts))


def _spread_windows(held: torch.Tensor, seq_len: int, batch_size: int, n_batches: int) -> list[torch.Tensor]:
    """``n_batches`` batches of windows at evenly spaced starts over the held-out tokens (no randomness, so
    every peer gets the same ones; non-overlapping when the region is large enough)."""
    if held.numel() < seq_len:
        raise ConfigError(f"data.eval_fraction: the held-out data has {held.numel()} tokens, fewer than "
                          f"model.seq_len {seq_len}; raise data.eval_fraction or add data")
    count = n_batches * batch_size
    starts = torch.linspace(0, held.numel() - seq_len, count).round().long()
    windows = held[starts[:, None] + torch.arange(seq_len)].long()
    return list(windows.view(n_batches, batch_size, seq_len).unbind(0))


def _stream_data(dataset, cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, batch_size: int,
                 seed: int) -> Data:
    """Hold out the stream's first documents (enough for the eval batches); train on the rest, shuffled."""
    needed = cfg.eval_batches * batch_size * seq_len
    held_out, parts, have = set(), [], 0
    for example in dataset:
        text = _text_of(example, cfg.text_field)
        if not text:
            continue
        held_out.add(_doc_hash(text))
        parts.append(tokenizer.encode_documents([text]))
        have += len(parts[-1])
        if have >= needed:
            break
    if have < needed:
        raise ConfigError(f"data.eval_batches: the stream has only {have} tokens, fewer than the {needed} "
                          f"needed for held-out evaluation")
    tokens = torch.from_numpy(np.concatenate(parts)[:needed]).long()
    evals = list(tokens.view(cfg.eval_batches, batch_size, seq_len).unbind(0))
    reader = StreamBatches(dataset, cfg.text_field, tokenizer, seq_len, batch_size, seed, frozenset(held_out),
                           tokenizer_threads=cfg.tokenizer_threads)
    if cfg.prefetch_batches:
        from p2p_diloco.train.prefetch import Prefetcher  # imports this module

        reader = Prefetcher(reader, cfg.prefetch_batches)
    return Data(reader, evals, tokenizer.vocab_size, tokenizer)
