"""train/reference.py: the in-process DiLoCo the convergence study runs is the peer's round, and plain AdamW at ε = 1."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.peer import Peer
from p2p_diloco.train.data import build_data
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.model import build_model
from p2p_diloco.train.outer import params_digest
from p2p_diloco.train.reference import ReferenceDiLoCo

from test_peer import FakeAverager

pytestmark = pytest.mark.timeout(60)

SMALL = {"model.seq_len": "32", "inner.batch_size": "2", "inner.warmup_steps": "2", "inner.lr": "1e-3",
         "diloco.inner_steps": "3", "data.eval_batches": "1", "run.threads": "1", "run.progress": "false",
         "run.rounds": "2", "run.name": "peer0"}


def test_one_replica_is_bit_identical_to_a_peer(tmp_path):
    """Same data order, inner state across commits, pseudo-gradient and outer step as a peer named peer0."""
    overrides = {**SMALL, "run.run_dir": str(tmp_path / "run"), "diloco.weight_by_tokens": "false"}
    fake = FakeAverager(["ok", "ok"])
    peer = Peer(load_config(overrides=overrides), averager=fake).start()
    fake.bind(peer)
    peer.run()
    peer.close()
    ref = ReferenceDiLoCo(load_config(overrides=overrides), 1)
    for _ in range(2):
        ref.run_round()
    assert params_digest(ref.params) == params_digest(peer.state.params)
    assert params_digest(ref.outer.state_tensors()) == params_digest(peer.state.outer.state_tensors())
    assert ref.tokens == 2 * 3 * 2 * 32


def test_one_replica_with_plain_averaging_is_adamw():
    """ε = 1 without momentum gives θ_global = θ_local every round: AdamW, to float rounding."""
    cfg = load_config(overrides={**SMALL, "diloco.outer_optimizer": "sgd", "diloco.outer_lr": "1.0"})
    ref = ReferenceDiLoCo(cfg, 1)
    for _ in range(2):
        ref.run_round()
    data = build_data(cfg.data, 32, 2, "peer0")
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    trainer = InnerTrainer(model, cfg.inner, torch.device("cpu"), total_steps=6)
    for _ in range(6):
        trainer.step(data.train.next_batch)
    for a, b in zip(ref.params, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)
