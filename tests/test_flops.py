"""train/flops.py: model FLOPs per token by PaLM's formula, and MFU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from p2p_diloco.train.flops import PEAK_BF16_TFLOPS, flops_per_token, matmul_params, mfu, peak_flops
from p2p_diloco.train.model import preset_config

pytestmark = pytest.mark.timeout(60)


def _meta(name: str, vocab: int):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(preset_config(name, vocab))


def test_flops_per_token_by_hand_for_a_tied_and_an_untied_preset():
    tiny = _meta("tiny", 256)  # 2 layers, d 128, 4 heads, MLP 384, tied head
    per_layer = 4 * 128 * 128 + 3 * 128 * 384  # q, k, v, o; gate, up, down
    assert matmul_params(tiny) == 2 * per_layer + 256 * 128  # the tied matrix counts once, as the head
    assert flops_per_token(tiny, 64) == 6 * (2 * per_layer + 256 * 128) + 12 * 2 * 128 * 64
    big = _meta("1b", 32000)  # untied: the input embedding is a lookup, not a matmul
    assert matmul_params(big) == sum(p.numel() for p in big.parameters() if p.dim() == 2) - 32000 * 2048
    assert flops_per_token(big, 2048) == pytest.approx(6 * matmul_params(big) + 12 * 22 * 2048 * 2048)


def test_mfu_and_peaks():
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert mfu(1000.0, 6e9, None) is None
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), peak_tflops=2.5) == 2.5e12
    assert PEAK_BF16_TFLOPS["H100"] == 989.0 and list(PEAK_BF16_TFLOPS).index("H100 PCIe") < list(
        PEAK_BF16_TFLOPS).index("H100")  # the more specific name is matched first
