"""Worker functions of the ManifoldMuon-on-FSDP2 tests (importable by spawned processes; no test logic).

Each job builds the same matrices on every rank (and in the parent, for the single-process
reference), steps them, and returns whole tensors and the per-matrix state for the parent to
compare. Gradients are computed identically on every rank and placed ``Shard(0)`` by hand in the
optimizer cases, so any difference from the single process is the optimizer's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: ``(rows, cols, dtype, layout)`` of the matrices of the optimizer cases: tall, wide and square;
#: rows not divisible by 2 or 4 (10, 5, 3: a rank with one row or none); float32, float64 and
#: bfloat16 (mixed dtypes in one optimizer); a ``Conv1D`` ("in_out") matrix.
MATRICES = (
    (10, 6, torch.float64, "out_in"),
    (6, 10, torch.float64, "out_in"),
    (8, 8, torch.float64, "out_in"),
    (10, 6, torch.float64, "out_in"),
    (5, 3, torch.float32, "out_in"),
    (12, 4, torch.float32, "in_out"),
    (3, 7, torch.float64, "out_in"),
    (16, 8, torch.bfloat16, "out_in"),
)
MANIFOLDS = ("euclidean", "stiefel", "dgram", "oblique")
#: Named option sets: the default CPU path, the products (sync-free) path, plain momentum.
OPTION_SETS = {
    "default": {},
    "products": {"dual": {"spectral": "products", "sync_free": True}},
    "plain-momentum": {"nesterov": False, "momentum": 0.5},
}
STEPS = 3
#: Scalars every rank keeps per matrix.
SCALAR_KEYS = ("skipped_steps", "dual_iterations", "dual_residual", "retraction_residual")


def _chosen(which: tuple[int, ...] | None):
    return MATRICES if which is None else [MATRICES[i] for i in which]


def initial_matrices(which: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(m, n, generator=generator, dtype=torch.float64).to(dtype) for m, n, dtype, _ in _chosen(which)]


def gradient(step: int, index: int, like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + index)
    g = torch.randn(like.shape, generator=generator, dtype=torch.float64)
    if step == 1 and index == 1 and like.shape == MATRICES[1][:2]:
        g[0, 0] = float("nan")  # one non-finite gradient: that matrix skips the step
    return g.to(like.dtype)


def groups(manifold: str, params: list[torch.Tensor], which: tuple[int, ...] | None) -> list[dict]:
    layouts = [layout for *_, layout in _chosen(which)]
    return [{"params": [p for p, lay in zip(params, layouts) if lay == layout], "layout": layout,
             "manifold": manifold} for layout in ("out_in", "in_out") if layout in layouts]


def run_steps(params: list[torch.Tensor], optimizer, grads_of) -> None:
    for step in range(STEPS):
        for index, p in enumerate(params):
            p.grad = grads_of(step, index, p)
        optimizer.step()


def state_summary(optimizer, params: list[torch.Tensor], whole) -> list[dict]:
    return [{key: whole(value).clone() for key, value in optimizer.state.get(p, {}).items()
             if isinstance(value, torch.Tensor)} for p in params]


def single_process(manifold: str, options: dict, which: tuple[int, ...] | None = None) -> dict:
    """The reference: the same steps on whole matrices in this process."""
    from manifoldlib.optim import ManifoldMuon

    params = [torch.nn.Parameter(w) for w in initial_matrices(which)]
    optimizer = ManifoldMuon(groups(manifold, params, which), lr=0.05, weight_decay=0.1, **options)
    run_steps(params, optimizer, gradient)
    return {"params": [p.detach().clone() for p in params],
            "state": state_summary(optimizer, params, lambda t: t)}


def optimizer_job(rank: int, cases: list[tuple[str, str, tuple[int, ...] | None]]) -> dict:
    """Each ``(manifold, option set, which matrices)`` case on row-sharded (DTensor ``Shard(0)``)
    matrices (``which``: indices into :data:`MATRICES`, ``None`` for all)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from manifoldlib.optim import ManifoldMuon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def sharded_gradient(step, index, p):
        return distribute_tensor(gradient(step, index, p), mesh, [Shard(0)])

    report = {}
    for manifold, option_set, which in cases:
        params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for w in initial_matrices(which)]
        optimizer = ManifoldMuon(groups(manifold, params, which), lr=0.05, weight_decay=0.1,
                                 **OPTION_SETS[option_set])
        run_steps(params, optimizer, sharded_gradient)
        report[(manifold, option_set, which)] = {
            "params": [p.detach().full_tensor() for p in params],
            "local_rows": [p.to_local().shape[0] for p in params],
            "state": state_summary(optimizer, params, whole),
            "kinds": [{key: str(tuple(v.placements)) if isinstance(v, DTensor) else "plain"
                       for key, v in optimizer.state[p].items()} for p in params],
        }
    return report


def gpt_config():
    from models.gpt import GPTConfig

    return GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=False,
                     connection="pre-ln")


def gpt_batch(step: int) -> torch.Tensor:
    return torch.randint(32, (4, 9), generator=torch.Generator().manual_seed(300 + step))


def _train(model, optimizer, steps: range) -> None:
    for step in steps:
        idx = gpt_batch(step)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def gpt_single(policy: str, steps: int) -> dict:
    """The reference: a float64 GPT trained by ``build_optimizer(policy)`` in this process."""
    from manifoldlib.optim import build_optimizer, optimizer_diagnostics
    from models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(gpt_config()).double()
    optimizer = build_optimizer(model, policy=policy, lr=0.02, adamw_lr=1e-3)
    _train(model, optimizer, range(steps))
    return {n: p.detach().clone() for n, p in model.named_parameters()} | {"diagnostics": optimizer_diagnostics(optimizer)}


def _fsdp_gpt(mesh, policy: str):
    """The same GPT under ``fully_shard`` (each block, then the root) and its optimizer."""
    from torch.distributed.fsdp import fully_shard

    from manifoldlib.optim import build_optimizer
    from models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(gpt_config()).double()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, build_optimizer(model, policy=policy, lr=0.02, adamw_lr=1e-3)


def gpt_fsdp_job(rank: int, policies: list[str], steps: int) -> dict:
    """The fully sharded GPT, every rank on the whole batch (so the averaged gradient is the
    single process's), for each policy: its parameters and ``optimizer_diagnostics``."""
    from torch.distributed.device_mesh import init_device_mesh

    from manifoldlib.optim import optimizer_diagnostics

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    report = {}
    for policy in policies:
        model, optimizer = _fsdp_gpt(mesh, policy)
        _train(model, optimizer, range(steps))
        report[policy] = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        report[policy, "diagnostics"] = optimizer_diagnostics(optimizer)
    return report


def checkpoint_job(rank: int, phase: str, folder: str, policy: str, steps: int) -> dict:
    """``phase="save"``: train ``steps`` steps under fully_shard, save model and optimizer with
    :mod:`torch.distributed.checkpoint` (each rank its shards), then train ``steps`` more;
    ``phase="resume"``: build afresh (any world size), load, train ``steps`` steps. Both return
    the whole parameters at the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, optimizer = _fsdp_gpt(mesh, policy)
    if phase == "save":
        _train(model, optimizer, range(steps))
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(model, optimizer, range(steps, 2 * steps))
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def refusal_job(rank: int) -> dict:
    """What ManifoldMuon and build_optimizer say about DTensors they cannot take (tensor-parallel
    and replicated placements)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from manifoldlib.distributed import is_row_sharded
    from manifoldlib.optim import ManifoldMuon, build_optimizer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    out = {"row_sharded": [is_row_sharded(distribute_tensor(w, mesh, [p])) for p in (Shard(0), Shard(1), Replicate())]}
    for label, placement in (("shard1", Shard(1)), ("replicate", Replicate())):
        param = torch.nn.Parameter(distribute_tensor(w, mesh, [placement]))
        try:
            ManifoldMuon([param], manifold="stiefel")
        except ValueError as error:
            out[label] = f"{type(error).__name__}: {error}"
        else:
            out[label] = "accepted"
    model = torch.nn.Module()
    model.attn = torch.nn.Linear(6, 8, bias=False)
    model.attn.weight = torch.nn.Parameter(distribute_tensor(model.attn.weight.detach(), mesh, [Shard(1)]))
    try:
        build_optimizer(model, policy="all-stiefel")
    except ValueError as error:
        out["builder"] = f"{type(error).__name__}: {error}"
    else:
        out["builder"] = "accepted"
    # a row-sharded Stiefel matrix whose rows were edited off the manifold after the optimizer was
    # made (each rank scales its own rows): the first step of the plan refuses it on every rank
    for spectral in ("products", "eigh"):
        param = torch.nn.Parameter(distribute_tensor(torch.randn(12, 6, generator=torch.Generator().manual_seed(1)),
                                                     mesh, [Shard(0)]))
        optimizer = ManifoldMuon([param], lr=0.05, manifold="stiefel", dual={"spectral": spectral})
        with torch.no_grad():
            param.to_local().mul_(1.5)
        param.grad = distribute_tensor(torch.randn(12, 6, generator=torch.Generator().manual_seed(2)), mesh, [Shard(0)])
        out[f"edited_{spectral}"], out[f"edited_{spectral}_unchanged"] = _refused_step(optimizer, param)
    # the same edit after the plan's first step, as a checkpoint loaded into the running model (a
    # DTensor copy_, which every rank runs): the next step checks the points again
    for spectral in ("products", "eigh"):
        point = torch.linalg.qr(torch.randn(12, 6, generator=torch.Generator().manual_seed(1)))[0]
        param = torch.nn.Parameter(distribute_tensor(point, mesh, [Shard(0)]))
        optimizer = ManifoldMuon([param], lr=0.05, manifold="stiefel", dual={"spectral": spectral})
        param.grad = distribute_tensor(torch.randn(12, 6, generator=torch.Generator().manual_seed(2)), mesh, [Shard(0)])
        optimizer.step()
        model = torch.nn.Module()
        model.weight = param
        model.load_state_dict({"weight": distribute_tensor(1.5 * point, mesh, [Shard(0)])})
        out[f"loaded_{spectral}"], out[f"loaded_{spectral}_unchanged"] = _refused_step(optimizer, param)
    return out


def _refused_step(optimizer, param) -> tuple[str, bool]:
    """``(what the step raised or "accepted", whether the row-sharded ``param`` kept its value)``."""
    before = param.detach().full_tensor().clone()
    try:
        optimizer.step()
    except ValueError as error:
        said = f"{type(error).__name__}: {error}"
    else:
        said = "accepted"
    return said, bool(torch.equal(param.detach().full_tensor(), before))


def bytes_job(rank: int, shapes: list[tuple[int, int]], manifold: str, steps: int) -> int:
    """Bytes this rank sent to other ranks by ``torch.distributed.all_to_all_single`` during its last
    optimizer step (``steps`` steps of float32 row-sharded matrices of ``shapes``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from manifoldlib.optim import ManifoldMuon

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(m, n, generator=generator), mesh, [Shard(0)]))
              for m, n in shapes]
    optimizer = ManifoldMuon(params, manifold=manifold, lr=0.02)
    sent = []
    all_to_all_single = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        splits = input_split_sizes or [input.numel() // dist.get_world_size()] * dist.get_world_size()
        sent.append((sum(splits) - splits[rank]) * input.element_size())  # what leaves this rank
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = distribute_tensor(gradient(step, i, p), mesh, [Shard(0)])
        sent.clear()
        dist.all_to_all_single = counting
        try:
            optimizer.step()
        finally:
            dist.all_to_all_single = all_to_all_single
    return sum(sent)
