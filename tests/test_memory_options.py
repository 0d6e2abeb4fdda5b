"""Memory options of one machine (train/memory.py): the chunked loss equals the model's own, the options are machine
settings a run refuses none of, the 8-bit AdamW learns on the CPU, and the big-models benchmark runs on the CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import ConfigError, InnerConfig, ModelConfig, load_config, shared_keys, shared_settings
from p2p_diloco.net.run_settings import first_difference
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.memory import ChunkedLossLM, chunked_cross_entropy
from p2p_diloco.train.model import build_model
from p2p_diloco.train.replica import build_inner

CPU = torch.device("cpu")
MEMORY_OPTIONS = {"model.loss_chunk": "64", "inner.optimizer_state": "fp32", "run.compile": "true",
                  "model.gradient_checkpointing": "true", "inner.offload": "true",
                  "inner.shard": "true"}
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")


def _tiny(seed: int = 0):
    return build_model(ModelConfig(name="tiny", seq_len=32), vocab_size=300, seed=seed)


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [7, 32, 1000, 0])  # uneven chunks, one per sequence, more than all, all at once
def test_chunked_loss_equals_the_models_loss_and_gradients(chunk):
    torch.manual_seed(1)
    x = torch.randint(0, 300, (3, 32))
    labels = x.clone()
    labels[1, 5:9] = -100  # ignored positions are left out of the mean in both
    plain, chunked = _tiny(), _tiny()
    reference = plain(input_ids=x, labels=labels, use_cache=False).loss
    reference.backward()
    loss = ChunkedLossLM(chunked, chunk)(input_ids=x, labels=labels).loss
    loss.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6, abs=1e-6)
    expected, got = _grads(plain), _grads(chunked)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(60)
def test_chunked_loss_keeps_no_full_logits_for_the_backward():
    # what autograd keeps between forward and backward: with chunks, no [tokens, vocabulary] tensor at all
    torch.manual_seed(2)
    hidden = torch.randn(2, 64, 8, requires_grad=True)
    weight = torch.randn(5000, 8, requires_grad=True)  # 40,000 values; one chunk's logits: 80,000
    labels = torch.randint(0, 5000, (2, 64))
    kept: list[int] = []

    def pack(t):
        kept.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    assert kept and max(kept) <= weight.numel()  # inputs and scalars only: no chunk's logits
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.cross_entropy((hidden @ weight.T).float().reshape(-1, 5000), labels.reshape(-1))
    assert max(kept) >= 128 * 5000  # the plain loss keeps the logits of all 128 positions


@pytest.mark.timeout(30)
def test_memory_options_are_machine_settings_and_a_run_refuses_none_of_them():
    keys = set(shared_keys())
    for key in MEMORY_OPTIONS:
        assert key not in keys, key
    run = shared_settings(load_config())  # a run whose first peer chose none of the options
    for key, value in {**MEMORY_OPTIONS, "inner.optimizer_state": "8bit"}.items():
        given: set[str] = set()
        try:
            mine = load_config(overrides={key: value}, given=given)
        except ConfigError:  # 8bit without torchao: refused by this machine's own check, not by the run
            assert key == "inner.optimizer_state" and importlib.util.find_spec("torchao") is None
            continue
        assert key in given
        assert first_difference(mine, run, given=given) is None, key
    # and a peer with every option set finds its run's settings equal to those of a peer with none
    everything = load_config(overrides=MEMORY_OPTIONS)
    assert shared_settings(everything) == run


@pytest.mark.timeout(30)
def test_8bit_without_torchao_is_one_line_naming_the_key(monkeypatch):
    import p2p_diloco.config.sections as sections

    monkeypatch.setattr(sections, "_installed", lambda module: module != "torchao")
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"inner.optimizer_state": "8bit"})
    assert "inner.optimizer_state" in str(err.value) and "torchao" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="inner.optimizer_state"):
        load_config(overrides={"inner.optimizer_state": "4bit"})
    with pytest.raises(ConfigError, match="model.loss_chunk"):
        load_config(overrides={"model.loss_chunk": "-1"})


def _steps(trainer: InnerTrainer, x: torch.Tensor, n: int) -> list[float]:
    return [trainer.step(lambda: x).loss for _ in range(n)]


@needs_torchao
@pytest.mark.timeout(600)
def test_8bit_adamw_learns_on_the_cpu_and_its_state_survives_a_checkpoint(tmp_path):
    from torchao.optim.subclass_8bit import OptimState8bit

    torch.set_num_threads(1)
    torch.manual_seed(3)
    x = torch.randint(0, 300, (4, 32))
    cfg = InnerConfig(lr=3e-3, warmup_steps=1, optimizer_state="8bit")
    model = _tiny()
    trainer = InnerTrainer(model, cfg, CPU, total_steps=None)
    losses = _steps(trainer, x, 6)
    assert losses[-1] < losses[0] - 0.3, losses
    big = [s for s in trainer.optimizer.state.values() if s["exp_avg"].numel() >= 4096]
    assert big and all(isinstance(s["exp_avg"], OptimState8bit) for s in big)
    # 8 bits: the moments of the big tensors take a quarter of fp32's bytes (plus one fp32 scale per 256 values)
    assert all(s["exp_avg"].codes.dtype == torch.uint8 for s in big)
    torch.save({"inner": trainer.state_dict(), "model": model.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed_model = _tiny(seed=9)
    resumed_model.load_state_dict(saved["model"])
    resumed = InnerTrainer(resumed_model, cfg, CPU, total_steps=None)
    resumed.load_state_dict(saved["inner"])
    assert _steps(resumed, x, 1) == pytest.approx(_steps(trainer, x, 1), rel=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("grad_accum", [1, 2])  # the first micro-batch's gradients are copied, later ones added
def test_offloaded_adamw_steps_like_adamw_and_follows_theta_local_changed_outside(grad_accum):
    from p2p_diloco.train.offload import HostAdamW
    from p2p_diloco.train.transfer import flatten_parameters, load_params

    torch.set_num_threads(1)
    torch.manual_seed(5)
    batches = [torch.randint(0, 300, (2, 32)) for _ in range(2)]
    trainers, models = [], []
    for offload in (False, True):
        model = _tiny()
        flatten_parameters(model)  # as the peer does: the version counter is the flat buffer's
        cfg = InnerConfig(lr=3e-3, warmup_steps=1, grad_clip=0.5, grad_accum=grad_accum, offload=offload)
        trainers.append(InnerTrainer(model, cfg, CPU, total_steps=None))
        models.append(model)
    assert isinstance(trainers[1].optimizer, HostAdamW)

    def run(trainer, n):
        out = []
        for _ in range(n):
            it = iter(batches * grad_accum)
            r = trainer.step(lambda: next(it))
            out += [r.loss, r.grad_norm]
        return out

    plain, offloaded = run(trainers[0], 3), run(trainers[1], 3)
    assert offloaded == pytest.approx(plain, rel=1e-5)
    assert all(p.grad is None for p in models[1].parameters())  # the device keeps no gradient
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # θ_local <- θ_global, as at a round's start: the master copy follows before the next update
    fresh = [p.detach().clone() for p in _tiny(seed=7).parameters()]
    for model in models:
        load_params(list(model.parameters()), fresh)
    assert run(trainers[1], 2) == pytest.approx(run(trainers[0], 2), rel=1e-5)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_offload_is_refused_on_a_multi_process_peer_with_one_line():
    from p2p_diloco.train.replica import Ranks

    cfg = load_config(overrides={"inner.offload": "true"})
    with pytest.raises(ConfigError, match="inner.offload"):
        build_inner(cfg, _tiny(), CPU, ranks=Ranks(0, 2, 0, None))


@pytest.mark.timeout(600)
def test_the_peers_inner_loop_with_chunked_loss_checkpointing_and_compile_matches_the_plain_one():
    torch.set_num_threads(1)
    torch.manual_seed(4)
    x = torch.randint(0, 300, (2, 32))
    base = {"model.name": "tiny", "model.seq_len": "32", "inner.warmup_steps": "1", "inner.lr": "1e-3"}
    losses = {}
    for label, options in (("plain", {}), ("options", MEMORY_OPTIONS)):
        cfg = load_config(overrides={**base, **options})
        model = build_model(cfg.model, 300, seed=0)
        inner = build_inner(cfg, model, CPU, ranks=None)
        losses[label] = _steps(inner, x, 3)
    assert losses["options"] == pytest.approx(losses["plain"], rel=1e-4)
    assert losses["plain"][-1] < losses["plain"][0]


@pytest.mark.timeout(60)
def test_the_3b_preset_has_about_3b_parameters_and_its_flops_per_token():
    from transformers import AutoModelForCausalLM

    from p2p_diloco.train.flops import flops_per_token, matmul_params
    from p2p_diloco.train.model import preset_config

    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(preset_config("3b", 50257))
    assert 2.9e9 < sum(p.numel() for p in model.parameters()) < 3.1e9
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as Llama-3.2-3B
    assert flops_per_token(model, 1024) == 6 * matmul_params(model) + 12 * 28 * 3072 * 1024
    assert flops_per_token(model, 1024) == pytest.approx(18.9e9, rel=0.01)


@pytest.mark.timeout(900)
def test_big_models_benchmark_smoke_run_on_the_cpu(tmp_path):
    script = Path(__file__).parent.parent / "benchmarks" / "big_models.py"
    out = tmp_path / "big.json"
    run = subprocess.run([sys.executable, str(script), "--smoke", "--json", str(out)], capture_output=True,
                         text=True, timeout=850)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["preset"], r["loop"], r["cap_gib"]) for r in rows} == {
        ("tiny", loop, cap) for loop in ("peer", "reference") for cap in (24.0, None)}
    for r in rows:
        assert r["fits"] and r["micro_batch"] >= 1 and r["tokens_per_s"] > 0
    assert "| tiny |" in run.stdout and "peer / reference" in run.stdout


@pytest.mark.timeout(120)
def test_big_models_ab_benchmark_smoke_run_on_the_cpu(tmp_path):
    """benchmarks/big_ab.py's code path: both loops resident, alternating timed blocks, the balanced ratio."""
    script = Path(__file__).parent.parent / "benchmarks" / "big_ab.py"
    out = tmp_path / "ab.json"
    run = subprocess.run([sys.executable, str(script), "--smoke", "--json", str(out)], capture_output=True,
                         text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["tokens_per_s"]["peer"]) == len(row["tokens_per_s"]["reference"]) == 2
    assert row["balanced_ratios"] == [pytest.approx((row["ratios"][0] * row["ratios"][1]) ** 0.5)]
    assert 0.2 < row["median_balanced_ratio"] < 5  # both loops ran the same work on the same machine


@pytest.mark.timeout(300)
def test_memory_loss_benchmark_smoke_run_on_the_cpu(tmp_path):
    """benchmarks/memory_loss.py's code path: offload trains to the same held-out loss as fp32 AdamW on the CPU (the
    same arithmetic there), and an option this machine cannot run is reported unmeasured, never estimated."""
    script = Path(__file__).parent.parent / "benchmarks" / "memory_loss.py"
    out = tmp_path / "loss.json"
    run = subprocess.run([sys.executable, str(script), "--smoke", "--json", str(out)], capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["option"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["offload"]["losses"] == pytest.approx(rows["fp32"]["losses"], rel=1e-4)
    assert all(3.0 < x < 6.0 for x in rows["fp32"]["losses"])  # trained from ~5.5 (byte vocabulary)
    if importlib.util.find_spec("torchao") is None:
        assert rows["8bit"]["unmeasured"] and "unmeasured" in run.stdout
    else:
        assert all(x is not None for x in rows["8bit"]["losses"])
