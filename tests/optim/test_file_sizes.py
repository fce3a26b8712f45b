"""Issue 19's readability bound: no file of ``manifoldlib/optim`` is over 400 lines (a file that
grows past it is split by what its parts do, not trimmed)."""

from __future__ import annotations

from pathlib import Path

import manifoldlib.optim

OPTIM = Path(manifoldlib.optim.__file__).parent
MAX_LINES = 400


def test_no_optim_file_is_over_400_lines():
    sizes = {path.name: len(path.read_text().splitlines()) for path in sorted(OPTIM.glob("*.py"))}
    assert len(sizes) > 10
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
