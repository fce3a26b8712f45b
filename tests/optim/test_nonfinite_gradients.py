"""A non-finite gradient skips its matrix, on the device: no error, no host read.

The matrix keeps its value and its momentum buffer that step, ``state["skipped_steps"]`` (a 0-dim
long tensor) counts it, :func:`~manifoldlib.optim.optimizer_diagnostics` reports it by name, and
every other matrix — in the same bank or not — takes exactly the step it takes when the bad one
has a finite gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from manifoldlib.optim import ManifoldMuon, build_optimizer, optimizer_diagnostics

MANIFOLDS = ["euclidean", "stiefel", "dgram", "oblique"]
#: two (10, 4) matrices (one bank, the bad one in it) and a (6, 6) one (a bank of its own)
SHAPES = [(10, 4), (10, 4), (6, 6)]


def _params(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen, dtype=torch.float64)) for s in SHAPES], gen


def _run(manifold, spectral, bad):
    """Two steps; at the second, entry (2, 3) of the second matrix's gradient is ``bad`` (``None``:
    left finite). Returns the parameters, the optimizer and the values before the second step."""
    params, gen = _params()
    opt = ManifoldMuon(params, manifold=manifold, lr=0.02, dual={"spectral": spectral})
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    opt.step()  # a good step first: momentum buffers are nonzero
    before = [p.detach().clone() for p in params]
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    if bad is not None:
        params[1].grad[2, 3] = bad
    opt.step()
    return params, opt, before, buffers


@pytest.mark.parametrize("spectral", ["eigh", "products"])
@pytest.mark.parametrize("manifold", MANIFOLDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_skips_its_matrix_and_counts_it(manifold, spectral, bad):
    params, opt, before, buffers = _run(manifold, spectral, bad)
    skipped = opt.state[params[1]]
    assert torch.equal(params[1].detach(), before[1])  # kept its value ...
    assert torch.equal(skipped["momentum_buffer"], buffers[1])  # ... and its momentum
    assert skipped["skipped_steps"].dim() == 0 and skipped["skipped_steps"].dtype == torch.long
    assert [int(opt.state[p]["skipped_steps"]) for p in params] == [0, 1, 0]
    for p in params:  # nothing non-finite anywhere but the skipped matrix's unmeasured residuals
        assert bool(torch.isfinite(p).all())
        for key, value in opt.state[p].items():
            if p is params[1] and key.endswith("residual"):
                continue
            assert not value.is_floating_point() or bool(torch.isfinite(value).all()), key
    # no direction was solved for it: no dual iterations, and NaN (not measured) residuals
    if manifold != "euclidean":  # (Muon's step: no dual)
        assert int(skipped["dual_iterations"]) == 0 and bool(torch.isnan(skipped["dual_residual"]))
    if "retraction_residual" in skipped:
        assert bool(torch.isnan(skipped["retraction_residual"]))
    # the others took the step they take when every gradient is finite (to rounding: a bank's
    # batched eigendecompositions may round a member differently next to other members)
    twins, twin_opt, _, _ = _run(manifold, spectral, None)
    for i in (0, 2):
        assert float((params[i] - twins[i]).detach().abs().max()) <= 1e-12, i
        assert int(opt.state[params[i]].get("dual_iterations", 0)) == int(twin_opt.state[twins[i]].get("dual_iterations", 0))
        assert torch.equal(opt.state[params[i]]["momentum_buffer"], twin_opt.state[twins[i]]["momentum_buffer"]), i
    assert not torch.equal(twins[1].detach(), before[1])  # a finite gradient would have moved it


@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_the_next_finite_gradient_steps_as_usual(manifold):
    params, opt, before, _ = _run(manifold, "products", float("nan"))
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
    assert not torch.equal(params[1].detach(), before[1])
    assert int(opt.state[params[1]]["skipped_steps"]) == 1  # counted once, not reset, not repeated
    for _ in range(2):  # two more skips add up
        for p in params:
            p.grad = torch.full(p.shape, float("nan"), dtype=p.dtype)
        opt.step()
    assert [int(opt.state[p]["skipped_steps"]) for p in params] == [2, 3, 2]


def test_diagnostics_report_the_skipped_matrix_by_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("attn", torch.nn.Linear(4, 6, bias=False))
    model.add_module("mlp", torch.nn.Linear(6, 12, bias=False))
    opt = build_optimizer(model, policy="all-stiefel", lr=0.02)
    model.attn.weight.grad = torch.full_like(model.attn.weight, float("nan"))
    model.mlp.weight.grad = torch.randn_like(model.mlp.weight)
    before = model.attn.weight.detach().clone()
    opt.step()
    rows = optimizer_diagnostics(opt, spectral=False)
    assert rows["attn.weight"]["skipped_steps"] == 1 and rows["mlp.weight"]["skipped_steps"] == 0
    # the skipped matrix solved nothing: its residuals are not measured (NaN), not exact (0)
    assert rows["attn.weight"]["dual_iterations"] == 0
    assert math.isnan(rows["attn.weight"]["dual_residual"]) and math.isnan(rows["attn.weight"]["retraction_residual"])
    assert 0.0 < rows["mlp.weight"]["dual_residual"] < 1.0 and rows["mlp.weight"]["dual_iterations"] > 0
    assert torch.equal(model.attn.weight.detach(), before)


@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_a_finite_float64_gradient_beyond_float32s_range_steps(manifold):
    # entries of ~1e100 are finite in float64 (their float32 sum, or a cast to the Euclidean
    # Newton-Schulz's float32/bfloat16, would be inf): not skipped, and the step (scale-free in G)
    # is the one the gradient's direction gives (a power-of-two scale: the casts round alike)
    params, gen = _params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ManifoldMuon(params, manifold=manifold, lr=0.02)
    twin_opt = ManifoldMuon(twins, manifold=manifold, lr=0.02)
    for p, q in zip(params, twins):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        p.grad, q.grad = 2.0**332 * g, g
    opt.step()
    twin_opt.step()
    for p, q in zip(params, twins):
        assert torch.isfinite(p).all()
        assert int(opt.state[p]["skipped_steps"]) == 0
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_a_finite_gradient_whose_float32_sum_overflows_steps(manifold, dtype):
    # entries of ~2^125 ≈ 4e37 to 8e37, all positive: finite in float32 and bfloat16, but 36 of them sum
    # past float32's 3.4e38; the finiteness test must not read that sum as a non-finite gradient
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in SHAPES]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ManifoldMuon(params, manifold=manifold, lr=0.02)
    twin_opt = ManifoldMuon(twins, manifold=manifold, lr=0.02)
    for p, q in zip(params, twins):
        g = (torch.rand(p.shape, generator=gen) + 1.0).to(dtype)
        p.grad, q.grad = 2.0**125 * g, g  # a power of two: the same mantissas
    opt.step()
    twin_opt.step()
    assert [int(opt.state[p]["skipped_steps"]) for p in params] == [0, 0, 0]
    # (Euclidean, bfloat16: Newton-Schulz scales the update into range first; unscaled, its
    # ||X||_F^2 overflowed float32 and the direction came back ~0, the step 1/37 of the twin's)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.detach(), q.detach())
