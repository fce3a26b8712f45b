"""SEL on a CUDA device: ``impl="fused"`` takes the compiled expression there (no C++ kernels), and
must give the values and gradients of the plain rule computed on the CPU in float64.

Skipped without a CUDA device; ``benchmarks/gpu_sel.sh`` runs this file on a lent GPU before it
times the chart. (The compiled expression itself is also checked on the CPU, by the slow
``test_compiled_forward_matches_plain_autograd``.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from manifoldlib.charts import SEL, apply_chart, merge_charts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: Norm-wise relative agreement with the float64 CPU reference: float64 rounding, and float32's
#: (the scale gradients are sums over a row or a column of ~300 terms).
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


def _chart_case(shape=(96, 300), seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=g, dtype=torch.float64) / shape[1] ** 0.5
    chart = SEL(weight, max_exponent=3.0)
    with torch.no_grad():  # non-uniform rank-1 scales, so every (i, j) sees its own a, b, c
        for name, p in chart.named_parameters():
            if not name.startswith("delta"):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    raw = chart.right_inverse(weight * 0.5).detach()
    raw[0, :3] = torch.tensor([0.0, 5.0, -5.0], dtype=torch.float64)  # zero and two clamped entries
    probe = torch.randn(shape, generator=g, dtype=torch.float64)
    return chart, raw, probe


def _values_and_grads(chart: SEL, raw: torch.Tensor, probe: torch.Tensor):
    chart.zero_grad(set_to_none=True)
    r = raw.clone().requires_grad_(True)
    out = chart(r)
    (out * probe).sum().backward()
    return [out.detach(), r.grad] + [p.grad for p in chart.parameters()]


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().cpu(), y.double().cpu()
    return float((x - y).norm() / y.norm().clamp_min(1e-300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_chart_on_cuda_matches_the_float64_cpu_rule(dtype):
    chart, raw, probe = _chart_case()
    chart.impl = "autograd"
    reference = _values_and_grads(chart, raw, probe)
    on_gpu = copy.deepcopy(chart).to(device="cuda", dtype=dtype)
    on_gpu.impl = "fused"
    found = _values_and_grads(on_gpu, raw.to("cuda", dtype), probe.to("cuda", dtype))
    assert all(t.device.type == "cuda" for t in found)
    errors = [_rel(x, y) for x, y in zip(found, reference)]
    assert max(errors) <= TOL[dtype], errors


def test_a_charted_model_trains_on_cuda_like_on_the_cpu_and_merges():
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).double()
    apply_chart(cpu, SEL)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(16, 64, dtype=torch.float64)
    for model, inputs in ((cpu, x), (gpu, x.cuda())):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(inputs).square().mean().backward()
            opt.step()
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert _rel(b, a) <= 1e-10, name
    merged = copy.deepcopy(gpu)
    merge_charts(merged)
    assert _rel(merged(x.cuda()), gpu(x.cuda())) <= 1e-12
