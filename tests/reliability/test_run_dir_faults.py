"""The run directory under faults: crafted, truncated and bit-flipped checkpoints, a partial
metrics line, planted symlinks, a full disk, and a kill -9 during a checkpoint write (and the
temporary file it leaves, removed at the next start)."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from models.run_dir import (
    CHECKPOINT,
    DAMAGED_CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    RUN_FILES,
    CheckpointError,
    MetricsLog,
    RunError,
    atomic_write,
    check_run_dir,
    clear_stale_run,
    describe_os_error,
    has_checkpoint,
    load_checkpoint,
    read_metrics,
    remove_stale_temporaries,
    rewrite_metrics,
    rng_state,
    save_checkpoint,
    set_rng_state,
    state_checksum,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]
KEYS = ("weights", "step")


def _state(step: int, n: int = 1000) -> dict:
    return {"weights": torch.arange(n, dtype=torch.float32) + step, "step": step,
            "note": f"step {step}"}


def _two_checkpoints(tmp_path: Path) -> Path:
    save_checkpoint(tmp_path / CHECKPOINT, _state(10), previous_step=-1)
    save_checkpoint(tmp_path / CHECKPOINT, _state(20), previous_step=10)
    return tmp_path / CHECKPOINT


def _flip_tensor_byte(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit inside ``tensor``'s stored bytes (torch stores records uncompressed)."""
    raw = bytearray(path.read_bytes())
    needle = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = raw.find(needle)
    assert at >= 0, "tensor bytes not found in the file"
    raw[at + len(needle) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


# ---- checksums and fallbacks ----------------------------------------------------------------


def test_checkpoint_round_trips_with_weights_only_and_its_checksum(tmp_path):
    path = _two_checkpoints(tmp_path)
    loaded = torch.load(path, weights_only=True)
    checksum = loaded.pop("checksum")
    assert checksum == state_checksum(_state(20)) and len(checksum) == 64
    state, note = load_checkpoint(tmp_path, required=KEYS)
    assert note is None and state["step"] == 20 and torch.equal(state["weights"],
                                                                _state(20)["weights"])
    assert torch.load(tmp_path / PREVIOUS_CHECKPOINT, weights_only=True)["step"] == 10
    assert has_checkpoint(tmp_path)


def test_checksum_sees_one_changed_value_dtype_or_key():
    base = _state(1)
    assert state_checksum(base) == state_checksum(_state(1))
    changed = _state(1)
    changed["weights"][3] += 1
    assert state_checksum(changed) != state_checksum(base)
    assert state_checksum({**base, "weights": base["weights"].double()}) != state_checksum(base)
    assert state_checksum({**base, "extra": 0}) != state_checksum(base)


def test_a_bit_flip_inside_tensor_data_falls_back_to_the_previous_checkpoint(tmp_path):
    path = _two_checkpoints(tmp_path)
    _flip_tensor_byte(path, _state(20)["weights"])
    state, note = load_checkpoint(tmp_path, required=KEYS)
    assert state["step"] == 10
    assert "does not match its checksum" in note and PREVIOUS_CHECKPOINT in note
    assert (tmp_path / DAMAGED_CHECKPOINT).is_file() and not path.exists()


@pytest.mark.parametrize("damage", ["truncated", "emptied", "half", "garbage"])
def test_an_unreadable_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    path = _two_checkpoints(tmp_path)
    raw = path.read_bytes()
    path.write_bytes({"truncated": raw[:-100], "emptied": b"", "half": raw[:len(raw) // 2],
                      "garbage": os.urandom(len(raw))}[damage])
    state, note = load_checkpoint(tmp_path, required=KEYS)
    assert state["step"] == 10 and f"{path} is damaged (unreadable" in note


def test_a_damaged_checkpoint_without_a_previous_one_is_one_clear_error(tmp_path):
    save_checkpoint(tmp_path / CHECKPOINT, _state(10), previous_step=-1)
    (tmp_path / CHECKPOINT).write_bytes((tmp_path / CHECKPOINT).read_bytes()[:50])
    with pytest.raises(CheckpointError, match="is damaged .* no previous good checkpoint"):
        load_checkpoint(tmp_path, required=KEYS)


def test_a_checkpoint_missing_a_key_or_the_checksum_is_damaged(tmp_path):
    save_checkpoint(tmp_path / CHECKPOINT, {"step": 3}, previous_step=-1)
    with pytest.raises(CheckpointError, match=r"is damaged \(missing weights\)"):
        load_checkpoint(tmp_path, required=KEYS)
    torch.save({"step": 3, "weights": torch.zeros(2)}, tmp_path / CHECKPOINT)  # unsealed
    with pytest.raises(CheckpointError, match="has no checksum"):
        load_checkpoint(tmp_path, required=KEYS)


def test_a_missing_newest_checkpoint_uses_the_previous_one(tmp_path):
    path = _two_checkpoints(tmp_path)
    path.unlink()  # a crash between the two renames of save_checkpoint
    state, note = load_checkpoint(tmp_path, required=KEYS)
    assert state["step"] == 10 and "is missing" in note


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(CheckpointError, match="has no checkpoint.pt"):
        load_checkpoint(tmp_path)
    assert not has_checkpoint(tmp_path)


class _Exec:
    """An object whose unpickling runs code (what a crafted checkpoint carries)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned.txt"
    _two_checkpoints(tmp_path)
    torch.save({"step": 30, "weights": _Exec(marker)}, tmp_path / CHECKPOINT)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, required=KEYS)
    message = str(info.value)
    assert message.startswith(f"refusing to load {tmp_path / CHECKPOINT}") and "\n" not in message
    assert not marker.exists()
    assert (tmp_path / CHECKPOINT).exists()  # refused, not treated as damage: nothing moved


def test_save_never_goes_back_and_leaves_no_temporary(tmp_path):
    path = _two_checkpoints(tmp_path)
    save_checkpoint(path, _state(5), previous_step=20)
    assert load_checkpoint(tmp_path, required=KEYS)[0]["step"] == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CHECKPOINT, PREVIOUS_CHECKPOINT])


def test_rng_state_is_plain_data_and_restores_every_generator(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    state = rng_state(torch.device("cpu"))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.save(state, tmp_path / "rng.pt")
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


# ---- atomic, exclusive writes ---------------------------------------------------------------


def test_a_planted_symlink_at_a_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in ("config.json.tmp", ".config.json.tmp", "checkpoint.pt.tmp"):
        (tmp_path / name).symlink_to(victim)
    write_json(tmp_path / "config.json", {"a": 1})
    save_checkpoint(tmp_path / CHECKPOINT, _state(1), previous_step=-1)
    assert victim.read_text() == "keep me"
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}


def test_a_symlink_at_the_target_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "summary.json").symlink_to(victim)
    write_json(tmp_path / "summary.json", {"ok": True})
    assert victim.read_text() == "keep me" and not (tmp_path / "summary.json").is_symlink()


def test_atomic_write_names_the_path_of_a_failure(tmp_path):
    target = tmp_path / "missing-dir" / "config.json"
    with pytest.raises(OSError) as info:
        atomic_write(target, b"{}")
    assert info.value.errno == errno.ENOENT and info.value.filename == str(target)
    assert describe_os_error(info.value) == f"{target}: No such file or directory (ENOENT)"


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), pytest.param(0o077, 0o600, marks=pytest.mark.slow),
                                             pytest.param(0o002, 0o664, marks=pytest.mark.slow)])
def test_run_files_get_the_mode_of_any_new_file_under_the_umask(tmp_path, umask, mode):
    """Atomic writes go through mkstemp (owner-only 0o600); the written files must be readable
    as the umask says, like the files ``open`` creates. Each umask in a fresh process (the
    library reads it once)."""
    target = tmp_path / "summary.json"
    code = (f"import os; os.umask({umask}); from models.storage import atomic_write, save_checkpoint; "
            f"atomic_write({str(target)!r}, b'{{}}'); "
            f"save_checkpoint({str(tmp_path / CHECKPOINT)!r}, {{'step': 1}}, previous_step=-1)")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True)
    assert oct(target.stat().st_mode & 0o777) == oct(mode)
    assert oct((tmp_path / CHECKPOINT).stat().st_mode & 0o777) == oct(mode)


def test_a_full_disk_is_one_enospc_error_and_the_checkpoint_stays_intact(small_tmpfs):
    tiny_disk = small_tmpfs(256)
    path = tiny_disk / CHECKPOINT
    save_checkpoint(path, _state(1, n=1000), previous_step=-1)
    with pytest.raises(OSError) as info:
        save_checkpoint(path, _state(2, n=200_000), previous_step=1)  # 800 KB > 256 KiB
    assert info.value.errno == errno.ENOSPC and info.value.filename is not None
    assert "No space left on device (ENOSPC)" in describe_os_error(info.value)
    assert load_checkpoint(tiny_disk, required=KEYS)[0]["step"] == 1
    assert [p.name for p in tiny_disk.iterdir()] == [CHECKPOINT]  # no temporary left


# ---- metrics.jsonl --------------------------------------------------------------------------


def test_a_partial_last_metrics_line_is_dropped_and_rewritten(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5, "train_loss": 1.0}\n{"step": 10, "train_loss": 0.9}\n{"step": 1')
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [5, 10]
    rewrite_metrics(path, rows[:1])
    assert path.read_text() == '{"step": 5, "train_loss": 1.0}\n'


@pytest.mark.parametrize("bad", ["not json", "[1, 2]", '{"loss": 1.0}', '{"step": "5"}',
                                 '{"step": true}', '{"step": 6, "train_loss": "x"}',
                                 '{"step": 6, "val_loss": [1]}', '{"step": 6, "train_loss": true}'])
def test_a_garbage_metrics_line_is_an_error_naming_the_line(tmp_path, bad):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 5}}\n{bad}\n{{"step": 10}}\n')
    with pytest.raises(RunError, match=f"{path} line 2 is not a metrics row"):
        read_metrics(path)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_metrics_row_that_finds_the_disk_full_names_the_file_on_close_too(tmp_path):
    """The row stays in the file's buffer after the failed append, and closing writes it again:
    that error (the one the trainer's ``finally`` reports) must name the file as well."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    log = MetricsLog(tmp_path, [], write=True)
    with pytest.raises(OSError) as appended:
        log.append({"step": 1, "train_loss": 2.0})
    with pytest.raises(OSError) as closed:
        log.close()
    for info in (appended, closed):
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == str(tmp_path / "metrics.jsonl")
    log.close()  # closed once and for all


# ---- run directory rules --------------------------------------------------------------------


def test_a_directory_without_a_checkpoint_can_be_started_again(tmp_path):
    for name in RUN_FILES - {"summary.json"}:
        (tmp_path / name).write_text("x")
    (tmp_path / ".checkpoint.pt.verify").write_text("half")  # a kill mid-write
    (tmp_path / "summary.json").write_text('{"finished": false, "diverged": true}')
    assert check_run_dir(tmp_path, resume=False) is True
    clear_stale_run(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_finished_run_without_a_checkpoint_or_a_foreign_file_is_refused(tmp_path):
    (tmp_path / "summary.json").write_text('{"finished": true}')
    with pytest.raises(RunError, match="is not empty; pass --resume"):
        check_run_dir(tmp_path, resume=False)
    (tmp_path / "summary.json").unlink()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="is not empty"):
        check_run_dir(tmp_path, resume=False)


# ---- kill -9 during a checkpoint write -------------------------------------------------------

_WRITER = textwrap.dedent("""
    import sys, torch
    from models.run_dir import save_checkpoint
    out = sys.argv[1]
    for step in range(1, 10_000):
        state = {"weights": torch.full((500_000,), float(step)), "step": step}
        save_checkpoint(out + "/checkpoint.pt", state, previous_step=step - 1)
        print(step, flush=True)
""")


@pytest.mark.parametrize("writes_seen", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_kill_9_during_checkpoint_writes_leaves_a_loadable_checkpoint(tmp_path, writes_seen):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(writes_seen):
            last = int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)  # somewhere inside the next save (or between saves)
        proc.wait(timeout=60)
    state, _ = load_checkpoint(tmp_path, required=KEYS)
    assert state["step"] >= last - 1
    assert torch.equal(state["weights"], torch.full((500_000,), float(state["step"])))
    assert check_run_dir(tmp_path, resume=True) is False


# ---- temporary files a kill leaves, removed at the next start --------------------------------

_KILLED_BEFORE_THE_RENAME = textwrap.dedent("""
    import os, signal, sys, torch
    from models.run_dir import save_checkpoint
    os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # killed at the rename
    state = {"weights": torch.full((500_000,), 1.0), "step": 1}
    save_checkpoint(sys.argv[1] + "/checkpoint.pt", state, previous_step=0)
""")


def _killed_writer_leftover(folder: Path) -> Path:
    """What a kill -9 between writing a checkpoint and renaming it into place leaves."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_THE_RENAME, str(folder)],
                          cwd=REPO, env=env, capture_output=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL
    (left,) = folder.iterdir()
    return left


def test_a_kill_before_the_rename_leaves_a_full_size_temporary_named_after_its_writer(tmp_path):
    left = _killed_writer_leftover(tmp_path)
    assert left.name.startswith(".checkpoint.pt.") and left.name.endswith(".tmp")
    assert left.stat().st_size > 2_000_000  # the whole checkpoint, verified
    pid = int(left.name.split(".")[3])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # its writer is gone
    assert remove_stale_temporaries(tmp_path, {CHECKPOINT}) == [left.name]
    assert list(tmp_path.iterdir()) == []


def test_only_our_temporaries_of_writers_that_are_gone_are_removed(tmp_path):
    left = _killed_writer_leftover(tmp_path)
    dead = left.name.split(".")[3]
    live = {f".checkpoint.pt.1.{left.name.split('.')[4]}.tmp",  # pid 1 exists
            f".config.json.{os.getpid()}.abcd1234.tmp"}          # this process's own
    foreign = {f".notes.{dead}.abcd1234.tmp",  # not a file name of ours
               ".checkpoint.pt.verify.bak", "checkpoint.pt.12.abcd1234.tmp"}
    legacy = {".checkpoint.pt.verify", "..checkpoint.pt.verify.ab_d1234.tmp",
              ".config.json.abcd1234.tmp"}  # written before the pid was in the name
    for name in live | foreign | legacy:
        (tmp_path / name).write_text("x")
    names = {CHECKPOINT, "config.json"}
    assert remove_stale_temporaries(tmp_path, names) == [left.name]
    assert {p.name for p in tmp_path.iterdir()} == live | foreign | legacy
    # holding the directory's lock proves that no writer of ours is at work in it
    assert remove_stale_temporaries(tmp_path, names, locked=True) == sorted(
        (live | legacy) - {f".config.json.{os.getpid()}.abcd1234.tmp"})
    assert {p.name for p in tmp_path.iterdir()} == foreign | {
        f".config.json.{os.getpid()}.abcd1234.tmp"}
