"""Without the C++ CPU kernels — switched off by the environment, or no compiler to build them —
the fused sphere residual and the SEL chart run their ATen paths with the same numbers, and a
failed build is reported once, by the line of the build log that says why. Each case is a fresh
process with a real environment (an empty extension cache; a compiler that does not exist, or one
that fails), so the loader is exercised as a user meets it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from manifoldlib import _cpu_kernels

REPO = pathlib.Path(__file__).resolve().parents[1]

# The client: loads the kernels twice, runs a sphere residual and the SEL chart's forward rule,
# forward and backward, on the fused paths, and compares them with the plain reference math in
# float64 (largest deviation of the value and each gradient, relative to that tensor's largest entry).
_CLIENT = r"""
import json, warnings
import torch

def deviation(got, want):
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))

from manifoldlib import _cpu_kernels
from manifoldlib.charts.kernel import sel_forward_rule
from manifoldlib.nn import sphere_residual, sphere_residual_reference
from manifoldlib.retractions import get_retraction

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = _cpu_kernels.load()
    second = _cpu_kernels.load()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 16, generator=g, dtype=torch.float64)
    h = 1.7 * h / h.norm(dim=-1, keepdim=True)
    f = 0.4 * torch.randn(6, 16, generator=g, dtype=torch.float64)
    h.requires_grad_(), f.requires_grad_()
    out = sphere_residual(h, f, 0.5, get_retraction("sphere", "gnomonic"))
    probe = torch.randn(out.shape, generator=g, dtype=torch.float64)
    fused = [out.detach(), *torch.autograd.grad((out * probe).sum(), (h, f))]
    ref = sphere_residual_reference(h, f, 0.5, get_retraction("sphere", "gnomonic"))
    plain = [ref.detach(), *torch.autograd.grad((ref * probe).sum(), (h, f))]
    sphere_err = deviation(fused, plain)

    raw = (0.6 * torch.randn(7, 11, generator=g, dtype=torch.float64)).requires_grad_()
    factors = [(0.5 + torch.rand(*shape, generator=g, dtype=torch.float64)).requires_grad_()
               for shape in ((7, 1), (1, 11), (7, 1), (1, 11), (7, 1), (1, 11))]
    leaves = [raw, *factors]
    pairs = (factors[0:2], factors[2:4], factors[4:6])
    w_probe = torch.randn(7, 11, generator=g, dtype=torch.float64)
    sel = {}
    for impl in ("fused", "autograd"):
        weight = sel_forward_rule(raw, *pairs, 50.0, impl)
        sel[impl] = [weight.detach(), *torch.autograd.grad((weight * w_probe).sum(), leaves)]
        if impl == "fused":
            sel_path = type(weight.grad_fn).__name__
    sel_err = deviation(sel["fused"], sel["autograd"])
print(json.dumps({
    "loaded": [first is not None, second is not None],
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    "sphere_err": sphere_err,
    "sel_path": sel_path,
    "sel_err": sel_err,
}))
"""


def _run(cache=None, **env):
    """The client's report, run with ``env`` added and the extension cache in ``cache`` (None:
    the caller's own cache, where this test session's kernels are already built)."""
    environment = {**os.environ, **env}
    if cache is not None:
        environment["TORCH_EXTENSIONS_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, "-c", _CLIENT], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_environment_switch_keeps_the_kernels_unbuilt_and_the_aten_paths_agree(tmp_path):
    result = _run(tmp_path / "extensions", **{_cpu_kernels.ENV_VAR: "0"})
    assert result["loaded"] == [False, False]
    assert result["warnings"] == []  # switched off is not a failure
    assert not (tmp_path / "extensions").exists()  # nothing was built
    assert result["sel_path"] == "_SELForwardRuleBackward"  # the ATen autograd function
    assert result["sphere_err"] <= 1e-14
    assert result["sel_err"] <= 1e-14


def test_a_missing_compiler_warns_once_naming_it_and_falls_back(tmp_path):
    compiler = {"CXX": str(tmp_path / "no-such-compiler"), _cpu_kernels.ENV_VAR: "1"}  # on, whatever the caller's
    result = _run(tmp_path / "extensions", **compiler)
    assert result["loaded"] == [False, False]
    failures = [w for w in result["warnings"] if "could not be built" in w]
    assert len(failures) == 1, result["warnings"]  # once, not at every use
    assert failures[0].startswith("RuntimeWarning: ") and "RuntimeError: " in failures[0]  # the cause
    if _cpu_kernels.available():  # a build tool chain is here, so the compiler is what failed: named
        assert "no-such-compiler" in failures[0]
        assert "-isystem" not in failures[0]  # the shell's diagnostic, not the compile command line
    assert "using the ATen paths instead" in failures[0]
    assert result["sel_path"] == "_SELForwardRuleBackward"
    assert result["sphere_err"] <= 1e-14
    assert result["sel_err"] <= 1e-14


@pytest.mark.slow  # a failed build in a fresh interpreter (~5 s); the missing compiler above is the default run's
@pytest.mark.skipif(not (_cpu_kernels.available() and shutil.which("g++")), reason="no build tool chain here")
def test_a_compile_error_is_reported_by_its_diagnostic_line(tmp_path):
    # a compiler that identifies itself as g++ (torch asks it for its version) and then fails
    # every compile with a diagnostic on stderr, as a broken header or an old g++ would
    compiler = tmp_path / "failing-c++"
    compiler.write_text('#!/bin/sh\ncase "$1" in -v|--version) exec g++ "$@";; esac\n'
                        'echo "sel_chart.cpp:1:1: error: the diagnostic of a failing compiler" >&2\nexit 1\n')
    compiler.chmod(0o755)
    result = _run(tmp_path / "extensions", CXX=str(compiler), **{_cpu_kernels.ENV_VAR: "1"})
    assert result["loaded"] == [False, False]
    failures = [w for w in result["warnings"] if "could not be built" in w]
    assert len(failures) == 1, result["warnings"]
    assert "sel_chart.cpp:1:1: error: the diagnostic of a failing compiler" in failures[0]
    assert result["sphere_err"] <= 1e-14 and result["sel_err"] <= 1e-14


@pytest.mark.skipif(not _cpu_kernels.available(), reason="the C++ CPU kernels are not built here")
def test_the_same_client_runs_the_kernels_where_they_build():
    # the control of the two cases above: with the compiler, the fused paths are the kernels
    result = _run()
    assert result["loaded"] == [True, True]
    assert result["sel_path"] == "_SELKernelRuleBackward"
    assert result["sphere_err"] <= 1e-14
    assert result["sel_err"] <= 1e-14


# The client of a first use under torch.compile: imports the library, reports what the import
# loaded, then runs a compiled SphereResidual (fullgraph, forward and backward) as the process's
# first use of the kernels, and reports the kernels it ran (profiled: the compiled graph's calls).
_COMPILE_CLIENT = r"""
import json, sys
import torch
import manifoldlib, manifoldlib.nn
from manifoldlib._cpu_kernels import loader

report = {"imported": sorted(m for m in ("torch._dynamo", "manifoldlib._cpu_kernels.sphere_step") if m in sys.modules),
          "loaded_at_import": loader._state["done"]}
compiled = torch.compile(manifoldlib.nn.SphereResidual(8), fullgraph=True, backend="aot_eager")
h, f = torch.randn(3, 8).requires_grad_(), torch.randn(3, 8)
compiled(h, f).sum().backward()  # traces: the first use of the kernels
with torch.profiler.profile() as prof:
    compiled(h, f).sum().backward()
report["calls"] = [e.name for e in prof.events() if e.name.startswith("manifoldlib_cpu::")]
report["registered"] = "manifoldlib._cpu_kernels.sphere_step" in sys.modules
print(json.dumps(report))
"""


@pytest.mark.slow  # a fresh process compiling a model: 5-8 s each (the default suite's budget)
@pytest.mark.parametrize("switch", ["0", "1"], ids=["off", "on"])
def test_importing_loads_nothing_and_a_first_use_under_compile_takes_the_kernels_where_they_are_on(switch):
    """``import manifoldlib`` builds, loads and registers nothing (nor imports torch._dynamo, about a
    second); a process whose first use of the kernels is a torch.compile(fullgraph=True) trace loads
    them while tracing and runs the row kernels, or, switched off, runs the ATen path and never
    registers the operators."""
    if switch == "1" and not _cpu_kernels.available():
        pytest.skip("the C++ CPU kernels are not built here")
    environment = {**os.environ, _cpu_kernels.ENV_VAR: switch}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_CLIENT], check=False, cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["imported"] == [] and report["loaded_at_import"] is False
    if switch == "1":
        assert report["calls"] == ["manifoldlib_cpu::sphere_step_forward", "manifoldlib_cpu::sphere_step_backward"]
        assert report["registered"] is True
    else:
        assert report["calls"] == [] and report["registered"] is False
