"""torchrun end to end: init_from_env and sharded_apply in a real ``torch.distributed.run`` job."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.slow
def test_torchrun_two_processes_share_the_single_process_results() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        os.path.join(HERE, "torchrun_check.py"),
    ]
    done = subprocess.run(
        command, check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "torchrun check ok: world_size=2 tensors=11" in done.stdout
