"""Shared test configuration: a reproducible hypothesis profile, single-threaded small-tensor
suites (and a share of the cores per pytest-xdist worker), and fixtures that keep the retraction
registry clean.

The ``manifoldlib`` profile is loaded by default: ``derandomize=True`` (the same examples every
run), no deadline (timing never fails a test), and a modest ``max_examples`` so the default suite
stays fast on two CPU cores. ``HYPOTHESIS_PROFILE=thorough`` runs 10x more examples.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, settings

from manifoldlib.retractions import AngleRetraction, register_retraction
from manifoldlib.retractions import base as registry_base

settings.register_profile(
    "manifoldlib",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("manifoldlib"),
    max_examples=250,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "manifoldlib"))

# The README's command runs one pytest-xdist worker per core: the suites that keep torch's threads
# (distributed, reliability, ...) get an equal share of the cores in each worker, not every core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _CORES // _WORKERS))

# Tests build their tensors with explicit dtypes and generators; keep the process-wide
# state fixed as well so an accidental default draw is still reproducible.
torch.manual_seed(0)

# These suites use small tensors, where intra-op threading only adds synchronization: on a shared
# 2-core machine a 12x12 solve is ~10x slower with 2 threads than with 1, and tests/charts took
# 89 s with 2 threads against 5 s with 1 (tests/models: 23 s either way; its training runs in
# subprocesses keep their own threads). Scoped to folders so other suites keep their threads.
_SINGLE_THREAD_DIRS = {"functional", "retractions", "manifolds", "testing", "nn", "models", "charts", "optim"}
_TESTS_ROOT = pathlib.Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _single_thread_for_small_tensor_suites(request):
    path = pathlib.Path(str(request.node.path)).resolve()
    try:
        top = path.relative_to(_TESTS_ROOT).parts[0]
    except (ValueError, IndexError):
        top = ""
    if top not in _SINGLE_THREAD_DIRS:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def clean_registry(monkeypatch):
    """Let a test register retractions (and aliases) without leaking them into other tests:
    every family's table is replaced by a copy for the duration of the test."""
    for table in (registry_base._REGISTRY, registry_base._ALIASES):
        for family in list(table):
            monkeypatch.setitem(table, family, dict(table[family]))


@pytest.fixture
def clean_policies(monkeypatch):
    """Let a test register policies without leaking them into other tests (a leaked name shows up
    in every later "valid policies: ..." message)."""
    from manifoldlib.optim import policies

    monkeypatch.setattr(policies, "_POLICIES", dict(policies._POLICIES))


@pytest.fixture
def user_p3_name(clean_registry):
    """Register a user's sphere retraction, defined only by its angle theta = 3 atan(beta / 3),
    as ``"test-user-p3"`` for one test, and return that name."""

    @register_retraction("sphere", "test-user-p3")
    class UserP3(AngleRetraction):
        order = 2

        def angle(self, beta):
            return 3.0 * torch.atan(beta / 3.0)

    return "test-user-p3"
