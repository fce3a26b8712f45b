"""The Hugging Face tutorial's code blocks run, in order, as written in the docs."""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "hf_model.rst"


def python_blocks(text: str) -> list[str]:
    """Bodies of the ``.. code-block:: python`` directives (indented lines after a blank line)."""
    return [textwrap.dedent(m.group(1)) for m in
            re.finditer(r"^\.\. code-block:: python\n\n((?:(?:    .*)?\n)+)", text, re.MULTILINE)]


def test_tutorial_has_its_five_steps():
    blocks = python_blocks(TUTORIAL.read_text())
    assert len(blocks) == 5
    assert "split_blocks(" in blocks[2] and "apply_chart(" in blocks[3] and "merge_charts(" in blocks[4]


def test_tutorial_runs_and_prints_what_it_says(capsys):
    namespace: dict = {"__name__": "hf_tutorial"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        for block in python_blocks(TUTORIAL.read_text()):
            exec(compile(block, str(TUTORIAL), "exec"), namespace)  # noqa: S102 (the blocks assert their claims)
    # no fallback and no empty-chart warning; one from build_optimizer on the charted model (step 4:
    # its MLP charts go to AdamW, as the tutorial says)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "charted matrices (e.g. 'transformer.h.0.mlp.c_fc') go to AdamW" \
        in messages[0]
    out = capsys.readouterr().out
    assert "(32, 96)" in out and "6 Stiefel blocks of shape (32, 32)" in out
    assert "4 charted" in out and "merged: Conv1D" in out
    assert len(namespace["charted"]) == 4
