"""The execution policy: every device-dependent choice of a step resolved in one place, and obeyed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from core_step import core_step  # pytest puts this folder on sys.path
from torch import nn

from manifoldlib.manifolds import Stiefel
from manifoldlib.optim import ExecutionPolicy, ManifoldMuon
from manifoldlib.optim.execution import BFLOAT16_MIN_SIZE, SMOOTHED_CUDA_DTYPE


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_policy(native):
    policy = ExecutionPolicy.resolve("cpu", bfloat16_native=native, workers=2)
    assert policy.ns_dtype == (torch.bfloat16 if native else torch.float32)
    assert policy.spectral == "eigh"
    assert policy.search_dtype == (torch.bfloat16 if native else None)
    assert policy.search_min_size == BFLOAT16_MIN_SIZE
    assert policy.smoothed_dtype is None  # LAPACK's float32 eigh follows the smoothed Newton steps
    assert policy.workers == 2  # an int is taken as is


def test_a_cuda_policy_needs_no_cuda_runtime_when_told_the_hardware():
    policy = ExecutionPolicy.resolve("cuda:0", bfloat16_native=True, workers=2)
    assert policy.spectral == "products" and policy.ns_dtype == torch.bfloat16
    assert policy.smoothed_dtype == SMOOTHED_CUDA_DTYPE == torch.float64
    assert policy.workers == 1  # CPU threads never run CUDA solves


def test_auto_workers_follow_the_shapes():
    big = [(3072, 768), (3072, 768)]
    assert ExecutionPolicy.resolve("cpu", workers="auto", shapes=[(8, 8), (8, 8)]).workers == 1  # tiny solves
    expected = 2 if torch.get_num_threads() >= 2 else 1
    assert ExecutionPolicy.resolve("cpu", workers="auto", shapes=big).workers == expected


def test_a_policy_is_frozen_plain_data():
    policy = ExecutionPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.spectral = "products"
    assert dataclasses.replace(policy, spectral="products").spectral == "products"
    with pytest.raises(ValueError, match="ExecutionPolicy.workers must be an int >= 1, got 0"):
        ExecutionPolicy(workers=0)
    with pytest.raises(ValueError, match="search_min_size must be an int >= 1, got 0"):
        ExecutionPolicy(search_min_size=0)


def test_the_optimizer_runs_the_policy_it_resolves():
    # ManifoldMuon with dual spectral "products" on a CPU = the functional core handed the policy
    # with spectral "products" (bit for bit); the eigh policy gives another point
    g = torch.Generator().manual_seed(5)
    w0 = torch.linalg.qr(torch.randn(48, 12, generator=g))[0]
    grad = torch.randn(48, 12, generator=g)
    param = nn.Parameter(w0.clone())
    opt = ManifoldMuon([param], lr=0.05, manifold="stiefel", project_init=False, dual={"spectral": "products"})
    param.grad = grad.clone()
    opt.step()
    group = opt.param_groups[0]

    def core(policy):
        manifold = Stiefel(retraction="polar", method="gram-eigh")
        return core_step(w0, grad, group, manifold, fuse_retraction=True, execution=policy)

    products = core(ExecutionPolicy.resolve("cpu", spectral="products"))
    torch.testing.assert_close(products, param.detach(), rtol=0, atol=0)
    eigh = core(ExecutionPolicy.resolve("cpu", spectral="eigh"))
    assert not torch.equal(eigh, products)  # a different path ...
    torch.testing.assert_close(eigh, products, rtol=0, atol=1e-5)  # ... to the same step
