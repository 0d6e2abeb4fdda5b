"""The outer step (pure math) against torch's own optimizers."""

import pytest
import torch

from p2p_diloco.train.outer import (OuterNesterov, OuterSGD, build_outer_optimizer, load_into, params_digest,
                              pseudo_gradient)

pytestmark = pytest.mark.timeout(60)


def _params(seed, shapes=((5, 7), (11,), (3, 2, 4))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def test_pseudo_gradient_is_global_minus_local():
    glob, local = _params(0), _params(1)
    out = [torch.empty_like(p) for p in glob]
    pseudo_gradient(glob, local, out)
    for o, g, l in zip(out, glob, local):
        assert torch.equal(o, g - l)


def test_pseudo_gradient_casts_low_precision_local_params_to_fp32():
    glob = _params(0)
    local = [p.to(torch.bfloat16) for p in _params(1)]
    out = [torch.empty_like(p) for p in glob]
    pseudo_gradient(glob, local, out)
    for o, g, l in zip(out, glob, local):
        assert o.dtype == torch.float32
        assert torch.equal(o, g - l.float())


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (0.4, 0.0), (1.0, 0.5)])
def test_nesterov_matches_torch_sgd_over_several_rounds(lr, momentum):
    ours = _params(0)
    ref = [torch.nn.Parameter(p.clone()) for p in ours]
    torch_opt = torch.optim.SGD(ref, lr=lr, momentum=momentum, nesterov=momentum > 0, dampening=0)
    opt = OuterNesterov(ours, lr, momentum)
    for round_ in range(6):
        deltas = _params(100 + round_)
        opt.step(ours, deltas, num_contributions=3)
        for p, d in zip(ref, deltas):
            p.grad = d.clone()
        torch_opt.step()
        for a, b in zip(ours, ref):
            # separate mul/add (no fused multiply-add) can differ from torch's kernel by an ulp or so
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-6)
    for m, p in zip(opt.state_tensors(), ref):
        if momentum == 0:
            break  # torch keeps no momentum buffer then
        torch.testing.assert_close(m, torch_opt.state[p]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_outer_sgd_matches_torch_sgd():
    ours = _params(0)
    ref = [torch.nn.Parameter(p.clone()) for p in ours]
    torch_opt = torch.optim.SGD(ref, lr=0.5)
    opt = OuterSGD(ours, 0.5)
    deltas = _params(7)
    opt.step(ours, deltas)
    for p, d in zip(ref, deltas):
        p.grad = d
    torch_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-7)


def test_outer_step_is_deterministic_bit_for_bit():
    """Peers apply the same bytes; they must get the same bits (the invariant rests on this)."""
    results = []
    for _ in range(2):
        params = _params(0)
        opt = build_outer_optimizer("nesterov", params, 0.7, 0.9)
        for r in range(3):
            opt.step(params, _params(50 + r))
        results.append(params_digest(params) + params_digest(opt.state_tensors()))
    assert results[0] == results[1]


def test_state_dict_roundtrip_restores_momentum():
    params = _params(0)
    opt = OuterNesterov(params, 0.7, 0.9)
    opt.step(params, _params(1))
    saved = opt.state_dict()
    other = OuterNesterov(_params(0), 0.7, 0.9)
    other.load_state_dict(saved)
    assert params_digest(other.state_tensors()) == params_digest(opt.state_tensors())


def test_load_into_and_digest():
    glob, local = _params(0), _params(1)
    assert params_digest(glob) != params_digest(local)
    load_into(local, glob)
    assert params_digest(glob) == params_digest(local)
