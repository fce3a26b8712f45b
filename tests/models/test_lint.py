"""``ruff`` on ``models/`` and ``tests/models/``: import order (``I``) and pyflakes (``F``: unused
imports and names), the rules that mean the same in every ruff version (its default set grows);
``ruff check models tests/models`` with the project's configuration is clean too, by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff")

REPO = Path(__file__).resolve().parents[2]


def test_models_imports_are_sorted_and_used():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "I,F",
                           "--output-format", "concise", "models", "tests/models"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
