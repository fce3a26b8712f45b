"""The optimizer keeps what a step is made of (its banks, options, executions) from step to step.

Every test runs a sequence of steps with a change between two of them (a scheduler's ``lr``, a
setting edited in place, a matrix without a gradient, a state dict loaded, state cleared) and
checks each step bit for bit against a copy of the optimizer taken just before it: a
``copy.deepcopy`` keeps nothing from earlier steps but the state, so it resolves everything afresh.
"""

import copy

import pytest
import torch

from manifoldlib.optim import ManifoldMuon

SHAPES = [(48, 16), (48, 16), (16, 48), (32, 32), (24, 8)]


def _optimizer(manifold="stiefel", **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64)) for shape in SHAPES]
    groups = [{"params": params[:3]}, {"params": params[3:], "manifold": "dgram", "weight_decay": 0.05}]
    return ManifoldMuon(groups, lr=0.02, manifold=manifold, **kw)


def _grads(opt, seed, skip=()):
    gen = torch.Generator().manual_seed(1000 + seed)  # not the weights' stream
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        p.grad = None if i in skip else torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _step_against_a_fresh_copy(opt):
    """Step ``opt`` and a deep copy of it taken now; assert equal parameters and states."""
    fresh = copy.deepcopy(opt)
    mine = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in fresh.param_groups for p in g["params"]]
    for p, q in zip(mine, theirs):  # a deep copy of a parameter leaves its gradient behind
        q.grad = None if p.grad is None else p.grad.clone()
    opt.step()
    fresh.step()
    for p, q in zip(mine, theirs):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            other = fresh.state[q][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    return opt


def _each_step(opt, change, steps=4, at=2):
    for k in range(steps):
        if k == at:
            change(opt)
        _grads(opt, seed=k)
        _step_against_a_fresh_copy(opt)


@pytest.mark.parametrize("spectral", ["products", "eigh"])
def test_a_scheduled_learning_rate_moves_the_next_step(spectral):
    opt = _optimizer(dual={"spectral": spectral})
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]

    def schedule(o):
        for group in o.param_groups:
            group["lr"] = group["lr"] * 0.5

    _each_step(opt, schedule)
    assert opt.param_groups[0]["lr"] == 0.01
    after = [p for g in opt.param_groups for p in g["params"]]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


def test_a_tensor_learning_rate_is_read_every_step():
    opt = _optimizer()
    for group in opt.param_groups:
        group["lr"] = torch.tensor(0.02, dtype=torch.float64)

    def schedule(o):
        for group in o.param_groups:
            group["lr"].mul_(0.25)  # in place: the same tensor, a new value

    _each_step(opt, schedule)


def test_a_setting_edited_in_place_acts_on_the_next_step():
    def edit(o):
        o.param_groups[0]["momentum"] = 0.5
        o.param_groups[1]["dual"]["max_iter"] = 1

    _each_step(_optimizer(), edit)


def test_a_matrix_without_a_gradient_is_left_alone_and_steps_again_later():
    opt = _optimizer()
    params = [p for g in opt.param_groups for p in g["params"]]
    for k in range(4):
        skip = (1, 3) if k < 2 else ()  # two matrices lose their gradients, then regain them
        _grads(opt, seed=k, skip=skip)
        frozen = {i: params[i].detach().clone() for i in skip}
        _step_against_a_fresh_copy(opt)
        assert all(torch.equal(params[i], value) for i, value in frozen.items())


def test_cleared_state_starts_the_momentum_afresh():
    opt = _optimizer()

    def clear(o):
        o.state.clear()

    _each_step(opt, clear)
    assert all(int(s["skipped_steps"]) == 0 for s in opt.state.values())


def test_a_loaded_state_dict_continues_as_the_saved_run():
    opt = _optimizer()
    params = [p for g in opt.param_groups for p in g["params"]]
    for k in range(2):
        _grads(opt, seed=k)
        opt.step()
    saved = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])
    after = []
    for k in (2, 3):
        _grads(opt, seed=k)
        _step_against_a_fresh_copy(opt)
        after.append([p.detach().clone() for p in params])
    opt.load_state_dict(saved[0])  # back to before step 2: new state dicts, the same parameters
    with torch.no_grad():
        for p, value in zip(params, saved[1]):
            p.copy_(value)
    for k, expected in zip((2, 3), after):
        _grads(opt, seed=k)
        _step_against_a_fresh_copy(opt)
        assert all(torch.equal(p, e) for p, e in zip(params, expected))


def test_a_parameter_converted_to_another_dtype_is_banked_by_its_new_dtype():
    opt = _optimizer()
    first = opt.param_groups[0]["params"][0]  # shares a bank with the next two

    def to_float32(o):
        first.data = first.data.float()
        o.state[first]["momentum_buffer"] = o.state[first]["momentum_buffer"].float()

    _each_step(opt, to_float32)
    assert first.dtype == torch.float32 and opt.state[first]["momentum_buffer"].dtype == torch.float32


def test_a_momentum_buffer_replaced_in_the_state_is_the_one_used():
    def reset(o):
        for state in o.state.values():
            state["momentum_buffer"] = torch.zeros_like(state["momentum_buffer"])

    _each_step(_optimizer(), reset)


def test_a_decay_that_would_flip_the_weights_is_refused_when_the_learning_rate_grows():
    opt = _optimizer()
    _grads(opt, seed=0)
    opt.step()
    opt.param_groups[1]["lr"] = 25.0  # lr * weight_decay = 1.25 on DGram
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    _grads(opt, seed=1)
    with pytest.raises(ValueError, match="lr \\* weight_decay must be < 1"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, (p for g in opt.param_groups for p in g["params"])))
