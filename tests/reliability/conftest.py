"""Fixtures of the fault tests."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def small_tmpfs(tmp_path):
    """``small_tmpfs(kib)``: a fresh tmpfs of ``kib`` KiB (the test is skipped where mounting is
    not allowed); unmounted afterwards."""
    mounts = []

    def mount(kib: int):
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)],
                              capture_output=True, check=False)
        if proc.returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", str(where)], check=True)
