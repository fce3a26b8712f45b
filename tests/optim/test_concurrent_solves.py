"""Per-matrix solves side by side on CPU threads: the schedule decision, the runner's guarantees,
and ManifoldMuon steps that equal one-at-a-time steps at the workers' thread count, bit for bit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from manifoldlib.optim import ManifoldMuon
from manifoldlib.optim.concurrent_solves import (
    BALANCE_SLACK,
    MIN_MEAN_COST,
    resolve_workers,
    run_concurrently,
)
from manifoldlib.optim.matmul_precision import _matmul_backends

TALL, SQUARE = (3072, 768), (768, 768)


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True, None])
def test_bad_workers_name_the_value(bad):
    with pytest.raises(ValueError, match=f"workers must be 'auto' or an int >= 1, got {bad!r}"):
        resolve_workers(bad, [SQUARE, SQUARE])
    with pytest.raises(ValueError, match="workers must be"):
        ManifoldMuon([torch.nn.Parameter(torch.randn(4, 4))], manifold="stiefel", workers=bad)


@pytest.mark.parametrize(
    "shapes,threads,expected",
    [
        ([TALL, TALL, SQUARE, SQUARE], 2, 2),  # the GPT-small set: two equal halves
        ([SQUARE, SQUARE], 2, 2),
        ([TALL, SQUARE], 2, 1),  # the big one alone on one thread would set the pace
        ([TALL], 2, 1),
        ([], 2, 1),
        ([TALL, TALL, SQUARE, SQUARE], 1, 1),  # one thread: nothing to share
        ([SQUARE] * 8, 4, 4),
        ([SQUARE] * 3, 8, 3),  # never more workers than matrices
        ([(128, 128), (128, 128), (512, 128), (128, 512)], 2, 2),  # mean cost 5.2e6
        ([(96, 96), (96, 96), (384, 96), (96, 384)], 2, 1),  # 2.2e6: Python-bound, one at a time
        ([(21, 21)] * 8, 2, 1),
    ],
)
def test_auto_runs_side_by_side_only_when_the_split_is_even(shapes, threads, expected):
    assert resolve_workers("auto", shapes, threads=threads) == expected


def test_auto_thresholds_are_the_balance_slack_and_the_size_floor():
    # loads 5 + 4 over two workers: makespan 5 against a mean of 4.5, 1.11 > 1.1
    shapes = [(5 * 256, 256), (4 * 256, 256)]
    assert 5 / 4.5 > BALANCE_SLACK
    assert resolve_workers("auto", shapes, threads=2) == 1
    assert resolve_workers("auto", [(21 * 256, 256), (20 * 256, 256)], threads=2) == 2  # 21 / 20.5 = 1.02
    side = round(MIN_MEAN_COST ** (1 / 3))  # a square of about the floor's cost
    assert resolve_workers("auto", [(side + 2, side + 2)] * 2, threads=2) == 2
    assert resolve_workers("auto", [(side - 2, side - 2)] * 2, threads=2) == 1


def test_an_explicit_count_is_capped_at_the_number_of_solves():
    assert resolve_workers(4, [TALL, SQUARE]) == 2
    assert resolve_workers(3, [TALL]) == 1
    assert resolve_workers(2, [TALL, SQUARE]) == 2  # explicit: no balance check


def test_runner_returns_in_task_order_from_pool_threads_with_their_thread_share():
    torch.set_num_threads(2)
    seen = []
    lock = threading.Lock()

    def task(k):
        def run():
            with lock:
                seen.append((threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))
            return k * k
        return run

    out = run_concurrently([task(k) for k in range(5)], [(k + 1, 1) for k in range(5)], workers=2)
    assert out == [0, 1, 4, 9, 16]
    assert all(name.startswith("manifoldlib-solve2") for name, _, _ in seen)
    assert all(threads == 1 for _, threads, _ in seen)  # 2 threads // 2 workers
    assert not any(grad for _, _, grad in seen)
    assert torch.get_num_threads() == 2  # the caller's count, restored


def test_one_worker_runs_in_the_calling_thread_with_its_settings():
    names = run_concurrently([lambda: threading.current_thread().name] * 2, [SQUARE] * 2, workers=1)
    assert names == [threading.current_thread().name] * 2
    assert run_concurrently([], [], workers=2) == []


def test_a_lone_task_still_gets_the_workers_thread_share():
    torch.set_num_threads(2)
    assert run_concurrently([torch.get_num_threads], [TALL], workers=2) == [1]


def test_never_more_than_workers_at_once():
    active, peak = [0], [0]
    lock = threading.Lock()

    def task():
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1

    run_concurrently([task] * 8, [SQUARE] * 8, workers=3)
    assert peak[0] == 3


def test_a_failure_is_raised_after_every_task_finished():
    finished = []

    def slow():
        time.sleep(0.05)
        finished.append("slow")

    def bad():
        raise RuntimeError("solve 1 failed")

    with pytest.raises(RuntimeError, match="solve 1 failed"):
        run_concurrently([slow, bad, slow], [SQUARE] * 3, workers=2)
    assert finished == ["slow", "slow"]


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="got 2 tasks but 1 shapes"):
        run_concurrently([lambda: 0, lambda: 0], [SQUARE], workers=2)


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g) / shape[0] ** 0.5) for shape in shapes]


def _run(shapes, groups_of, steps, **kwargs):
    params = _params(shapes)
    opt = ManifoldMuon(groups_of(params), lr=0.05, weight_decay=0.01, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params], opt


SHAPES = [(96, 32), (32, 96), (48, 48), (48, 48), (64, 16)]


def _mixed_groups(params):
    return [
        {"params": params[:2], "manifold": "dgram"},
        {"params": params[2:4], "manifold": "stiefel"},
        {"params": params[4:], "manifold": "euclidean"},
    ]


def test_side_by_side_steps_equal_one_at_a_time_steps_at_the_workers_thread_count():
    torch.set_num_threads(1)
    reference, ref_opt = _run(SHAPES, _mixed_groups, 4, workers=1)
    torch.set_num_threads(2)
    got, opt = _run(SHAPES, _mixed_groups, 4, workers=2)  # 2 workers x 1 thread
    for a, b in zip(reference, got):
        assert torch.equal(a, b)
    for p_ref, p in zip(ref_opt.param_groups[0]["params"], opt.param_groups[0]["params"]):
        assert ref_opt.state[p_ref]["dual_iterations"] == opt.state[p]["dual_iterations"]
        assert torch.equal(ref_opt.state[p_ref]["dual_correction"], opt.state[p]["dual_correction"])
    assert torch.get_num_threads() == 2


def _two_matrix_step(manifold, workers, precision="ieee"):
    params = _params([(512, 256), (512, 256)])
    opt = ManifoldMuon(params, manifold=manifold, lr=0.05, workers=workers)
    gen = torch.Generator().manual_seed(11)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    previous = [h.fp32_precision for h in _matmul_backends()]
    torch.backends.mkldnn.matmul.fp32_precision = precision
    try:
        opt.step()
        assert torch.backends.mkldnn.matmul.fp32_precision == precision  # left as it was
    finally:
        for h, value in zip(_matmul_backends(), previous):
            h.fp32_precision = value
    return [p.detach().clone() for p in params]


def test_auto_is_the_default_and_leaves_grad_mode_and_precision_alone():
    torch.set_num_threads(2)
    assert ManifoldMuon(_params([(8, 4)]), manifold="stiefel").workers == "auto"
    auto = _two_matrix_step("stiefel", "auto", precision="bf16")  # above the size floor of "auto"
    two = _two_matrix_step("stiefel", 2)
    assert all(torch.equal(a, b) for a, b in zip(auto, two))  # auto took two workers
    assert torch.is_grad_enabled()


def test_products_inside_the_workers_are_ieee_under_a_bfloat16_setting():
    # a bfloat16 matmul setting of the caller does not reach the workers: the step is the IEEE one, bit for bit
    torch.set_num_threads(2)
    under_bf16 = _two_matrix_step("dgram", 2, precision="bf16")
    under_ieee = _two_matrix_step("dgram", 2, precision="ieee")
    assert all(torch.equal(a, b) for a, b in zip(under_bf16, under_ieee))


def test_a_failing_solve_names_its_error_and_leaves_the_threads_restored():
    torch.set_num_threads(2)
    params = _params([(64, 32), (64, 32)])
    opt = ManifoldMuon(params, manifold="stiefel", lr=0.05, workers=2)
    for p in params:
        p.grad = torch.randn(p.shape)
    with torch.no_grad():
        params[1].mul_(3.0)  # moved off Stiefel behind the optimizer's back: its solve refuses it
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match="W is not a Stiefel point"):
        opt.step()
    assert torch.get_num_threads() == 2
    assert not torch.equal(params[0], before)  # the other matrix's solve still finished


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_builds_its_own_pool():
    import os

    torch.set_num_threads(2)
    run_concurrently([lambda: 1, lambda: 2], [SQUARE, SQUARE], workers=2)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # child: the parent's pool threads are gone; the step must not wait on them
        import signal

        signal.alarm(30)  # a hang kills the child (exit by signal), not the test run
        code = 1
        try:
            code = 0 if run_concurrently([lambda: 3, lambda: 4], [SQUARE, SQUARE], workers=2) == [3, 4] else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
