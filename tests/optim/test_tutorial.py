"""The code blocks of docs/tutorials/custom_policy.rst run, in order, in one namespace."""

from __future__ import annotations

import pathlib
import re
import textwrap

TUTORIAL = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "custom_policy.rst"


def _code_blocks(text: str) -> list[str]:
    blocks = []
    for match in re.finditer(r"^\.\. code-block:: python\n\n((?:(?:    .*)?\n)+)", text, flags=re.MULTILINE):
        blocks.append(textwrap.dedent(match.group(1)))
    return blocks


def test_tutorial_code_runs(clean_policies):  # the tutorial registers "out-stiefel": not for later tests
    blocks = _code_blocks(TUTORIAL.read_text())
    assert len(blocks) == 4
    namespace: dict = {"__name__": "tutorial"}
    for block in blocks:
        exec(compile(block, str(TUTORIAL), "exec"), namespace)
    assert "out-stiefel" in namespace["available_policies"]()
    assert ("muon", "stiefel") in namespace["kinds"] and ("muon", "dgram") in namespace["kinds"]
