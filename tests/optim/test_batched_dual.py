"""Same-shape matrices solved as one batched dual (the products path): the per-matrix step's result.

Every test runs the functional core (or the optimizer) twice, with the execution policy's
``batch`` on and off, and compares new parameters and per-matrix state. That the batched solve
ran is seen from outside: a ``TorchFunctionMode`` records the leading size of every 3-D matrix
product (there are none without batching).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch.overrides import TorchFunctionMode

from manifoldlib import get_manifold
from manifoldlib.optim import ExecutionPolicy, ManifoldMuon, manifold_muon
from manifoldlib.testing.hard_instances import hard_instance

NS = (3.4445, -4.7750, 2.0315)
MANIFOLDS = ("stiefel", "dgram", "oblique")
_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.baddbmm}


class _BatchSizes(TorchFunctionMode):
    """Records the batch size of every 3-D matrix product run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
            self.sizes.add(args[0].size(0))
        return func(*args, **(kwargs or {}))


def _points(manifold: str, shapes, seed: int, dtype) -> list[torch.Tensor]:
    """Points of ``manifold`` in each shape (a wide one is a tall point transposed)."""
    man, gen = get_manifold(manifold), torch.Generator().manual_seed(seed)
    out = []
    for m, n in shapes:
        tall = man.random(max(m, n), min(m, n), generator=gen, dtype=torch.float64)
        out.append((tall if m >= n else tall.mT).contiguous().to(dtype))
    return out


def _gradients(shapes, seed: int, dtype=torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _step(params, grads, states, manifold, batch: bool, dual: dict, *, fuse: bool = True) -> set[int]:
    """One ``manifold_muon`` step on the products path (no momentum: the dual sees ``grads``);
    returns the batch sizes of its 3-D products."""
    recorder = _BatchSizes()
    with recorder:
        manifold_muon(
            params, [g.clone() for g in grads], [torch.zeros_like(p) for p in params], states,
            lr=0.05, weight_decay=0.1, momentum=0.0, nesterov=False, ns_coefficients=NS, ns_steps=5,
            eps=1e-7, adjust_lr_fn=None, manifold=manifold, dual={"spectral": "products", **dual},
            fuse_retraction=fuse, execution=ExecutionPolicy(spectral="products", batch=batch),
        )
    return recorder.sizes


def _twice(manifold, params, grad_steps, dual, **kw):
    """The same steps with batching on and off: ``(params, states, sizes)`` of each."""
    runs = []
    for batch in (True, False):
        ps, states, sizes = [p.clone() for p in params], [{} for _ in params], set()
        for grads in grad_steps:
            sizes |= _step(ps, grads, states, manifold, batch, dual, **kw)
        runs.append((ps, states, sizes))
    return runs


def _assert_same(batched, single, atol: float) -> None:
    (pb, sb, _), (pu, su, _) = batched, single
    for i, (a, b) in enumerate(zip(pb, pu)):
        assert float((a - b).abs().max()) <= atol, i
    for i, (a, b) in enumerate(zip(sb, su)):
        assert a.keys() == b.keys(), i
        assert a["dual_iterations"] == b["dual_iterations"], (i, a["dual_iterations"], b["dual_iterations"])
        assert a["dual_residual"] == pytest.approx(b["dual_residual"], rel=1e-3, abs=10 * atol), i
        correction = a["dual_correction"]
        if correction is None:  # a zero gradient: no dual ran, nothing to warm-start
            assert b["dual_correction"] is None, i
            continue
        assert correction.shape == b["dual_correction"].shape and correction.dtype == b["dual_correction"].dtype
        assert float((correction - b["dual_correction"]).abs().max()) <= 10 * atol, i


def _assert_batches(seen: set[int], classes: set[int]) -> None:
    """Every same-shape class was solved as one batch of its size; the later, smaller batches are
    the instances still active after others converged."""
    assert classes <= seen <= set(range(1, max(classes) + 1)), (seen, classes)


@pytest.mark.parametrize("manifold", MANIFOLDS)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("smoothing", [None, "auto"])
def test_batched_steps_equal_per_matrix_steps(manifold, dtype, atol, smoothing):
    # tall, wide (the same tall shape: one batch of three) and square; three warm-started steps
    shapes = [(48, 12), (12, 48), (48, 12), (20, 20), (20, 20)]
    params = _points(manifold, shapes, seed=0, dtype=dtype)
    grads = [_gradients(shapes, seed=10 + k, dtype=dtype) for k in range(3)]
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    batched, single = _twice(manifold, params, grads, {"tol": tol, "max_iter": 100, "smoothing": smoothing})
    _assert_same(batched, single, atol)
    assert single[2] == set()  # no batched product without batching
    # square DGram and Oblique are smoothed from the start with "auto": per matrix (eigh)
    squares_batched = smoothing is None or manifold == "stiefel"
    _assert_batches(batched[2], {3, 2} if squares_batched else {3})
    for shape, state in zip(shapes, batched[1]):
        # square DGram without smoothing: a rank-deficient optimum, the plain dual stalls (and
        # says so, batched or not)
        stalls = manifold == "dgram" and shape[0] == shape[1] and smoothing is None
        assert (state["dual_residual"] <= tol) != stalls


@pytest.mark.parametrize("seed", [0, 1])
def test_a_hard_instance_converges_later_within_its_batch(seed):
    # Oblique, low-rank gradient: BB gets there, in two to three times the easy instances' steps
    w_hard, g_hard = hard_instance("oblique", 128, 32, 4, 0.1, seed)
    easy = _points("oblique", [(128, 32)] * 2, seed=seed + 5, dtype=torch.float64)
    params = [easy[0], w_hard, easy[1]]
    grads = [_gradients([(128, 32)], seed=seed + 20)[0], g_hard, _gradients([(128, 32)], seed=seed + 21)[0]]
    batched, single = _twice("oblique", params, [grads], {"tol": 1e-6, "max_iter": 100})
    _assert_same(batched, single, 1e-10)
    _assert_batches(batched[2], {3})
    iterations = [s["dual_iterations"] for s in batched[1]]
    assert iterations[1] > max(iterations[0], iterations[2]) > 0
    assert all(s["dual_residual"] <= 1e-6 for s in batched[1])


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("smoothing", ["auto", None])
def test_an_instance_that_stalls_in_the_batch_takes_the_per_matrix_solve(manifold, smoothing):
    # the hard instance's plain dual stalls (rank-deficient optimum): with "auto" the per-matrix
    # solve continues on the smoothed dual and converges; without smoothing it stays above tol,
    # exactly as the unbatched step reports it
    w_hard, g_hard = hard_instance(manifold, 128, 32, 4, 0.1, seed=0)
    easy = _points(manifold, [(128, 32)] * 2, seed=3, dtype=torch.float64)
    params = [easy[0], w_hard, easy[1]]
    grads = [_gradients([(128, 32)], seed=30)[0], g_hard, _gradients([(128, 32)], seed=31)[0]]
    tol = 1e-3
    batched, single = _twice(manifold, params, [grads], {"tol": tol, "smoothing": smoothing})
    _assert_same(batched, single, 1e-10)
    _assert_batches(batched[2], {3})
    states = batched[1]
    assert states[0]["dual_residual"] <= tol and states[2]["dual_residual"] <= tol
    if smoothing == "auto":
        assert states[1]["dual_residual"] <= tol
    else:
        assert states[1]["dual_residual"] > tol  # never reported converged


@pytest.mark.parametrize("manifold", MANIFOLDS)
def test_a_mixed_shape_group_batches_only_equal_shapes(manifold):
    # (48, 12) twice (once wide), (64, 16) and (30, 10) alone: batches of two and of one
    shapes = [(48, 12), (64, 16), (12, 48), (30, 10)]
    params = _points(manifold, shapes, seed=2, dtype=torch.float64)
    grads = [_gradients(shapes, seed=40 + k) for k in range(2)]
    batched, single = _twice(manifold, params, grads, {"tol": 1e-6, "max_iter": 100})
    _assert_same(batched, single, 1e-10)
    _assert_batches(batched[2], {2, 1})


def test_the_plain_retraction_takes_the_batched_solve_too():
    shapes = [(48, 12), (12, 48)]
    params = _points("dgram", shapes, seed=4, dtype=torch.float64)
    batched, single = _twice("dgram", params, [_gradients(shapes, seed=50)], {"tol": 1e-6}, fuse=False)
    _assert_same(batched, single, 1e-10)
    _assert_batches(batched[2], {2})


def _hetero(params) -> list[dict]:
    return [{"params": params[:2], "manifold": "stiefel"}, {"params": params[2:], "manifold": "dgram"}]


def _train(opt, params, steps: int, first: int) -> None:
    for k in range(first, first + steps):
        for p, g in zip(params, _gradients([tuple(p.shape) for p in params], seed=100 + k)):
            p.grad = g
        opt.step()


def test_the_optimizer_batches_and_its_state_dict_round_trips():
    shapes = [(40, 10), (10, 40), (36, 12), (12, 36)]
    dual = {"spectral": "products", "tol": 1e-6, "max_iter": 100}
    start = _points("stiefel", shapes[:2], 6, torch.float64) + _points("dgram", shapes[2:], 7, torch.float64)
    runs = {}
    for batch in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = ManifoldMuon(_hetero(params), lr=0.05, dual=dual, batch=batch, project_init=False)
        _train(opt, params, 3, 0)
        runs[batch] = (params, opt)
    (pb, ob), (pu, _) = runs[True], runs[False]
    assert max(float((a - b).abs().max()) for a, b in zip(pb, pu)) <= 1e-10
    for p in pb:  # each matrix's own warm start, not a view of the batch (a checkpoint stores it alone)
        correction = ob.state[p]["dual_correction"]
        assert correction.untyped_storage().nbytes() == correction.numel() * correction.element_size()
    buffer = io.BytesIO()
    torch.save(ob.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in pb]
    resumed = ManifoldMuon(_hetero(resumed_params), lr=0.05, dual=dual, batch=True, project_init=False)
    resumed.load_state_dict(saved)
    _train(ob, pb, 2, 3)
    _train(resumed, resumed_params, 2, 3)
    for a, b in zip(pb, resumed_params):
        assert torch.equal(a, b)
    assert ob.batch is True and ManifoldMuon(_hetero(pu), batch="auto").batch == "auto"


def test_the_policy_decides_batching():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert ExecutionPolicy.resolve(cpu, spectral="products").batch is True
    assert ExecutionPolicy.resolve(cpu).batch is False  # the eigh path keeps the thread pool
    assert ExecutionPolicy.resolve(cuda, bfloat16_native=False).batch is True  # products on CUDA
    assert ExecutionPolicy.resolve(cuda, bfloat16_native=False, batch=False).batch is False
    assert ExecutionPolicy().batch is False
    with pytest.raises(ValueError, match="spectral='products'"):
        ExecutionPolicy.resolve(cpu, batch=True)
    with pytest.raises(ValueError, match="spectral='products'"):
        ExecutionPolicy(batch=True)
    with pytest.raises(ValueError, match="True or False"):
        ExecutionPolicy(spectral="products", batch=1)
    with pytest.raises(ValueError, match="batch must be one of"):
        ExecutionPolicy.resolve(cpu, batch="on")
    with pytest.raises(ValueError, match="batch must be one of"):
        ManifoldMuon([torch.nn.Parameter(torch.randn(4, 2))], manifold="stiefel", batch="on")


def test_euclidean_groups_ignore_batching():
    params = [torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))]
    opt = ManifoldMuon(params, manifold="euclidean", batch=True)  # no dual to batch: no error
    params[0].grad = torch.ones(6, 4)
    opt.step()
    assert opt.state[params[0]]["dual_iterations"] == 0


class _Precisions(TorchFunctionMode):
    """Records the float32 precision of the cuBLAS and oneDNN matmul backends
    (``torch.backends.*.matmul.fp32_precision``) at every 3-D matrix product run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
            for backend in (torch.backends.cuda, torch.backends.mkldnn):
                self.seen.add(backend.matmul.fp32_precision)
        return func(*args, **(kwargs or {}))


def test_the_batched_solve_runs_in_ieee_float32():
    # TF32's 1e-3 error is the size of the dual's tolerance: the batched products must not use it
    shapes = [(48, 12), (12, 48)]
    params = _points("stiefel", shapes, seed=8, dtype=torch.float32)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        recorder = _Precisions()
        with recorder:
            _step(params, _gradients(shapes, seed=60, dtype=torch.float32), [{}, {}], "stiefel", True, {"tol": 1e-4})
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert recorder.seen and recorder.seen <= {"ieee", "none"}  # "none": the default, IEEE


def test_options_the_batched_solve_does_not_run_fail_as_the_per_matrix_step_does():
    # Anderson steps need the eigh path: refused with the policy's products path, batched or not
    shapes = [(48, 12), (48, 12)]
    params = _points("stiefel", shapes, seed=9, dtype=torch.float64)
    for batch in (True, False):
        with pytest.raises(ValueError, match="anderson"):
            manifold_muon(
                [p.clone() for p in params], _gradients(shapes, seed=70), [torch.zeros_like(p) for p in params],
                [{}, {}], lr=0.05, weight_decay=0.0, momentum=0.0, nesterov=False, ns_coefficients=NS,
                ns_steps=5, eps=1e-7, adjust_lr_fn=None, manifold="stiefel", dual={"update": "anderson"},
                execution=ExecutionPolicy(spectral="products", batch=batch),
            )


def test_bfloat16_matrices_are_solved_in_float32_batched_or_not():
    shapes = [(48, 12), (12, 48), (48, 12)]
    params = _points("dgram", shapes, seed=11, dtype=torch.bfloat16)
    grads = [_gradients(shapes, seed=80 + k, dtype=torch.bfloat16) for k in range(2)]
    batched, single = _twice("dgram", params, grads, {"tol": 1e-4, "max_iter": 100})
    _assert_same(batched, single, 1e-5)
    _assert_batches(batched[2], {3})
    assert all(p.dtype == torch.bfloat16 for p in batched[0])
    assert all(s["dual_correction"].dtype == torch.float32 for s in batched[1])


def test_a_zero_gradient_in_a_batch_takes_the_per_matrix_step():
    shapes = [(48, 12)] * 3
    params = _points("stiefel", shapes, seed=12, dtype=torch.float64)
    grads = _gradients(shapes, seed=90)
    grads[1] = torch.zeros(48, 12, dtype=torch.float64)
    batched, single = _twice("stiefel", params, [grads], {"tol": 1e-6, "max_iter": 100})
    _assert_same(batched, single, 1e-10)
    _assert_batches(batched[2], {2})  # the other two
    assert batched[1][1]["dual_iterations"] == 0
    assert float((batched[0][1] - params[1]).abs().max()) <= 1e-12  # a zero step: the point stays


def test_a_stored_warm_start_of_the_wrong_shape_is_refused_batched_or_not():
    shapes = [(48, 12)] * 2
    params = _points("stiefel", shapes, seed=13, dtype=torch.float64)
    for batch in (True, False):
        states = [{"dual_correction": torch.zeros(12, 12, dtype=torch.float64)},
                  {"dual_correction": torch.zeros(8, 8, dtype=torch.float64)}]
        with pytest.raises(ValueError, match="correction must have shape"):
            _step([p.clone() for p in params], _gradients(shapes, seed=95), states, "stiefel", batch, {"tol": 1e-6})


@pytest.mark.parametrize("manifold,message", [("stiefel", "not a Stiefel point: column 3"),
                                              ("dgram", r"columns \[3\]"), ("oblique", "linearly dependent")])
def test_a_point_the_dual_cannot_use_is_refused_batched_or_not(manifold, message):
    shapes = [(48, 12)] * 2
    for batch in (True, False):
        params = _points(manifold, shapes, seed=14, dtype=torch.float64)
        if manifold == "stiefel":
            params[1][:, 3] *= 2.0  # column 3 of the second matrix: norm 2
        else:
            params[1][:, 3] = 0.0  # a zero column
        with pytest.raises(ValueError, match=message):
            _step(params, _gradients(shapes, seed=96), [{}, {}], manifold, batch, {"tol": 1e-6})
