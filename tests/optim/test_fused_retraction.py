"""The manifold's default Muon retraction, taken in its Gram form from the solve's pieces, equals
forming the direction and retracting it with the same retraction named explicitly.

A group whose ``retraction`` is ``None`` takes the manifold's ``muon_retraction`` in Gram form
(:math:`Y\\Phi` from :math:`Y^\\top Y`, built from the dual's ``n × n`` pieces or, on the sync-free
path, from the formed :math:`Y`); a group that names that same retraction takes the manifold's own
``retract``. The two must agree to rounding, keep points on the manifold over many steps, and
remove a drift of the point in one step.
"""

from __future__ import annotations

import pytest
import torch

from manifoldlib.functional.dgram import off_diagonal
from manifoldlib.manifolds import get_manifold
from manifoldlib.optim import ManifoldMuon, manifold_muon

MANIFOLDS = ("stiefel", "dgram", "oblique")


def _point(m, n, manifold, dtype, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    if manifold == "dgram":
        q = q * torch.exp(spread * torch.randn(n, generator=g, dtype=torch.float64))
    return q.to(dtype), torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)


def _explicit(manifold: str) -> dict:
    """The manifold's default Muon retraction, named (so the group takes the manifold's ``retract``)."""
    name, options = get_manifold(manifold).muon_retraction
    return {"name": name, **options}


def _one_step(w, g, manifold, retraction, spectral, drift=None):
    p = torch.nn.Parameter(w.clone())
    opt = ManifoldMuon([p], lr=0.02, manifold=manifold, weight_decay=0.5 if manifold == "dgram" else 0.0,
                       momentum=0.0, nesterov=False, retraction=retraction,
                       dual={"spectral": spectral, "tol": 1e-6, "max_iter": 60})
    if drift is not None:
        with torch.no_grad():  # moved off the manifold behind the optimizer's back
            p.copy_(p @ drift)
    p.grad = g.clone()
    opt.step()
    return p.detach().clone()


def _relative_residual(w: torch.Tensor, manifold: str) -> float:
    """Stiefel ``||W^T W - I|| / ||diag||``, DGram ``||Off(W^T W)|| / ||diag||``, Oblique ``||diag - 1|| / ||diag||``."""
    gram = w.mT @ w
    if manifold == "dgram":
        residual = off_diagonal(gram)
    elif manifold == "stiefel":
        residual = gram - torch.eye(w.size(1), dtype=gram.dtype)
    else:
        residual = gram.diagonal() - 1.0
    return float(residual.norm() / gram.diagonal().norm())


@pytest.mark.parametrize("spectral", ["eigh", "products"])  # products: what CUDA solves with
@pytest.mark.parametrize("shape", [(96, 24), (64, 32), (24, 24)])
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_the_gram_form_equals_direction_then_retraction(manifold, dtype, rtol, shape, spectral):
    w, g = _point(*shape, manifold, dtype)
    fused = _one_step(w, g, manifold, None, spectral)
    plain = _one_step(w, g, manifold, _explicit(manifold), spectral)
    assert fused.dtype == dtype
    assert float((fused - plain).norm() / plain.norm()) <= rtol
    assert float((fused - w).norm()) > 1e3 * rtol * float(w.norm())  # the step is far larger


@pytest.mark.parametrize("spectral", ["eigh", "products"])
@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_a_drifted_point_is_retracted_onto_the_manifold_in_one_step(manifold, spectral):
    w, g = _point(96, 24, manifold, torch.float64)
    tilt = torch.eye(24, dtype=torch.float64)
    tilt[0, 1] = 1e-6  # W -> W (I + 1e-6 E_01): Off(W^T W) ~ 1e-7, far above float64's rounding
    assert _relative_residual(w @ tilt, manifold) > 1e-8
    fused = _one_step(w, g, manifold, None, spectral, drift=tilt)
    plain = _one_step(w, g, manifold, _explicit(manifold), spectral, drift=tilt)
    assert float((fused - plain).norm() / plain.norm()) <= 1e-12
    assert _relative_residual(fused, manifold) < 1e-13  # the drift is gone


@pytest.mark.parametrize("spectral", ["eigh", "products"])
@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_many_float32_steps_keep_tall_points_on_the_manifold(manifold, spectral):
    # 300 float32 steps stay within 2 * 64 float32 epsilons (1.5e-5) of the manifold, relative
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(128, 32))
    opt = ManifoldMuon([p], lr=0.02, manifold=manifold, weight_decay=0.01, dual={"spectral": spectral})
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        p.grad = torch.randn(128, 32, generator=g)
        opt.step()
    assert _relative_residual(p.detach().double(), manifold) <= 2 * 64 * torch.finfo(torch.float32).eps
    assert int(opt.state[p]["skipped_steps"]) == 0


@pytest.mark.parametrize("spectral", ["eigh", "products"])
def test_a_group_with_its_own_retraction_takes_the_manifolds_retract(spectral):
    # the optimizer's step of each group equals the functional core given that group's options
    # (bit for bit): the Gram form for the default retraction, the manifold's retract for a named
    # one; the two round differently (float32)
    g = torch.Generator().manual_seed(2)
    w0 = [torch.randn(64, 16, generator=g) for _ in range(2)]
    grads = [torch.randn(64, 16, generator=g) for _ in range(2)]
    default, own = (torch.nn.Parameter(w.clone()) for w in w0)
    opt = ManifoldMuon([{"params": [default]}, {"params": [own], "retraction": _explicit("dgram")}],
                       lr=0.02, manifold="dgram", dual={"spectral": spectral})
    starts = [p.detach().clone() for p in (default, own)]  # projected onto DGram
    default.grad, own.grad = grads[0].clone(), grads[1].clone()
    opt.step()

    def core(start, grad, group):
        w = start.clone()
        options = {k: v for k, v in group.items() if k != "params"}
        manifold_muon([w], [grad.clone()], [torch.zeros_like(w)], [{}], options)
        return w

    first, second = opt.param_groups
    torch.testing.assert_close(default.detach(), core(starts[0], grads[0], first), rtol=0, atol=0)
    torch.testing.assert_close(own.detach(), core(starts[1], grads[1], second), rtol=0, atol=0)
    named = core(starts[0], grads[0], {**first, "retraction": _explicit("dgram")})
    assert not torch.equal(default.detach(), named)  # the Gram form rounds differently ...
    assert float((default.detach() - named).norm() / named.norm()) <= 2e-6  # ... from the same step
