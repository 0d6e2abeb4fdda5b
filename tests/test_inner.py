"""inner.py: the lr schedule, the tiny model learning on the embedded corpus, exact resume of the inner loop."""

import copy
import math

import pytest
import torch

from p2p_diloco.config import ConfigError, DataConfig, InnerConfig, ModelConfig
from p2p_diloco.train.data import build_data
from p2p_diloco.train.inner import InnerTrainer, evaluate, lr_at, resolve_device, schedule_total_steps
from p2p_diloco.train.model import build_model

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


@pytest.fixture
def one_thread():
    # why: results and timings must not depend on how many cores the test machine has
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    cfg = InnerConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 110) == pytest.approx(1e-4)
    assert lr_at(4, cfg, 110) == pytest.approx(5e-4)
    assert lr_at(9, cfg, 110) == pytest.approx(1e-3)  # peak at the end of warm-up
    assert lr_at(10, cfg, 110) == pytest.approx(1e-3)
    assert lr_at(60, cfg, 110) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway down the cosine
    assert lr_at(110, cfg, 110) == pytest.approx(1e-4)
    assert lr_at(10_000, cfg, 110) == pytest.approx(1e-4)  # clamped beyond the end
    decay = [lr_at(s, cfg, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_lr_is_constant_after_warm_up_without_a_total():
    cfg = InnerConfig(lr=4e-4, warmup_steps=5)
    assert [lr_at(s, cfg, None) for s in (5, 50, 10 ** 6)] == [4e-4] * 3
    assert lr_at(0, InnerConfig(lr=4e-4, warmup_steps=0), None) == 4e-4


def test_schedule_total_steps_from_the_config():
    assert schedule_total_steps(InnerConfig(warmup_steps=10, cosine_steps=100), 5, 50) == 110
    assert schedule_total_steps(InnerConfig(), 5, 50) == 250
    assert schedule_total_steps(InnerConfig(), None, 50) is None


def _setup(seed: int = 0, **inner):
    data = build_data(DataConfig(), seq_len=128, batch_size=8, peer_name="alice")
    model = build_model(ModelConfig(name="tiny", seq_len=128), data.vocab_size, seed)
    cfg = InnerConfig(**{"lr": 1e-3, "warmup_steps": 10, **inner})
    return data, model, InnerTrainer(model, cfg, CPU, total_steps=None)


def test_tiny_model_learns_the_embedded_corpus(one_thread):
    data, model, trainer = _setup()
    before = evaluate(model, data.eval_batches, CPU)
    assert before == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at initialization
    results = [trainer.step(data.train.next_batch) for _ in range(60)]
    after = evaluate(model, data.eval_batches, CPU)
    assert model.training, "evaluate must restore train mode"
    assert after < before - 1.5, (before, after)
    assert results[-1].loss < results[0].loss - 1.5
    assert results[0].tokens == 8 * 128 and results[0].lr == pytest.approx(1e-4)
    assert trainer.step_count == 60


def test_grad_accum_scales_tokens_and_reports_the_mean_loss(one_thread):
    data, model, trainer = _setup(grad_accum=2, grad_clip=None)
    result = trainer.step(data.train.next_batch)
    assert result.tokens == 2 * 8 * 128 and result.grad_norm is None
    assert result.loss == pytest.approx(math.log(256), abs=0.3)


def test_state_dict_roundtrip_gives_the_identical_next_step(one_thread):
    data, model, trainer = _setup()
    for _ in range(3):
        trainer.step(data.train.next_batch)
    saved = copy.deepcopy({"model": model.state_dict(), "inner": trainer.state_dict(),
                           "data": data.train.state_dict()})
    expected = trainer.step(data.train.next_batch)
    expected_params = copy.deepcopy(model.state_dict())

    data2, model2, trainer2 = _setup(seed=1)  # a restarted peer, different initial weights
    model2.load_state_dict(saved["model"])
    trainer2.load_state_dict(saved["inner"])
    data2.train.load_state_dict(saved["data"])
    got = trainer2.step(data2.train.next_batch)
    assert trainer2.step_count == 4
    assert (got.loss, got.lr, got.tokens) == (expected.loss, expected.lr, expected.tokens)
    assert all(torch.equal(v, model2.state_dict()[k]) for k, v in expected_params.items())


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="run.device"):
        resolve_device("tpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="run.device"):
            resolve_device("cuda")
