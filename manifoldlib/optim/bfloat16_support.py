"""Where bfloat16 matrix products are native, and the dtype Muon's Newton–Schulz runs in.

:class:`torch.optim.Muon` runs its Newton–Schulz iteration in bfloat16, which is fast where the
hardware multiplies bfloat16 natively (CUDA devices that support it, CPUs with AVX512-BF16 or
AMX) and very slow where it does not: on a 2-core AMD EPYC with AVX2 only (torch 2.13, MKL;
2026-12-01) a 768² bfloat16 product took 770–900 ms against 11–19 ms in float32, 128² 1.9 ms
against 0.053 ms, and one ``torch.optim.Muon`` step on a 768² matrix 7.8 s. There the default
training run spent half its time in bfloat16 Newton–Schulz.

:class:`~manifoldlib.optim.ManifoldMuon` takes ``ns_dtype`` (:data:`NS_DTYPES`): ``"auto"``
(default) — bfloat16 where it is native, float32 elsewhere — ``"bfloat16"`` (always: its
Euclidean steps then equal ``torch.optim.Muon``'s on every device) or ``"float32"``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["NS_DTYPES", "native_bfloat16", "resolve_ns_dtype"]

#: ``ns_dtype`` values of a ManifoldMuon group: the dtype its Euclidean Newton–Schulz runs in.
NS_DTYPES = ("bfloat16", "float32", "auto")


@functools.cache
def native_bfloat16(device_type: str) -> bool:
    """Whether bfloat16 matrix products run natively (faster than float32) on this device type."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(probe()) if probe is not None else False
    return False


def resolve_ns_dtype(ns_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype of Muon's Newton–Schulz for ``ns_dtype`` (one of :data:`NS_DTYPES`) on ``device``.

    ``"auto"``: bfloat16 where :func:`native_bfloat16` holds for the device type, else float32.
    """
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
    if ns_dtype == "auto":
        return torch.bfloat16 if native_bfloat16(device.type) else torch.float32
    return getattr(torch, ns_dtype)
