"""Runs every code block of docs/tutorials/custom_retraction.rst, in order, in one namespace."""

from __future__ import annotations

import pathlib
import re
import textwrap



TUTORIAL = (
    pathlib.Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "custom_retraction.rst"
)


def _code_blocks(text: str) -> list[str]:
    blocks = []
    for match in re.finditer(
        r"^\.\. code-block:: python\n\n((?:(?:    .*)?\n)+)", text, flags=re.MULTILINE
    ):
        blocks.append(textwrap.dedent(match.group(1)))
    return blocks


def test_tutorial_has_the_expected_blocks():
    blocks = _code_blocks(TUTORIAL.read_text())
    assert len(blocks) == 6
    assert '@register_retraction("sphere", "my-p3")' in blocks[0]


def test_tutorial_code_runs_and_its_claims_hold(clean_registry, capsys):
    namespace: dict = {"__name__": "tutorial"}
    for i, block in enumerate(_code_blocks(TUTORIAL.read_text())):
        exec(compile(block, f"{TUTORIAL.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    # section 3: the registered retraction verifies as second order
    assert abs(namespace["measured"] - 2.0) < 0.05
    assert "measured order 2.000" in out
    # section 4: the broken angle function is caught by the derivative check
    assert "the derivative at 0 is not the identity on the tangent space" in namespace["message"]
    # section 6: the user's Stiefel retraction is second order and selectable by name
    assert abs(namespace["measured_stiefel"] - 2.0) < 0.05
    from manifoldlib.retractions import available_retractions

    assert "my-p3" in available_retractions("sphere")
    assert "polar-ns" in available_retractions("stiefel")
