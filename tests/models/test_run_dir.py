"""The run directory's checks and writers (models.run_dir), one by one."""

from __future__ import annotations

import json

import pytest
import torch

from models.config import DTYPES, RESUMABLE_FIELDS, ConfigError, build_config
from models.data import load_corpus
from models.run_dir import (
    MetricsLog,
    RunError,
    check_corpus,
    check_resumable,
    check_same_corpus,
    finished_summary,
    prepare_run,
    read_metrics,
    read_saved_config,
    resumed_rows,
    with_legacy_defaults,
)
from models.train import main


def test_check_resumable_names_every_change_outside_the_resumable_fields():
    saved = build_config("smoke")
    check_resumable(saved, saved.replace(steps=99, stop_at=5, eval_batches=1))
    assert {"steps", "stop_at", "grad_accum_steps", "peak_flops", "log"} <= RESUMABLE_FIELDS
    with pytest.raises(RunError, match=r"dtype \('float32' -> 'float16'\), n_layer \(2 -> 3\)"):
        check_resumable(saved, saved.replace(n_layer=3, dtype="float16"))
    assert DTYPES == ("float32", "bfloat16", "float16")


def test_read_saved_config_and_legacy_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"lr": 0.5}))
    assert read_saved_config(tmp_path) == {"lr": 0.5, "muon_ns_dtype": "bfloat16",
                                           "periln_embed_norm": False, "muon_weight_decay": 0.0,
                                           "tokenizer": "byte", "lr_schedule_version": 1}
    saved = {"muon_ns_dtype": "float32", "periln_embed_norm": True, "muon_weight_decay": 0.1,
             "tokenizer": "bpe", "lr_schedule_version": 2}
    assert with_legacy_defaults(saved) == saved
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(RunError, match="is not a valid configuration"):
        read_saved_config(tmp_path)


def test_prepare_run_checks_before_any_write(tmp_path):
    cfg = build_config("smoke")
    resolved, ckpt, corpus, stale = prepare_run(cfg, tmp_path / "new", False, 1, is_main=True,
                                                echo=False)
    assert ckpt is None and corpus.vocab_size == 256 and not stale
    assert resolved == cfg.replace(tokenizer="byte")  # "auto": the text corpus's own
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="not divisible by the 3 processes of this job times "
                                          "grad_accum_steps 2"):
        prepare_run(cfg.replace(grad_accum_steps=2), tmp_path / "x", False, 3, is_main=True,
                    echo=False)
    with pytest.raises(RunError, match="has no checkpoint.pt"):
        prepare_run(cfg, tmp_path / "new", True, 1, is_main=True, echo=False)


def test_a_finished_run_resumes_to_its_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--sample_tokens", "0", "--steps", "10", "--stop_at", "5",
                 "--out", str(out)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed_rows(out, 5)] == [r["step"] for r in rows] == [0, 5]
    assert [r["step"] for r in resumed_rows(out, 4)] == [0]
    assert finished_summary(out, 10, 10, echo=True)["steps"] == 5
    assert "already finished at step 10" in capsys.readouterr().out


def test_a_resume_to_steps_the_checkpoint_is_past_is_refused(tmp_path, capsys):
    """A run configured for 12 steps and stopped at 8, resumed with --steps 4 (or 8), said
    "already finished at step 8 (steps=4); nothing to do" and exited 0, though it never finished;
    a finished run resumed below its step said the same. Both are refused, naming the steps and
    what to pass; a finished run resumed at its own steps still has nothing to do."""
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--sample_tokens", "0", "--steps", "12", "--stop_at", "8",
                 "--eval_interval", "4", "--progress", "false", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    for steps, past in (("4", ", past it"), ("8", "")):
        assert main(["--resume", "--steps", steps, "--out", str(out)]) == 2
        assert capsys.readouterr().err == (
            f"error: cannot resume {out} with steps={steps}: its checkpoint is at step 8{past}, "
            f"and the run is configured for steps=12 and never got there; omit --steps (or pass "
            f"--steps 12) to finish it, or --steps above 8 to end it elsewhere\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(["--resume", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]
    capsys.readouterr()
    assert main(["--resume", "--steps", "12", "--out", str(out)]) == 0
    assert "already finished at step 12 (steps=12); nothing to do" in capsys.readouterr().out
    assert main(["--resume", "--steps", "10", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: cannot resume {out} with steps=10: its checkpoint is at step 12, past it, and "
        f"the run finished there (its steps=12); omit --steps (nothing to do) or pass --steps "
        f"above 12 to extend it\n")


@pytest.mark.parametrize("text, why", [("garbage", "Expecting value"), ("[1]", "not a JSON object"),
                                       (b"\xff", "can't decode")])
def test_a_damaged_summary_of_a_finished_run_is_a_run_error_naming_it(tmp_path, text, why):
    path = tmp_path / "summary.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(RunError, match=f"{path} is damaged .*{why}"):
        finished_summary(tmp_path, 10, 10, echo=False)


def test_corpus_checks():
    cfg = build_config("smoke")
    corpus = load_corpus(cfg.corpus)
    check_corpus(None, corpus, cfg)
    check_corpus({"corpus_fingerprint": corpus.fingerprint}, corpus, cfg)
    with pytest.raises(RunError, match="changed since the run started"):
        check_corpus({"corpus_fingerprint": "0" * 64}, corpus, cfg)
    check_same_corpus(corpus, cfg)  # one process: nothing to compare


def test_metrics_log_appends_and_keeps_rows(tmp_path):
    log = MetricsLog(tmp_path, [{"step": 1}], write=True)
    log.append({"step": 2, "train_loss": 1.5})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 2, "train_loss": 1.5}]
    assert [r["step"] for r in log.rows] == [1, 2]
    silent = MetricsLog(tmp_path / "nowhere", [], write=False)  # another rank: no file
    silent.append({"step": 3})
    assert silent.rows == [{"step": 3}] and not (tmp_path / "nowhere").exists()


def test_run_files_checkpoint_and_summary_through_a_run(tmp_path):
    """config.json, corpus.json, the checkpoint (with the loss scale) and the summary."""
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--sample_tokens", "0", "--steps", "10", "--out",
                 str(out), "--dtype", "float16"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float16" and json.loads((out / "corpus.json").read_text())
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 10 and ckpt["scaler"]["scale"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dtype"] == "float16" and summary["grad_accum_steps"] == 1
