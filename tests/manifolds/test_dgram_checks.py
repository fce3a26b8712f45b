"""DGram's point check and constraint deviation judge each pair of columns by its cosine."""

from __future__ import annotations

import math

import pytest
import torch

from manifoldlib import DGram
from manifoldlib.manifolds.dgram import column_cosines
from manifoldlib.optim import constraint_residual

DTYPES = [torch.float32, torch.float64]


def _orthonormal(m, n, seed, batch=()):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(batch + (m, n), generator=g, dtype=torch.float64))
    return q  # (..., m, n)


def _collapsed_point(dtype):
    """20x5, column norms 0.036..39, the 0.036 column collapsed to norm 5e-11 at cosine 0.98 with
    column 1 (what an SVD polar factor once made of a retraction step)."""
    q = _orthonormal(20, 5, 0)
    w = q * torch.logspace(math.log10(0.036), math.log10(39.0), 5, dtype=torch.float64)
    w[:, 0] = 5e-11 * (0.98 * q[:, 1] + math.sqrt(1 - 0.98**2) * q[:, 0])
    return w.to(dtype)


def _tiny_at_cosine(dtype, batch=()):
    """Columns of norms 1e-3 .. 1e3; the 1e-3 column at cosine 0.5 with the 1e3 one."""
    q = _orthonormal(12, 4, 1, batch)
    w = q * torch.tensor([1e-3, 1.0, 10.0, 1e3], dtype=torch.float64)
    w[..., 0] = 1e-3 * (0.5 * q[..., 3] + math.sqrt(0.75) * q[..., 0])
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_collapsed_small_column_is_refused(dtype):
    w = _collapsed_point(dtype)
    ok, reason = DGram().check_point_on_manifold(w, explain=True)
    assert not ok and "columns 0, 1" in reason and "exceeds" in reason
    with pytest.raises(ValueError, match="exceeds"):
        DGram().assert_check_point_on_manifold(w)
    assert float(column_cosines(w)[0, 1]) == pytest.approx(0.98, abs=1e-5)
    # Off(C) / ||C||_F: the pair counts with its cosine, not weighted by ||w_0|| ||w_1|| / ||W^T W||_F
    unit = math.sqrt(5 + 2 * 0.98**2)  # ||C||_F
    assert float(DGram().constraint_deviation(w)[0, 1]) == pytest.approx(0.98 / unit, abs=1e-5)
    assert float(constraint_residual(w, "dgram")) == pytest.approx(0.98 * math.sqrt(2) / unit, abs=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tiny_column_at_cosine_one_half_with_a_big_one_is_refused(dtype):
    w = _tiny_at_cosine(dtype)
    ok, reason = DGram().check_point_on_manifold(w, explain=True)
    assert not ok and "columns 0, 3" in reason
    assert float(column_cosines(w)[0, 3]) == pytest.approx(0.5, abs=1e-6)
    assert float(DGram().constraint_deviation(w)[0, 3]) == pytest.approx(0.5 / math.sqrt(4.5), abs=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_check_refuses_one_bad_matrix_and_passes_good_ones(dtype):
    bad = _tiny_at_cosine(dtype, batch=(3,))
    good = _orthonormal(12, 4, 2, (3,)).to(dtype) * torch.tensor([1e-3, 1.0, 10.0, 1e3], dtype=dtype)
    assert DGram().check_point_on_manifold(good)
    mixed = good.clone()
    mixed[1] = bad[1]
    assert not DGram().check_point_on_manifold(mixed)
    dev = DGram().constraint_deviation(mixed)  # (3, 4, 4)
    assert dev.shape == (3, 4, 4)
    assert float(dev[1, 0, 3]) == pytest.approx(0.5 / math.sqrt(4.5), abs=1e-6)  # ||C||_F^2 = 4 + 2/4
    assert float(dev[[0, 2]].abs().max()) <= 16 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_is_scale_free_to_the_ends_of_the_dtype_range(dtype):
    """Orthogonal columns pass whatever their norms, where W^T W itself over- or underflows."""
    big = math.log10(torch.finfo(dtype).max) - 2
    tiny = math.log10(torch.finfo(dtype).tiny) + 2
    q = _orthonormal(16, 3, 3)
    for norms in ([10**tiny, 1.0, 10**big], [10**big] * 3, [10**tiny] * 3):
        w = (q * torch.tensor(norms, dtype=torch.float64)).to(dtype)
        ok, reason = DGram().check_point_on_manifold(w, explain=True, atol=0.0, rtol=16 * torch.finfo(dtype).eps)
        assert ok, (norms, reason)
        assert float(DGram().constraint_deviation(w).abs().max()) <= 16 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
def test_tolerance_is_compared_with_the_largest_cosine(dtype):
    """The check passes exactly when max |cos| <= atol + rtol."""
    q = _orthonormal(10, 3, 4)
    c = 1e-3
    w = q.clone()
    w[:, 2] = 1e-4 * (c * q[:, 0] + math.sqrt(1 - c**2) * q[:, 2])
    w = w.to(dtype)
    assert DGram().check_point_on_manifold(w, atol=0.0, rtol=1.01 * c)
    assert DGram().check_point_on_manifold(w, atol=0.5 * c, rtol=0.51 * c)
    assert not DGram().check_point_on_manifold(w, atol=0.0, rtol=0.99 * c)
    assert not DGram().check_point_on_manifold(w, atol=0.99 * c, rtol=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_columns_are_refused_and_have_no_cosine(dtype):
    w = _orthonormal(8, 3, 5, (2,)).to(dtype)
    w[1, :, 2] = 0
    ok, reason = DGram().check_point_on_manifold(w, explain=True)
    assert not ok and "columns [2]" in reason and "zero" in reason
    dev = DGram().constraint_deviation(w)
    assert dev[1].isnan().all() and not dev[0].isnan().any()


def test_non_finite_columns_fail_and_cosines_are_taken_in_at_least_float32():
    w = _orthonormal(8, 3, 6)
    for value in (float("nan"), float("inf")):
        bad = w.clone()
        bad[0, 1] = value
        ok, reason = DGram().check_point_on_manifold(bad, explain=True)
        assert not ok and "nan" in reason
    assert column_cosines(w).dtype == torch.float64
    assert column_cosines(w.to(torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_columns_are_named_as_non_finite_not_as_zero(value):
    """A NaN in W made dual_factor say 'columns [] ... are zero' and the point check blame the
    cosine of columns (0, 1); an inf passed dual_factor's check (norm inf > 0)."""
    w = _orthonormal(8, 4, 7, (2,)).float()
    w[1, 3, 2] = value
    ok, reason = DGram().check_point_on_manifold(w, explain=True)
    assert not ok and reason.startswith("columns [2] of W hold non-finite entries (nan or inf)")
    with pytest.raises(ValueError, match=r"^W is not a DGram point: columns \[2\] \(tall orientation\) "
                                         r"hold non-finite entries \(nan or inf\)"):
        DGram().dual_factor(w)
    DGram().dual_factor(w, check=False)  # no host read, no error


@pytest.mark.parametrize("scale, what", [(1e-25, "underflow to 0"), (1e25, "overflow to inf")])
def test_dual_factor_names_column_norms_out_of_range_instead_of_zero_columns(scale, what):
    """A float32 DGram point at scale 1e-25 (nonzero, orthogonal columns; its point check passes)
    was refused as 'columns [0, 1, 2] ... are zero'; at 1e25 its inf norms passed the check."""
    w = (_orthonormal(8, 3, 8) * scale).float()
    assert DGram().check_point_on_manifold(w)
    with pytest.raises(ValueError, match=rf"W is not usable by the DGram dual in torch.float32: "
                                         rf"columns \[0, 1, 2\] have norms that {what}"):
        DGram().dual_factor(w)
    d = DGram().dual_factor(w.double())  # in range in float64
    assert torch.allclose(d, torch.full((3,), scale, dtype=torch.float64), rtol=1e-6)


# -- tangent check ------------------------------------------------------------------------------


def _spread_tangent(dtype, m=40, n=8, seed=3, batch=()):
    """A DGram point with column norms 1e-3 .. 1e3 and a tangent vector scaled like it (float64
    projection, then rounded to ``dtype``)."""
    q = _orthonormal(m, n, seed, batch)
    d = torch.logspace(-3, 3, n, dtype=torch.float64)
    w = q * d
    g = torch.Generator().manual_seed(seed + 1)
    u = DGram().proju(w, torch.randn(w.shape, generator=g, dtype=torch.float64) * d)
    return q, w, u


def _tangent_defect(w, u):
    """Oracle, float64: max over i != j of |w_i^T u_j + u_i^T w_j| / (||w_i|| ||w_j||)."""
    w, u = w.double(), u.double()
    s = w.mT @ u
    off = (s + s.mT) * (1 - torch.eye(w.size(-1), dtype=torch.float64))
    wn = w.norm(dim=-2)
    return float((off.abs() / (wn.unsqueeze(-1) * wn.unsqueeze(-2))).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tangent_vector_with_column_norms_over_six_orders_passes(dtype):
    _, w, u = _spread_tangent(dtype)
    assert _tangent_defect(w.to(dtype), u.to(dtype)) <= 50 * torch.finfo(dtype).eps  # the oracle agrees
    ok, reason = DGram().check_vector_on_tangent(w.to(dtype), u.to(dtype), explain=True)
    assert ok, reason
    # and under DGram's symmetry W -> W D', U -> U D' (norms now 1e-6 .. 1e6 or all equal)
    for d in (torch.logspace(-3, 3, 8, dtype=torch.float64), torch.logspace(3, -3, 8, dtype=torch.float64)):
        assert DGram().check_vector_on_tangent((w * d).to(dtype), (u * d).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_normal_part_in_a_small_column_is_refused_whatever_the_big_ones(dtype):
    # one scale for the whole matrix (atol + rtol max|W| max|U|, 10 here) let this pass: column 1
    # (norm 1e-3) of U is 1e-3 q_2, so w_2^T u_1 / (||w_1|| ||w_2||) = 1 — fully normal
    q = _orthonormal(12, 3, 4)
    d = torch.tensor([1e3, 1e-3, 1.0], dtype=torch.float64)
    w = q * d
    g = torch.Generator().manual_seed(5)
    u = DGram().proju(w, torch.randn(12, 3, generator=g, dtype=torch.float64) * d)
    u[:, 1] += 1e-3 * q[:, 2]
    assert _tangent_defect(w, u) >= 0.99  # the oracle: clearly not tangent
    ok, reason = DGram().check_vector_on_tangent(w.to(dtype), u.to(dtype), explain=True)
    assert not ok
    assert "columns 1, 2" in reason and "1.000e+00" in reason


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tangent_check_finds_the_one_bad_matrix_of_a_batch(dtype):
    q, w, u = _spread_tangent(dtype, batch=(2, 3))
    assert DGram().check_vector_on_tangent(w.to(dtype), u.to(dtype))
    u = u.clone()
    u[1, 2, :, 0] += 1e-3 * q[1, 2, :, 5]  # column 0 has norm 1e-3: normal to column 5 in full
    ok, reason = DGram().check_vector_on_tangent(w.to(dtype), u.to(dtype), explain=True)
    assert not ok and "columns 0, 5" in reason


@pytest.mark.parametrize("exponents", [(15, 21), (-21, -15), (-30, -25)], ids=str)
def test_float32_proju_keeps_columns_far_from_unit_norm_tangent(exponents):
    # d_i^2 + d_j^2 overflowed (norms 1e15 .. 1e21: NaN) or fell into the subnormals (1e-21 ..
    # 1e-15: off tangent by 2e-5 relative; 1e-30 .. 1e-25: NaN) in float32
    q = _orthonormal(30, 6, 6)
    d = torch.logspace(*exponents, 6, dtype=torch.float64)
    w = q * d
    g = torch.Generator().manual_seed(7)
    z = torch.randn(30, 6, generator=g, dtype=torch.float64) * d
    w32, z32 = w.float(), z.float()
    ref = DGram().proju(w32.double(), z32.double())  # oracle: the same inputs in float64
    out = DGram().proju(w32, z32)
    assert bool(torch.isfinite(out).all())
    column_error = (out.double() - ref).norm(dim=-2) / ref.norm(dim=-2)
    assert float(column_error.max()) <= 1e-6, column_error.tolist()
    assert DGram().check_vector_on_tangent(w32, out)


def _dense_projection_oracle(w, z):
    """Oracle independent of P_W(Z) = Z - WS and of floating point: the orthogonal projection onto
    the null space of the constraints w_i^T v_j + v_i^T w_j = 0 (i < j) of the given (rounded) W,
    from the explicit constraint matrix A (rows normalized), Z - A^T (A A^T)^{-1} A Z in 600-bit
    mpmath arithmetic. Returns float64."""
    import mpmath

    mp = mpmath.mp.clone() if hasattr(mpmath.mp, "clone") else mpmath.mp
    old_prec = mp.prec
    mp.prec = 600
    try:
        m, n = w.shape
        W = [[mpmath.mpf(float(v)) for v in row] for row in w.double().tolist()]
        zf = [mpmath.mpf(float(v)) for v in z.double().flatten().tolist()]
        rows = []
        for i in range(n):
            for j in range(i + 1, n):
                a = [mpmath.mpf(0)] * (m * n)
                for k in range(m):
                    a[k * n + j] += W[k][i]
                    a[k * n + i] += W[k][j]
                scale = mpmath.sqrt(mpmath.fsum(v * v for v in a))  # (same null space)
                rows.append([v / scale for v in a])
        A = mpmath.matrix(rows)
        Z = mpmath.matrix(zf)
        coef = mpmath.lu_solve(A * A.T, A * Z)
        out = Z - A.T * coef
        return torch.tensor([float(out[k]) for k in range(m * n)], dtype=torch.float64).reshape(m, n)
    finally:
        mp.prec = old_prec


def _column_error(out, ref):
    """||out_j - ref_j|| / ||ref_j|| per column, each column scaled by its largest |ref| first."""
    scale = ref.abs().amax(dim=-2, keepdim=True)
    return ((out.double() - ref) / scale).norm(dim=-2) / (ref / scale).norm(dim=-2)


def _assert_proju_matches_the_oracle(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """DGram().proju(w, z) finite, within 8 eps of the dense oracle per column, and tangent; the
    oracle (float64) is returned."""
    ref = _dense_projection_oracle(w, z)
    out = DGram().proju(w, z)
    assert bool(torch.isfinite(out).all())
    column_error = _column_error(out, ref)
    assert float(column_error.max()) <= 8 * torch.finfo(w.dtype).eps, column_error.tolist()
    assert DGram().check_vector_on_tangent(w, out)
    return ref


@pytest.mark.parametrize(
    "dtype, w_exp, z_exp",
    [(torch.float32, -20, 20), (torch.float32, -30, 10), (torch.float64, -160, 160), (torch.float64, -300, 20)],
    ids=str,
)
def test_proju_of_a_z_far_larger_than_w_matches_the_oracle(dtype, w_exp, z_exp):
    # S ~ |z|/|w| (1e40 in float32, 1e320 in float64) left the dtype's range though WS ~ |z| does
    # not: proju and tangent_residual came back NaN
    q = _orthonormal(20, 4, 8)
    w = (q * torch.tensor([1.0, 2.0, 3.0, 0.5], dtype=torch.float64) * 10.0**w_exp).to(dtype)
    z = (torch.randn(20, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 10.0**z_exp).to(dtype)
    ref = _assert_proju_matches_the_oracle(w, z)
    residual = float(DGram().tangent_residual(w, z))
    zs = z.double() / float(z.abs().max())
    assert math.isclose(residual, float((zs - ref / float(z.abs().max())).norm() / zs.norm()), rel_tol=1e-5)


@pytest.mark.parametrize("dtype, low", [(torch.float32, -25), (torch.float32, -30), (torch.float64, -170)], ids=str)
def test_proju_with_columns_far_below_the_largest(dtype, low):
    # with one scale for the whole matrix, d_i^2 + d_j^2 of two small columns fell into the
    # subnormals or to 0 (float32 norms 1e-25 .. 1: NaN, silently; the point passes its check)
    q = _orthonormal(30, 6, 10)
    d = torch.logspace(low, 0, 6, dtype=torch.float64)
    w = (q * d).to(dtype)
    z = (torch.randn(30, 6, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * d).to(dtype)
    assert DGram().check_point_on_manifold(w)
    _assert_proju_matches_the_oracle(w, z)


@pytest.mark.parametrize(
    "dtype, w_exp, u_exp",
    [(torch.float32, -20, 0), (torch.float32, -30, -5), (torch.float32, -20, 10), (torch.float64, -160, 0),
     (torch.float64, -200, 90)],
    ids=str,
)
def test_the_tangent_check_refuses_a_normal_part_in_a_u_far_larger_than_w(dtype, w_exp, u_exp):
    # ||u_j|| / ||w_j|| was formed at full scale: float32 W ~ 1e-20 with U ~ 1 made the norms of
    # U D^-1 overflow to inf, so the bound was inf and a fully normal U passed, silently
    q = _orthonormal(12, 3, 12)
    w = q * torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64) * 10.0**w_exp
    g = torch.Generator().manual_seed(13)
    u = DGram().proju(w, torch.randn(12, 3, generator=g, dtype=torch.float64) * 10.0**u_exp)
    bad = u.clone()
    bad[:, 0] += 10.0**u_exp * q[:, 1]
    ws = w / w.abs().max()  # the oracle's defect is invariant under W -> cW
    ratio = 10.0 ** (u_exp - w_exp)  # ||u_j|| / ||w_j||, the unit of the defect
    assert _tangent_defect(ws, u / w.abs().max()) <= 1e-12 * ratio  # the oracle: tangent
    assert _tangent_defect(ws, bad / w.abs().max()) >= 0.1 * ratio  # and clearly normal
    ok, reason = DGram().check_vector_on_tangent(w.to(dtype), u.to(dtype), explain=True)
    assert ok, reason
    ok, reason = DGram().check_vector_on_tangent(w.to(dtype), bad.to(dtype), explain=True)
    assert not ok and "columns 0, 1" in reason
