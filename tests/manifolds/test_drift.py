"""Rounding drift: many chained float32 retractions stay on the manifold (docs/theory/sphere.rst,
section Numerics, Drift).

Each step draws a fresh Gaussian direction, projects it onto the tangent space and retracts with
a step of about 5% of the point's size; no re-projection happens between steps.
"""

from __future__ import annotations

import pytest
import torch

from manifoldlib.functional import off_diagonal
from manifoldlib.testing import point_norm, random_point, registered_manifolds

CASES = dict(registered_manifolds(("sphere", "stiefel", "dgram")))
SHAPES = {"sphere": (16, 32), "stiefel": (4, 6, 3), "dgram": (4, 6, 3)}


def _relative_constraint_error(manifold, x: torch.Tensor) -> float:
    x = x.double()
    if manifold.name == "sphere":
        return float(((x.norm(dim=-1) - manifold.radius).abs() / manifold.radius).max())
    gram = x.mT @ x  # (..., n, n)
    if manifold.name == "stiefel":
        return float((gram - torch.eye(x.shape[-1], dtype=x.dtype)).abs().max())
    return float((off_diagonal(gram).norm(dim=(-2, -1)) / gram.norm(dim=(-2, -1))).max())


def _chain(manifold, steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = SHAPES[manifold.name]
    x0 = random_point(manifold, shape, generator=g, dtype=torch.float32)
    x = x0
    # ||z|| ≈ 0.05·||x|| per point before projection
    per_point = float(torch.tensor(shape[-manifold.ndim :]).prod())
    with torch.no_grad():
        for _ in range(steps):
            z = torch.randn(shape, generator=g) * (0.05 * point_norm(manifold, x) / per_point**0.5)
            x = manifold.retr(x, manifold.proju(x, z))
    return x0, x


@pytest.mark.parametrize(
    "case,steps",
    [
        # the other sphere retractions take 10,000 steps in the slow test below (a suite's
        # worth of seconds each)
        pytest.param("sphere-gnomonic", 10_000, marks=pytest.mark.slow),
        pytest.param("sphere-cayley", 10_000, marks=pytest.mark.slow),
        ("sphere-exp", 10_000),
        ("stiefel-polar", 2_000),
        ("stiefel-exp", 2_000),
        ("dgram-alternating", 2_000),
    ],
)
def test_chained_float32_retractions_stay_on_manifold(case, steps):
    manifold = CASES[case]
    x0, x = _chain(manifold, steps)
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    assert _relative_constraint_error(manifold, x) <= 1e-4
    assert float((x - x0).norm()) > 0.1 * float(x0.norm())  # the chain really moved


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_chained_float32_retractions_stay_on_manifold_every_retraction(case):
    manifold = CASES[case]
    _, x = _chain(manifold, 10_000, seed=1)
    assert _relative_constraint_error(manifold, x) <= 1e-4


@pytest.mark.parametrize("shape", [(6, 3), (16, 16)])
def test_chained_float32_stiefel_exp_stays_within_1e_5(shape):
    # the exponential computes in float64: without it 2,000 float32 steps drifted to 1.7e-5 (6x3)
    # and 2.9e-4 (16x16)
    manifold = CASES["stiefel-exp"]
    g = torch.Generator().manual_seed(0)
    x = random_point(manifold, shape, generator=g, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(2_000):
            z = torch.randn(shape, generator=g) * (0.05 / shape[-1] ** 0.5)
            x = manifold.retr(x, manifold.proju(x, z))
    assert x.dtype == torch.float32
    assert _relative_constraint_error(manifold, x) <= 1e-5
