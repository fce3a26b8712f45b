"""The smoothed dual's line search: Armijo on the value where the value can see the predicted
decrease, a lower residual where rounding hides it (float32 near the optimum)."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.optim import ExecutionPolicy, dual_solvers
from manifoldlib.optim.dual_problem import _State
from manifoldlib.optim.steepest import solve_dual


def _state(value: float) -> _State:
    return _State(torch.zeros(2, 2), None, value=value)


def test_armijo_decides_where_the_value_resolves_the_decrease():
    accept = dual_solvers._accept
    # predicted decrease 1e-3 against noise 1e-6: the value decides, the residual is ignored
    # Armijo asks for 1e-4 of the predicted decrease: 1e-7 here
    assert accept(_state(10.0), _state(10.0 - 5e-8), 1.0, 0.1, -1e-3, 1e-6) is False  # residual fell: ignored
    assert accept(_state(10.0), _state(10.0 - 2e-7), 1.0, 5.0, -1e-3, 1e-6) is True  # residual rose: ignored


def test_the_residual_decides_where_rounding_hides_the_decrease():
    accept = dual_solvers._accept
    # predicted decrease 1e-9 below noise 1e-6: a value that rose by rounding does not matter
    assert accept(_state(10.0), _state(10.0 + 3e-6), 1e-3, 9e-4, -1e-9, 1e-6) is True
    assert accept(_state(10.0), _state(10.0 - 3e-6), 1e-3, 1.1e-3, -1e-9, 1e-6) is False
    assert accept(_state(10.0), _state(10.0), 1e-3, float("nan"), -1e-9, 1e-6) is False


def _instance(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(n, n, generator=g))[0] * torch.exp(0.1 * torch.randn(n, generator=g))
    signal = torch.randn(n, 16, generator=g) @ torch.randn(16, n, generator=g) / n
    return w, signal + 0.3 * torch.randn(n, n, generator=g) / n**0.5


def test_float32_newton_steps_past_the_noise_floor_stop_wasting_evaluations(monkeypatch):
    """Continue converged 64² DGram solves (float32) towards 1e-6: there the predicted decreases
    (~1e-9) are below the value's rounding (~1e-6). Armijo alone (a noise allowance of zero ulps)
    backtracks on noise (about ten evaluations per Newton step); the noise-aware test accepts
    residual decreases instead."""
    evaluations = {"armijo": 0, "noise-aware": 0}
    options = dict(msign_method="jordan5", gap_tol=None, execution=ExecutionPolicy())  # float32 search products
    for seed in range(3):
        w, g = _instance(64, seed)
        solution = solve_dual(w, g, "dgram", tol=1e-3, max_iter=30, **options)
        assert solution.info.converged
        residuals = {}
        for name, ulps in (("armijo", 0), ("noise-aware", dual_solvers.VALUE_NOISE_ULPS)):
            monkeypatch.setattr(dual_solvers, "VALUE_NOISE_ULPS", ulps)
            info = solve_dual(w, g, "dgram", tol=1e-6, max_iter=8, multiplier=solution.info.multiplier,
                              **options).info
            assert info.stages == ("smoothed",) and info.iterations >= 1
            evaluations[name] += info.evaluations
            residuals[name] = info.residual
        assert residuals["noise-aware"] <= 1.2 * residuals["armijo"], residuals
    assert evaluations["noise-aware"] <= 0.7 * evaluations["armijo"], evaluations


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_square_dgram_solves_still_converge(dtype):
    w, g = _instance(48, seed=4)
    solution = solve_dual(w.to(dtype), g.to(dtype), "dgram", msign_method="jordan5", tol=1e-3, max_iter=30,
                          gap_tol=None)  # the optimizer's budget; the certified default is tested elsewhere
    assert solution.info.converged
    assert dual_solvers.VALUE_NOISE_ULPS == 16
