"""The one Newton–Schulz module: three evaluators of every preset agree, and the matrix form is Muon's.

:func:`newton_schulz` iterates on the matrix, :func:`gram_newton_schulz` on its Gram matrix
(:math:`\\operatorname{msign}(X) \\approx XR`), :func:`newton_schulz_gain` on the eigenvalues of
the Gram matrix; in exact arithmetic all three are the same polynomial map of the singular values.
The references are independent of the module: an eigendecomposition of :math:`X^\\top X` (for the
gain), :func:`torch.linalg.svdvals`, and :func:`torch.optim._muon._zeropower_via_newtonschulz`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.optim._muon import _zeropower_via_newtonschulz

import manifoldlib.functional
from manifoldlib.functional.newton_schulz import (
    CONVERGENT_QUINTIC,
    JORDAN5_COEFFICIENTS,
    MUON_COEFFICIENTS,
    NEWTON_SCHULZ_PRESETS,
    POLAR_EXPRESS_COEFFICIENTS,
    gram_newton_schulz,
    newton_schulz,
    newton_schulz_gain,
    resolve_schedule,
)

F64 = torch.float64
PRESETS = sorted(NEWTON_SCHULZ_PRESETS)


def _gaussian(shape, seed, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _with_spectrum(m: int, n: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    """An (m, n) matrix with singular values ``s`` (length min(m, n)), random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=F64))[0]
    v = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=F64))[0]
    return (u * s) @ v.T


def _three_forms(x: torch.Tensor, preset: str, steps: int | None = None):
    """``msign(X)`` of ``preset`` by the matrix iteration, the Gram form and the eigenvalue gain."""
    schedule, scale = resolve_schedule(preset, steps)
    matrix = newton_schulz(x, NEWTON_SCHULZ_PRESETS[preset].schedule, len(schedule), normalize_scale=scale)
    s = x.mT @ x  # (..., n, n); x is tall
    gram = x @ gram_newton_schulz(s, preset, steps)
    lam, vec = torch.linalg.eigh(s)
    gain = newton_schulz_gain(lam.clamp_min(0), preset, steps)  # (..., n)
    eigen = x @ ((vec * gain.unsqueeze(-2)) @ vec.mT)
    return matrix, gram, eigen, (lam.clamp_min(0) * gain * gain).sum(-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(a - b).max() / torch.linalg.matrix_norm(b).max())


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 24), n=st.integers(1, 12))
def test_three_evaluators_agree(preset, dtype, seed, m, n):
    m = max(m, n)  # tall: the Gram form is n x n
    x = _gaussian((m, n), seed, dtype)
    sv = torch.linalg.svdvals(x.double())
    kappa = float(sv.max() / sv.min())
    if kappa > (1e4 if dtype == torch.float64 else 1e2):
        return  # the Gram form cannot resolve it in this dtype (rank-deficient inputs: tested below)
    matrix, gram, eigen, norm_sq = _three_forms(x, preset)
    assert matrix.dtype == gram.dtype == eigen.dtype == dtype
    # forming X^T X squares the condition number: agreement to about kappa^2 eps (measured up to
    # 19 kappa^2 eps over 2400 draws: Muon's quintic amplifies rounding by its slope, up to 3.4 a step)
    tol = 32 * kappa**2 * torch.finfo(dtype).eps
    assert _rel(gram, matrix) <= tol
    assert _rel(eigen, matrix) <= tol
    # ||X psi(S)||_F^2 = sum lambda psi^2: the gain alone gives the norm of the answer
    torch.testing.assert_close(norm_sq, matrix.square().sum(), rtol=tol, atol=0)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("steps", [0, 1, 3, 12])
def test_step_counts_past_and_short_of_the_schedule_agree(preset, steps):
    x = _gaussian((3, 30, 8), 1)
    x = x * torch.tensor([1e-3, 1.0, 1e3], dtype=F64).view(3, 1, 1)  # each matrix has its own norm
    matrix, gram, eigen, _ = _three_forms(x, preset, steps)
    assert _rel(gram, matrix) <= 1e-13 and _rel(eigen, matrix) <= 1e-13
    # a batch is its matrices: each is normalized by its own Frobenius norm
    for i in range(3):
        single, _, _, _ = _three_forms(x[i], preset, steps)
        torch.testing.assert_close(matrix[i], single, rtol=0, atol=1e-15)
        torch.testing.assert_close(gram[i], x[i] @ gram_newton_schulz(x[i].mT @ x[i], preset, steps), rtol=0, atol=1e-15)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("cond", [1e1, 1e3, 1e4])
def test_gram_forms_stay_within_the_squared_condition_bound(preset, cond):
    # forming X^T X squares the condition number: the Gram and gain forms agree with the matrix
    # iteration to about kappa^2 eps
    x = _with_spectrum(30, 8, torch.logspace(0, -math.log10(cond), 8, dtype=F64), seed=1)
    matrix, gram, eigen, _ = _three_forms(x, preset)
    bound = 10 * cond**2 * torch.finfo(F64).eps
    assert _rel(gram, matrix) <= bound and _rel(eigen, matrix) <= bound


@pytest.mark.parametrize("preset", PRESETS)
def test_rank_deficient_input_stays_finite_and_the_forms_agree_to_the_null_gain(preset):
    x = _gaussian((40, 10), 12)
    x[:, -1] = x[:, 0]  # a zero singular value: the gain has no 1/sigma
    matrix, gram, eigen, norm_sq = _three_forms(x, preset)
    assert bool(torch.isfinite(gram).all() and torch.isfinite(eigen).all() and torch.isfinite(norm_sq))
    # In the null direction every form sees only rounding (about eps of the normalized X), which
    # the preset's polynomial amplifies by its slope at 0, the product of its steps' a: 1.875^30
    # ~ 1.6e8 for the convergent quintic. The forms may differ by a few times that.
    schedule, _ = resolve_schedule(preset)
    null_gain = math.prod(a for a, _, _ in schedule)
    atol = 4 * null_gain * torch.finfo(F64).eps
    torch.testing.assert_close(gram, matrix, rtol=0, atol=atol)
    torch.testing.assert_close(eigen, matrix, rtol=0, atol=atol)


@pytest.mark.parametrize("preset", PRESETS)
def test_zero_maps_to_zero(preset):
    z = torch.zeros(2, 12, 5, dtype=F64)
    matrix, gram, eigen, norm_sq = _three_forms(z, preset)
    assert torch.equal(matrix, z) and torch.equal(gram, z) and torch.equal(eigen, z)
    assert bool(torch.isfinite(gram_newton_schulz(z.mT @ z, preset)).all()) and torch.equal(norm_sq, torch.zeros(2, dtype=F64))


@pytest.mark.parametrize("form", ["gram", "gain"])
def test_the_gram_forms_of_a_zero_matrix_have_finite_gradients(form):
    # ||X||_F = sqrt(tr S) is floored at eps, so near S = 0 both forms are polynomials in S: the
    # square root's infinite derivative at 0 times the floor's zero gradient gave NaN (the diagonal
    # of dR/dS, every entry of d gain/d lambda). A batch of a zero matrix and a nonzero one, against
    # finite differences (eps = 1 and two steps keep the slopes where finite differences resolve them)
    x = torch.stack([torch.zeros(6, 3, dtype=F64), 0.1 * _gaussian((6, 3), 5)])
    s = x.mT @ x  # (2, 3, 3)
    if form == "gram":
        f, arg = (lambda t: gram_newton_schulz(0.5 * (t + t.mT), "jordan5", 2, eps=1.0)), s
    else:
        f, arg = (lambda t: newton_schulz_gain(t, "jordan5", 2, eps=1.0)), torch.linalg.eigvalsh(s).clamp_min(0)
    arg = arg.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (arg,), eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (33, 33), (7, 300)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bfloat16_matrix_form_is_torch_muon(shape, dtype):
    x = _gaussian(shape, 3, dtype)
    ours = newton_schulz(x, MUON_COEFFICIENTS, 5, dtype=torch.bfloat16)
    theirs = _zeropower_via_newtonschulz(x, MUON_COEFFICIENTS, 5, 1e-7)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_a_batch_equals_its_matrices_in_bfloat16():
    x = _gaussian((4, 48, 16), 4, torch.float32)
    x[1] *= 1e3  # each matrix normalized by its own norm
    batched = newton_schulz(x, MUON_COEFFICIENTS, 5, dtype=torch.bfloat16)
    for i in range(x.size(0)):
        assert torch.equal(batched[i], newton_schulz(x[i], MUON_COEFFICIENTS, 5, dtype=torch.bfloat16))
        assert torch.equal(batched[i], _zeropower_via_newtonschulz(x[i], MUON_COEFFICIENTS, 5, 1e-7))


@pytest.mark.parametrize("shape", [(2, 3, 10, 4), (2, 3, 4, 10), (2, 1, 2, 6, 6)], ids=str)
def test_two_or_more_batch_dimensions_equal_their_matrices(shape):
    # baddbmm takes one batch dimension: more used to raise a RuntimeError from an expand
    x = _gaussian(shape, 7, torch.float64)
    n = min(shape[-2:])
    flat = x.reshape(-1, *shape[-2:])
    checks = [
        (newton_schulz(x, MUON_COEFFICIENTS, 5), [newton_schulz(m, MUON_COEFFICIENTS, 5) for m in flat]),
        (manifoldlib.functional.msign(x, "polar-express"), [manifoldlib.functional.msign(m, "polar-express") for m in flat]),
        (gram_newton_schulz(x.mT @ x if shape[-2] >= shape[-1] else x @ x.mT),
         [gram_newton_schulz(m.mT @ m if shape[-2] >= shape[-1] else m @ m.mT) for m in flat]),
    ]
    for batched, alone in checks:
        assert batched.shape[:-2] == shape[:-2] and batched.shape[-1] in (n, shape[-1])
        torch.testing.assert_close(batched.reshape(len(alone), *batched.shape[-2:]), torch.stack(alone),
                                   rtol=0, atol=64 * torch.finfo(torch.float64).eps)


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                            (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_default_iteration_dtype(dtype, expected):
    # 16-bit input iterates in float32 unless a dtype is asked for
    assert newton_schulz(_gaussian((12, 5), 5, dtype), MUON_COEFFICIENTS, 5).dtype == expected


@pytest.mark.parametrize("cond", [2.0, 10.0, 100.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_polar_express_ends_near_one_on_well_conditioned_input(cond, dtype):
    x = _with_spectrum(64, 16, torch.logspace(0, -math.log10(cond), 16, dtype=F64), seed=3).to(dtype)
    schedule, scale = resolve_schedule("polar-express")
    sv = torch.linalg.svdvals(newton_schulz(x, schedule, len(schedule), normalize_scale=scale).double())
    assert float((sv - 1).abs().max()) <= 10 * torch.finfo(dtype).eps * 16  # measured: 2 eps
    lam = torch.linalg.eigvalsh(x.mT @ x).clamp_min(0)
    mapped = newton_schulz_gain(lam, "polar-express") * lam.sqrt()  # the singular values, from the gain
    assert float((mapped.double() - 1).abs().max()) <= 10 * torch.finfo(dtype).eps * 16
    # Muon's quintic is not convergent: its singular values end far from 1 on the same input
    jordan = torch.linalg.svdvals(newton_schulz(x, MUON_COEFFICIENTS, 5).double())
    assert float((jordan - 1).abs().max()) > 0.2


def test_the_preset_table():
    assert NEWTON_SCHULZ_PRESETS["jordan5"].schedule == (MUON_COEFFICIENTS,) and JORDAN5_COEFFICIENTS == MUON_COEFFICIENTS
    assert MUON_COEFFICIENTS == (3.4445, -4.7750, 2.0315)
    assert NEWTON_SCHULZ_PRESETS["newton-schulz"].schedule == (CONVERGENT_QUINTIC,) == ((1.875, -1.25, 0.375),)
    pe = NEWTON_SCHULZ_PRESETS["polar-express"]
    assert pe.schedule == POLAR_EXPRESS_COEFFICIENTS and pe.steps == 8 and pe.scale == 1.01
    assert POLAR_EXPRESS_COEFFICIENTS[0][0] == pytest.approx(8.28721201814563 / 1.01, rel=1e-15)
    assert POLAR_EXPRESS_COEFFICIENTS[-1] == (1.875, -1.25, 0.375)
    assert {name: p.steps for name, p in NEWTON_SCHULZ_PRESETS.items()} == {
        "jordan5": 5, "polar-express": 8, "newton-schulz": 30}
    # past the schedule the last triple repeats
    schedule, scale = resolve_schedule("polar-express", 10)
    assert schedule == POLAR_EXPRESS_COEFFICIENTS + ((1.875, -1.25, 0.375),) * 2 and scale == 1.01
    # manifoldlib.functional re-exports the function, not the module of the same name
    assert manifoldlib.functional.newton_schulz is newton_schulz
    assert manifoldlib.functional.NEWTON_SCHULZ_PRESETS is NEWTON_SCHULZ_PRESETS


def test_custom_coefficients_replace_the_schedule_and_its_scale():
    x = _gaussian((30, 8), 6)
    custom = x @ gram_newton_schulz(x.mT @ x, None, 5, coefficients=MUON_COEFFICIENTS)
    torch.testing.assert_close(custom, x @ gram_newton_schulz(x.mT @ x, "jordan5"), rtol=0, atol=0)
    # a preset's name with custom coefficients keeps its step count, not its 1.01 first scale
    pe = x @ gram_newton_schulz(x.mT @ x, "polar-express", coefficients=POLAR_EXPRESS_COEFFICIENTS)
    torch.testing.assert_close(pe, newton_schulz(x, POLAR_EXPRESS_COEFFICIENTS, 8), rtol=0, atol=1e-13)
    assert resolve_schedule(None, None, MUON_COEFFICIENTS) == ((MUON_COEFFICIENTS,), 1.0)
    lam = torch.linalg.eigvalsh(x.mT @ x)
    torch.testing.assert_close(newton_schulz_gain(lam, None, 5, coefficients=MUON_COEFFICIENTS),
                               newton_schulz_gain(lam, "jordan5"), rtol=0, atol=0)


@pytest.mark.parametrize(
    "args,match",
    [
        (("qr",), r"unknown Newton-Schulz preset 'qr'; valid: jordan5, polar-express, newton-schulz"),
        ((None,), r"unknown Newton-Schulz preset None"),
        (("jordan5", -1), r"steps must be an int >= 0, got -1"),
        (("jordan5", 2.5), r"steps must be an int >= 0, got 2.5"),
        ((None, 5, ()), r"coefficients must be one \(a, b, c\) triple or a sequence of triples, got \(\)"),
        ((None, 5, ((1.0, 2.0),)), r"coefficients must be .* got \(\(1.0, 2.0\),\)"),
        ((None, 5, (1.0, 2.0)), r"coefficients must be .* got \(1.0, 2.0\)"),
    ],
)
def test_resolve_schedule_errors_name_the_bad_value(args, match):
    with pytest.raises(ValueError, match=match):
        resolve_schedule(*args)


def test_evaluators_refuse_bad_input_by_name():
    s = torch.eye(3, dtype=F64)
    with pytest.raises(ValueError, match="unknown Newton-Schulz preset 'svd'"):
        gram_newton_schulz(s, "svd")
    with pytest.raises(ValueError, match="unknown Newton-Schulz preset 'svd'"):
        newton_schulz_gain(torch.ones(3, dtype=F64), "svd")
    with pytest.raises(ValueError, match=r"expects a matrix or a batch of matrices \(\.\.\., m, n\), got shape \(3,\)"):
        newton_schulz(torch.ones(3, dtype=F64), MUON_COEFFICIENTS, 5)
    with pytest.raises(ValueError, match="steps must be an int >= 0, got -2"):
        newton_schulz(s, MUON_COEFFICIENTS, -2)


_X = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), dtype=F64)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: manifoldlib.functional.msign(_X, "jordan5", steps=True), "steps must be None or an int >= 0, got True"),
        (lambda: manifoldlib.functional.msign(_X, "newton", steps=2.5), "steps must be None or an int >= 0, got 2.5"),
        (lambda: manifoldlib.functional.msign(_X, "newton", tol=True), "tol must be None or a finite number >= 0, got True"),
        (lambda: manifoldlib.functional.msign(_X, "jordan5", eps=math.nan), "eps must be a finite number > 0, got nan"),
        (lambda: newton_schulz(_X, MUON_COEFFICIENTS, 5, normalize_scale=-1.0),
         "normalize_scale must be a finite number > 0, got -1.0"),
        (lambda: newton_schulz(_X, MUON_COEFFICIENTS, 5, dtype=torch.int64),
         "dtype must be None or a real floating-point dtype, got torch.int64"),
        (lambda: newton_schulz(_X, ("3.4445", -4.7750, 2.0315), 5), "coefficients must be finite numbers, got"),
        (lambda: gram_newton_schulz(_X.mT @ _X, eps=0.0), "eps must be a finite number > 0, got 0.0"),
        (lambda: manifoldlib.functional.sphere_unit_tangent(_X, _X, eps=0.0), "eps must be a finite number > 0, got 0.0"),
        (lambda: manifoldlib.functional.dgram_metric_projection(_X, iterations=True),
         r"iterations must be an int >= 1 \(or None: to convergence\), got True"),
    ],
    ids=["msign-steps-bool", "msign-steps-float", "msign-tol-bool", "msign-eps-nan", "ns-scale-negative",
         "ns-dtype-int", "ns-coefficient-str", "gram-ns-eps-0", "unit-tangent-eps-0", "projection-iterations-bool"],
)
def test_an_option_outside_its_range_is_refused_by_name(call, match):
    """Each ran without an error before, to a wrong result (True as one step, a tolerance of 1.0,
    a string coefficient parsed) or NaN (a NaN or zero floor, a negative scale), or failed deep
    in torch (steps=2.5: range(), dtype=int64: vector_norm)."""
    with pytest.raises(ValueError, match=match):
        call()
