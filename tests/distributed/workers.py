"""Worker functions for the multi-process tests: importable by spawned processes, no test logic.

Each job is called as ``job(rank, *args)`` by :func:`manifoldlib.distributed.run_workers`
inside an initialized gloo process group and returns plain data for the parent to assert on.
"""

from __future__ import annotations

import copy
import os
import sys
import threading

import torch
import torch.distributed as dist

from manifoldlib.distributed import (
    STRATEGIES,
    assign_owners,
    get_rank_world,
    init_from_env,
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
    ((0, 3), torch.int32),  # a dtype whose tensors are all empty: only the layout digest is gathered
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
    report["mismatches"] = _mismatch_errors(rank)
    report["collectives"] = _collectives_per_call(tensors)
    return report


def _collectives_per_call(tensors: list[torch.Tensor]) -> dict[bool, tuple[int, int]]:
    """``check_layout -> (gathers, host reads)`` of one :func:`sharded_apply` call."""
    from manifoldlib.testing import count_ops

    out = {}
    for check in (True, False):
        counts = count_ops(lambda: sharded_apply(tensors, reference_fn, check_layout=check))
        out[check] = (counts.by_name["_allgather_base_"], counts.syncs)
    return out


def _mismatch_errors(rank: int) -> dict[str, str]:
    """What :func:`sharded_apply` says where the ranks pass the same payload sizes but another
    order, dtype or owners, another set of dtypes (so another number of gathers), or no tensors
    at all (each case once per rank; ``"no error"`` where it returned)."""
    swapped = [(2, 3), (3, 2)] if rank == 0 else [(3, 2), (2, 3)]  # equal costs: same owners
    cases = {
        "order": ([torch.full(s, float(rank), dtype=torch.float64) for s in swapped], None),
        "dtype": ([torch.ones(4, 4, dtype=torch.float32 if rank == 0 else torch.int32)] * 2,
                  None),
        "owners": ([torch.ones(4, 4)] * 2, [0, 1] if rank == 0 else [1, 0]),
        "dtype_sets": ([torch.ones(4, 4), torch.ones(4, 4, dtype=torch.float64 if rank == 0
                                                     else torch.float32)], None),
        "empty": ([torch.ones(3, 3)] if rank == 0 else [], None),
    }
    out = {}
    for name, (tensors, owners) in cases.items():
        try:
            sharded_apply(tensors, lambda i, t: t * 2, owners=owners)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


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


def leaving_job(rank: int, how: str) -> int:
    """Rank 1 leaves ``fn`` with exit code 0 without returning (``how``: ``"sys.exit"``,
    ``"KeyboardInterrupt"`` or ``"os._exit"``); rank 0 returns its rank."""
    if rank == 1:
        if how == "sys.exit":
            sys.exit(0)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        os._exit(0)
    return rank


def hung_collective_job(rank: int) -> None:
    """Rank 0 enters an all_reduce that rank 1 never joins: the collective must time out."""
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        threading.Event().wait()  # never set: the parent terminates this rank


def never_finishing_job(rank: int) -> None:
    """No rank ever returns: only the harness timeout ends this job."""
    threading.Event().wait()


def rank_and_world_job(rank: int) -> dict:
    """Report ``(rank, world_size)`` as the process group sees it, the torchrun variables the
    worker was given, and what :func:`init_from_env` makes of them beside the existing group."""
    assert get_rank_world() == (rank, dist.get_world_size())
    return {"rank_world": get_rank_world(), "env": [os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")],
            "init_from_env": init_from_env(timeout=30.0)}


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


# ---- ManifoldMuon under DDP -----------------------------------------------------------------

#: (shape, manifold) of the matrices of :class:`MuonNet`: tall, wide and square, on every
#: manifold a ManifoldMuon group can use.
MUON_LAYERS: tuple[tuple[tuple[int, int], str], ...] = (
    ((16, 8), "stiefel"),
    ((8, 16), "stiefel"),  # wide: orthonormal rows
    ((12, 8), "dgram"),
    ((12, 12), "stiefel"),
    ((6, 12), "dgram"),
    ((6, 6), "euclidean"),
)
MUON_BATCH = 8


class MuonNet(torch.nn.Module):
    """A chain of bias-free matrices ``x -> tanh(W_i x)``; float64; deterministic init."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(0.3 * torch.randn(shape, generator=generator, dtype=torch.float64))
            for shape, _ in MUON_LAYERS
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8) -> (B, 6)
        for w in self.weights:
            x = torch.tanh(x @ w.mT)
        return x


def muon_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs ``(B, 8)`` and targets ``(B, 6)``, float64."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(MUON_BATCH, 8, generator=generator, dtype=torch.float64)
    return x, torch.randn(MUON_BATCH, 6, generator=generator, dtype=torch.float64)


def make_muon(model: torch.nn.Module, **options):
    """ManifoldMuon with one group per manifold of :data:`MUON_LAYERS`."""
    from manifoldlib.optim import ManifoldMuon

    groups: dict[str, list] = {}
    for p, (_, manifold) in zip(model.weights, MUON_LAYERS):
        groups.setdefault(manifold, []).append(p)
    return ManifoldMuon(
        [{"params": ps, "manifold": m} for m, ps in groups.items()],
        lr=0.05, momentum=0.9, weight_decay=0.01, **options,
    )


def _train_steps(models_and_opts, steps: int, shard: slice, first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = muon_batch(step)
        for model, opt in models_and_opts:
            loss = (model(x[shard]) - y[shard]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def _state_keys(opt, params) -> list[list[str]]:
    """The state keys ``opt`` holds for each of ``params`` (in that order)."""
    return [sorted(opt.state[p].keys()) for p in params]


def muon_ddp_job(rank: int, steps: int, options: dict) -> dict:
    """Sharded and replicated ManifoldMuon (extra ``options``) on two DDP copies of MuonNet.

    After ``steps`` steps: both copies' weights; the sharded optimizer's owners and which
    state keys each rank held; the state dicts of both (the sharded one after
    ``consolidate_state_dict``); the weights after ``steps`` more steps with the same
    optimizers (``"continued"``) and, from the same point, with fresh optimizers loaded from
    those state dicts (``"resumed"``, the checkpoint path). In a plain process
    (``rank`` 0 of 1, no group) the same code is the single-process reference.
    """
    from torch.nn.parallel import DistributedDataParallel

    from manifoldlib.distributed import batch_shard, get_rank_world

    rank, world_size = get_rank_world()
    shard = batch_shard(MUON_BATCH, rank, world_size)
    wrap = DistributedDataParallel if world_size > 1 else (lambda m: m)
    nets = {mode: MuonNet() for mode in ("sharded", "replicated")}
    opts = {mode: make_muon(nets[mode], distribution=mode, **options) for mode in nets}
    _train_steps([(wrap(nets[m]), opts[m]) for m in nets], steps, shard)
    report: dict = {
        "weights": {m: [p.detach().clone() for p in nets[m].weights] for m in nets},
        "held": _state_keys(opts["sharded"], nets["sharded"].weights),
        "held_replicated": _state_keys(opts["replicated"], nets["replicated"].weights),
        "owners": [opts["sharded"].owners()[id(p)] for p in nets["sharded"].weights],
    }
    for opt in opts.values():
        opt.consolidate_state_dict()
    # a deep copy, as torch.save would write it: later steps update the buffers in place
    report["state_dicts"] = {m: copy.deepcopy(opts[m].state_dict()) for m in opts}
    report["held_after"] = _state_keys(opts["sharded"], nets["sharded"].weights)
    saved = {m: [p.detach().clone() for p in nets[m].weights] for m in nets}
    # continue with the same optimizers ...
    _train_steps([(wrap(nets[m]), opts[m]) for m in nets], steps, shard, first=steps)
    report["continued"] = {m: [p.detach().clone() for p in nets[m].weights] for m in nets}
    # ... and resume in a checkpoint's order: fresh optimizers (they project the current weights),
    # then the saved weights and the saved state loaded into them
    fresh = {m: make_muon(nets[m], distribution=m, **options) for m in nets}
    with torch.no_grad():
        for m, net in nets.items():
            for p, value in zip(net.weights, saved[m]):
                p.copy_(value)
    for m in nets:
        fresh[m].load_state_dict(report["state_dicts"][m])
    _train_steps([(wrap(nets[m]), fresh[m]) for m in nets], steps, shard, first=steps)
    report["resumed"] = {m: [p.detach().clone() for p in nets[m].weights] for m in nets}
    return report


def sharded_step_syncs(steps: int) -> list[int]:
    """Host synchronizations of each sharded (products-path) :meth:`ManifoldMuon.step` of a DDP
    copy of MuonNet (:func:`~manifoldlib.testing.count_ops`)."""
    from torch.nn.parallel import DistributedDataParallel

    from manifoldlib.distributed import batch_shard, get_rank_world
    from manifoldlib.testing import count_ops

    rank, world_size = get_rank_world()
    shard = batch_shard(MUON_BATCH, rank, world_size)
    net = MuonNet()
    opt = make_muon(net, distribution="sharded", dual={"spectral": "products"})
    model = DistributedDataParallel(net) if world_size > 1 else net
    syncs = []
    for step in range(steps):
        x, y = muon_batch(step)
        (model(x[shard]) - y[shard]).pow(2).mean().backward()
        syncs.append(count_ops(opt.step).syncs)
        opt.zero_grad(set_to_none=True)
    return syncs


def muon_ddp_jobs(rank: int, steps: int, option_sets: dict[str, dict]) -> dict:
    """:func:`muon_ddp_job` for each named set of options, in one process group, and the host
    synchronizations of the sharded steps (``"sharded_step_syncs"``, :func:`sharded_step_syncs`)."""
    report = {name: muon_ddp_job(rank, steps, options) for name, options in option_sets.items()}
    report["sharded_step_syncs"] = sharded_step_syncs(4)
    return report


def combined_ddp_job(rank: int, steps: int) -> dict:
    """``build_optimizer`` (hetero policy) on a tiny float64 GPT under DDP, both modes."""
    from torch.nn.parallel import DistributedDataParallel

    from manifoldlib.distributed import batch_shard, get_rank_world
    from manifoldlib.optim import build_optimizer
    from models.gpt import GPT, GPTConfig

    rank, world_size = get_rank_world()
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16,
                       dropout=0.0, bias=False)
    shard = batch_shard(MUON_BATCH, rank, world_size)
    out: dict = {"params": {}, "kinds": {}}
    for mode in ("sharded", "replicated"):
        torch.manual_seed(0)
        model = GPT(config).double()
        opt = build_optimizer(model, policy="hetero", lr=0.02, adamw_lr=1e-3, distribution=mode)
        trained = DistributedDataParallel(model) if world_size > 1 else model
        for step in range(steps):
            generator = torch.Generator().manual_seed(200 + step)
            idx = torch.randint(32, (MUON_BATCH, 9), generator=generator)
            _, loss = trained(idx[shard, :-1], idx[shard, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.consolidate_state_dict()
        out["params"][mode] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["kinds"][mode] = sorted({g["manifold"] for g in opt.param_groups if "manifold" in g})
        out.setdefault("state_sizes", {})[mode] = len(opt.state_dict()["state"])
    return out


def ddp_teardown_job(rank: int) -> dict:
    """One DDP step, then the group destroyed: the warnings that raised and the gloo threads
    still alive afterwards (thread names from /proc; Linux only)."""
    import gc
    import glob
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    from manifoldlib.distributed import destroy_process_group

    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    del model
    gc.collect()

    def gloo_threads() -> list[str]:
        names = []
        for path in glob.glob("/proc/self/task/*/comm"):
            try:
                with open(path) as handle:
                    names.append(handle.read().strip())
            except OSError:  # a thread that ended while we listed them
                continue
        return sorted(name for name in names if "gloo" in name)

    before = gloo_threads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        destroy_process_group()
    return {"before": before, "after": gloo_threads(), "warnings": [str(w.message) for w in caught]}


def exchange_from_one_side_job(rank: int) -> dict:
    """:func:`exchange` where rank 1 sends nothing at all: rank 0 sends it a float64 and an int32
    piece and keeps a bfloat16 one; ``device`` left to the group (``None``) and named (``"cpu"``).

    Returns ``{device: [[(device type, dtype name, values), ...] per source rank]}``."""
    from manifoldlib.distributed import exchange

    pieces = [torch.arange(6, dtype=torch.float64).view(3, 2), torch.arange(5, dtype=torch.int32)]
    kept = [torch.full((2,), 1.5, dtype=torch.bfloat16)]

    def specs(tensors):
        return [(tuple(t.shape), t.dtype) for t in tensors]

    outgoing, incoming = ([kept, pieces], [specs(kept), []]) if rank == 0 else ([[], []], [specs(pieces), []])
    report = {}
    for device in (None, "cpu"):
        received = exchange(outgoing, incoming, device=device)
        report[str(device)] = [[(t.device.type, str(t.dtype), t.clone()) for t in source] for source in received]
    return report
