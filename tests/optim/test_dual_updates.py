"""Plain-dual update rules: Anderson-mixed eigenbasis-preconditioned steps against BB steps.

The optimal value comes from the independent scipy dual of ``test_steepest.py``; the Anderson
update must reach it with a Newton–Schulz msign (the eigen path), and so must BB on the
products-only path; Anderson must take fewer iterations than BB,
and hand a stalled solve to the smoothed dual.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_steepest import CASES, _dual_optimum, _instance

from manifoldlib.optim import (
    ExecutionPolicy,
    ManifoldMuon,
    dual_solvers,
    steepest_direction,
    tangent_residual,
)
from manifoldlib.optim.steepest import DUAL_UPDATES, solve_dual


@pytest.mark.parametrize("manifold,m,n", [c for c in CASES if c[1] > c[2]])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "update,spectral", [("anderson", "eigh"), ("auto", "products")]  # the products path moves by BB
)
def test_plain_dual_reaches_the_independent_optimum(manifold, m, n, seed, update, spectral):
    w, g = _instance(m, n, manifold, seed)
    a, info = steepest_direction(w, g, manifold, tol=1e-8, max_iter=500, msign_method="newton-schulz",
                                 ns_steps=60, dual_update=update, spectral=spectral, smoothing=None,
                                 return_info=True)
    optimum = _dual_optimum(w.numpy(), g.numpy(), zero_diag=manifold == "dgram")
    assert info.converged
    assert abs(float((g * a).sum()) - optimum) <= 1e-3 * optimum
    assert float(torch.linalg.matrix_norm(a, ord=2)) <= 1 + 1e-4
    assert float(tangent_residual(w, a, manifold)) <= 1e-6


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_anderson_needs_fewer_iterations_than_bb(manifold, seed):
    # a GPT-like tall instance: a low-rank signal plus noise, float32, Muon's msign in the dual
    m, n = 512, 128
    gen = torch.Generator().manual_seed(seed)
    w, _ = _instance(m, n, manifold, seed, dtype=torch.float32)
    g = (torch.randn(m, 8, generator=gen) @ torch.randn(8, n, generator=gen)) / 8 + 0.3 * torch.randn(m, n, generator=gen)
    iterations = {}
    for update in ("anderson", "bb"):
        a, info = steepest_direction(w, g, manifold, tol=1e-3, max_iter=60, msign_method="jordan5",
                                     dual_update=update, smoothing=None, return_info=True)
        assert info.converged, (update, info.history)
        assert float(tangent_residual(w, a, manifold)) <= 1e-3
        iterations[update] = info.iterations
    assert iterations["anderson"] < iterations["bb"], iterations


def test_auto_picks_anderson_on_the_eigen_path_and_bb_for_svd():
    w, g = _instance(24, 6, "stiefel", seed=3)
    kw = {"tol": 1e-6, "max_iter": 300, "return_info": True}
    for method, expected in (("jordan5", "anderson"), ("svd", "bb")):
        _, auto = steepest_direction(w, g, "stiefel", msign_method=method, **kw)
        _, explicit = steepest_direction(w, g, "stiefel", msign_method=method, dual_update=expected, **kw)
        assert auto.history == explicit.history


def test_unknown_or_impossible_dual_update_is_refused():
    w, g = _instance(12, 4, "stiefel", seed=0)
    with pytest.raises(ValueError, match="unknown dual_update 'newton'; valid: auto, anderson, bb"):
        steepest_direction(w, g, dual_update="newton")
    with pytest.raises(ValueError, match="dual_update='anderson' needs a Newton-Schulz msign_method"):
        steepest_direction(w, g, msign_method="svd", dual_update="anderson")
    p = torch.nn.Parameter(w.clone())
    with pytest.raises(ValueError, match="dual update must be one of auto, anderson, bb, got 'lbfgs'"):
        ManifoldMuon([p], manifold="stiefel", dual={"update": "lbfgs"})
    with pytest.raises(ValueError, match="needs a Newton-Schulz msign_method, got msign_method='svd'"):
        ManifoldMuon([p], manifold="stiefel", dual={"update": "anderson", "msign_method": "svd"})
    assert DUAL_UPDATES == ("auto", "anderson", "bb")


def _tall_dgram_trajectory(smoothing):
    """Residuals of a 12x8 DGram matrix along 10 ManifoldMuon steps on a quadratic; its plain
    dual stalls from the first step (a rank-deficient optimum on a tall matrix)."""
    gen = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(0.1 * torch.randn(12, 8, generator=gen, dtype=torch.float64))
    target = torch.randn(12, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    opt = ManifoldMuon([p], lr=0.05, momentum=0.9, manifold="dgram", dual={"smoothing": smoothing})
    residuals = []
    for _ in range(10):
        p.grad = (p.detach() - target) + 0.01 * torch.sin(p.detach() * 7.0)
        opt.step()
        residuals.append(opt.state[p]["dual_residual"])
    return residuals


def test_a_stalled_tall_dual_continues_on_the_smoothed_dual():
    plain = _tall_dgram_trajectory(None)
    auto = _tall_dgram_trajectory("auto")
    assert max(plain) > 1e-2  # the plain dual stalls far above the tolerance ...
    assert max(auto) <= 1e-3  # ... and the smoothed continuation converges every step


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_bfloat16_step_rotations_keep_the_iterations_of_float32(manifold):
    # the preconditioned step of a float32 solve is rotated in bfloat16 where that is native: a
    # search direction with a 4e-3 relative error, checked by a residual evaluated in float32
    w, g = _instance(400, 100, manifold, seed=3)
    runs = {}
    for native in (False, True):
        # the policy of a CPU with native bfloat16; small instances take it too (min size 32)
        policy = ExecutionPolicy.resolve("cpu", bfloat16_native=native)
        policy = dataclasses.replace(policy, search_min_size=32)
        runs[native] = steepest_direction(w.float(), g.float(), manifold, tol=1e-5, max_iter=60,
                                          msign_method="jordan5", smoothing=None, dual_update="anderson",
                                          execution=policy, return_info=True)
    (a32, info32), (a16, info16) = runs[False], runs[True]
    assert info32.converged and info16.converged
    assert abs(info16.iterations - info32.iterations) <= 1
    assert float(tangent_residual(w, a16.double(), manifold)) <= 2e-5
    assert 0 < float((a16 - a32).norm() / a32.norm()) <= 1e-3  # a different path to the same answer
    # float64 solves never take it
    assert policy.search_dtype_for(w) == torch.float64
    assert policy.search_dtype_for(w.float()) == torch.bfloat16
    assert policy.search_dtype_for(torch.zeros(31, 31)) == torch.float32  # under the size floor


@pytest.mark.parametrize("m", [48, 60])
def test_bfloat16_hessian_products_reach_the_float32_answer(m):
    # square DGram (always smoothed) and a near-square tall DGram (smoothed by "auto"): the
    # Hessian-vector products that steer CG run in bfloat16 where native; the Newton iterates
    # are evaluated in float32 and must reach the same answer
    w, g = _instance(m, 48, "dgram", seed=4)
    runs = {}
    for native in (False, True):
        policy = dataclasses.replace(ExecutionPolicy.resolve("cpu", bfloat16_native=native), search_min_size=32)
        assert policy.search_dtype_for(w.float()) == (torch.bfloat16 if native else torch.float32)
        runs[native] = solve_dual(w.float(), g.float(), "dgram", tol=1e-3, max_iter=40, msign_method="jordan5",
                                  gap_tol=None, execution=policy)  # the optimizer's float32 solve
        info = runs[native].info
        assert info.converged and info.stages[-1] == "smoothed"
        assert info.hessian_products > 20  # the solve ran on Hessian-vector products
    a32, a16 = runs[False].direction(), runs[True].direction()
    assert not torch.equal(a32, a16)  # the bfloat16 products took another path ...
    assert float(tangent_residual(w, a16.double(), "dgram")) <= 1.5e-3
    value32, value16 = float((g.float() * a32).sum()), float((g.float() * a16).sum())
    assert abs(value16 - value32) <= 1e-3 * abs(value32)


def test_search_products_stay_float32_below_the_size_floor():
    # bfloat16 products are no faster under ~128 columns (2.5x slower at 64): small solves keep float32
    from manifoldlib.optim.execution import BFLOAT16_MIN_SIZE

    policy = ExecutionPolicy.resolve("cpu", bfloat16_native=True)
    assert policy.search_min_size == BFLOAT16_MIN_SIZE == 256
    assert policy.search_dtype_for(torch.zeros(BFLOAT16_MIN_SIZE, BFLOAT16_MIN_SIZE)) == torch.bfloat16
    assert policy.search_dtype_for(torch.zeros(BFLOAT16_MIN_SIZE - 1, BFLOAT16_MIN_SIZE - 1)) == torch.float32
    assert policy.search_dtype_for(torch.zeros(8, 8, dtype=torch.float64)) == torch.float64
    assert policy.search_dtype_for(torch.zeros(8, 8, dtype=torch.bfloat16)) == torch.bfloat16  # never changes a dtype otherwise
    plain = ExecutionPolicy.resolve("cpu", bfloat16_native=False)  # no native bfloat16: never
    assert plain.search_dtype_for(torch.zeros(BFLOAT16_MIN_SIZE, BFLOAT16_MIN_SIZE)) == torch.float32


def _gpt_like(m, n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=dtype))[0]
    signal = (torch.randn(m, 8, generator=g, dtype=dtype) / m**0.5) @ (torch.randn(8, n, generator=g, dtype=dtype) / n**0.5)
    return w, signal + 0.3 * torch.randn(m, n, generator=g, dtype=dtype) / m**0.5


def _history(w, g, manifold, iterations):
    info = solve_dual(w, g, manifold, tol=1e-12, max_iter=iterations, msign_method="jordan5", ns_steps=5,
                      ns_coefficients=(3.4445, -4.7750, 2.0315), smoothing=None, dual_update="anderson").info
    return info.history


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_over_relaxed_steps_reach_lower_residuals(monkeypatch, manifold, seed):
    w, g = _gpt_like(512, 128, seed)
    if manifold == "dgram":
        w = w * torch.exp(0.02 * torch.randn(128, generator=torch.Generator().manual_seed(seed), dtype=w.dtype))
    assert dual_solvers.PRECONDITIONED_RELAXATION == 1.2
    relaxed = _history(w, g, manifold, 3)
    monkeypatch.setattr(dual_solvers, "PRECONDITIONED_RELAXATION", 1.0)
    plain = _history(w, g, manifold, 3)
    assert relaxed[0] == plain[0]  # the same start
    assert relaxed[3] <= 0.85 * plain[3]  # measured: 0.69-0.70 (Stiefel), 0.71-0.72 (DGram)


def test_over_relaxation_stops_once_the_residual_grows():
    # a low-rank DGram instance on which over-relaxed steps without the fallback ran into the
    # cap of 100 iterations (benchmarks/bench_dual_iterations.py, Muon's quintic)
    w, g = _instance(64, 16, "dgram", 5, lowrank=True)
    _, info = steepest_direction(w, g, "dgram", tol=1e-3, max_iter=100, msign_method="jordan5",
                                 dual_update="anderson", smoothing=None, return_info=True)
    assert info.converged and info.iterations <= 30
    used = list(info.relaxations)
    assert len(used) == info.iterations  # one preconditioned step per Anderson iteration
    history = info.history
    first_growth = next(k for k in range(len(history) - 1) if not history[k + 1] < history[k])
    assert used[: first_growth + 1] == [1.2] * (first_growth + 1)
    assert used[first_growth + 1:] == [1.0] * (len(used) - first_growth - 1)
    assert len(used) > first_growth + 1  # it went on with plain steps
