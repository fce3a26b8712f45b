"""Build (once, into torch's extension cache) and load the C++ CPU kernels.

One library holds the kernels of the fused sphere residual (``sphere_residual.cpp``, used by
:mod:`manifoldlib.nn._fused`) and of the SEL chart's forward rule (``sel_chart.cpp``, used by
:mod:`manifoldlib.charts.kernel`), all in the ``torch.ops.manifoldlib_cpu`` namespace.
The sources are compiled on first use with :func:`torch.utils.cpp_extension.load` into
``$TORCH_EXTENSIONS_DIR`` (default: torch's ``~/.cache/torch_extensions``), in a folder whose
name carries the instruction set and a hash of the source, the flags and the torch version — so
a cache shared between machines or torch versions never hands one the other's binary. Later
processes only load the cached library. If the build fails, :func:`load` warns once, naming the
cause in one line (the compiler's or shell's diagnostic from the build log), and returns ``None``:
the callers then use their ATen path.

``MANIFOLDLIB_CPU_KERNELS=0`` (also ``false``/``off``/``no``) disables the kernels before any
build; :func:`disabled` does the same for a block of code (benchmarks, tests).

Once the library is loaded, :func:`load` registers the fake functions and autograd formulas of the
sphere residual's row kernels (:mod:`.sphere_step`), so that ``torch.compile`` keeps them; nothing
is imported or registered before (``import manifoldlib`` neither builds nor loads anything).
:func:`in_use` is the decision a traced function can make: whether to call the kernels now.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import torch

__all__ = ["ENV_VAR", "available", "disabled", "enabled", "in_use", "load"]

#: Environment variable that switches the kernels off when set to 0 / false / off / no.
ENV_VAR = "MANIFOLDLIB_CPU_KERNELS"

_NAMESPACE = "manifoldlib_cpu"  # the TORCH_LIBRARY namespace of the sources
_SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("sphere_residual.cpp", "sel_chart.cpp"))
_HEADERS = (pathlib.Path(__file__).with_name("row_kernel.h"),)  # included by the sources: in the key
# torch adds its own -std. -fno-trapping-math: g++ may if-convert (vectorized selects; the same
# results). -fopenmp: ATen's at::parallel_for is header code that splits work across threads only
# when compiled with OpenMP (without it every kernel ran on one thread whatever torch's setting);
# the library then uses the libgomp that torch itself has loaded. Linux only: Apple's clang has no
# -fopenmp (there the kernels build without it and run on one thread).
_OPENMP_FLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []
_BASE_FLAGS = ["-O3", "-fno-trapping-math", *_OPENMP_FLAGS]
_AVX2_FLAGS = ["-mavx2", "-mfma"]
_OFF_VALUES = ("0", "false", "off", "no")
# a compiler's or linker's diagnostic, or the shell's when the compiler is missing (not the
# command lines around them in torch's build log, whose paths may contain any word)
_DIAGNOSTIC = re.compile(r"\berror: |: not found$|No such file or directory|Permission denied|"
                         r"cannot find|undefined reference", re.IGNORECASE)

_log = logging.getLogger("manifoldlib")
_lock = threading.Lock()
_state: dict[str, object] = {"done": False, "ops": None}
_disabled_depth = 0


def _isa() -> tuple[str, list[str]]:
    """The instruction set to compile for: AVX2 + FMA where torch's own kernels use AVX2 or
    better on this CPU, else the portable x86-64 / aarch64 baseline (no ``-march=native``)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return "avx2", _AVX2_FLAGS
    return "base", []


def _build_directory(name: str) -> pathlib.Path:
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return pathlib.Path(root) / name


def _build():
    """The ``torch.ops`` namespace of the kernels, compiling them if no cached build matches."""
    from torch.utils import cpp_extension

    isa, isa_flags = _isa()
    flags = _BASE_FLAGS + isa_flags
    # keyed by the source, flags, torch build and environment, and the source's *path*: torch
    # rebuilds a cached extension whose recorded source path differs, so two checkouts or two
    # environments on one machine sharing one folder would rebuild over each other
    environment = "\0".join((*(str(s.resolve()) for s in _SOURCES), sys.prefix, sys.version, torch.__file__))
    digest = hashlib.sha256(
        b"".join(s.read_bytes() for s in (*_SOURCES, *_HEADERS)) + " ".join(flags).encode() + torch.__version__.encode()
        + environment.encode()
    ).hexdigest()[:12]
    name = f"{_NAMESPACE}_{isa}_{digest}"
    build_dir = _build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = (build_dir / f"{name}.so").exists()
    if not cached:
        _log.warning("manifoldlib: compiling the C++ CPU kernels (SphereResidual, SEL) into %s "
                     "(once; set %s=0 to skip)", build_dir, ENV_VAR)
    start = time.perf_counter()
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in _SOURCES],
        extra_cflags=flags,
        extra_ldflags=_OPENMP_FLAGS,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    elapsed = time.perf_counter() - start
    if not cached:
        _log.warning("manifoldlib: compiled the C++ CPU kernels in %.1f s", elapsed)
    elif elapsed > 2.0:  # a cached library loads in milliseconds: torch rebuilt it
        _log.warning("manifoldlib: the cached C++ CPU kernels in %s were rebuilt "
                     "(%.1f s)", build_dir, elapsed)
    from . import sphere_step

    sphere_step.register()  # a failure here means the ATen path, as a failed build does
    return getattr(torch.ops, _NAMESPACE)


def _cause(err: Exception) -> str:
    """One line of a failed build that says why: the first diagnostic of the compiler, linker or
    shell (``error:``, ``not found``, ``No such file or directory``, ...) in torch's build log,
    which opens with the compiler's full command line; the error's first line when there is none."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
    return next((line for line in lines if _DIAGNOSTIC.search(line)), lines[0])[:300]


def load():
    """The kernels' ``torch.ops`` namespace, or ``None`` when disabled by :data:`ENV_VAR` or
    when the build failed (warned once). Built or loaded on the first call, then cached."""
    if not _state["done"]:
        with _lock:
            if not _state["done"]:
                ops = None
                if os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF_VALUES:
                    try:
                        ops = _build()
                    except Exception as err:  # noqa: BLE001 - any build failure means the ATen path
                        warnings.warn(
                            f"manifoldlib: the C++ CPU kernels (SphereResidual, SEL) could not be "
                            f"built ({type(err).__name__}: {_cause(err)}); using the ATen paths "
                            f"instead (set {ENV_VAR}=0 to skip the build)",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                _state["ops"] = ops
                _state["done"] = True
    return _state["ops"]


def available() -> bool:
    """Whether the kernels are built (building them now if needed) and not disabled by
    :data:`ENV_VAR`. Ignores :func:`disabled`."""
    return load() is not None


def enabled():
    """The kernels' namespace if they should be used right now, else ``None``: not inside
    :func:`disabled`, not switched off by :data:`ENV_VAR`, and built."""
    if _disabled_depth:
        return None
    return load()


def _built() -> bool:
    return load() is not None


# Fixed for the process once load() has run, so torch.compile may call it while tracing (building or
# loading the kernels then if need be, outside the trace: load() takes a lock and runs a build) and
# keep the answer. This is torch.compiler.assume_constant_result(_built), which sets this attribute
# and nothing else, without its import of torch._dynamo (about a second) when manifoldlib is imported;
# tests/nn/test_sphere_residual_cpu_kernels.py checks that the decorator still sets it.
_built._dynamo_marked_constant = True


def in_use() -> bool:
    """Whether the kernels should be used right now, as :func:`enabled` decides, as a bool that
    ``torch.compile`` can trace: the build is asked once, and a graph traced outside
    :func:`disabled` is guarded on its depth (inside the block the function is traced anew, on the
    ATen path)."""
    return not _disabled_depth and _built()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, the fused sphere residual and the SEL chart use their ATen paths (the
    decision is taken in the forward, so a backward runs on the path its forward took).
    Process-wide, not per thread."""
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1
