"""Projections of rank-deficient matrices: Stiefel completes the range, DGram refuses.

msign maps zero singular values to 0, so the polar factor of a rank-deficient matrix is *not*
a Stiefel point; the projection used to return it (for a zero matrix: the zero matrix). A DGram
point needs nonzero, independent columns, so there is no nearest one; ManifoldMuon turned such a
matrix into NaNs on its first step.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from manifoldlib.functional import msign
from manifoldlib.functional.dgram import dgram_metric_projection
from manifoldlib.manifolds import DGram, Stiefel
from manifoldlib.optim import ManifoldMuon, build_optimizer, constraint_residual, steepest_direction


def _rank_deficient(m: int, n: int, rank: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, n, generator=g,
                                                                               dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("rank", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stiefel_projection_of_a_rank_deficient_matrix_is_on_the_manifold(rank, dtype):
    x = _rank_deficient(9, 5, rank, seed=rank, dtype=dtype)
    y = Stiefel().projx(x)
    assert y.dtype == dtype
    eye = torch.eye(5, dtype=torch.float64)
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    assert float(torch.linalg.matrix_norm(y.double().T @ y.double() - eye)) <= tol
    if rank:  # on the row space of x it is still the polar factor: it agrees with msign there
        rows = torch.linalg.svd(x.double(), full_matrices=False)[2][:rank].T  # (5, rank)
        torch.testing.assert_close(y.double() @ rows, msign(x.double(), "svd") @ rows, rtol=0, atol=1e-5)


def test_stiefel_projection_is_still_the_nearest_point_for_full_rank():
    x = _rank_deficient(9, 5, 5, seed=7)
    y = Stiefel().projx(x)
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(y, u @ vh, rtol=0, atol=1e-13)
    # nearer than any other sampled Stiefel point
    others = [Stiefel().random(9, 5, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
              for k in range(20)]
    assert all(float((x - y).norm()) <= float((x - o).norm()) for o in others)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.zeros(8, 4), "got rank 0; zero columns: [0, 1, 2, 3]"),
        (torch.ones(8, 4), "got rank 1: no nearest dgram point exists"),
        (torch.cat([torch.eye(8)[:, :3], torch.zeros(8, 1)], 1), "got rank 3; zero columns: [3]"),
    ],
    ids=["zero", "rank-1", "zero-column"],
)
def test_dgram_projection_refuses_rank_deficient_input(x, message):
    with pytest.raises(ValueError, match="dgram needs a matrix of full column rank 4") as caught:
        DGram().projx(x)
    assert message in str(caught.value)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_manifold_muon_refuses_a_zero_initialized_matrix_by_name(manifold):
    model = torch.nn.Module()
    model.attn = torch.nn.Linear(8, 8, bias=False)
    torch.nn.init.zeros_(model.attn.weight)
    policy = "all-stiefel" if manifold == "stiefel" else "all-dgram"
    with pytest.raises(ValueError, match=rf"parameter 'attn.weight' of shape \(8, 8\) is all zeros and "
                                         rf"cannot be projected onto {manifold}"):
        build_optimizer(model, policy=policy)


def test_manifold_muon_names_a_rank_deficient_dgram_matrix():
    p = torch.nn.Parameter(torch.ones(8, 4))
    with pytest.raises(ValueError, match=r"parameter #0 of its group of shape \(8, 4\): dgram needs a matrix"):
        ManifoldMuon([p], manifold="dgram")
    q = torch.nn.Parameter(torch.ones(8, 4))
    ManifoldMuon([q], manifold="stiefel")  # Stiefel completes the range instead
    assert float(constraint_residual(q.detach(), "stiefel")) <= 1e-6


def test_dgram_dual_refuses_zero_columns_instead_of_returning_nan():
    w = torch.cat([torch.eye(6)[:, :3], torch.zeros(6, 1)], 1)
    with pytest.raises(ValueError, match=r"W is not a DGram point: columns \[3\] \(tall orientation\) are zero"):
        steepest_direction(w, torch.randn(6, 4), "dgram")


def _ill_conditioned_float32(m: int, n: int, seed: int) -> torch.Tensor:
    """A full-rank float32 ``(m, n)`` Gaussian matrix whose smallest singular value is set to
    1e-6 of its largest: its unit-norm columns have a condition number past
    ``1/(max(m, n)·eps₃₂)``, as a square Gaussian initialization has with probability about
    ``2n²·eps₃₂``."""
    g = torch.Generator().manual_seed(seed)
    x = 0.02 * torch.randn(m, n, generator=g, dtype=torch.float64)
    u, sv, vh = torch.linalg.svd(x, full_matrices=False)
    sv[-1] = 1e-6 * sv[0]
    x = ((u * sv) @ vh).float()
    unit = x.double() / x.double().norm(dim=0)
    sv = torch.linalg.svdvals(unit)
    assert float(sv[0] / sv[-1]) > 1 / (max(m, n) * torch.finfo(torch.float32).eps)  # float32's eps calls it rank deficient
    assert float(sv[0] / sv[-1]) < 1e9  # float64's does not
    return x


@pytest.mark.parametrize(("m", "n"), [(64, 64), (96, 48)])
def test_dgram_projects_a_full_rank_float32_matrix_float32_eps_would_call_deficient(m, n):
    """A square float32 Gaussian init has such a condition number with probability about
    2n²·eps₃₂ (one in seven at n = 768); the projection runs in float64 and returns a DGram point
    as near as the nearest one (which exists: interior, certified by stationarity)."""
    x = _ill_conditioned_float32(m, n, seed=m + n)
    w = DGram().projx(x)
    assert w.dtype == torch.float32 and bool(torch.isfinite(w).all())
    w64 = DGram().projx(x.double())
    gram = w64.T @ w64
    off = gram - torch.diag(torch.diagonal(gram))
    assert float(off.abs().max()) <= 1e-12 * float(torch.diagonal(gram).max())
    # the nearest point, certified: x − W* normal to the tangent space at W*, every column well
    # away from zero; 2000 alternating rounds reach it too, no nearer than the projection
    normal = x.double() - w64
    assert float(DGram().proju(w64, normal).norm()) <= 1e-10 * float(normal.norm())
    d = w64.norm(dim=0)
    assert float(d.min()) >= 0.1 * float(d.max())
    rounds = dgram_metric_projection(x.double(), iterations=2000)
    assert float(normal.norm()) <= (1 + 1e-12) * float((x.double() - rounds).norm())
    torch.testing.assert_close(w.double(), w64, rtol=0, atol=1e-6 * float(w64.abs().max()))


def test_manifold_muon_takes_and_steps_such_a_dgram_matrix():
    p = torch.nn.Parameter(_ill_conditioned_float32(64, 64, seed=1))
    opt = ManifoldMuon([p], manifold="dgram", lr=0.01)
    p.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    opt.step()
    assert bool(torch.isfinite(p).all())
    assert float(constraint_residual(p.detach(), "dgram")) <= 1e-4


@pytest.mark.parametrize("eps", [1e-2, 1e-4, 1e-7])
def test_nearly_dependent_dgram_columns_have_an_interior_nearest_point(eps):
    """Full column rank is enough for a nearest DGram point (docs/theory/dgram.rst): two nearly
    parallel columns give one with both column norms near 1/sqrt(2), not a vanishing column. The
    projection is checked against a dense search over every 2 x 2 orthogonal Q (d_j = max(0, q_j^T x_j))."""
    x = torch.tensor([[1.0, 1.0], [0.0, eps]], dtype=torch.float64)
    p = DGram().projx(x)
    a = torch.linspace(0, 2 * math.pi, 2_000_001, dtype=torch.float64)
    c, s = torch.cos(a), torch.sin(a)
    best = math.inf
    for sign in (1.0, -1.0):  # rotations and reflections
        d1 = (c * x[0, 0] + s * x[1, 0]).clamp_min(0)  # q_1 = (c, s)
        d2 = (-sign * s * x[0, 1] + sign * c * x[1, 1]).clamp_min(0)  # q_2 = sign * (-s, c)
        best = min(best, float(((x * x).sum() - d1 * d1 - d2 * d2).min()))
    cost = float(((x - p) ** 2).sum())
    assert cost <= best + 1e-10
    assert float((p.mT @ p - torch.diag(torch.diagonal(p.mT @ p))).abs().max()) <= 1e-12
    norms = p.norm(dim=0)
    assert float((norms - 2 ** -0.5).abs().max()) < 0.01


def _spread(m: int, n: int, decades: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(m + n)
    return torch.randn(m, n, generator=g, dtype=torch.float64) * torch.logspace(-decades, decades, n, dtype=torch.float64)


@pytest.mark.parametrize(("m", "n", "decades"), [(128, 128, 1.0), (256, 256, 2.0), (64, 64, 0.0)])
def test_dgram_projection_is_the_nearest_point_where_alternating_rounds_crawl(m, n, decades):
    """Square matrices, plain Gaussian or with column norms spread over ``2 * decades`` orders: ten
    alternating rounds (the projection before it searched to stationarity) leave a column norm
    off by 2e-4 to 7e-2; projx is stationary (x - W normal at W) to 1e-10 and no farther from x
    than ten or 200 rounds."""
    x = _spread(m, n, decades)
    w = DGram().projx(x)
    normal = x - w
    assert float(DGram().proju(w, normal).norm()) <= 1e-10 * float(normal.norm())
    assert float(constraint_residual(w, "dgram")) <= 1e-12
    ten = dgram_metric_projection(x, iterations=10)
    assert float(((ten.norm(dim=0) - w.norm(dim=0)).abs() / w.norm(dim=0)).max()) > 1e-4  # stopped short
    for rounds in (ten, dgram_metric_projection(x, iterations=200)):
        assert float(normal.norm()) <= float((x - rounds).norm()) * (1 + 1e-14)


def test_a_dgram_projection_that_does_not_converge_says_so(monkeypatch):
    import manifoldlib.functional.dgram as kernels

    monkeypatch.setattr(kernels, "PROJECTION_MAX_EVALUATIONS", 2)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"\(64, 64\) matrix was not found within 2 evaluations \(relative stationarity"):
        DGram().projx(x)


def test_columns_the_svd_drowns_are_resolved_by_the_newton_polar_factor():
    """Column norms over six orders in a square matrix: with the SVD's polar factor the small
    columns of the nearest point drown in the large ones' rounding (a column of norm 1e-308 came
    back; ten alternating rounds returned ~1e-11 for inputs of norm 0.02). The search is repeated
    with the QR-based Newton polar factor, which resolves each column relative to its own norm."""
    x = _spread(128, 128, 3)
    w = DGram().projx(x)
    assert float(DGram().proju(w, x - w).norm()) <= 1e-10 * float((x - w).norm())
    assert float(w.norm(dim=0).min()) > 1e-3  # the nearest point's smallest column is 1.2e-3
    newton = dgram_metric_projection(x, method="newton")
    torch.testing.assert_close(w, newton, rtol=0, atol=1e-9 * float(w.abs().max()))


def test_a_column_the_search_does_not_determine_is_refused_naming_it(monkeypatch):
    import manifoldlib.functional.dgram as kernels

    monkeypatch.setattr(kernels, "PROJECTION_COLUMN_TOL", 1e-30)  # no column is a fixed point to 1e-30
    x = _spread(32, 32, 1)
    with pytest.raises(ValueError, match=r"does not determine the nearest DGram point's columns \[\d"):
        DGram().projx(x)
    p = torch.nn.Parameter(x.clone())
    with pytest.raises(ValueError, match=r"parameter #0 of its group of shape \(32, 32\): .*does not determine"):
        ManifoldMuon([p], manifold="dgram")
    assert torch.equal(p.detach(), x)  # refused before anything moved


def test_the_same_spread_over_fewer_columns_is_projected():
    x = _spread(64, 64, 3)  # stationary at float64's floor for this spread (PROJECTION_FLOOR)
    w = DGram().projx(x)
    assert float(DGram().proju(w, x - w).norm()) <= 1e-8 * float((x - w).norm())
    assert float(w.norm(dim=0).min()) > 0


@pytest.mark.parametrize("method", ["auto", "svd", "gram-eigh", "newton-schulz"])
@pytest.mark.parametrize("cancelled", [[0], [0, 1, 2, 3, 4]], ids=["one-column", "all"])
def test_stiefel_polar_retraction_of_a_rank_deficient_step_is_on_the_manifold(method, cancelled):
    """A step that cancels columns of x (u = -x there) makes x + u rank deficient: msign maps its
    zero singular values to 0, and the polar retraction returned that, a matrix with zero columns
    (u = -x: the zero matrix), off the manifold without an error. It completes the range as
    projx does: a Stiefel point, the polar factor on the row space of x + u."""
    x = Stiefel().random(9, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mask = torch.zeros(5, dtype=torch.float64)
    mask[cancelled] = 1.0
    u = -x * mask
    y = Stiefel(retraction="polar", method=method).retr(x, u)
    eye = torch.eye(5, dtype=torch.float64)
    assert float((y.T @ y - eye).abs().max()) <= 1e-14
    kept = [j for j in range(5) if j not in cancelled]
    if kept:  # x + u = x diag(1 - mask): its row space is spanned by the kept coordinates
        torch.testing.assert_close(y[:, kept], msign(x + u, "svd")[:, kept], rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    ("retraction", "method"),
    [("colnorm-polar", "auto"), ("colnorm-polar", "svd"), ("colnorm-polar", "gram-eigh"),
     ("colnorm-polar", "newton-schulz"), ("alternating", "svd"), ("alternating", "newton-schulz")],
)
def test_dgram_retraction_of_a_step_to_parallel_columns_is_a_dgram_point(retraction, method):
    """A step that makes column 1 of x + u twice column 0: the polar factor of the rank-deficient
    x + u (or x + u diag(c)) had a zero column, so both columns of the result lay along one
    direction (cosine 1), off the manifold without an error. The SVD's completion gives
    orthonormal factors: orthogonal columns, colnorm-polar's of the norms of x + u's columns."""
    w = DGram().random(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = torch.zeros_like(w)
    u[:, 1] = 2.0 * w[:, 0] - w[:, 1]
    y = DGram(retraction=retraction, method=method).retr(w, u)
    norms = y.norm(dim=0)
    assert float(norms.min()) > 0.1
    cosines = (y.T @ y) / (norms.unsqueeze(0) * norms.unsqueeze(1))
    assert float((cosines - torch.eye(3, dtype=torch.float64)).abs().max()) <= 1e-14
    if retraction == "colnorm-polar":
        torch.testing.assert_close(norms, (w + u).norm(dim=0), rtol=1e-15, atol=0)


@pytest.mark.parametrize("iterations", [None, 3], ids=["to-convergence", "3-rounds"])
def test_the_functional_dgram_projection_refuses_rank_deficient_input(iterations):
    # with iterations, a zero column came back zero and two parallel ones a point off DGram (a
    # column of norm 0.16 at cosine far from 0), no error; to convergence msign's "use method='svd'"
    y = torch.randn(6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    parallel = y.clone()
    parallel[:, 1] = 2.0 * y[:, 0]
    for x, detail in ((y * torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), "; zero columns: [1]"),
                      (parallel, ": no nearest")):
        with pytest.raises(ValueError, match=re.escape(f"dgram_metric_projection needs a matrix of full column "
                                                       f"rank 3 (nonzero, linearly independent columns), got rank 2{detail}")):
            dgram_metric_projection(x, iterations)
