"""The outer step (pure math) against torch's own optimizers."""

import pytest
import torch

from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.train.outer import (OuterNesterov, OuterSGD, auto_outer, build_outer_optimizer, load_into,
                                    params_digest, pseudo_gradient, rebase, resolve_auto)

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


# ---------------------------------------------------------------------------------------------- Delayed Nesterov

def _dn_reference(theta, arrivals, lr, beta, n, c):
    """Alg. 3 of Asynchronous Local-SGD, literally: one contribution at a time (float64, for a clean reference)."""
    theta = [p.double() for p in theta]
    m = [torch.zeros_like(p) for p in theta]
    buf = [torch.zeros_like(p) for p in theta]
    for t, g in enumerate(arrivals):
        g = [x.double() for x in g]
        for i in range(len(theta)):
            buf[i] = buf[i] + g[i]
            if (t + 1) % n == 0:
                m[i] = beta * m[i] + buf[i] / n
                theta[i] = theta[i] - lr * ((1 - c * n + c) * beta * m[i] + g[i] / n)
                buf[i] = torch.zeros_like(buf[i])
            else:
                theta[i] = theta[i] - lr * (c * beta * m[i] + g[i] / n)
    return theta, m, buf


@pytest.mark.parametrize("n,c,ks", [(4, 0.0, [4, 4, 4]), (4, 0.1, [3, 2, 4, 1, 5]), (3, 1 / 3, [1, 1, 7, 2]),
                                    (1, 0.0, [2, 1, 3]), (5, 0.05, [12, 3])])
def test_delayed_nesterov_round_of_k_equals_k_arrivals_of_its_average(n, c, ks):
    """The definition: a round whose average is Δ over k contributions is k arrivals of Δ, whatever N, c and where
    the momentum updates fall (inside a round or at its end)."""
    ours = _params(0)
    opt = build_outer_optimizer("delayed_nesterov", ours, 0.7, 0.9, delay=n, c=c)
    arrivals = []
    for r, k in enumerate(ks):
        delta = _params(200 + r)
        opt.step(ours, delta, num_contributions=k)
        arrivals += [delta] * k
    theta, m, buf = _dn_reference(_params(0), arrivals, 0.7, 0.9, n, c)
    for a, b in zip(ours + opt.buffers + opt.sums, theta + m + buf):
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-6)
    assert int(opt.arrivals) == sum(ks)


def test_delayed_nesterov_with_equal_weights_equals_the_individual_arrivals_when_rounds_fill_n():
    """With equal weights the round's Δ is the plain mean, so its k arrivals put exactly Σ g_i into the buffer; when
    every round brings N contributions the momentum moves at the round's end, and the round equals its k individual
    pseudo-gradients arriving one by one."""
    n = 3
    ours = _params(0)
    opt = build_outer_optimizer("delayed_nesterov", ours, 0.7, 0.9, delay=n)
    arrivals = []
    for r in range(4):
        gs = [_params(300 + 10 * r + i) for i in range(n)]
        opt.step(ours, [sum(parts) / n for parts in zip(*gs)], num_contributions=n)
        arrivals += gs
    theta, m, _ = _dn_reference(_params(0), arrivals, 0.7, 0.9, n, 0.0)
    for a, b in zip(ours + opt.buffers, theta + m):
        torch.testing.assert_close(a, b.float(), rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_with_n_contributions_per_round_is_diloco_nesterov():
    dn, nes = _params(0), _params(0)
    opt_dn = build_outer_optimizer("delayed_nesterov", dn, 0.7, 0.9, delay=4)
    opt_nes = OuterNesterov(nes, 0.7, 0.9)
    for r in range(5):
        delta = _params(400 + r)
        opt_dn.step(dn, delta, num_contributions=4)
        opt_nes.step(nes, delta, num_contributions=4)
    for a, b in zip(dn + opt_dn.buffers, nes + opt_nes.buffers):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_delayed_nesterov_state_is_digested_deterministic_and_restored():
    runs = []
    for _ in range(2):
        params = _params(0)
        opt = build_outer_optimizer("delayed_nesterov", params, 0.7, 0.9, delay=3, c=0.2)
        for r, k in enumerate([2, 2, 1]):
            opt.step(params, _params(50 + r), num_contributions=k)
        runs.append((params_digest(params), params_digest(opt.state_tensors()), opt))
    assert runs[0][:2] == runs[1][:2], "the same bytes in must give the same bits out"
    opt = runs[0][2]
    assert len(opt.state_tensors()) == 2 * 3 + 1 and int(opt.arrivals) == 5  # m, buf, t
    other = build_outer_optimizer("delayed_nesterov", _params(0), 0.7, 0.9, delay=3, c=0.2)
    assert params_digest(other.state_tensors()) != runs[0][1]  # the counter and buffer are in the digest
    other.load_state_dict(opt.state_dict())
    assert params_digest(other.state_tensors()) == runs[0][1]


def test_delayed_nesterov_rejects_c_above_one_over_n():
    with pytest.raises(ValueError):
        build_outer_optimizer("delayed_nesterov", _params(0), 0.7, 0.9, delay=4, c=0.5)


def test_rebase_moves_the_local_work_onto_the_new_global_params():
    old, new, local = _params(0), _params(1), _params(2)
    work = [torch.empty_like(p) for p in old]
    pseudo_gradient(old, local, work)  # δ = θ_old − θ_local, taken before θ_global is replaced
    rebase(local, new, work)
    for l, o, n, l0 in zip(local, old, new, _params(2)):
        torch.testing.assert_close(l, n + (l0 - o), rtol=0, atol=1e-6)
    same = _params(0)
    rebase(same, _params(5), [torch.zeros_like(p) for p in same])  # no work: exactly the new θ_global
    assert params_digest(same) == params_digest(_params(5))


# ------------------------------------------------------------------------------------------- the 'auto' rule

def test_auto_outer_has_the_documented_values_for_every_size_and_h():
    """ε = 0.5, β = 0.5 whatever M and H (benchmarks/learning-quality.md 7.3: best or within 0.3 % at M 1, 2, 4 and
    H 10, 30)."""
    for peers in (1, 2, 3, 4, 8, 64):
        for h in (1, 10, 30, 100, 500):
            assert auto_outer(peers, h) == (0.5, 0.5)


def test_auto_outer_rejects_sizes_below_one():
    with pytest.raises(ValueError):
        auto_outer(0, 30)
    with pytest.raises(ValueError):
        auto_outer(4, 0)


def test_auto_is_the_default_parses_from_text_and_only_auto_values_are_resolved():
    cfg = load_config(overrides={"diloco.outer_momentum": "0.8", "diloco.inner_steps": "30"})
    assert (cfg.diloco.outer_lr, cfg.diloco.outer_momentum) == ("auto", 0.8)
    assert load_config(overrides={"diloco.outer_lr": "AUTO"}).diloco.outer_lr == "auto"
    assert resolve_auto(cfg.diloco, 2) == ["diloco.outer_lr=0.5"]
    assert (cfg.diloco.outer_lr, cfg.diloco.outer_momentum) == (0.5, 0.8)
    for bad in ({"diloco.outer_lr": "-1"}, {"diloco.outer_lr": "fast"}, {"diloco.outer_momentum": "1.0"}):
        with pytest.raises(ConfigError):
            load_config(overrides=bad)
