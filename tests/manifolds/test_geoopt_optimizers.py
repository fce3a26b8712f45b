"""geoopt interop: ManifoldParameter + RiemannianSGD / RiemannianAdam on known-answer problems.

Answers come from scipy (eigh, polar, lstsq) or are built into the problem (a DGram target), never
from manifoldlib itself.
"""

from __future__ import annotations

import geoopt
import numpy as np
import pytest
import scipy.linalg
import torch

from manifoldlib import DGram, Euclidean, Sphere, Stiefel
from manifoldlib.retractions import available_retractions
from manifoldlib.testing import random_point

SGD = (geoopt.optim.RiemannianSGD, {"lr": 0.1}, 1.0, 300)
ADAM = (geoopt.optim.RiemannianAdam, {"lr": 0.1}, 0.995, 1000)  # lr decays 0.1 -> 7e-4
OPTIMIZERS = {"sgd": SGD, "adam": ADAM}


def _minimize(manifold, x0, loss, optimizer):
    cls, kwargs, gamma, steps = optimizer
    param = geoopt.ManifoldParameter(x0.clone(), manifold=manifold)
    opt = cls([param], **kwargs)
    schedule = torch.optim.lr_scheduler.ExponentialLR(opt, gamma)
    for _ in range(steps):
        opt.zero_grad()
        loss(param).backward()
        opt.step()
        schedule.step()
    ok, reason = manifold.check_point_on_manifold(
        param.detach(), explain=True, atol=0.0, rtol=1e-12
    )
    assert ok, reason
    return param.detach()


def _canonical(family):
    return [n for n in available_retractions(family) if n not in ("projection", "stereographic")]


@pytest.fixture(scope="module")
def eig_problem():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(8, 8, generator=g, dtype=torch.float64)
    a = b @ b.T / 8  # (8, 8) symmetric PSD, eigengap ~1
    _, vecs = scipy.linalg.eigh(a.numpy())
    return a, torch.from_numpy(vecs[:, -1])


@pytest.mark.parametrize("retraction", _canonical("sphere"))
def test_sphere_sgd_finds_leading_eigenvector(eig_problem, retraction):
    a, top = eig_problem
    r = 2.0
    s = Sphere(r, retraction=retraction)
    x0 = random_point(s, (8,), generator=torch.Generator().manual_seed(1))
    x = _minimize(
        s, x0, lambda p: -(p @ a @ p) / r**2, (geoopt.optim.RiemannianSGD, {"lr": 0.5}, 1.0, 300)
    )
    assert 1 - abs(float(x @ top)) / r <= 1e-12


def test_sphere_adam_finds_leading_eigenvector(eig_problem):
    a, top = eig_problem
    s = Sphere(2.0)
    x0 = random_point(s, (8,), generator=torch.Generator().manual_seed(1))
    x = _minimize(s, x0, lambda p: -(p @ a @ p) / 4, ADAM)
    assert 1 - abs(float(x @ top)) / 2.0 <= 1e-10


@pytest.fixture(scope="module")
def procrustes_problem():
    m = torch.randn(8, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return m, torch.from_numpy(scipy.linalg.polar(m.numpy())[0])


@pytest.mark.parametrize("retraction", _canonical("stiefel"))
def test_stiefel_sgd_solves_nearest_orthonormal_frame(procrustes_problem, retraction):
    target, answer = procrustes_problem
    st = Stiefel(retraction=retraction)
    x0 = random_point(st, (8, 3), generator=torch.Generator().manual_seed(2))
    x = _minimize(st, x0, lambda p: ((p - target) ** 2).sum(), SGD)
    assert float((x - answer).norm()) <= 1e-10


def test_stiefel_adam_solves_nearest_orthonormal_frame(procrustes_problem):
    target, answer = procrustes_problem
    st = Stiefel()
    x0 = random_point(st, (8, 3), generator=torch.Generator().manual_seed(2))
    x = _minimize(st, x0, lambda p: ((p - target) ** 2).sum(), ADAM)
    assert float((x - answer).norm()) <= 1e-8


def test_stiefel_square_orthogonal_procrustes_matches_scipy():
    # min ||A X - B||_F over orthogonal X; O(n) has two components, so start in det(R_true)'s
    g = torch.Generator().manual_seed(7)
    a = torch.randn(20, 4, generator=g, dtype=torch.float64)
    st = Stiefel()
    r_true = random_point(st, (4, 4), generator=g)
    b = a @ r_true + 0.01 * torch.randn(20, 4, generator=g, dtype=torch.float64)
    answer = torch.from_numpy(scipy.linalg.orthogonal_procrustes(a.numpy(), b.numpy())[0])
    x0 = random_point(st, (4, 4), generator=g)
    if torch.linalg.det(x0) * torch.linalg.det(answer) < 0:
        x0 = x0 * torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=x0.dtype)
    scale = float(torch.linalg.matrix_norm(a, ord=2)) ** 2
    x = _minimize(
        st,
        x0,
        lambda p: ((a @ p - b) ** 2).sum() / scale,
        (geoopt.optim.RiemannianSGD, {"lr": 0.2}, 1.0, 400),
    )
    assert float((x - answer).norm()) <= 1e-9


@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.parametrize("retraction", _canonical("dgram"))
def test_dgram_recovers_a_target_with_orthogonal_columns(name, retraction):
    dg = DGram(retraction=retraction)
    target = random_point(dg, (8, 3), generator=torch.Generator().manual_seed(3))  # Q diag(d)
    x0 = random_point(dg, (8, 3), generator=torch.Generator().manual_seed(4))
    x = _minimize(dg, x0, lambda p: ((p - target) ** 2).sum(), OPTIMIZERS[name])
    assert float((x - target).norm()) <= (1e-10 if name == "sgd" else 1e-8)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_euclidean_least_squares_matches_scipy_lstsq(name):
    g = torch.Generator().manual_seed(6)
    a = torch.randn(12, 5, generator=g, dtype=torch.float64)
    b = torch.randn(12, generator=g, dtype=torch.float64)
    answer = torch.from_numpy(scipy.linalg.lstsq(a.numpy(), b.numpy())[0])
    scale = float(torch.linalg.matrix_norm(a, ord=2)) ** 2
    e = Euclidean(ndim=1)
    # loss Hessian 2 A^T A / ||A||_2^2 has norm 2: SGD is stable below lr = 1
    optimizer = (geoopt.optim.RiemannianSGD, {"lr": 0.45}, 1.0, 300) if name == "sgd" else ADAM
    x = _minimize(
        e,
        torch.zeros(5, dtype=torch.float64),
        lambda p: ((a @ p - b) ** 2).sum() / scale,
        optimizer,
    )
    assert float((x - answer).norm()) <= 1e-8 * max(1.0, float(np.linalg.norm(answer.numpy())))


@pytest.mark.parametrize("ndim", [1, 2])
def test_riemannian_adam_on_euclidean_is_torch_adam(ndim):
    # geoopt's Adam takes its second moment from component_inner; the inherited default sums it
    # over the point dimensions (one second moment per point: 0.49 off Adam after 5 steps of this
    # problem), where geoopt's Euclidean keeps one per entry
    g = torch.Generator().manual_seed(4)
    w0 = torch.randn(5, 4, generator=g, dtype=torch.float64)
    scale = torch.arange(20, dtype=torch.float64).reshape(5, 4)
    target = torch.randn(5, 4, generator=g, dtype=torch.float64)
    results = []
    for param in (torch.nn.Parameter(w0.clone()), geoopt.ManifoldParameter(w0.clone(), manifold=Euclidean(ndim))):
        opt = (torch.optim.Adam if type(param) is torch.nn.Parameter else geoopt.optim.RiemannianAdam)([param], lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            ((param * scale - target) ** 2).sum().backward()
            opt.step()
        results.append(param.detach())
    assert torch.allclose(results[1], results[0], rtol=0, atol=1e-14)
