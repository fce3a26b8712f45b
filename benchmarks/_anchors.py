"""The Muon anchor of the optimizer benchmarks, in a precision the machine runs natively.

:class:`torch.optim.Muon` runs its Newton–Schulz iteration in bfloat16. Where bfloat16 products
are native (AVX512-BF16 or AMX CPUs, CUDA) that is the fast anchor the ratios are meant against;
where they are emulated (an AVX2-only CPU) the same iteration runs 20–40 times slower than in
float32, and every ratio against it would flatter the candidate by as much. ``--anchor auto`` (the scripts' default) therefore times ``torch.optim.Muon`` where
bfloat16 is native and :class:`Float32Muon` — ``torch.optim.Muon`` itself, with only its
Newton–Schulz run in float32 — elsewhere; the scripts print which anchor they used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from manifoldlib.optim.execution import native_bfloat16

ANCHORS = ("auto", "bfloat16", "float32")


def _newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """Muon's quintic Newton–Schulz iteration on the wide orientation, in float32."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Float32Muon(torch.optim.Muon):
    """:class:`torch.optim.Muon` with its Newton–Schulz iteration in float32 (everything else,
    momentum, learning-rate adjustment and weight decay, is torch's own step)."""

    @torch.no_grad()
    def step(self, closure=None):
        module = importlib.import_module("torch.optim._muon")  # where step looks the iteration up
        original = module._zeropower_via_newtonschulz
        module._zeropower_via_newtonschulz = _newton_schulz_float32
        try:
            return super().step(closure)
        finally:
            module._zeropower_via_newtonschulz = original


def muon_anchor(kind: str, device: torch.device) -> tuple[str, Callable[..., torch.optim.Optimizer]]:
    """``(label, factory)`` of the Muon anchor ``kind`` (one of :data:`ANCHORS`) on ``device``."""
    if kind not in ANCHORS:
        raise SystemExit(f"--anchor must be one of {', '.join(ANCHORS)}, got {kind!r}")
    if kind == "auto":
        kind = "bfloat16" if native_bfloat16(device.type) else "float32"
    if kind == "bfloat16":
        return "torch.optim.Muon (anchor)", torch.optim.Muon
    return "torch.optim.Muon, float32 NS (anchor)", Float32Muon


def bfloat16_line(device: torch.device) -> str:
    """One line saying whether bfloat16 products are native on ``device``."""
    native = native_bfloat16(device.type)
    return f"bfloat16 products {'native' if native else 'EMULATED (slow)'} on {device.type}"
