"""Optional C++ CPU kernels for the full-tensor passes of the fused sphere residual.

Private: :mod:`manifoldlib.nn._fused` calls them when they are built and its tensors are
contiguous float32/float64 CPU tensors, and falls back to ATen otherwise. See
``sphere_residual.cpp`` for what each kernel reads and writes, and :mod:`.loader` for the build,
the cache and the ``MANIFOLDLIB_CPU_KERNELS`` switch.
"""

from .loader import ENV_VAR, available, disabled, enabled, load

__all__ = ["ENV_VAR", "available", "disabled", "enabled", "load"]
