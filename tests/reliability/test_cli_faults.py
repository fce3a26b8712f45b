"""The training CLI under faults: non-finite gradients, damaged run directories, a crafted
checkpoint, a full disk, Ctrl-C, SIGTERM and SIGHUP, kills that leave temporary files. Every run
is the smoke preset with a few steps."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import models.train as train_mod
from models.run_dir import (
    DAMAGED_CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    load_checkpoint,
    read_metrics,
    save_checkpoint,
    state_checksum,
)
from models.train import main

REPO = Path(__file__).resolve().parents[2]
COMPARED = ("step", "train_loss", "val_loss", "lr", "tokens", "grad_norm")


def _quiet(*args: str) -> list[str]:
    return ["--preset", "smoke", "--sample_tokens", "0", "--schedule", "constant",
            "--eval_interval", "5", *args]


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in COMPARED} == {k: rb.get(k) for k in COMPARED}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 20-step run: the rows every resumed run must reproduce exactly."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main([*_quiet("--steps", "20"), "--out", str(out)]) == 0
    return read_metrics(out / "metrics.jsonl")


def _poison_gradients_from(monkeypatch, step: int, factor: float = math.inf) -> list:
    """Multiply the gradient of one weight by ``factor`` (default: make it infinite) from
    training step ``step`` on (the loss stays finite); returns a list that receives the model."""
    build, models = train_mod.build_model, []

    def poisoned(cfg, vocab_size):
        model = build(cfg, vocab_size)
        calls = {"n": 0}

        def hook(grad):
            calls["n"] += 1
            return grad * factor if calls["n"] >= step else grad

        next(p for p in model.parameters() if p.dim() == 2).register_hook(hook)
        models.append(model)
        return model

    monkeypatch.setattr(train_mod, "build_model", poisoned)
    return models


# ---- non-finite gradients --------------------------------------------------------------------


def test_a_non_finite_gradient_norm_stops_before_the_step_with_status_3(tmp_path, monkeypatch,
                                                                         capsys):
    models = _poison_gradients_from(monkeypatch, 13)
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "20", "--grad_clip", "0"), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "training diverged: non-finite gradient norm (inf) at step 13" in err
    assert "last good checkpoint (step 10)" in err
    assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())  # never stepped
    assert load_checkpoint(out)[0]["step"] == 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"] and summary["steps"] == 12 and not summary["finished"]
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert last["step"] == 13 and last["grad_norm"] is None and last["diverged"] is True


def test_a_finite_gradient_whose_float32_norm_overflows_is_clipped_and_stepped(tmp_path,
                                                                                monkeypatch):
    # entries near 1e22: finite in float32, but their squares (and torch's norm) overflow
    models = _poison_gradients_from(monkeypatch, 3, factor=1e22)
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "10", "--log_interval", "1"), "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]
    norms = [r["grad_norm"] for r in read_metrics(out / "metrics.jsonl") if "grad_norm" in r]
    assert len(norms) == 10 and all(math.isfinite(n) for n in norms)
    assert all(n > 1e19 for n in norms[2:])  # measured, not overflowed
    assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())


def test_without_clipping_a_gradient_that_would_overflow_adamw_stops_the_run(tmp_path, monkeypatch,
                                                                            capsys):
    # unclipped, entries near 1e22 would make AdamW's exp_avg_sq inf and freeze the weight
    models = _poison_gradients_from(monkeypatch, 7, factor=1e22)
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "10", "--grad_clip", "0"), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "with grad_clip 0: its square overflows AdamW's float32 second moment" in err
    assert "(set --grad_clip) at step 7" in err and "last good checkpoint (step 5)" in err
    assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert last["step"] == 7 and last["diverged"] is True and last["grad_norm"] > 1e19
    assert load_checkpoint(out)[0]["step"] == 5


def test_float16_gradients_that_overflow_at_every_loss_scale_are_a_divergence(tmp_path,
                                                                              monkeypatch, capsys):
    models = _poison_gradients_from(monkeypatch, 3)  # skipped steps from 3 on: the scale halves
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "40", "--eval_interval", "10", "--dtype", "float16"),
                 "--out", str(out)]) == 3
    err = capsys.readouterr().err
    # 2**16 halved 30 times is 2**-14 < 1e-4 (fairseq's min_loss_scale): step 3 + 29
    assert "training diverged: non-finite gradients at every loss scale (the float16 loss " \
           "scale fell below 0.0001) at step 32" in err
    assert "last good checkpoint (step 30)" in err
    assert all(bool(torch.isfinite(p).all()) for p in models[0].parameters())
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert last["step"] == 32 and last["grad_norm"] is None and last["diverged"] is True


def test_a_run_that_diverges_before_its_first_checkpoint_can_be_run_again(
        tmp_path, monkeypatch, capsys, reference):
    out = tmp_path / "run"
    argv = [*_quiet("--steps", "20"), "--out", str(out)]
    _poison_gradients_from(monkeypatch, 3)
    assert main(argv) == 3
    assert "no checkpoint had been written yet" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(argv) == 0  # the same command, on the same directory
    _same_rows(read_metrics(out / "metrics.jsonl"), reference)


# ---- damaged run directories -----------------------------------------------------------------


def _stopped_at(tmp_path: Path, step: int) -> Path:
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "20", "--stop_at", str(step)), "--out", str(out)]) == 0
    return out


def test_a_bit_flipped_checkpoint_resumes_exactly_from_the_previous_one(tmp_path, capsys,
                                                                        reference):
    out = _stopped_at(tmp_path, 15)  # checkpoint.pt at step 15, checkpoint.prev.pt at 10
    path = out / "checkpoint.pt"
    weight = torch.load(path, weights_only=True)["model"]["lm_head.weight"]
    raw = bytearray(path.read_bytes())
    at = raw.find(weight.contiguous().view(torch.uint8).numpy().tobytes())
    raw[at + 7] ^= 0x01
    path.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["--resume", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "does not match its checksum); resuming from the previous checkpoint" in err
    assert (out / DAMAGED_CHECKPOINT).is_file()
    _same_rows(read_metrics(out / "metrics.jsonl"), reference)


def test_a_partial_last_metrics_line_is_repaired_on_resume(tmp_path, reference):
    out = _stopped_at(tmp_path, 10)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "train_lo')  # a kill during the append
    assert main(["--resume", "--out", str(out)]) == 0
    _same_rows(read_metrics(out / "metrics.jsonl"), reference)


def _garbage_line(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join([lines[0], "%%% garbage %%%\n", *lines[1:]])


def _loss_not_a_number(text: str) -> str:
    rows = [json.loads(line) for line in text.splitlines()]
    rows[0]["train_loss"] = "x"  # an edited file: the end-of-run plot could not draw it
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize(("damage", "line"), [(_garbage_line, 2), (_loss_not_a_number, 1)],
                         ids=["garbage-line", "loss-not-a-number"])
def test_a_damaged_metrics_row_stops_the_resume_naming_the_line(tmp_path, capsys, damage, line):
    out = _stopped_at(tmp_path, 10)
    (out / "metrics.jsonl").write_text(damage((out / "metrics.jsonl").read_text()))
    capsys.readouterr()
    assert main(["--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"metrics.jsonl line {line} is not a metrics row" in err


def test_a_deleted_config_json_is_rewritten_from_the_checkpoint_on_resume(tmp_path, reference):
    out = _stopped_at(tmp_path, 10)
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").unlink()
    assert main(["--resume", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text()) == {**saved, "stop_at": 0}
    _same_rows(read_metrics(out / "metrics.jsonl"), reference)


def test_resuming_a_finished_run_with_a_damaged_summary_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 0
    (out / "summary.json").write_text("{trunc")
    capsys.readouterr()
    assert main(["--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out / 'summary.json'} is damaged") and err.count("\n") == 1


def _reseal(out: Path, part: str, change) -> None:
    """Replace ``part`` of the run's checkpoint by ``change(part)`` and seal it again (what an
    edited checkpoint, or one of another version of the program, holds): the only one left."""
    state = load_checkpoint(out)[0]
    state[part] = change(state[part])
    (out / PREVIOUS_CHECKPOINT).unlink()
    (out / "checkpoint.pt").unlink()
    save_checkpoint(out / "checkpoint.pt", state, -1)


@pytest.mark.parametrize("part, change, needle", [
    ("model", lambda model: {**model, "wte.weight": torch.zeros(3, 3)},
     "size mismatch for wte.weight"),
    ("sampler", lambda sampler: {}, "'generator'"),
    ("optimizer", lambda opt: {"state": {}, "param_groups": []}, "parameter groups"),
])
def test_a_sealed_checkpoint_that_does_not_fit_the_model_is_one_line(tmp_path, capsys, part,
                                                                     change, needle):
    out = _stopped_at(tmp_path, 10)
    _reseal(out, part, change)
    capsys.readouterr()
    assert main(["--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot resume: the {part} state in {out}'s checkpoint does "
                          f"not fit") and needle in err and err.count("\n") == 1, err


def test_a_crafted_checkpoint_is_refused_with_one_line(tmp_path, capsys):
    out = _stopped_at(tmp_path, 10)
    marker = tmp_path / "pwned.txt"

    class Exec:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('pwned')",)

    state = torch.load(out / "checkpoint.pt", weights_only=True)
    state["sampler"] = Exec()
    torch.save(state, out / "checkpoint.pt")
    capsys.readouterr()
    assert main(["--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: refusing to load {out / 'checkpoint.pt'}: it holds objects "
                          f"other than tensors and plain data") and err.count("\n") == 1
    assert "nothing in it was run" in err
    assert not marker.exists()


@pytest.mark.parametrize("files", [{"config.json": '{"my": "own settings"}', "sample.txt": "notes"},
                                   {"sample.txt": "notes"}, {"config.json": "x"}])
def test_a_users_files_named_like_run_files_are_never_cleared(tmp_path, capsys, files):
    out = tmp_path / "mine"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    assert main([*_quiet("--steps", "5"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run directory {out} is not empty") and err.count("\n") == 1
    assert {p.name: p.read_text() for p in out.iterdir()} == files


# ---- two runs into one directory -------------------------------------------------------------


class _AnotherRun:
    """Hold the lock a training process holds on its run directory (``flock`` on the directory)."""

    def __init__(self, out: Path) -> None:
        self.fd = os.open(out, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _files(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_resuming_a_directory_another_run_is_writing_is_refused(tmp_path, capsys, reference):
    out = _stopped_at(tmp_path, 10)
    before = _files(out)
    with _AnotherRun(out):
        capsys.readouterr()
        assert main(["--resume", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: run directory {out} is in use by another run (it holds the " \
                      f"directory's lock); wait for it to end, or choose another --out\n"
        assert _files(out) == before
    assert main(["--resume", "--out", str(out)]) == 0  # the other run has ended
    _same_rows(read_metrics(out / "metrics.jsonl"), reference)


def test_a_fresh_run_leaves_the_files_of_a_run_before_its_first_checkpoint_alone(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")  # another run, still before its first checkpoint
    (out / "metrics.jsonl").write_text('{"step": 5}\n')
    before = _files(out)
    with _AnotherRun(out):
        assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 2
        assert "is in use by another run" in capsys.readouterr().err
        assert _files(out) == before


# ---- the environment -------------------------------------------------------------------------


def test_a_full_disk_exits_1_naming_the_path_and_enospc(small_tmpfs, capsys):
    out = small_tmpfs(96) / "run"  # room for the small files, not for a checkpoint
    assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}") and "No space left on device (ENOSPC)" in err
    assert err.count("\n") == 1


def test_a_full_disk_names_the_checkpoint_not_its_temporary_file(small_tmpfs, capsys):
    out = small_tmpfs(96) / "run"  # room for the small files, not for a checkpoint
    assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out / 'checkpoint.pt'}: No space left on device (ENOSPC)")


def _one_enospc_line(err: str, path: Path, kept: bool = False) -> None:
    left = "the last checkpoint is kept" if kept else "no checkpoint had been written yet"
    assert err == f"error: {path}: No space left on device (ENOSPC); {left}\n"


def test_a_full_disk_after_the_first_checkpoint_says_it_is_kept(small_tmpfs, capsys):
    out = small_tmpfs(700) / "run"  # the step-5 checkpoint (~440 KiB) fits, a second one not
    assert main([*_quiet("--steps", "10"), "--out", str(out)]) == 1
    _one_enospc_line(capsys.readouterr().err, out / "checkpoint.pt", kept=True)
    assert load_checkpoint(out)[0]["step"] == 5   # whole, and resumable


def test_a_full_disk_during_a_metrics_append_names_metrics_jsonl(small_tmpfs, capsys):
    out = small_tmpfs(12) / "run"  # config.json and corpus.json, then 4 KiB of rows
    assert main([*_quiet("--steps", "60", "--eval_interval", "60", "--log_interval", "1",
                         "--checkpoint", "false"), "--out", str(out)]) == 1
    _one_enospc_line(capsys.readouterr().err, out / "metrics.jsonl")


def test_a_full_disk_while_plotting_names_loss_png_and_leaves_no_part_of_it(small_tmpfs,
                                                                             capsys):
    pytest.importorskip("matplotlib")
    out = small_tmpfs(24) / "run"  # every file of the run but the figure
    assert main([*_quiet("--steps", "5", "--checkpoint", "false"), "--out", str(out)]) == 1
    _one_enospc_line(capsys.readouterr().err, out / "loss.png")
    assert json.loads((out / "summary.json").read_text())["finished"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "corpus.json",
                                                     "metrics.jsonl", "summary.json"]


def test_a_full_disk_while_saving_the_bpe_tokenizer_is_one_line(small_tmpfs, capsys):
    pytest.importorskip("tokenizers")
    out = small_tmpfs(12) / "run"  # config.json and corpus.json, not tokenizer.json
    assert main([*_quiet("--steps", "5", "--tokenizer", "bpe", "--bpe_vocab_size", "400"),
                 "--out", str(out)]) == 1
    _one_enospc_line(capsys.readouterr().err, out / "tokenizer.json")
    assert not (out / "tokenizer.json").exists()  # no truncated file: the write is atomic


@pytest.mark.parametrize("corpus, refused", [
    ("synthetic:60000", "train.bin"),  # 110 KB of uint16 tokens
    ("synthetic:6000", "meta.json"),   # both shards fit in 16 KiB, their metadata does not
])
def test_prepare_on_a_full_disk_is_one_line_and_leaves_no_shards_without_metadata(
        small_tmpfs, capsys, corpus, refused):
    """A folder with train.bin / val.bin and no meta.json has lost the record of its dtype and
    vocabulary: nothing is moved into place before every file has been written."""
    from models.prepare import main as prepare_main

    out = small_tmpfs(16) / "shards"
    assert prepare_main(["--corpus", corpus, "--out", str(out)]) == 1
    assert capsys.readouterr().err == \
        f"error: {out / refused}: No space left on device (ENOSPC)\n"
    assert list(out.iterdir()) == []


def test_ctrl_c_during_the_final_sample_keeps_the_summary_of_the_finished_run(tmp_path,
                                                                              monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the end-of-run sample is generated

    monkeypatch.setattr(train_mod, "generate_sample", interrupted)
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--steps", "10", "--out", str(out)]) == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 10
    assert (out / "loss.png").is_file()
    monkeypatch.undo()
    assert main(["--resume", "--out", str(out)]) == 0  # "already finished": the same summary


def _interrupt_after(out, lines: int) -> tuple[int, str]:
    """Start a long run into ``out``, send SIGINT after its first ``lines`` stdout lines (the
    corpus line, then one per evaluation, each printed just before that step's checkpoint is
    written), and return the exit status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "models.train", *_quiet("--steps", "100000"), "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("corpus ")  # training has started
        for _ in range(lines - 1):
            assert proc.stdout.readline().startswith("step ")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


@pytest.mark.slow  # a training subprocess (~5 s); the interrupt after a checkpoint below is the default run's
def test_ctrl_c_exits_130_with_one_line_and_no_traceback(tmp_path):
    code, err = _interrupt_after(tmp_path / "run", lines=1)
    assert code == 130
    assert err.strip().splitlines() == [
        "interrupted before the first checkpoint: nothing to resume; run the same command again "
        "to start over"]


def test_ctrl_c_after_a_checkpoint_says_resume_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    code, err = _interrupt_after(out, lines=4)  # "step 0", "step 5", "step 10": step 5's
    # checkpoint is written
    assert code == 130
    assert err.strip().splitlines() == ["interrupted; resume with --resume (from the last checkpoint)"]
    assert main(["--resume", "--steps", "20", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 20


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                    reason="needs the optional tokenizers package")
def test_resume_refuses_a_bpe_run_whose_token_ids_changed(tmp_path, capsys):
    """The corpus fingerprint covers the text, not a BPE's ids: a run's tokenizer.json swapped
    for another (or a tokenizers release encoding differently) would resume on other data."""
    from models.tokenizer import BPETokenizer

    out = tmp_path / "run"
    bpe = ["--tokenizer", "bpe", "--bpe_vocab_size", "300"]
    assert main([*_quiet("--steps", "10", "--stop_at", "5", *bpe), "--out", str(out)]) == 0
    own = (out / "tokenizer.json").read_bytes()
    other = BPETokenizer.train([b"zeta omega " * 400, b"lambda mu nu " * 400], 300)
    other.save(out / "tokenizer.json")
    capsys.readouterr()
    assert main(["--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot resume: the token ids of corpus 'synthetic:60000' changed")
    assert err.count("\n") == 1
    (out / "tokenizer.json").write_bytes(own)  # the run's own tokenizer: resumes
    assert main(["--resume", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 10


# ---- SIGTERM / SIGHUP: what batch schedulers send --------------------------------------------


def _every_step(*args: str) -> list[str]:
    """A run that logs and prints every step and writes no checkpoint of its own before step
    1000 (so a checkpoint at an earlier step is the one the signal made)."""
    return [*_quiet("--steps", "100000", "--eval_interval", "1000", "--log_interval", "1",
                    "--progress_interval", "0"), *args]


def _terminate_after(out: Path, signum: int, step: int) -> tuple[int, str]:
    """Start a long run into ``out``, send ``signum`` once it has printed step ``step``'s line,
    and return the exit status and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "models.train", *_every_step(), "--out",
                             str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stdout:
            if line.startswith(f"step {step}/"):
                break
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143),
                                            pytest.param(signal.SIGHUP, 129, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGHUP"])  # SIGHUP takes the same path: with -m slow
def test_a_terminating_signal_checkpoints_at_a_step_boundary_and_resume_is_exact(
        tmp_path, capsys, signum, status):
    out = tmp_path / "run"
    code, err = _terminate_after(out, signum, step=3)
    assert code == status
    name = signal.Signals(signum).name
    (line,) = err.strip().splitlines()  # one line, no traceback
    stop = re.fullmatch(rf"terminated by {name} at step (\d+): checkpoint written; resume with "
                        rf"python -m models\.train --resume --out {re.escape(str(out))}", line)
    assert stop is not None, line
    step = int(stop.group(1))
    ckpt, note = load_checkpoint(out)
    assert step >= 3 and ckpt["step"] == step and note is None
    assert read_metrics(out / "metrics.jsonl")[-1]["step"] == step
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary left
    # resumed to four steps further, it equals a run that was never stopped, bit for bit
    assert main(["--resume", "--stop_at", str(step + 4), "--out", str(out)]) == 0
    reference = tmp_path / "reference"
    assert main([*_every_step("--stop_at", str(step + 4)), "--out", str(reference)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(step + 5))
    _same_rows(rows, read_metrics(reference / "metrics.jsonl"))
    resumed, uninterrupted = load_checkpoint(out)[0], load_checkpoint(reference)[0]
    assert resumed["step"] == uninterrupted["step"] == step + 4
    for key, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    # model, optimizer, sampler, RNG states and the rest: all but the wall time are the same
    del resumed["wall_time_s"], uninterrupted["wall_time_s"]
    assert state_checksum(resumed) == state_checksum(uninterrupted)


# ---- temporary files of a killed run, removed at the next start ------------------------------

_KILLED_AT_A_RENAME = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    rename, target, count = os.replace, sys.argv[1], int(sys.argv[2])
    seen = []

    def replace(src, dst):  # SIGKILL at the count-th rename onto `target`: a kill mid-write
        if Path(dst).name == target:
            seen.append(dst)
            if len(seen) == count:
                os.kill(os.getpid(), signal.SIGKILL)
        return rename(src, dst)

    os.replace = replace
    module = sys.argv[3]
    if module == "train":
        from models.train import main
    else:
        from models.prepare import main
    main(sys.argv[4:])
""")


def _killed_at_a_rename(target: str, count: int, module: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _KILLED_AT_A_RENAME, target, str(count), module,
                           *args], cwd=REPO, env=env, capture_output=True, timeout=300,
                          check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.slow  # a killed training subprocess (~4 s); test_run_dir_faults kills checkpoint writes in the default run
def test_a_kill_during_a_checkpoint_write_leaves_a_file_the_resume_removes(tmp_path, capsys,
                                                                           reference):
    out = tmp_path / "run"
    # killed as step 10's checkpoint was about to replace step 5's (renamed to the previous one)
    _killed_at_a_rename("checkpoint.pt", 2, "train", *_quiet("--steps", "20"), "--out", str(out))
    (left,) = [p for p in out.iterdir() if p.name.startswith(".")]
    assert re.fullmatch(r"\.checkpoint\.pt\.\d+\.\w{8}\.tmp", left.name)
    assert left.stat().st_size > (out / PREVIOUS_CHECKPOINT).stat().st_size // 2  # a whole one
    (out / ".my-notes.tmp").write_text("mine")  # a user's own file is not ours to remove
    assert main(["--resume", "--out", str(out)]) == 0
    assert f"removed 1 temporary file that a killed run left in {out}: {left.name}" in \
        capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".my-notes.tmp"]
    _same_rows(read_metrics(out / "metrics.jsonl"), reference)


def test_a_killed_prepare_leaves_partial_files_the_next_start_removes(tmp_path, capsys):
    from models.prepare import main as prepare_main

    out = tmp_path / "shards"
    _killed_at_a_rename("train.bin", 1, "prepare", "--corpus", "synthetic:20000", "--out",
                        str(out))
    partials = sorted(p.name for p in out.iterdir())
    assert [re.sub(r"\.\d+\.", ".PID.", n) for n in partials] == [
        ".meta.json.PID.partial", ".train.bin.PID.partial", ".val.bin.PID.partial"]
    (out / ".train.bin.1.partial").write_text("pid 1 is alive: not provably stale")
    assert prepare_main(["--corpus", "synthetic:20000", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".train.bin.1.partial", "meta.json",
                                                     "train.bin", "val.bin"]
