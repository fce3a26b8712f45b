"""Every Python block of README.md runs alone, verbatim, in a fresh interpreter, and prints what it says;
so do the ``.. code-block:: python`` examples of the docs' front pages (``docs/index.rst``,
``docs/overview.rst``), the first code a reader of the site copies. The install commands are one
pair of torch lines everywhere (CPU as written, CUDA commented), and ``.ci/run`` installs with
the README's CPU line and runs its test command.

A reader copies one block at a time, so each block is run as ``python -c <block>`` in a new process
from the repository root. A comment ``# -> text`` (at the end of a line or on a line of its own)
promises an output line: the block's stdout lines must be exactly those texts, in order; a promise
``# -> ...`` stands for any number of lines (for a long printout, such as ``build_optimizer(...,
verbose=True)``'s assignment table, of which the README shows a few lines). Blocks that import
``transformers`` are skipped when it is not installed (the ``test`` extra has it).

The README is a front page: measurements live in ``docs/results`` and ``docs/guides`` with their
command and machine, so it names no machine and no date, and the pages it links to exist.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
PROMISE = re.compile(r"#\s*->\s*(.+?)\s*$")
#: A promise that matches any number of output lines, the elided part of a long printout.
ANY_LINES = "..."
FRONT_PAGES = ("docs/index.rst", "docs/overview.rst")


def rst_python_blocks(text: str) -> list[str]:
    """Bodies of the ``.. code-block:: python`` directives of an rST page, dedented."""
    return [textwrap.dedent(m.group(1)) for m in
            re.finditer(r"^\.\. code-block:: python\n\n((?:(?:[ ]+.*)?\n)+)", text, re.MULTILINE)]


DOC_BLOCKS = [(page, k, block) for page in FRONT_PAGES
              for k, block in enumerate(rst_python_blocks((ROOT / page).read_text()))]


def promised_lines(block: str) -> list[str]:
    """The ``# -> text`` promises of a block, in order."""
    return [m.group(1) for line in block.splitlines() if (m := PROMISE.search(line))]


def output_matches(lines: list[str], promises: list[str]) -> bool:
    """Whether output ``lines`` are the ``promises`` in order, ``...`` matching any run of lines."""
    if not promises:
        return not lines
    head, rest = promises[0], promises[1:]
    if head == ANY_LINES:
        return any(output_matches(lines[i:], rest) for i in range(len(lines) + 1))
    return bool(lines) and lines[0] == head and output_matches(lines[1:], rest)


def test_readme_has_python_blocks_and_each_promises_output():
    assert len(BLOCKS) >= 5
    for block in BLOCKS:
        assert set(promised_lines(block)) - {ANY_LINES}, f"a README block prints nothing it promises:\n{block}"


def test_promise_parsing():
    assert promised_lines("print(1)  # -> 1\nx = 2  # a comment\n# -> (True, None)\n") == ["1", "(True, None)"]


def test_elided_promises_match_any_run_of_lines():
    assert output_matches(["a", "b", "c", "d"], ["a", ANY_LINES, "d"])
    assert output_matches(["a", "d"], ["a", ANY_LINES, "d"])
    assert output_matches(["h", "x", "y", "z"], ["h", ANY_LINES, "y", ANY_LINES])
    assert not output_matches(["a", "b"], ["a", ANY_LINES, "c"])
    assert not output_matches(["a", "b", "c"], ["a", "c"])
    assert not output_matches(["a"], ["a", "b"])


def test_readme_shows_the_assignment_table_that_build_optimizer_prints():
    (block,) = [b for b in BLOCKS if "verbose=True" in b]
    promises = promised_lines(block)
    assert ANY_LINES in promises  # a few lines of the table, checked against what it prints
    assert promises[0].split() == ["parameter", "shape", "layout", "optimizer", "why"]


def run_alone(block: str, where: str) -> None:
    """Run ``block`` as ``python -c`` in a fresh process; its stdout must be its promises."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("PYTHONSTARTUP", None)
    proc = subprocess.run(
        [sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{where} failed alone:\n{block}\n--- stderr ---\n{proc.stderr}"
    assert output_matches(proc.stdout.splitlines(), promised_lines(block)), proc.stdout


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i}")
def test_readme_block_runs_alone_and_prints_its_promises(index):
    block = BLOCKS[index]
    if "transformers" in block and importlib.util.find_spec("transformers") is None:
        pytest.skip("this README block needs transformers (pip install -e '.[test]')")
    run_alone(block, f"README block {index}")


def test_each_front_page_has_an_example_that_promises_output():
    assert sorted({page for page, _, _ in DOC_BLOCKS}) == sorted(FRONT_PAGES)
    assert all(promised_lines(block) for _, _, block in DOC_BLOCKS)


@pytest.mark.parametrize(("page", "index", "block"), DOC_BLOCKS, ids=[f"{p}:{k}" for p, k, _ in DOC_BLOCKS])
def test_front_page_example_runs_alone_and_prints_its_promises(page, index, block):
    run_alone(block, f"{page} code block {index}")


#: The widest code line the docs' theme shows without a scroll bar.
CODE_COLUMN = 88


@pytest.mark.parametrize("page", FRONT_PAGES)
def test_front_page_code_fits_the_column(page):
    blocks = re.findall(r"^(?:\.\. code-block:: \w+|.*::)\n\n((?:(?:[ ]+.*)?\n)+)",
                        (ROOT / page).read_text(), re.MULTILINE)
    assert blocks, f"{page} has no code blocks"
    wide = [line for block in blocks for line in textwrap.dedent(block).splitlines()
            if len(line) > CODE_COLUMN]
    assert not wide, f"{page}: code lines wider than {CODE_COLUMN} characters: {wide}"


# ---- install commands ------------------------------------------------------------------------

#: The torch lines of every install command: CPU as written, the CUDA build (PyPI's) commented.
CPU_LINE = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
GPU_LINE = "# pip install torch==2.13.0"
#: What .ci/run adds to the CPU line: the PyTorch index is not reachable from CI.
CI_FALLBACK = "--extra-index-url https://pypi.org/simple --retries 1"
BASH_BLOCKS = re.findall(r"^```bash\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
CI_RUN = (ROOT / ".ci" / "run").read_text()


def _commands(text: str) -> list[str]:
    """Shell lines without their trailing comments, continuations joined, blanks dropped."""
    joined = re.sub(r"\\\n\s*", "", text)
    return [line.strip().split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def _torch_lines(text: str) -> list[str]:
    return [line for line in _commands(text) if "torch==" in line]


#: The README's test command: one worker process per CPU core (pytest-xdist, in the ``test`` extra;
#: most suites run their small tensors on one thread each), a test file's tests on one worker (its
#: module fixtures built once).
TEST_COMMAND = "python -m pytest -q -n auto --dist loadfile"


@pytest.mark.parametrize("command", ['pip install -e ".[train]" && python -m models.train',
                                     f'pip install -e ".[test]" && {TEST_COMMAND}'])
def test_each_highlighted_command_installs_torch_for_the_machine_then_runs(command):
    (block,) = [b for b in BASH_BLOCKS if command in b]
    assert _commands(block) == [CPU_LINE, GPU_LINE, command]
    assert "# CPU" in block and "# NVIDIA GPU (CUDA)" in block  # each line says what it is for


def test_the_docs_landing_page_installs_with_the_same_lines():
    (block,) = re.findall(r"^\.\. code-block:: bash\n\n((?:   .*\n)+)",
                          (ROOT / "docs" / "index.rst").read_text(), re.MULTILINE)
    assert _torch_lines(block) == [CPU_LINE, GPU_LINE]
    assert f'pip install -e ".[test]" && {TEST_COMMAND}' in _commands(block)


def test_ci_installs_with_the_readmes_cpu_line_and_runs_its_test_command():
    (ci_line,) = _torch_lines(CI_RUN)
    assert ci_line == f"python -m pip install -q {CPU_LINE[len('pip install '):]} {CI_FALLBACK}"
    (readme_tests,) = [b for b in BASH_BLOCKS if "pytest" in b]
    assert _commands(readme_tests)[-1].endswith(f" && {TEST_COMMAND}")
    assert TEST_COMMAND in _commands(CI_RUN)  # the README's test command


# ---- a front page ----------------------------------------------------------------------------

#: Words that mark a dated measurement: the machines benchmarks ran on.
MACHINE_WORDS = ("EPYC", "Xeon", "AMX", "AVX", "H100", "H200", "A100")


def test_readme_names_no_machine_and_no_date():
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", README)
    machines = [word for word in MACHINE_WORDS if word in README]
    assert not dates and not machines, (f"the README carries dated measurements ({dates + machines}); "
                                        "they belong in docs/results or docs/guides")


def test_readme_links_to_pages_that_exist():
    targets = re.findall(r"\]\(((?!https?:)[^)#]+)\)", README)
    assert any(t.startswith("docs/results/") for t in targets)
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing pages: {missing}"
