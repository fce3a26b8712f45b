"""Storage layouts: a matrix stored ``(in, out)`` (Hugging Face ``Conv1D``) gets the step and the
constraint of the same map stored ``(out, in)`` (``torch.nn.Linear``).

The oracle is the layout's definition: two models computing the same function, one with
``Conv1D``-style layers and one with ``nn.Linear`` layers whose weights are the transposes, have
transposed gradients; under every manifold the optimizer must keep them transposes of each other.
Before layouts existed a square DGram/Oblique matrix was constrained as stored (the rows of a
``Conv1D``'s map, the columns of a ``Linear``'s) and Muon's ``"original"`` shape factor read the
stored shape, so these tests failed for square DGram/Oblique and rectangular Euclidean matrices.
"""

from __future__ import annotations

import io

import pytest
import torch
from dispatch_ops import ProductRecorder  # tests/dispatch_ops.py (tests/ is on sys.path)
from torch import nn

from manifoldlib.charts.blocks import output_dim
from manifoldlib.optim import (
    LAYOUTS,
    ManifoldMuon,
    build_optimizer,
    constraint_residual,
    manifold_muon,
    optimizer_diagnostics,
    weight_layout,
)
from manifoldlib.optim.options import check_layout

SHAPES = ((24, 24), (24, 40), (40, 24))  # (in, out): square, widening, narrowing


class Conv1D(nn.Module):
    """Hugging Face's layout (the layout rule reads the class name): weight ``(in, out)``, ``y = x W``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x):
        return x @ self.weight


def _pair(shapes, seed=0):
    """Two models of the same function: Conv1D layers (in, out) and Linear layers (out, in)."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(i, o, generator=gen, dtype=torch.float64) / i**0.5 for i, o in shapes]
    conv = nn.Sequential(*[Conv1D(w) for w in weights])
    linear = nn.Sequential(*[nn.Linear(w.size(0), w.size(1), bias=False, dtype=torch.float64) for w in weights])
    with torch.no_grad():
        for layer, w in zip(linear, weights):
            layer.weight.copy_(w.T)
    return conv, linear


def _train(model, opt, steps=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    width = next(model.parameters()).size(0) if isinstance(model[0], Conv1D) else model[0].in_features
    for _ in range(steps):
        x = torch.randn(16, width, generator=gen, dtype=torch.float64)
        loss = torch.tanh(model(x)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _policy(manifold):
    return lambda name, module, param: manifold


@pytest.mark.parametrize("manifold", ["euclidean", "stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_conv1d_and_linear_take_the_same_steps(manifold, shape):
    conv, linear = _pair([shape, shape[::-1]])
    # a tight dual tolerance on the eigh path: two solves stopped at 1e-3 from inputs that differ by
    # rounding may stop at different iterates; at 1e-11 both are the optimum (unique where the dual
    # is). The products path's fixed iterations: test_the_banked_solve_reads_the_layout_too
    opts = {"lr": 0.05, "adamw_lr": 1e-3, "weight_decay": 0.1, "ns_dtype": "float32",
            "dual": {"tol": 1e-11, "max_iter": 200, "spectral": "eigh"}}
    opt_conv = build_optimizer(conv, _policy(manifold), **opts)
    opt_linear = build_optimizer(linear, _policy(manifold), **opts)
    assert {g["layout"] for g in opt_conv.param_groups} == {"in_out"}
    assert {g["layout"] for g in opt_linear.param_groups} == {"out_in"}
    for a, b in zip(conv, linear):  # the projection at construction already agrees
        torch.testing.assert_close(a.weight.T, b.weight, rtol=0, atol=1e-12)
    _train(conv, opt_conv)
    _train(linear, opt_linear)
    for a, b in zip(conv, linear):
        # Euclidean: Muon's Newton–Schulz runs in float32 (G and G^T round differently); the
        # shape factor a wrong layout gets wrong moves the weights by ~1e-2
        torch.testing.assert_close(a.weight.T, b.weight, rtol=0, atol=1e-5 if manifold == "euclidean" else 1e-9)
    if manifold != "euclidean":
        for name, row in optimizer_diagnostics(opt_conv, spectral=False).items():
            assert row["residual"] < 1e-8, (name, row)


def test_a_square_dgram_conv1d_has_orthogonal_map_columns_not_stored_columns():
    conv, _ = _pair([(24, 24)])
    opt = build_optimizer(conv, _policy("dgram"), lr=0.05, adamw_lr=1e-3)
    _train(conv, opt)
    stored = conv[0].weight.detach()  # (in, out) = W^T

    def off(m):
        return float((m - torch.diag(torch.diag(m))).norm() / m.norm())

    assert off(stored @ stored.T) < 1e-10  # Off(W^T W) = 0 for the map W = stored^T
    assert off(stored.T @ stored) > 1e-2  # and not the stored columns
    assert constraint_residual(stored, "dgram", "in_out") < 1e-10
    assert constraint_residual(stored, "dgram") > 1e-2


def test_weight_layout_reads_the_module():
    assert weight_layout(nn.Linear(3, 4)) == "out_in"
    assert weight_layout(Conv1D(torch.zeros(3, 4))) == "in_out"
    assert weight_layout(nn.Embedding(3, 4)) == "out_in"
    assert output_dim(Conv1D(torch.zeros(3, 4))) == 1 and output_dim(nn.Linear(3, 4)) == 0


def test_a_bad_layout_is_refused_by_name():
    w = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    assert [check_layout(layout) for layout in LAYOUTS] == list(LAYOUTS)
    with pytest.raises(ValueError, match=r"layout must be one of out_in, in_out.*None"):
        check_layout(None)
    with pytest.raises(ValueError, match=r"layout must be one of out_in, in_out.*'transposed'"):
        ManifoldMuon([{"params": [w], "layout": "transposed"}], manifold="dgram")
    with pytest.raises(ValueError, match=r"layout must be one of out_in, in_out.*'in-out'"):
        constraint_residual(w.detach(), "dgram", "in-out")
    with pytest.raises(ValueError, match=r"layout must be one of out_in, in_out.*'T'"):
        manifold_muon([w], [torch.ones_like(w)], [torch.zeros_like(w)], [{}],
                      {"lr": 0.1, "manifold": "dgram", "layout": "T"})
    conv, _ = _pair([(8, 8)])
    with pytest.raises(ValueError, match=r"may not set 'layout'"):
        build_optimizer(conv, _policy("dgram"), manifold_options={"dgram": {"layout": "out_in"}})
    with pytest.raises(ValueError, match=r"layout of each matrix is read from its module"):
        build_optimizer(conv, _policy("dgram"), layout="out_in")
    assert LAYOUTS == ("out_in", "in_out")


def test_layout_round_trips_and_a_group_saved_without_it_reads_out_in():
    w = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    w.grad = torch.randn(8, 8, dtype=torch.float64)
    opt = ManifoldMuon([{"params": [w], "layout": "in_out"}], manifold="dgram", lr=0.05)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)

    def loaded(layout):
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)  # a fresh copy each time: steps write the buffers
        assert state["param_groups"][0]["layout"] == "in_out"
        for group in state["param_groups"]:
            group.pop("layout")  # None: a state dict from before layouts existed
            if layout is not None:
                group["layout"] = layout
        return state

    def twin_optimizer(layout):
        # a checkpoint's order: build on fresh values (projected), then load the saved ones
        twin = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
        o = ManifoldMuon([{"params": [twin], "layout": layout}], manifold="dgram", lr=0.05)
        with torch.no_grad():
            twin.copy_(w)
        return twin, o

    stepped = {}
    for layout in ("out_in", "in_out", None):  # None: saved before layouts existed, read as out_in
        twin, o = twin_optimizer(layout or "out_in")
        o.load_state_dict(loaded(layout))
        twin.grad = w.grad.clone()
        o.step()
        stepped[layout] = twin.detach()
    for mine, saved in (("out_in", "in_out"), ("in_out", "out_in"), ("in_out", None)):
        _, o = twin_optimizer(mine)
        with pytest.raises(ValueError, match=rf"saved with layout='{saved or 'out_in'}', this optimizer has "
                                             rf"layout='{mine}'"):
            o.load_state_dict(loaded(saved))
    torch.testing.assert_close(stepped[None], stepped["out_in"], rtol=0, atol=0)
    assert constraint_residual(stepped["in_out"], "dgram", "in_out") < 1e-10
    assert constraint_residual(stepped["in_out"], "dgram") > 1e-3


@pytest.mark.parametrize(("manifold", "spectral"), [
    (manifold, spectral) if (manifold, spectral) != ("dgram", "eigh")
    else pytest.param(manifold, spectral, marks=pytest.mark.slow)  # square DGram to 1e-11: about 12 s
    for spectral in ("eigh", "products") for manifold in ("stiefel", "dgram", "oblique")
], ids=lambda v: v)
def test_the_banked_solve_reads_the_layout_too(manifold, spectral):
    # two same-shape matrices per model: the square pair and the tall pair (one stored wide) are
    # each one bank. eigh: solved to 1e-11; products: the default fixed iterations (which stop far
    # from 1e-11, where the two layouts' rounding would part the stalled iterates)
    shapes = [(24, 64), (64, 64), (64, 64), (64, 24)]
    conv, linear = _pair(shapes)
    dual = {"tol": 1e-11, "max_iter": 200} if spectral == "eigh" else {}
    opts = {"lr": 0.05, "adamw_lr": 1e-3, "dual": {"spectral": spectral, **dual}}
    opt_conv = build_optimizer(conv, _policy(manifold), **opts)
    opt_linear = build_optimizer(linear, _policy(manifold), **opts)
    recorder = ProductRecorder()
    with recorder:
        _train(conv, opt_conv)
    assert "bmm" in recorder.names or "baddbmm" in recorder.names  # the banked solve ran
    _train(linear, opt_linear)
    for a, b in zip(conv, linear):
        torch.testing.assert_close(a.weight.T, b.weight, rtol=0, atol=1e-9)
    for name, row in optimizer_diagnostics(opt_conv, spectral=False).items():
        assert row["residual"] < 1e-8, (name, row)
        assert row["skipped_steps"] == 0, (name, row)
