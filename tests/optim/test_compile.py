"""``torch.compile(fullgraph=True)`` of the functional core: the sync-free products-path step of
every manifold compiles as one graph (no graph break, no host read) and steps as the eager one."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.optim import ManifoldMuon, manifold_muon
from manifoldlib.optim.options import MuonOptions


def _matrices(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 12), (48, 12), (12, 48), (16, 16)]  # a bank of three (one flipped) and a square one
    params = [torch.linalg.qr(torch.randn(max(s), min(s), generator=g))[0] for s in shapes]
    params = [p if p.shape == torch.Size(s) else p.mT.contiguous() for p, s in zip(params, shapes)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    return params, grads, [torch.zeros(s) for s in shapes], [{} for _ in shapes]


def _options(manifold: str) -> MuonOptions:
    # Euclidean: Newton-Schulz in float32, so that eager and compiled agree beyond bfloat16 rounding
    # (inductor keeps a bfloat16 iteration's elementwise intermediates in float32)
    probe = torch.nn.Parameter(torch.randn(4, 4))
    group = {"params": [probe], "ns_dtype": "float32"}
    opt = ManifoldMuon([group], lr=0.02, manifold=manifold, dual={"spectral": "products", "sync_free": True})
    return MuonOptions.from_group(opt.param_groups[0])


_SLOW = pytest.mark.slow  # tracing takes 10-20 s a case: Stiefel with aot_eager in the default suite
CASES = [("stiefel", "aot_eager")] + [pytest.param(m, b, marks=_SLOW) for m, b in [
    ("euclidean", "aot_eager"), ("dgram", "aot_eager"), ("oblique", "aot_eager"),
    ("euclidean", "inductor"), ("stiefel", "inductor"), ("dgram", "inductor"), ("oblique", "inductor")]]


@pytest.mark.parametrize("manifold,backend", CASES)
def test_the_functional_step_compiles_as_one_graph_and_steps_as_eager(manifold, backend):
    options = _options(manifold)
    eager, compiled = _matrices(0), _matrices(0)

    def step(params, grads, bufs, states):
        manifold_muon(params, grads, bufs, states, options)

    torch._dynamo.reset()
    fn = torch.compile(step, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    for _ in range(2):  # the second step reads the first one's warm start from the states
        step(*eager)
        fn(*compiled)
    for a, b in zip(eager[0] + eager[2], compiled[0] + compiled[2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if manifold != "euclidean":
        for s_eager, s_compiled in zip(eager[3], compiled[3]):
            torch.testing.assert_close(s_compiled["dual_correction"], s_eager["dual_correction"], rtol=1e-4, atol=1e-6)
            assert int(s_compiled["dual_iterations"]) == int(s_eager["dual_iterations"])
    assert not torch.equal(compiled[0][0], _matrices(0)[0][0])  # it moved
