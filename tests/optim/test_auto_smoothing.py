"""smoothing="auto": which shapes smooth from the start, and why (near-square tall matrices)."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.optim import steepest_direction, tangent_residual
from manifoldlib.optim.options import AUTO_SMOOTHING, SMOOTH_BELOW_ASPECT, resolve_smoothing
from manifoldlib.optim.execution import Execution
from manifoldlib.optim.steepest import matrix_manifold


def _instance(m: int, n: int, manifold: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    if manifold == "dgram":
        w = w * torch.exp(0.3 * torch.randn(n, generator=g, dtype=torch.float64))
    return w, torch.randn(m, n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(
    "manifold,shape,exact,expected",
    [
        ("dgram", (64, 64), False, (2e-2, None)),  # square DGram: always
        ("dgram", (64, 64), True, (2e-2, None)),
        ("stiefel", (64, 64), False, (None, 2e-2)),  # square Stiefel: closed form
        ("stiefel", (96, 64), False, (2e-2, None)),  # aspect 1.5
        ("dgram", (159, 64), False, (2e-2, None)),  # aspect 2.48
        ("stiefel", (160, 64), False, (None, 2e-2)),  # aspect 2.5: plain first
        ("stiefel", (96, 64), True, (None, 2e-2)),  # the exact SVD dual is left alone
    ],
)
def test_which_shapes_smooth_from_the_start(manifold, shape, exact, expected):
    assert SMOOTH_BELOW_ASPECT == 2.5 and AUTO_SMOOTHING == 2e-2
    assert resolve_smoothing("auto", matrix_manifold(manifold), shape, exact=exact) == expected


@pytest.mark.parametrize("smoothing,expected", [(None, (None, None)), (0.05, (0.05, None))])
def test_an_explicit_smoothing_is_kept_on_every_shape(smoothing, expected):
    for shape in ((64, 64), (96, 64), (256, 64)):
        assert resolve_smoothing(smoothing, matrix_manifold("dgram"), shape) == expected


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("spectral", ["eigh", "products"])
def test_near_square_tall_matrices_converge_fast_with_auto_and_crawl_without(manifold, spectral):
    # aspect 1.5: the Gram matrix of G's part outside span(W) has rank m - n < n, the dual optimum
    # is close to rank deficient and the plain dual crawls
    w, g = _instance(96, 64, manifold, seed=3)
    kw = {"msign_method": "jordan5", "ns_steps": 5, "tol": 1e-3, "patience": 6, "spectral": spectral,
          "return_info": True, "gap_tol": None}
    a, info = steepest_direction(w, g, manifold, max_iter=30, **kw)
    assert info.converged and info.iterations <= 20 and info.stages == ("smoothed",)
    assert float(tangent_residual(w, a, manifold)) <= 1e-3
    _, plain = steepest_direction(w, g, manifold, max_iter=20, smoothing=None, **kw)
    assert not plain.converged  # 20 plain iterations are not enough where the smoothed solve is done


@pytest.mark.parametrize("spectral,plain", [("eigh", "anderson"), ("products", "bb")])
def test_auto_keeps_the_plain_dual_on_the_gpt_mlp_aspect(spectral, plain):
    w, g = _instance(256, 64, "stiefel", seed=4)  # aspect 4
    _, info = steepest_direction(w, g, "stiefel", msign_method="jordan5", ns_steps=5, tol=1e-3,
                                 max_iter=30, spectral=spectral, return_info=True)
    assert info.converged and info.stages == (plain,) and info.hessian_products == 0


@pytest.mark.parametrize(
    "dtype,device,smoothed,expected",
    [
        (torch.float32, "cuda", True, torch.float64),  # cuSOLVER's float32 eigh stalls the Newton steps
        (torch.bfloat16, "cuda", True, torch.float64),
        (torch.float32, "cuda", False, torch.float32),  # the plain dual keeps float32 (products path)
        (torch.float32, "cpu", True, torch.float32),  # LAPACK's float32 eigh converges
        (torch.bfloat16, "cpu", False, torch.float32),
        (torch.float16, "cpu", True, torch.float32),
        (torch.float64, "cuda", True, torch.float64),
    ],
)
def test_solve_dtype_widens_only_smoothed_float32_solves_on_cuda(dtype, device, smoothed, expected):
    execution = Execution.resolve(device, bfloat16_native=False)  # no CUDA runtime needed
    assert execution.work_dtype(dtype, smoothed) == expected
    assert execution.smoothed_dtype == (torch.float64 if device == "cuda" else None)
