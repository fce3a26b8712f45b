"""Sharded checkpoints in the run directory, without a process group: the manifest that seals
the shard files (a missing, altered or misnamed one falls back to the previous checkpoint), the
removal of what a killed save leaves, and the reader that refuses a crafted DCP ``.metadata``.

The multi-process save, resume and reshard are tested in
``tests/distributed/test_train_fsdp.py``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.sharded_checkpoint import _reader, _split, remove_stale_shard_folders
from models.storage import (
    CHECKPOINT,
    DAMAGED_CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    REQUIRED_KEYS,
    SHARDS,
    CheckpointError,
    check_run_dir,
    load_checkpoint,
    save_checkpoint,
    shard_manifest,
)


def _sharded(out: Path, step: int, previous_step: int = -1) -> str:
    """A sealed sharded checkpoint of ``step`` in ``out`` (every required key but the model and
    the optimizer, which its folder holds) and its folder of two shard files; the folder name."""
    folder = f"checkpoint-{step}-{step:08x}.dcp"
    (out / folder).mkdir()
    for name, size in ((".metadata", 40), ("__0_0.distcp", 300), ("__1_0.distcp", 200)):
        (out / folder / name).write_bytes(bytes(range(step, step + size % 256)) * (size // 100 + 1))
    state = {key: step for key in REQUIRED_KEYS if key not in ("model", "optimizer")}
    state[SHARDS] = {"folder": folder, "files": shard_manifest(out / folder)}
    save_checkpoint(out / CHECKPOINT, state, previous_step)
    return folder


def _two(tmp_path: Path) -> tuple[str, str]:
    return _sharded(tmp_path, 4), _sharded(tmp_path, 8, previous_step=4)


def test_a_sharded_checkpoint_with_its_files_loads_without_a_model_or_optimizer_key(tmp_path):
    _, newest = _two(tmp_path)
    state, note = load_checkpoint(tmp_path)
    assert note is None and state["step"] == 8 and state[SHARDS]["folder"] == newest
    assert set(state[SHARDS]["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda f: f.joinpath("__1_0.distcp").write_bytes(b"\x00" * 900),
     "shard file {folder}/__1_0.distcp does not match its checksum"),
    (lambda f: f.joinpath(".metadata").unlink(), "shard file {folder}/.metadata is missing"),
    (lambda f: [p.unlink() for p in f.iterdir()] and f.rmdir(),
     "its shard folder {folder} is missing"),
])
def test_a_damaged_shard_folder_falls_back_to_the_previous_checkpoint(tmp_path, damage, reason):
    _, newest = _two(tmp_path)
    damage(tmp_path / newest)
    state, note = load_checkpoint(tmp_path)
    assert state["step"] == 4
    assert note == (f"{tmp_path / CHECKPOINT} is damaged ({reason.format(folder=newest)}); "
                    f"resuming from the previous checkpoint {PREVIOUS_CHECKPOINT} (step 4); the "
                    f"damaged file is kept as {DAMAGED_CHECKPOINT}")


def test_a_manifest_that_names_a_folder_outside_the_run_directory_is_damaged(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    folder = _sharded(outside, 4)
    state = {key: 4 for key in REQUIRED_KEYS if key not in ("model", "optimizer")}
    state[SHARDS] = {"folder": f"../elsewhere/{folder}",
                     "files": shard_manifest(outside / folder)}
    save_checkpoint(run / CHECKPOINT, state, -1)
    with pytest.raises(CheckpointError, match="its shard manifest is not a folder name"):
        load_checkpoint(run)


def test_without_a_previous_checkpoint_a_damaged_shard_is_an_error(tmp_path):
    folder = _sharded(tmp_path, 4)
    (tmp_path / folder / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is missing\) and no previous good"):
        load_checkpoint(tmp_path)


def test_stale_shard_folders_go_and_the_checkpoints_folders_stay(tmp_path):
    kept = set(_two(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    leftovers = {f".checkpoint-12-0000abcd.dcp.{dead}.tmp",  # a save killed while DCP wrote
                 "checkpoint-12-0000abcd.dcp"}  # killed between the rename and checkpoint.pt
    for name in leftovers:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
    alive = f".checkpoint-16-0000abcd.dcp.{os.getpid()}.tmp"  # our own save, under way
    (tmp_path / alive).mkdir()
    # unlocked: only the temporary folder of a dead writer (the rest may be another run's)
    assert remove_stale_shard_folders(tmp_path, locked=False) == \
        [f".checkpoint-12-0000abcd.dcp.{dead}.tmp"]
    assert remove_stale_shard_folders(tmp_path, locked=True) == ["checkpoint-12-0000abcd.dcp"]
    assert {p.name for p in tmp_path.iterdir() if p.is_dir()} == kept | {alive}


def test_an_unreadable_checkpoint_keeps_every_complete_shard_folder(tmp_path):
    _two(tmp_path)
    (tmp_path / "checkpoint-12-0000abcd.dcp").mkdir()
    (tmp_path / CHECKPOINT).write_bytes(b"not a checkpoint")
    assert remove_stale_shard_folders(tmp_path, locked=True) == []


def test_a_run_killed_between_its_shards_and_its_first_checkpoint_can_start_again(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoint-4-0000abcd.dcp").mkdir()
    assert check_run_dir(tmp_path, resume=False) is True


def test_tensors_go_to_the_shards_and_plain_data_to_the_sealed_file():
    weight = torch.ones(2)
    tensors, plain = _split({"model": {"w": weight},
                             "optimizer": {"state": {"w": {"step": torch.tensor(3.0), "k": 1}},
                                           "param_groups": [{"lr": 0.1, "params": ["w"]}]}})
    assert tensors == {"model": {"w": weight}, "optimizer": {"state": {"w": {
        "step": torch.tensor(3.0)}}}}
    assert plain == {"optimizer": {"state": {"w": {"k": 1}},
                                   "param_groups": [{"lr": 0.1, "params": ["w"]}]}}


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo crafted",))


def test_a_crafted_dcp_metadata_file_is_refused_and_nothing_in_it_runs(tmp_path, capfd):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match=r"refusing to load .*\.metadata: it is not DCP's "
                                              r"metadata \(posix\.system is not part"):
        _reader(tmp_path).read_metadata()
    assert "crafted" not in capfd.readouterr().out
