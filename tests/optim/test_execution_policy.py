"""How a step runs on its device: every device-dependent choice resolved in one place
(:class:`~manifoldlib.optim.execution.Execution`), and the optimizer doing what it resolved.

What the optimizer did is seen from outside: its parameters (bit for bit against an explicit
choice) and :func:`~manifoldlib.testing.counting.count_ops` (host reads, eigendecompositions).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from torch import nn

from manifoldlib.optim import ManifoldMuon
from manifoldlib.optim.execution import (
    EIGH_MIN_COLUMNS,
    SIDE_BY_SIDE_FLOPS,
    SMALL_SOLVE_FLOPS,
    Execution,
    run_side_by_side,
    side_by_side,
)
from manifoldlib.testing.counting import count_ops


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_execution(native):
    narrow = Execution.resolve("cpu", bfloat16_native=native, columns=EIGH_MIN_COLUMNS - 1)
    wide = Execution.resolve("cpu", bfloat16_native=native, columns=EIGH_MIN_COLUMNS)
    assert (narrow.spectral, narrow.sync_free) == ("products", True)  # a step of launches: no host reads
    assert (wide.spectral, wide.sync_free) == ("eigh", False)  # early stopping where eigh pays
    assert Execution.resolve("cpu", bfloat16_native=native).spectral == "eigh"  # columns unknown
    for execution in (narrow, wide):
        assert execution.ns_dtype == (torch.bfloat16 if native else torch.float32)
        assert execution.search_dtype == (torch.bfloat16 if native else None)
        assert execution.smoothed_dtype is None  # LAPACK's float32 eigh follows the smoothed Newton steps


def test_explicit_choices_override_the_device():
    assert Execution.resolve("cpu", spectral="eigh", columns=8).spectral == "eigh"
    assert Execution.resolve("cpu", spectral="products", columns=1024).spectral == "products"
    assert Execution.resolve("cpu", spectral="products", sync_free=False).sync_free is False
    assert Execution.resolve("cpu", spectral="eigh", sync_free=True).sync_free is True
    for ns_dtype in ("bfloat16", "float32"):
        for native in (False, True):
            assert Execution.resolve("cpu", ns_dtype=ns_dtype, bfloat16_native=native).ns_dtype == getattr(torch, ns_dtype)


def test_a_cuda_execution_needs_no_cuda_runtime_when_told_the_hardware():
    execution = Execution.resolve("cuda:0", bfloat16_native=True, columns=4096)
    assert execution.spectral == "products" and execution.sync_free  # whatever the size
    assert execution.ns_dtype == torch.bfloat16
    assert execution.smoothed_dtype == torch.float64


def test_an_execution_is_frozen_plain_data():
    # (its refusals of unknown values are in test_spectral_paths.py)
    execution = Execution()
    with pytest.raises(dataclasses.FrozenInstanceError):
        execution.spectral = "products"
    assert dataclasses.replace(execution, spectral="products").spectral == "products"


def test_small_cpu_steps_run_on_one_thread():
    side = round(SMALL_SOLVE_FLOPS ** (1 / 3))
    assert Execution.threads("cpu", [(side - 1, side - 1), (8, 8)]) == 1
    assert Execution.threads("cpu", [(side + 1, side + 1)]) is None  # torch's own setting
    assert Execution.threads("cuda", [(8, 8)]) is None
    assert Execution.threads("cpu", []) is None


@pytest.mark.parametrize("fails", [False, True])
def test_a_step_restores_the_callers_thread_count(fails):
    # a small step runs on one thread; the caller's count comes back, also when the step raises
    # (here: a point moved off Stiefel behind the optimizer's back, refused on the eigh path)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        p = nn.Parameter(torch.randn(12, 4))
        opt = ManifoldMuon([p], lr=0.05, manifold="stiefel", dual={"spectral": "eigh"})
        p.grad = torch.randn(12, 4)
        if fails:
            with torch.no_grad():
                p.mul_(3.0)
            with pytest.raises(ValueError, match="W is not a Stiefel point"):
                opt.step()
        else:
            opt.step()
        assert torch.get_num_threads() == 2
        assert torch.is_grad_enabled()
    finally:
        torch.set_num_threads(before)


def _step(shape, dual, seed=5, steps=2):
    """The point after ``steps`` steps from a projected random start, the last step's op counts,
    the start and the last dual residual."""
    g = torch.Generator().manual_seed(seed)
    param = nn.Parameter(torch.randn(*shape, generator=g))
    opt = ManifoldMuon([param], lr=0.05, manifold="stiefel", dual=dual)
    start = param.detach().clone()
    counts = None
    for _ in range(steps):
        param.grad = torch.randn(*shape, generator=g)
        counts = count_ops(opt.step)
    return param.detach().clone(), counts, start, float(opt.state[param]["dual_residual"])


@pytest.mark.parametrize("shape,resolved", [((96, 24), "products"), ((512, EIGH_MIN_COLUMNS), "eigh")])
def test_the_optimizer_runs_the_path_it_resolves(shape, resolved):
    # "auto" on the CPU is the explicit path the columns select, bit for bit; the other path
    # gives another point, as far from it as the two directions' tangent residuals allow
    auto, _, start, auto_residual = _step(shape, {}, steps=1)
    explicit, *_ = _step(shape, {"spectral": resolved}, steps=1)
    other, _, _, other_residual = _step(shape, {"spectral": "eigh" if resolved == "products" else "products"}, steps=1)
    torch.testing.assert_close(auto, explicit, rtol=0, atol=0)
    assert not torch.equal(auto, other)
    moved = float((auto - start).norm())
    assert float((auto - other).norm()) <= 5 * (auto_residual + other_residual) * moved


@pytest.mark.parametrize("spectral", ["eigh", "products"])
@pytest.mark.parametrize("sync_free", [True, False])
def test_the_sync_free_option_decides_the_host_reads(spectral, sync_free):
    _, counts, _, _ = _step((48, 12), {"spectral": spectral, "sync_free": sync_free})
    eighs = sum(n for name, n in counts.by_name.items() if "eigh" in name)
    # sync-free: no read of the step's own; an eigendecomposition synchronizes a CUDA device itself
    # (torch's linalg.eigh), counted as one, so the eigh path is never free of them
    assert (counts.syncs == eighs) == sync_free, (counts.syncs, eighs)
    if spectral == "products" and sync_free:
        assert eighs == 0  # products only
    if spectral == "eigh":
        assert eighs > 0


def test_large_cpu_banks_are_split_into_equal_parts_over_the_threads():
    before = torch.get_num_threads()
    side = round(SIDE_BY_SIDE_FLOPS ** (1 / 3)) + 1
    try:
        torch.set_num_threads(2)
        assert side_by_side("cpu", (side, side), 2) == 2
        assert side_by_side("cpu", (4 * side, side), 4) == 2
        assert side_by_side("cpu", (side, side), 3) == 1  # a lone matrix left over: not split
        assert side_by_side("cpu", (side, side), 1) == 1
        assert side_by_side("cpu", (side - 2, side - 2), 2) == 1  # small solves are mostly Python
        assert side_by_side("cuda", (side, side), 2) == 1
        torch.set_num_threads(1)
        assert side_by_side("cpu", (side, side), 2) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_a_split_bank_steps_as_the_unsplit_one(manifold):
    # two banks above SIDE_BY_SIDE_FLOPS (a 320x160 matrix and a 160x320 one, which share the tall
    # shape; two 256x256 on Stiefel, two 384x128 on DGram, whose square dual is smoothed and so
    # iterates differently at another thread count): on two threads their four parts run in one
    # pool, on one thread each bank whole; the same points, states and caller settings
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            g = torch.Generator().manual_seed(3)
            shapes = [(320, 160), (160, 320)] + [(256, 256) if manifold == "stiefel" else (384, 128)] * 2
            params = [nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64)) for shape in shapes]
            opt = ManifoldMuon(params, lr=0.05, manifold=manifold)
            opt.project_parameters()
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
                opt.step()
            assert torch.get_num_threads() == threads and torch.is_grad_enabled()
            results.append(([p.detach().clone() for p in params],
                            [opt.state[p]["dual_correction"].clone() for p in params],
                            [int(opt.state[p]["dual_iterations"]) for p in params]))
    finally:
        torch.set_num_threads(before)
    (split, split_corr, split_it), (whole, whole_corr, whole_it) = results
    assert split_it == whole_it
    for a, b in zip(split + split_corr, whole + whole_corr):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_side_by_side_raises_the_first_failure_after_all_finished_and_restores_threads():
    before = torch.get_num_threads()
    done = []

    def fails():
        raise RuntimeError("first")

    def works():
        done.append(torch.get_num_threads())
        return 7

    try:
        torch.set_num_threads(2)
        assert run_side_by_side([works, works]) == [7, 7]
        assert done == [1, 1]  # each with its share of the threads
        with pytest.raises(RuntimeError, match="first"):
            run_side_by_side([fails, works])
        assert len(done) == 3 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_more_tasks_than_workers_run_at_most_workers_at_once_in_task_order():
    before = torch.get_num_threads()
    lock = threading.Lock()
    together = threading.Barrier(2, timeout=30)  # the first two tasks must run at the same time
    running, most, seen = [0], [0], []

    def task(k, meet=False):
        def run():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
                seen.append(torch.get_num_threads())
            if meet:
                together.wait()  # broken (an error) if the pool ran one task at a time
            time.sleep(0.01)
            with lock:
                running[0] -= 1
            if k in (3, 4):
                raise RuntimeError(f"task {k}")
            return k
        return run

    try:
        torch.set_num_threads(4)
        assert run_side_by_side([task(k, meet=k < 2) for k in range(3)], workers=2) == [0, 1, 2]
        assert most[0] == 2 and seen == [2, 2, 2]  # two at a time, each with 4 // 2 threads
        with pytest.raises(RuntimeError, match="task 3"):  # the first failure in task order
            run_side_by_side([task(k) for k in range(6)], workers=2)
        assert len(seen) == 9 and running[0] == 0 and torch.get_num_threads() == 4  # every task ran
        assert run_side_by_side([task(0)], workers=2) == [0]  # one task: run here
    finally:
        torch.set_num_threads(before)


def test_banks_are_not_split_off_the_eigh_path_or_under_a_counter():
    before = torch.get_num_threads()
    side = round(SIDE_BY_SIDE_FLOPS ** (1 / 3)) + 1
    try:
        torch.set_num_threads(2)
        assert side_by_side("cpu", (side, side), 2, path="products", sync_free=True) == 1
        assert side_by_side("cpu", (side, side), 2, path="eigh", sync_free=True) == 1
        seen = []
        count_ops(lambda: seen.append(side_by_side("cpu", (side, side), 2)))
        assert seen == [1]  # a counter sees its own thread only: everything stays on it
        # and the counter then sees the whole solve of a bank that would be split
        params = [nn.Parameter(torch.randn(320, 160)) for _ in range(2)]
        opt = ManifoldMuon(params, lr=0.05, manifold="stiefel", dual={"spectral": "eigh"})
        opt.project_parameters()
        for p in params:
            p.grad = torch.randn(p.shape)
        counts = count_ops(opt.step)
        assert counts.flops > 4 * 2 * 320 * 160 * 160  # at least W^T G, G^T G and the answer's products
    finally:
        torch.set_num_threads(before)
