"""The sphere residual's row kernels as operators that ``torch.compile`` keeps.

``sphere_step_forward`` and ``sphere_step_backward`` (``sphere_residual.cpp``) are defined in C++
with a CPU kernel only. :func:`register` adds what tracing needs, once the library is loaded
(:func:`~manifoldlib._cpu_kernels.load` calls it; nothing here runs before the kernels are built):

- fake functions, the shapes and dtypes of the outputs without running the kernel, so that
  dynamo and AOTAutograd can trace a call and inductor keeps it as one opaque call in its graph
  (the kernel reads each row once per direction; inductor's fusion of the ATen formulas reads it
  several times);
- the forward's autograd formula: the backward kernel, and the per-row :math:`dL/ds` summed by
  ``torch.sum`` (in eager the ATen sum; inductor's own reduction in a compiled graph);
- the backward's refusal of a second derivative (the kernel has none).

Eager calls go through the same operators, so eager and compiled runs call the same kernels.
"""

from __future__ import annotations

import torch

NAMESPACE = "manifoldlib_cpu"
FORWARD = f"{NAMESPACE}::sphere_step_forward"
BACKWARD = f"{NAMESPACE}::sphere_step_backward"


def _forward_fake(h, f, s, family, p, eps):
    """``(N, d), (N, d) -> out (N, d), stats (N, 3) float64``, both contiguous."""
    return h.new_empty(h.shape), h.new_empty((h.shape[0], 3), dtype=torch.float64)


def _backward_fake(grad, h, f, stats, s, family, p, eps, want_h, want_f):
    """``grad_h``, ``grad_f`` ``(N, d)`` (``(0,)`` when not asked for), ``dL/ds`` per row ``(N,)`` float64."""
    return (
        h.new_empty(h.shape if want_h else (0,)),
        h.new_empty(h.shape if want_f else (0,)),
        h.new_empty((h.shape[0],), dtype=torch.float64),
    )


def _setup_context(ctx, inputs, output):
    h, f, s, family, p, eps = inputs
    _, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.save_for_backward(h, f, stats, s)
    ctx.rule = (family, p, eps)


def _backward(ctx, grad, _grad_stats):
    h, f, stats, s = ctx.saved_tensors
    want_h, want_f, want_s = ctx.needs_input_grad[:3]
    grad_h, grad_f, per_row = torch.ops.manifoldlib_cpu.sphere_step_backward(
        grad.contiguous(), h, f, stats, s, *ctx.rule, want_h, want_f
    )
    grad_s = per_row.sum().to(s.dtype).reshape(s.shape) if want_s else None
    return grad_h if want_h else None, grad_f if want_f else None, grad_s, None, None, None


def _no_second_derivative(ctx, *grads):
    raise RuntimeError(
        "the sphere residual's C++ row kernels have no second derivative (sphere_step_backward is "
        "not differentiable); for double backward use sphere_residual_reference or "
        "SphereResidual(fused=False)"
    )


def register() -> None:
    """Registers the fake functions and autograd formulas of the two row kernels (once per process,
    after the library is loaded)."""
    torch.library.register_fake(FORWARD, _forward_fake)
    torch.library.register_fake(BACKWARD, _backward_fake)
    torch.library.register_autograd(FORWARD, _backward, setup_context=_setup_context)
    torch.library.register_autograd(BACKWARD, _no_second_derivative)
