"""Tokenizers behind one small interface: the 256-symbol byte tokenizer (no download) and Hugging Face tokenizers."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import numpy as np

from p2p_diloco.config import ConfigError
from p2p_diloco.errors import first_line


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""
    vocab_size: int
    doc_separator: list[int]  # appended after every document (EOS where the tokenizer has one)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_documents(self, texts: list[str]) -> np.ndarray: ...

    def encode_each(self, texts: list[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 symbols, no download, no special tokens.

    All 256 ids are bytes, so there is no EOS; documents are separated by a newline byte instead.
    """
    vocab_size = 256
    doc_separator = [10]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """All documents, each followed by the separator, as one int32 array (vectorized: no per-byte loop)."""
        data = "".join(t + "\n" for t in texts).encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_each(self, texts: list[str]) -> list[np.ndarray]:
        """Each document followed by the separator, as one int32 array per document."""
        return [self.encode_documents([t]) for t in texts]


class HFTokenizer:
    """A transformers tokenizer behind the :class:`Tokenizer` interface.

    No special tokens inside documents; the tokenizer's EOS (if any) after each one.
    ``vocab_size`` is ``len(tokenizer)``, which counts added tokens (``tokenizer.vocab_size`` does not).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.doc_separator = [] if eos is None else [int(eos)]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(self.encode_each(texts))

    def encode_each(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        # one batched call (in Rust, without the GIL; on several cores if TOKENIZERS_PARALLELISM allows it)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        sep = self.doc_separator
        return [np.asarray(doc + sep, dtype=np.int32) for doc in ids]


def tokenizer_source(name: str, init_from: Optional[str] = None) -> str:
    """What ``data.tokenizer`` names once 'auto' is resolved: ``model.init_from`` (the checkpoint's own tokenizer)
    when that is set, else 'byte'; any other name as is."""
    if name != "auto":
        return name
    return init_from if init_from is not None else "byte"


def load_tokenizer(name: str, init_from: Optional[str] = None) -> Tokenizer:
    """'byte' -> :class:`ByteTokenizer`; otherwise a transformers tokenizer by local path (offline) or hub name
    (downloaded once into the Hugging Face cache; with ``HF_HUB_OFFLINE=1`` only the cache is read). 'auto' is
    resolved by :func:`tokenizer_source`. Raises ConfigError naming data.tokenizer when it cannot be loaded, or
    model.init_from when 'auto' took that checkpoint's tokenizer."""
    source = tokenizer_source(name, init_from)
    if source == "byte":
        return ByteTokenizer()
    from transformers import AutoTokenizer  # deferred: importing transformers costs ~1 s

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(source))
    except (OSError, ValueError) as e:
        key = "model.init_from" if name == "auto" else "data.tokenizer"
        also = " (its tokenizer, which data.tokenizer='auto' takes)" if name == "auto" else ""
        raise ConfigError(f"{key}: cannot load '{source}'{also}: {first_line(e)}") from None

