"""Mixed precision of a training step: autocast for the forward and loss, and for float16 a
:class:`torch.amp.GradScaler`.

``float32`` runs everything in float32 (autocast off). ``bfloat16`` runs the matrix products of
forward and backward in bfloat16 under :func:`torch.autocast` (parameters, gradients and the
optimizer stay float32); its exponent range is float32's, so no loss scaling is needed.
``float16`` has five exponent bits: small gradients underflow, so the loss is multiplied by a
scale :math:`s` before ``backward`` and the gradients divided by :math:`s` before clipping and
the step; a step whose gradients overflowed is skipped and :math:`s` halved (it grows again
after a run of good steps) — the scaler's state is part of the checkpoint. Gradients that
overflow whatever the scale (NaN, or infinite in float32) would halve it for ever while no step
is taken: once it falls below :data:`MIN_LOSS_SCALE` the run has diverged (fairseq's
``min_loss_scale`` rule).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["MIN_LOSS_SCALE", "Precision"]

#: The float16 loss scale below which overflowing gradients are a divergence, not an overflow
#: (fairseq's default ``min_loss_scale``): 30 skipped steps in a row from the initial 2**16.
MIN_LOSS_SCALE = 1e-4


class Precision:
    """Autocast and (float16) loss scaling for one device.

    Args:
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        device: the training device.
    """

    def __init__(self, dtype: str, device: torch.device) -> None:
        self.name = dtype
        self.dtype = getattr(torch, dtype)
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "float16" else None

    def autocast(self):
        """The forward's context: :func:`torch.autocast` unless float32."""
        if self.name == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the scaled loss under float16."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (before clipping); a no-op unless float16."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under float16 skipped when the gradients overflowed, and the
        scale updated."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def scale_collapsed(self) -> bool:
        """Whether the float16 loss scale has fallen below :data:`MIN_LOSS_SCALE` (always False
        outside float16)."""
        return self.scaler is not None and self.scaler.get_scale() < MIN_LOSS_SCALE

    def state_dict(self) -> dict:
        """The scaler's state (plain numbers), empty unless float16."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
