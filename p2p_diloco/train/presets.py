"""The model presets (``model.name``): Llama shapes as keyword arguments for :class:`transformers.LlamaConfig`.

Plain data, without torch or transformers, so that the command line checks a preset name at once (config/preflight.py);
train/model.py builds the models.
"""

from __future__ import annotations

import math


def _llama_intermediate(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 8/3 x hidden rounded up to ``multiple_of``.

    Why 8/3 and not 4x: a gated MLP has three matrices, so 8/3 x hidden gives the same 12·h² parameters per layer
    as the paper's 4x non-gated MLP, which keeps the presets' sizes close to the paper's names.
    """
    return multiple_of * math.ceil(8 * hidden / 3 / multiple_of)


def _paper_shape(layers: int, hidden: int, heads: int) -> dict:
    # tied embeddings: with a 32k vocabulary this is what makes 3 x 896 come out at ~60M (untied: ~86M)
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=heads, intermediate_size=_llama_intermediate(hidden),
                max_position_embeddings=2048, tie_word_embeddings=True)


PRESETS: dict[str, dict] = {
    # CPU demo and tests: ~0.46M parameters with the byte tokenizer; learns visibly within a minute on 2 cores
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=384, max_position_embeddings=1024, tie_word_embeddings=True),
    # the convergence study's second size: ~3.5M parameters with the byte tokenizer (Chinchilla: ~70M tokens)
    "small": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=768, max_position_embeddings=1024, tie_word_embeddings=True),
    # the DiLoCo paper's shapes (Table 1); with a 32k vocabulary: ~58M, ~145M, ~390M parameters
    "60m": _paper_shape(3, 896, 16),
    "150m": _paper_shape(12, 896, 16),
    "400m": _paper_shape(12, 1536, 12),
    # TinyLlama-1.1B's shape (grouped-query attention, untied head): ~1.1B parameters with a 32k vocabulary
    "1b": dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, max_position_embeddings=2048, tie_word_embeddings=False),
    # Llama-3.2-3B's shape (grouped-query attention, tied head): ~2.97B parameters with gpt2's 50257 tokens, ~2.92B
    # with 32k; 6·N + 12·L·d·T = 18.5 GFLOPs per token at 1024 tokens and 50257 (train/flops.py). One 24 GB card
    # trains it with the memory options (benchmarks/big-models.md)
    "3b": dict(num_hidden_layers=28, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192, max_position_embeddings=2048, tie_word_embeddings=True),
}
"""Keyword arguments for :class:`transformers.LlamaConfig`, without ``vocab_size`` (it comes from the tokenizer)."""
