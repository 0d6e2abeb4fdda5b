"""model.py: presets, deterministic initialization, local HF configs, fingerprints. Offline."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from p2p_diloco.config import ConfigError, ModelConfig
from p2p_diloco.train.model import (DEFAULT_VOCAB_SIZE, PRESETS, build_model, count_parameters, model_fingerprint,
                              preset_config, weights_digest)

pytestmark = pytest.mark.timeout(60)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_builds_fp32_with_the_tokenizer_vocabulary():
    model = build_model(ModelConfig(name="tiny", seq_len=128), vocab_size=256, seed=0)
    assert model.config.vocab_size == 256
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 300_000 < count_parameters(model) < 1_000_000
    loss = model(input_ids=torch.zeros(2, 16, dtype=torch.long), labels=torch.zeros(2, 16, dtype=torch.long)).loss
    assert torch.isfinite(loss)


def test_small_is_the_convergence_studys_few_million_parameters():
    model = build_model(ModelConfig(name="small", seq_len=128), vocab_size=259, seed=0)
    # benchmarks/learning-quality.md 7.5: 3.48M, Chinchilla budget 68.8M tokens
    assert 3.4e6 < count_parameters(model) < 3.6e6


def test_60m_builds_with_the_paper_size():
    model = build_model(ModelConfig(name="60m"), vocab_size=DEFAULT_VOCAB_SIZE, seed=0)
    assert 55e6 < count_parameters(model) < 65e6


@pytest.mark.parametrize("name,low,high", [("150m", 140e6, 160e6), ("400m", 370e6, 420e6), ("1b", 1.0e9, 1.2e9)])
def test_large_presets_have_their_nominal_size(name, low, high):
    with torch.device("meta"):  # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(preset_config(name, DEFAULT_VOCAB_SIZE))
    assert low < count_parameters(model) < high


def test_presets_hold_the_sequence_length():
    assert all(preset_config(name, 256, seq_len=4096).max_position_embeddings >= 4096 for name in PRESETS)


def test_same_seed_same_weights_regardless_of_global_rng():
    cfg = ModelConfig(name="tiny")
    torch.manual_seed(123)
    a = build_model(cfg, 256, seed=7)
    torch.rand(1000)  # other code drawing from the global RNG must not matter
    state = torch.get_rng_state()
    b = build_model(cfg, 256, seed=7)
    assert _same_weights(a, b) and weights_digest(a) == weights_digest(b)
    assert torch.equal(state, torch.get_rng_state()), "build_model must leave the global RNG alone"


def test_different_seed_different_weights():
    cfg = ModelConfig(name="tiny")
    a, b = build_model(cfg, 256, seed=0), build_model(cfg, 256, seed=1)
    assert not _same_weights(a, b) and weights_digest(a) != weights_digest(b)


def _write_config(folder, **overrides) -> None:
    config = preset_config("tiny", 300).to_dict()
    config.update(overrides)
    (folder / "config.json").write_text(json.dumps(config))


def test_hf_config_file_and_folder_build(tmp_path):
    _write_config(tmp_path, num_hidden_layers=1)
    for name in (str(tmp_path), str(tmp_path / "config.json")):
        model = build_model(ModelConfig(name=name), vocab_size=256, seed=0)
        assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 300


def test_hf_config_too_small_vocab_is_a_config_error(tmp_path):
    _write_config(tmp_path)
    with pytest.raises(ConfigError, match="model.name"):
        build_model(ModelConfig(name=str(tmp_path)), vocab_size=1000, seed=0)


def test_hf_config_too_short_context_is_a_config_error(tmp_path):
    _write_config(tmp_path, max_position_embeddings=64)
    with pytest.raises(ConfigError, match="model.name"):
        build_model(ModelConfig(name=str(tmp_path), seq_len=128), vocab_size=256, seed=0)


def test_unknown_name_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.name: no preset or config file .*presets: tiny, small, 60m"):
        build_model(ModelConfig(name=str(tmp_path / "missing")), vocab_size=256, seed=0)


def test_fingerprint_tells_models_apart_but_not_weights(tmp_path):
    tiny = build_model(ModelConfig(name="tiny"), 256, seed=0)
    assert len(model_fingerprint(tiny)) == 16
    assert model_fingerprint(tiny) == model_fingerprint(build_model(ModelConfig(name="tiny"), 256, seed=1))
    assert model_fingerprint(tiny) != model_fingerprint(build_model(ModelConfig(name="tiny"), 300, seed=0))
    _write_config(tmp_path, num_hidden_layers=1)
    other = build_model(ModelConfig(name=str(tmp_path)), 256, seed=0)
    assert model_fingerprint(tiny) != model_fingerprint(other)


def test_fingerprint_ignores_where_the_config_file_lives(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        _write_config(tmp_path / folder)
    a, b = (build_model(ModelConfig(name=str(tmp_path / f)), 256, seed=0) for f in ("a", "b"))
    assert model_fingerprint(a) == model_fingerprint(b)


# ---------------------------------------------------------------------------------------------- model.init_from

def _saved(tmp_path, dtype=torch.float32, seed: int = 5):
    """A tiny model saved with save_pretrained (no download): the pretrained checkpoint of these tests."""
    model = build_model(ModelConfig(name="tiny"), vocab_size=300, seed=seed)
    model.to(dtype).save_pretrained(str(tmp_path / "ckpt"))
    return str(tmp_path / "ckpt"), model


def test_init_from_a_local_checkpoint_gives_its_weights_in_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, saved = _saved(tmp_path)
    loaded = build_model(ModelConfig(name="tiny", init_from=path, seq_len=64), vocab_size=256, seed=123)
    assert _same_weights(loaded, saved) and weights_digest(loaded) == weights_digest(saved)
    assert loaded.config.vocab_size == 300 and loaded.config._attn_implementation == "sdpa"
    assert model_fingerprint(loaded) == model_fingerprint(saved)


def test_init_from_a_bf16_checkpoint_is_converted_exactly(tmp_path):
    path, saved = _saved(tmp_path, dtype=torch.bfloat16)
    loaded = build_model(ModelConfig(init_from=path), vocab_size=256, seed=0)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert all(torch.equal(a, b.float()) for a, b in zip(loaded.parameters(), saved.parameters()))


@pytest.mark.parametrize("case", ["missing", "vocab", "context"])
def test_init_from_errors_name_the_key(tmp_path, case):
    path, _ = _saved(tmp_path)
    cfg = ModelConfig(init_from=str(tmp_path / "nothing") if case == "missing" else path,
                      seq_len=4096 if case == "context" else 128)
    with pytest.raises(ConfigError, match=r"^model\.init_from: "):
        build_model(cfg, vocab_size=1000 if case == "vocab" else 256, seed=0)
