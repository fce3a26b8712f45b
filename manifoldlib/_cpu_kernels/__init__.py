"""Optional C++ CPU kernels for the full-tensor passes of the fused sphere residual and the SEL chart.

Private: :mod:`manifoldlib.nn._fused` and :mod:`manifoldlib.charts.kernel` call them when they
are built and their tensors are contiguous float32/float64 CPU tensors (the SEL kernels also take
float16/bfloat16 raw coordinates, computed in float32 entry by entry), and fall back to ATen
otherwise. See ``sphere_residual.cpp`` and ``sel_chart.cpp`` for what each kernel reads and
writes, :mod:`.loader` for the build, the cache and the ``MANIFOLDLIB_CPU_KERNELS`` switch, and
:mod:`.sphere_step` for the sphere residual's row kernels as operators that ``torch.compile`` keeps.
"""

from .loader import ENV_VAR, available, disabled, enabled, in_use, load

__all__ = ["ENV_VAR", "available", "disabled", "enabled", "in_use", "load"]
