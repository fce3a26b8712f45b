r"""Throughput of a training run: tokens per second, model FLOPs utilization, optimizer share.

**Model FLOPs per token** (the PaLM / nanoGPT estimate). A matrix product with :math:`N` weights
costs :math:`2N` FLOPs per token forward and :math:`4N` backward, so the weights cost
:math:`6N`; attention adds, per layer, :math:`QK^\top` and the weighted sum of values, each
:math:`2Td` per token forward (:math:`T` context, :math:`d` width), :math:`12LTd` in all with
backward:

.. math:: F = 6N + 12\,L\,T\,d,

with :math:`N` the parameters without the embedding lookups (no products): the position
embedding, and the token embedding where it is not tied to the LM head
(:meth:`models.gpt.GPT.num_params`).

**MFU** is the FLOPs the run does per second, :math:`F \cdot \text{tokens/s}`, over the peak of
the devices it runs on, :math:`W \cdot P`. :data:`PEAK_FLOPS` holds vendors' dense peaks per
device and dtype (float32 is the non-tensor-core rate: torch's default matmul precision does not
use TF32); ``--peak_flops`` gives :math:`P` for a device that is not listed (a CPU has no entry:
MFU is left out). **Optimizer share** is the optimizer step's part of the wall time of the steps
(on CUDA timed between synchronizations).
"""

from __future__ import annotations

import re
import time

import torch

__all__ = ["PEAK_FLOPS", "Throughput", "device_time", "flops_per_token", "peak_flops"]

#: Dense peak FLOP/s per device (whole words of ``torch.cuda.get_device_name()``: ``L4`` is not
#: an ``L40``; most specific first) and autocast dtype, from the vendors' data sheets.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12},
    "GH200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "float32": 91.6e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12},
    "RTX 4090": {"bfloat16": 165e12, "float16": 165e12, "float32": 82.6e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
    "T4": {"float16": 65e12, "float32": 8.1e12},
}


def device_time(device: torch.device) -> float:
    """``perf_counter()`` after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def flops_per_token(n_params: int, n_layer: int, block_size: int, n_embd: int) -> float:
    """:math:`6N + 12LTd`: training FLOPs per token of a GPT (forward and backward)."""
    return 6.0 * n_params + 12.0 * n_layer * block_size * n_embd


def peak_flops(device: torch.device, dtype: str, given: float = 0.0) -> float | None:
    """The peak FLOP/s of one ``device`` in ``dtype``: ``given`` if positive, else the
    :data:`PEAK_FLOPS` entry whose key is a whole word (or words) of a CUDA device's name
    (``NVIDIA L40`` is not an ``L4``), else ``None`` (unknown)."""
    if given > 0:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", name):
            return peaks.get(dtype)
    return None


class Throughput:
    """Accumulates step and optimizer times between reports.

    Args:
        tokens_per_step: tokens of one optimizer step (the global batch).
        flops_per_token: :func:`flops_per_token` of the model.
        peak: peak FLOP/s of one device (``None``: no MFU).
        world_size: number of devices.
        device: the training device (CUDA steps are timed between synchronizations).
    """

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None,
                 world_size: int, device: torch.device) -> None:
        self.tokens_per_step, self.flops, self.peak = tokens_per_step, flops_per_token, peak
        self.world_size, self.device = world_size, device
        self.steps, self.step_s, self.optimizer_s = 0, 0.0, 0.0
        self.last = device_time(device)

    def add_step(self, optimizer_seconds: float) -> None:
        """Count a finished step and the seconds its optimizer step took."""
        end = device_time(self.device)
        self.steps += 1
        self.step_s += end - self.last
        self.optimizer_s += optimizer_seconds
        self.last = end

    def skip(self) -> None:
        """Leave the time since the last step out (an evaluation, a checkpoint)."""
        self.last = device_time(self.device)

    def report(self) -> dict:
        """``tokens_per_s``, ``mfu`` (when the peak is known) and ``optimizer_share`` of the
        steps since the last report; then start over."""
        seconds = max(self.step_s, 1e-9)
        rate = self.steps * self.tokens_per_step / seconds
        out = {"tokens_per_s": rate, "optimizer_share": self.optimizer_s / seconds}
        if self.peak:
            out["mfu"] = rate * self.flops / (self.peak * self.world_size)
        self.steps, self.step_s, self.optimizer_s = 0, 0.0, 0.0
        return out
