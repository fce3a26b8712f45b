r"""FSDP2 for the reference GPT (``fsdp=True``): the model's parameters sharded across the ranks.

:func:`shard_model` applies :func:`torch.distributed.fsdp.fully_shard` to every transformer
block and then to the whole model, on the one-dimensional mesh of all :math:`W` ranks
(``init_device_mesh(device_type, (W,))``). Every parameter becomes a
:class:`~torch.distributed.tensor.DTensor` placed ``Shard(0)``: rank :math:`r` keeps a block of
its rows, and so do its gradient and the optimizer state built from it. A block's parameters
are all-gathered for its forward and again for its backward and freed after each; its gradients
are reduce-scattered, averaged over the ranks as DDP averages them, so the step is the one of
the global batch (``models.train.train_step``). The model is sharded in place, *before* the
optimizer is built: the optimizer holds the DTensors, and parameter names carry no prefix.

FSDP2 refuses 0-d parameters (the sphere connections' scales, DyT's :math:`\alpha`). They are
left out of the sharding (``ignored_params``): whole, plain tensors on every rank, whose
gradients :func:`average_replicated_grads` averages over the ranks after the backward (the
all-reduce DDP would do for them). One all-reduce of a few numbers a step.

Three things work differently from DDP, and have a helper here:

- gradient accumulation: the micro-steps before the last skip the reduce-scatter
  (:func:`gradient_sync`: ``set_requires_gradient_sync(False)`` where DDP uses ``no_sync()``);
- work on whole weights outside a forward (the diagnostics, which read weights and call
  sub-layers directly, and the sample): :func:`whole_parameters` gathers every parameter on
  every rank and keeps it through forwards until the block ends. Every rank does that work, on
  the same numbers, and rank 0 keeps the result; meanwhile each rank holds the whole model;
- checkpoints: :mod:`models.sharded_checkpoint` (each rank writes its own shards).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["average_replicated_grads", "forget_sharding_caches", "gradient_sync",
           "is_fully_sharded", "shard_model", "whole_parameters"]


def _fsdp_module_type() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside a :func:`torch.compile` wrapper (``_orig_mod``), else ``module``."""
    return getattr(module, "_orig_mod", module)


def is_fully_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or the module a :func:`torch.compile` wrapper holds) went through
    :func:`shard_model`."""
    return isinstance(_unwrapped(module), _fsdp_module_type())


def shard_model(model: torch.nn.Module, device_type: str, world_size: int) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2: ``fully_shard`` on each of ``model.blocks``, then on
    ``model``, on a one-dimensional mesh of ``world_size`` ranks of ``device_type``; its 0-d
    parameters stay whole (module docstring). Call it in every rank of an initialized process
    group (a group of one is a mesh of one), after moving the model to its device and before
    building the optimizer.

    Blocks free their gathered parameters after the forward (``reshard_after_forward=True``);
    the root keeps its own (embeddings and head) until the backward needs them, as FSDP2 does
    for a root by default.

    Returns:
        ``model`` itself (its class is now also an ``FSDPModule``).

    Raises:
        TypeError: ``model`` has no ``blocks`` (a ``ModuleList`` of transformer blocks).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise TypeError(f"fsdp shards a model with a ModuleList of transformer blocks at "
                         f".blocks; {type(model).__name__} has none")
    mesh = init_device_mesh(device_type, (world_size,))
    whole = {p for p in model.parameters() if p.dim() == 0}
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=whole)
    return model


@contextlib.contextmanager
def gradient_sync(trained: torch.nn.Module, sync: bool):
    """The context of one micro-step's forward and backward: with ``sync`` False the gradients
    stay on this rank, to be reduced with the last micro-step's (FSDP2:
    ``set_requires_gradient_sync``; DDP: ``no_sync()``; a plain module: nothing to do)."""
    module = _unwrapped(trained)
    if isinstance(module, _fsdp_module_type()):
        module.set_requires_gradient_sync(sync)
        yield
    elif not sync and isinstance(trained, torch.nn.parallel.DistributedDataParallel):
        with trained.no_sync():
            yield
    else:
        yield


def average_replicated_grads(trained: torch.nn.Module) -> None:
    """Average over the ranks the gradients of the parameters FSDP2 left whole (the 0-d ones),
    with one all-reduce; nothing to do in a group of one or for a model that is not sharded."""
    if not is_fully_sharded(trained) or dist.get_world_size() == 1:
        return
    dtensor = _dtensor_type()
    grads = [p.grad for p in trained.parameters()
             if p.grad is not None and not isinstance(p, dtensor)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads])  # (n,)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    for g, value in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(value.reshape(g.shape))


@contextlib.contextmanager
def whole_parameters(model: torch.nn.Module):
    """Inside the block every parameter of a sharded ``model`` is whole, on every rank: each
    FSDP module is all-gathered (a collective: every rank enters the block) and kept gathered
    through forwards; afterwards the shards are registered again and the modules free their
    gathered copies after forwards as :func:`shard_model` set them to. A model that is not
    sharded is left as it is."""
    if not is_fully_sharded(model):
        yield
        return
    root = _unwrapped(model)
    modules = [m for m in root.modules() if isinstance(m, _fsdp_module_type())]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        for module in modules:
            module.unshard()
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not root, recurse=False)


def forget_sharding_caches() -> None:
    """Empty DTensor's caches (sharding decisions, redistribution plans, mesh topologies), whose
    entries hold the device mesh and through it the process group: called when a sharded run
    ends, so that destroying the group frees it (a group that outlives its destruction runs its
    threads into interpreter shutdown: :func:`manifoldlib.distributed.destroy_process_group`
    warns of that). The caches are torch's private ones; one that a torch version lacks is
    skipped."""
    import importlib

    for module, path in _SHARDING_CACHES:
        try:
            target = importlib.import_module(module)
            for name in path.split("."):
                target = getattr(target, name)
        except (ImportError, AttributeError):
            continue
        target()


#: ``(module, attribute path)`` of the functions that empty DTensor's caches.
_SHARDING_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)
