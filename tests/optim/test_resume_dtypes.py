"""Resuming from a state dict keeps each matrix's dual correction in the dtype it was saved in.

The dual of a 16-bit matrix is solved in float32 and its warm start (``"dual_correction"``) is
stored in float32, while :meth:`torch.optim.Optimizer.load_state_dict` casts every floating-point
state tensor to its parameter's dtype: a resumed bfloat16 run then warm-started from a rounded
correction and drifted from the uninterrupted run.
"""

from __future__ import annotations

import io

import torch
from torch import nn

from manifoldlib.optim import ManifoldMuon, build_optimizer

SHAPES = [(96, 48), (64, 64), (128, 32)]


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _bf16_params(seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=generator).to(torch.bfloat16)) for s in SHAPES]


def _grads(steps: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(100)
    return [[torch.randn(s, generator=generator).to(torch.bfloat16) for s in SHAPES] for _ in range(steps)]


def _resumed(params, build):
    """A checkpoint's order: fresh parameters, the optimizer built on them (it projects them),
    then the saved values copied in (the optimizer's state is loaded by the caller)."""
    twins = [nn.Parameter(torch.randn_like(p)) for p in params]
    opt = build(twins)
    with torch.no_grad():
        for p, q in zip(params, twins):
            q.copy_(p)
    return twins, opt


def _run(params, opt, grads) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def test_load_state_dict_keeps_the_float32_correction_of_a_bfloat16_matrix():
    params = _bf16_params()
    opt = ManifoldMuon(params, manifold="dgram", lr=0.1, weight_decay=0.0)
    _run(params, opt, _grads(2))
    saved = {id(p): opt.state[p]["dual_correction"].clone() for p in params}
    assert all(c.dtype == torch.float32 for c in saved.values())
    twins, resumed = _resumed(params, lambda ps: ManifoldMuon(ps, manifold="dgram", lr=0.1, weight_decay=0.0))
    resumed.load_state_dict(_round_trip(opt.state_dict()))
    for p, q in zip(params, twins):
        loaded = resumed.state[q]["dual_correction"]
        assert loaded.dtype == torch.float32
        assert torch.equal(loaded, saved[id(p)])
        assert resumed.state[q]["momentum_buffer"].dtype == torch.bfloat16  # torch's cast, as before


def test_resumed_bfloat16_stiefel_run_equals_the_uninterrupted_one():
    grads = _grads(10)
    reference = _bf16_params()
    opt = ManifoldMuon(reference, manifold="stiefel", lr=0.1, weight_decay=0.0)
    _run(reference, opt, grads)

    first = _bf16_params()
    first_opt = ManifoldMuon(first, manifold="stiefel", lr=0.1, weight_decay=0.0)
    _run(first, first_opt, grads[:3])
    saved = _round_trip(first_opt.state_dict())
    resumed, resumed_opt = _resumed(first, lambda ps: ManifoldMuon(ps, manifold="stiefel", lr=0.1, weight_decay=0.0))
    resumed_opt.load_state_dict(saved)
    _run(resumed, resumed_opt, grads[3:])
    for p, q in zip(reference, resumed):
        assert torch.equal(p, q)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32, bias=False)
        self.mlp = nn.Linear(32, 96, bias=False)


def test_combined_optimizer_load_state_dict_keeps_the_float32_correction():
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16)
    opt = build_optimizer(model, policy="hetero", lr=0.05)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    twin = _Block().to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    resumed = build_optimizer(twin, policy="hetero", lr=0.05)
    resumed.load_state_dict(_round_trip(opt.state_dict()))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        expected, loaded = opt.state[p]["dual_correction"], resumed.state[q]["dual_correction"]
        assert loaded.dtype == expected.dtype == torch.float32, name
        assert torch.equal(loaded, expected), name
        assert resumed.optimizers["muon"].state[q]["dual_correction"] is loaded  # one shared state


def test_resumed_counts_stay_integers_and_keep_counting_on_a_bfloat16_matrix():
    """torch casts every state tensor of a floating parameter to its dtype: a bfloat16 matrix's
    ``skipped_steps`` of 301 came back as 300.0 (bfloat16) and three more skipped steps left it at
    300 (bfloat16 counts by 2 past 256); optimizer_diagnostics reported 300 where 304 were skipped."""
    from manifoldlib.optim import optimizer_diagnostics

    def build(params):
        return ManifoldMuon([{"params": params[:1], "manifold": "stiefel"}, {"params": params[1:]}], lr=0.02)

    params = _bf16_params()
    opt = build(params)
    for p, g in zip(params, _grads(1)[0]):
        p.grad = g
    opt.step()
    for p in params:
        opt.state[p]["skipped_steps"] = torch.tensor(301)
    resumed = _bf16_params(seed=1)
    opt2 = build(resumed)
    opt2.load_state_dict(_round_trip(opt.state_dict()))
    for _ in range(3):  # non-finite gradients: skipped, counted
        for p in resumed:
            p.grad = torch.full_like(p, float("nan"))
        opt2.step()
    for p in resumed:
        assert opt2.state[p]["skipped_steps"].dtype == torch.long and int(opt2.state[p]["skipped_steps"]) == 304
    assert opt2.state[resumed[0]]["dual_iterations"].dtype == torch.long
    assert {row["skipped_steps"] for row in optimizer_diagnostics(opt2, spectral=False).values()} == {304}
    combined = build_optimizer(nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16), "all-stiefel", classifier=lambda n, m: "attn")
    combined.state[next(iter(combined.optimizers["muon"].param_groups[0]["params"]))]["skipped_steps"] = torch.tensor(301)
    again = build_optimizer(nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16), "all-stiefel", classifier=lambda n, m: "attn")
    again.load_state_dict(_round_trip(combined.state_dict()))
    count = again.state[again.optimizers["muon"].param_groups[0]["params"][0]]["skipped_steps"]
    assert count.dtype == torch.long and int(count) == 301
