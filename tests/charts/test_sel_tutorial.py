"""The SEL fine-tuning tutorial's code blocks run, in order, as written in the docs."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "sel_finetune.rst"


def python_blocks(text: str) -> list[str]:
    """Bodies of the ``.. code-block:: python`` directives (indented lines after a blank line)."""
    blocks = []
    for match in re.finditer(
        r"^\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", text, re.MULTILINE
    ):
        blocks.append(textwrap.dedent(match.group(1)))
    return blocks


def test_tutorial_has_the_four_steps():
    blocks = python_blocks(TUTORIAL.read_text())
    assert len(blocks) == 4
    assert "apply_chart(" in blocks[1] and "merge_charts(" in blocks[3]


def test_tutorial_runs_and_fine_tuning_lowers_the_loss(capsys):
    namespace: dict = {"__name__": "sel_tutorial"}
    for block in python_blocks(TUTORIAL.read_text()):
        exec(compile(block, str(TUTORIAL), "exec"), namespace)  # noqa: S102 (the blocks assert their own claims)
    assert namespace["loss"].item() < namespace["pretrained_loss"]
    assert len(namespace["names"]) == 12
    assert "charted:" in capsys.readouterr().out
