"""msign is scale invariant, also where the input's Gram matrix or norm would over- or underflow.

Before the inputs were scaled into range, a finite float32 matrix with entries of 1e20 made
``"gram-eigh"`` raise ``torch._C._LinAlgError`` (its Gram matrix overflowed; the default Stiefel
and DGram retractions take it, so a float32 DGram weight with entries near 3e9 failed a step),
``"newton"`` return NaN, and the fixed-count presets return 0; entries of 1e-25 made the convergent
``"newton-schulz"`` return NaN. A power of two scales exactly, so the answer must be the same.
"""

from __future__ import annotations

import pytest
import torch

from manifoldlib.functional.msign import msign

METHODS = ["svd", "gram-eigh", "newton", "newton-schulz"]


def _input(dtype: torch.dtype, batch: tuple[int, ...] = ()) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(*batch, 12, 5, generator=generator, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype, exponent", [(torch.float32, 70), (torch.float32, -90),
                                             (torch.float64, 600), (torch.float64, -600)])
def test_convergent_methods_are_scale_invariant(method, dtype, exponent):
    x = _input(dtype)
    reference = msign(x, method)
    scaled = msign(x * 2.0**exponent, method)
    assert torch.equal(scaled, reference)


@pytest.mark.parametrize("method", ["jordan5", "polar-express"])
def test_fixed_count_presets_do_not_overflow(method):
    x = _input(torch.float32)
    reference = msign(x, method)
    scaled = msign(x * 2.0**70, method)
    torch.testing.assert_close(scaled, reference, rtol=0, atol=1e-6)


def test_each_matrix_of_a_batch_is_scaled_by_itself():
    x = _input(torch.float32, batch=(3,))
    spread = x * torch.tensor([2.0**70, 1.0, 2.0**-90]).view(3, 1, 1)
    assert torch.equal(msign(spread, "gram-eigh"), msign(x, "gram-eigh"))


def test_inputs_in_range_are_untouched():
    x = _input(torch.float32)
    svd = torch.linalg.svd(x, full_matrices=False)
    assert torch.equal(msign(x, "svd"), svd.U @ svd.Vh)
