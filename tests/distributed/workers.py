"""Worker functions for the multi-process tests: importable by spawned processes, no test logic.

Each job is called as ``job(rank, *args)`` by :func:`manifoldlib.distributed.run_workers`
inside an initialized gloo process group and returns plain data for the parent to assert on.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from manifoldlib.distributed import (
    STRATEGIES,
    assign_owners,
    get_rank_world,
    reject_unsupported_parameter,
    sharded_apply,
)
from manifoldlib.functional import msign, stiefel_polar, sym

#: (shape, dtype) of the tensors the sharding job works on: square, tall, wide, batched and
#: empty matrices, vectors, and five dtypes so several gather buffers are exercised.
CASES: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((24, 24), torch.float64),
    ((40, 12), torch.float64),
    ((12, 40), torch.float32),
    ((3, 8, 5), torch.float64),
    ((0, 4), torch.float64),
    ((7,), torch.float32),
    ((16, 16), torch.float32),
    ((9,), torch.bfloat16),
    ((32, 8), torch.float64),
    ((5,), torch.int64),
    ((0, 3), torch.int32),  # a dtype whose tensors are all empty: no gather for it
)


def make_inputs(seed: int = 1234) -> list[torch.Tensor]:
    """The same tensors on every rank and in the parent (drawn in float64, then cast)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
        for shape, dtype in CASES
    ]


def reference_fn(i: int, x: torch.Tensor) -> torch.Tensor:
    """Deterministic per-matrix work: a Polar Express ``msign`` for matrices, affine otherwise."""
    if x.dim() >= 2 and x.numel() > 0:
        return msign(x, "polar-express") * (i + 1)
    return x * 2 + i


def sharding_job(rank: int) -> dict:
    """Run :func:`sharded_apply` under every strategy; report results, calls and DTensor errors."""
    tensors = make_inputs()
    report: dict = {"rank_world": get_rank_world(), "results": {}, "calls": {}, "owners": {}}
    for strategy in STRATEGIES:
        calls: list[int] = []

        def recording_fn(i: int, x: torch.Tensor, calls: list[int] = calls) -> torch.Tensor:
            calls.append(i)
            return reference_fn(i, x)

        report["results"][strategy] = sharded_apply(tensors, recording_fn, strategy=strategy)
        report["calls"][strategy] = calls
        report["owners"][strategy] = assign_owners(
            [tuple(t.shape) for t in tensors], dist.get_world_size(), strategy
        )
    # explicit owners: everything on the last rank
    last = dist.get_world_size() - 1
    report["results"]["all-on-last"] = sharded_apply(
        tensors, reference_fn, owners=[last] * len(tensors)
    )
    # the full computation in this process, no sharding
    report["local"] = [reference_fn(i, t) for i, t in enumerate(tensors)]
    # a group of one rank takes the single-process path
    singletons = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own_group = singletons[rank]
    report["singleton_rank_world"] = get_rank_world(own_group)
    report["singleton"] = sharded_apply(tensors, reference_fn, process_group=own_group)
    report["rejections"] = _dtensor_rejections()
    return report


def _dtensor_rejections() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = torch.nn.Parameter(
        distribute_tensor(
            torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)]
        )
    )
    layer = torch.nn.Linear(4, 6)
    fully_shard(layer, mesh=mesh)
    candidates = [("tp.weight", sharded)] + [(f"fsdp2.{n}", p) for n, p in layer.named_parameters()]
    messages = []
    for name, param in candidates:
        try:
            reject_unsupported_parameter(param, name)
        except TypeError as error:
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append(f"accepted {name}")
    return messages


def raising_job(rank: int) -> None:
    """Rank 1 raises; rank 0 waits in a barrier that rank 1 never reaches."""
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()


def hung_collective_job(rank: int) -> None:
    """Rank 0 enters an all_reduce that rank 1 never joins: the collective must time out."""
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        threading.Event().wait()  # never set: the parent terminates this rank


def never_finishing_job(rank: int) -> None:
    """No rank ever returns: only the harness timeout ends this job."""
    threading.Event().wait()


def rank_and_world_job(rank: int) -> tuple[int, int]:
    """Report ``(rank, world_size)`` as the process group sees it."""
    assert get_rank_world() == (rank, dist.get_world_size())
    return get_rank_world()


#: Stiefel matrices (m >= n) of the optimizer-pattern job.
STIEFEL_SHAPES: tuple[tuple[int, int], ...] = ((16, 8), (12, 12), (20, 4), (9, 3), (24, 6))


def stiefel_muon_pattern(
    steps: int, seed: int = 5
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    r"""A miniature Stiefel Manifold Muon written the way a distributed optimizer uses sharding.

    Per step: momentum :math:`M \leftarrow \beta M + G` on every rank (replicated, like DDP's
    averaged gradients); then on the owner only, a warm-started dual step
    :math:`A = \operatorname{msign}(M + 2W\Lambda)`, :math:`\Lambda \leftarrow \Lambda -
    \alpha\,\operatorname{sym}(W^\top A)` with :math:`\Lambda` kept in owner-only state, and the
    polar retraction :math:`W \leftarrow \operatorname{msign}(W - \eta A)`. Gradients are drawn
    from a generator seeded by the step, identical on every rank. The same code runs in one
    process (no group) and in a gloo group.

    Returns:
        ``(weights, multipliers, held)`` after ``steps`` steps: the multipliers are shared from
        their owners at the end (the pattern for checkpointing owner-only state); ``held`` lists
        the indices whose multiplier this rank kept during the steps.
    """
    generator = torch.Generator().manual_seed(seed)
    weights = [
        msign(torch.randn(s, generator=generator, dtype=torch.float64)) for s in STIEFEL_SHAPES
    ]
    momenta = [torch.zeros_like(w) for w in weights]
    owner_state: dict[int, torch.Tensor] = {}  # index -> multiplier, only on the owner
    _, world_size = get_rank_world()
    owners = assign_owners([tuple(w.shape) for w in weights], world_size, "size")

    def solve_and_retract(i: int, w: torch.Tensor) -> torch.Tensor:
        n = w.size(-1)
        dual = owner_state.get(i, torch.zeros(n, n, dtype=w.dtype))
        a = msign(momenta[i] + 2 * w @ dual, "polar-express")
        owner_state[i] = dual - 0.1 * sym(w.mT @ a)
        return stiefel_polar(w, -0.05 * a, method="svd")

    for step in range(steps):
        step_generator = torch.Generator().manual_seed(1000 + step)
        for w, m in zip(weights, momenta):
            m.mul_(0.9).add_(torch.randn(w.shape, generator=step_generator, dtype=w.dtype) + w)
        weights = sharded_apply(weights, solve_and_retract, owners=owners)
    # share the owner-only multipliers: templates of the right shape, the owners fill them in
    templates = [torch.empty(w.size(-1), w.size(-1), dtype=w.dtype) for w in weights]
    multipliers = sharded_apply(
        templates, lambda i, t: owner_state.get(i, torch.zeros_like(t)), owners=owners
    )
    return [w.clone() for w in weights], [d.clone() for d in multipliers], sorted(owner_state)


def stiefel_muon_job(rank: int, steps: int) -> dict:
    """:func:`stiefel_muon_pattern` in the group, with the owners it used."""
    weights, multipliers, held = stiefel_muon_pattern(steps)
    owners = assign_owners(list(STIEFEL_SHAPES), dist.get_world_size(), "size")
    return {"weights": weights, "multipliers": multipliers, "held": held, "owners": owners}


def train_job(rank: int, runs: list[tuple[dict, str, bool]]) -> dict:
    """``models.train.run_training`` for each ``(overrides, out, resume)`` of ``runs`` in turn.

    The overrides apply on top of the ``smoke`` preset. Every training forward's input rows are
    recorded (the first batch of each run kept whole), so the parent can check that each rank
    trained on its own slice of the global batch.
    """
    import models.train as train_mod
    from models.config import build_config

    seen: list[list[torch.Tensor]] = []
    build = train_mod.build_model

    def recording_build(cfg, vocab_size):
        model = build(cfg, vocab_size)
        forward, inputs = model.forward, []
        seen.append(inputs)

        def recorded(idx, targets=None):
            if model.training:
                inputs.append(idx.detach().cpu().clone())
            return forward(idx, targets)

        model.forward = recorded
        return model

    train_mod.build_model = recording_build
    try:
        summaries = []
        for overrides, out, resume in runs:
            try:
                cfg = build_config("smoke", overrides=overrides)
                summaries.append(train_mod.run_training(cfg, out, resume=resume, echo=False))
            except ValueError as error:  # ConfigError, CorpusError
                summaries.append({"error": f"{type(error).__name__}: {error}"})
    finally:
        train_mod.build_model = build
    return {
        "summaries": summaries,
        "first_inputs": [inputs[0] for inputs in seen if inputs],
        "input_rows": sorted({len(x) for inputs in seen for x in inputs}),
    }
