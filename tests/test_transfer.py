"""train/transfer.py: the bulk transfers between θ_local and θ_global give the reference's bytes exactly."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import ModelConfig
from p2p_diloco.train.model import build_model
from p2p_diloco.train.outer import load_into, pseudo_gradient
from p2p_diloco.train.transfer import DeltaTransfer, flat_view, flatten_parameters, host_copy, load_params

pytestmark = pytest.mark.timeout(60)


def _model_and_global():
    model = build_model(ModelConfig(name="tiny"), vocab_size=256, seed=0)
    global_params = host_copy(model.parameters(), pin=False)
    with torch.no_grad():  # θ_local moves away from θ_global, as after inner steps
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    return model, global_params


def test_flattening_keeps_values_parameters_and_the_forward():
    model, _ = _model_and_global()
    x = torch.randint(0, 256, (2, 16))
    before = [p.detach().clone() for p in model.parameters()]
    ids = [id(p) for p in model.parameters()]
    loss = model(input_ids=x, labels=x).loss
    flat = flatten_parameters(model)
    assert [id(p) for p in model.parameters()] == ids  # the same Parameter objects: optimizers keep working
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert flat_view(list(model.parameters())).data_ptr() == flat.data_ptr()
    assert torch.equal(model(input_ids=x, labels=x).loss, loss)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert flat_view([torch.zeros(3), torch.zeros(3)]) is None


@pytest.mark.parametrize("chunk_values", [1000, 7777, 10 ** 8])  # pieces cutting across tensors, and one piece
def test_piecewise_pseudo_gradient_equals_the_per_tensor_reference_bit_for_bit(chunk_values):
    model, global_params = _model_and_global()
    flatten_parameters(model)
    expected = [torch.empty_like(g) for g in global_params]
    pseudo_gradient(global_params, model.parameters(), expected)
    for path in ("chunked", "pseudo_gradient"):
        out = [torch.full_like(g, float("nan")) for g in global_params]
        getattr(DeltaTransfer(list(model.parameters()), chunk_bytes=4 * chunk_values), path)(global_params, out)
        assert all(torch.equal(a, b) for a, b in zip(out, expected)), path


def test_bulk_load_equals_the_per_tensor_reference():
    model, global_params = _model_and_global()
    reference = build_model(ModelConfig(name="tiny"), vocab_size=256, seed=1)
    load_into(reference.parameters(), global_params)
    flatten_parameters(model)
    load_params(list(model.parameters()), global_params)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    unflat = [g.clone() for g in global_params]  # not one buffer: the per-tensor fallback
    load_params(list(reference.parameters()), unflat)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
