"""The trainer at scale, in tiny: gradient accumulation, mixed precision, compile, throughput,
the gpt2-small preset, and the newcomer's view of the CLI."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
import warnings

import pytest
import torch

from manifoldlib.optim import build_optimizer
from manifoldlib.optim.builder import adamw_param_groups
from models.config import PRESETS, build_config
from models.data import eval_batches
from models.evaluation import diagnostics, evaluate
from models.gpt import GPT
from models.job import Job
from models.precision import Precision
from models.throughput import Throughput, flops_per_token, peak_flops
from models.train import build_model, build_train_optimizer, main, read_metrics, train_step

CPU = torch.device("cpu")
COMPARED = ("step", "train_loss", "val_loss", "lr", "tokens", "grad_norm")


def _quiet(*args: str) -> list[str]:
    return ["--preset", "smoke", "--sample_tokens", "0", "--progress", "false", *args]


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in COMPARED} == {k: rb.get(k) for k in COMPARED}


# ---- gradient accumulation ------------------------------------------------------------------


@pytest.mark.parametrize("connection", ["pre-ln", "spheret"])
def test_grad_accumulation_takes_the_big_batch_step_in_float64(connection):
    """K micro-steps of B/K rows give the optimizer the gradient of the B-row batch: with SGD
    at lr 1 the parameters move by exactly that gradient, so they agree to rounding."""
    torch.manual_seed(0)
    cfg = build_config("smoke", overrides={"connection": connection, "grad_clip": "0"})
    model = build_model(cfg, vocab_size=256).double()
    x = torch.randint(0, 256, (cfg.batch_size, cfg.block_size))
    y = torch.randint(0, 256, (cfg.batch_size, cfg.block_size))
    after, losses = {}, {}
    for k in (1, 2, 8):
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=1.0)
        losses[k], norm, _ = train_step(trained, opt, x, y, cfg.replace(grad_accum_steps=k),
                                        Job(0, 1, CPU), Precision("float32", CPU))
        assert math.isfinite(norm) and norm > 0
        after[k] = [p.detach().clone() for p in trained.parameters()]
    moved = max(float((a - p.detach()).abs().max()) for a, p in zip(after[1], model.parameters()))
    assert moved > 1e-3  # the step is not empty
    for k in (2, 8):
        assert losses[k] == pytest.approx(losses[1], rel=1e-13)
        for a, b in zip(after[1], after[k]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_grad_accumulation_through_the_cli_matches_one_batch(tmp_path):
    assert main([*_quiet("--steps", "10", "--out", str(tmp_path / "k1"))]) == 0
    assert main([*_quiet("--steps", "10", "--grad_accum_steps", "4",
                         "--out", str(tmp_path / "k4"))]) == 0
    a, b = read_metrics(tmp_path / "k1" / "metrics.jsonl"), read_metrics(tmp_path / "k4" /
                                                                          "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] and a[-1]["tokens"] == b[-1]["tokens"]
    assert a[0]["step"] == 0  # the same initial model, evaluated in 1 and in 4 chunks
    assert b[0]["val_loss"] == pytest.approx(a[0]["val_loss"], abs=1e-5)
    for ra, rb in zip(a[1:], b[1:]):  # float32 rounding of a different summation order only
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], abs=2e-4)


def test_batch_size_must_split_into_the_micro_steps():
    with pytest.raises(ValueError, match="batch_size 8 is not divisible by grad_accum_steps 3"):
        build_config("smoke", overrides={"grad_accum_steps": "3"})


class _RecordingModel(torch.nn.Module):
    """A model that records the number of sequences of each forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.rows = model, []

    def forward(self, x, y):
        self.rows.append(len(x))
        return self.model(x, y)


def test_evaluation_chunks_are_one_ranks_micro_batch():
    """Every rank evaluates the whole batch, in chunks of the micro-batch it trains on,
    ``batch_size / (grad_accum_steps * world_size)``: not ``world_size`` times larger (which
    runs out of memory where training fits); the loss is the same mean."""
    from models.data import load_corpus

    cfg = build_config("smoke", overrides={"batch_size": 8, "grad_accum_steps": 2,
                                           "eval_batches": 1})
    corpus = load_corpus(cfg.corpus)
    torch.manual_seed(0)
    model = _RecordingModel(build_model(cfg, corpus.vocab_size))
    one = evaluate(model, corpus, cfg, CPU)
    assert model.rows == [4, 4]
    model.rows.clear()
    two = evaluate(model, corpus, cfg, CPU, world_size=2)
    assert model.rows == [2, 2, 2, 2]
    assert two == pytest.approx(one, rel=1e-6)


# ---- mixed precision, compile ---------------------------------------------------------------


def test_bfloat16_autocast_trains_and_is_recorded(tmp_path):
    out = tmp_path / "bf16"
    assert main([*_quiet("--steps", "20", "--dtype", "bfloat16", "--out", str(out))]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    evals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert all(math.isfinite(v) for v in evals) and evals[-1] < evals[0] < math.log(256)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "summary.json").read_text())["dtype"] == "bfloat16"


def test_bfloat16_autocast_runs_the_matmuls_in_bfloat16():
    cfg = build_config("smoke")  # spheret: its row kernels are operators dynamo captures
    model = build_model(cfg, vocab_size=256)
    x = torch.randint(0, 256, (2, cfg.block_size))
    with Precision("bfloat16", CPU).autocast():
        logits, _ = model(x, x)
    assert logits.dtype == torch.bfloat16
    with Precision("float32", CPU).autocast():
        assert model(x, x)[0].dtype == torch.float32


@pytest.mark.parametrize("extra", [
    ["--dtype", "bfloat16", "--grad_accum_steps", "2"],
    ["--dtype", "float16", "--dropout", "0.1"],
])
def test_resume_is_exact_with_the_new_options(tmp_path, extra):
    common = _quiet("--steps", "12", "--eval_interval", "4", "--log_interval", "2", *extra)
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--stop_at", "8", "--out", str(tmp_path / "b")]) == 0
    assert main(["--resume", "--out", str(tmp_path / "b")]) == 0
    _same_rows(read_metrics(tmp_path / "a" / "metrics.jsonl"),
               read_metrics(tmp_path / "b" / "metrics.jsonl"))
    ckpt = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert ckpt["config"]["dtype"] == extra[1]
    assert ("scale" in ckpt["scaler"]) == (extra[1] == "float16")


def test_resume_refuses_a_different_dtype_or_compile(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "10", "--stop_at", "5", "--out", str(out))]) == 0
    capsys.readouterr()
    assert main(["--resume", "--dtype", "bfloat16", "--out", str(out)]) == 2
    assert "dtype ('float32' -> 'bfloat16')" in capsys.readouterr().err
    assert main(["--resume", "--compile", "true", "--out", str(out)]) == 2
    assert "compile (False -> True)" in capsys.readouterr().err


def test_float16_loss_scaling_skips_an_overflowing_step():
    """A gradient that overflows under the loss scale leaves the parameters as they were and
    halves the scale (GradScaler), instead of stopping the run as divergent."""
    cfg = build_config("smoke", overrides={"connection": "pre-ln"})
    model = build_model(cfg, vocab_size=256)
    before = [p.detach().clone() for p in model.parameters()]
    precision = Precision("float16", CPU)
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)  # overflows at once
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.block_size))
    loss, norm, _ = train_step(model, opt, x, x, cfg, Job(0, 1, CPU), precision)
    assert math.isfinite(loss) and not math.isfinite(norm)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert precision.state_dict()["scale"] == 2.0**119


@pytest.mark.slow
def test_the_compiled_model_agrees_with_the_eager_one():
    """torch.compile of the reference GPT (the sphere residual's C++ kernels inside) gives the
    eager loss and gradients."""
    torch.manual_seed(0)
    cfg = build_config("smoke")
    model = build_model(cfg, vocab_size=256)
    compiled = torch.compile(copy.deepcopy(model))
    x = torch.randint(0, 256, (4, cfg.block_size))
    _, loss = model(x, x)
    loss.backward()
    _, loss_c = compiled(x, x)
    loss_c.backward()
    assert loss_c.item() == pytest.approx(loss.item(), rel=1e-5)
    for (name, p), pc in zip(model.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_model_compiles_without_a_graph_break():
    """The token-id check reads values (a host sync and a graph break); the compiled forward
    leaves it out, so dynamo captures the whole model as one graph (``fullgraph=True``)."""
    torch.manual_seed(0)
    cfg = build_config("smoke")  # spheret: its row kernels are operators dynamo captures
    model = build_model(cfg, vocab_size=256)
    x = torch.randint(0, 256, (2, cfg.block_size))
    _, loss = torch.compile(model, backend="eager", fullgraph=True)(x, x)
    assert loss.item() == pytest.approx(model(x, x)[1].item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        model(x + 256, x)  # eager still checks


# ---- throughput -----------------------------------------------------------------------------


def test_flops_per_token_and_peaks():
    assert flops_per_token(1000, 2, 16, 8) == 6 * 1000 + 12 * 2 * 16 * 8
    assert peak_flops(CPU, "bfloat16") is None
    assert peak_flops(CPU, "float32", given=1e12) == 1e12
    meter = Throughput(tokens_per_step=100, flops_per_token=10.0, peak=1e3, world_size=2,
                       device=CPU)
    meter.add_step(0.0)
    report = meter.report()
    assert report["tokens_per_s"] > 0 and report["optimizer_share"] == 0.0
    assert report["mfu"] == pytest.approx(report["tokens_per_s"] * 10.0 / 2e3)
    assert meter.report()["tokens_per_s"] == 0.0  # started over


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", None), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA A10", None)])
def test_the_peak_table_matches_whole_device_names(monkeypatch, name, peak):
    """A key matches a whole word of the device name: an L40 is not an L4."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), "bfloat16") == peak


def test_metrics_carry_throughput_and_mfu_with_a_given_peak(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "10", "--peak_flops", "1e12", "--out", str(out))]) == 0
    initial, *rows = read_metrics(out / "metrics.jsonl")  # step 0: evaluated, not trained
    assert initial["step"] == 0 and "tokens_per_s" not in initial
    assert rows and all(r["tokens_per_s"] > 0 and 0 <= r["optimizer_share"] < 1
                        and 0 < r["mfu"] < 1 for r in rows)
    assert "mfu" not in read_metrics(_run_plain(tmp_path))[-1]  # CPU: no peak, no MFU


@pytest.mark.parametrize("tied", [True, False])
def test_mfu_counts_the_products_and_not_the_embedding_lookups(tmp_path, tied):
    """MFU's :math:`6N + 12LTd` counts the parameters that do products: untied, the token
    embedding is a lookup and does not count; tied, it is the LM head's matrix and counts."""
    out = tmp_path / "run"
    assert main([*_quiet("--steps", "2", "--eval_interval", "2", "--eval_batches", "1",
                         "--tie_weights", str(tied).lower(), "--peak_flops", "1e12",
                         "--out", str(out))]) == 0
    row = read_metrics(out / "metrics.jsonl")[-1]
    cfg = build_config("smoke", overrides={"tie_weights": str(tied).lower()})
    model = build_model(cfg, vocab_size=256)
    lookups = model.wpe.weight.numel() + (0 if tied else model.wte.weight.numel())
    n = sum(p.numel() for p in model.parameters()) - lookups
    assert model.num_params() == n
    assert row["mfu"] * 1e12 / row["tokens_per_s"] == pytest.approx(
        flops_per_token(n, cfg.n_layer, cfg.block_size, cfg.n_embd), rel=1e-9)


def _run_plain(tmp_path):
    out = tmp_path / "plain"
    assert main([*_quiet("--steps", "5", "--out", str(out))]) == 0
    return out / "metrics.jsonl"


# ---- one AdamW grouping ---------------------------------------------------------------------


def test_one_adamw_grouping_for_the_trainer_and_the_library_builder():
    cfg = build_config("smoke", overrides={"connection": "pre-ln"})
    model = build_model(cfg, vocab_size=256)
    expected = adamw_param_groups(model.named_parameters(), 0.1)
    assert [len(g["params"]) for g in expected] == [
        sum(p.dim() >= 2 for p in model.parameters()), sum(p.dim() < 2 for p in model.parameters())]
    opt, _ = build_train_optimizer(model, cfg)
    assert [g["param_names"] for g in opt.param_groups] == [g["param_names"] for g in expected]
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.weight_decay, 0.0]
    library = build_optimizer(model, policy=lambda name, module, param: None, weight_decay=0.1)
    assert [g["param_names"] for g in library.param_groups] == [g["param_names"] for g in expected]


# ---- the gpt2-small preset ------------------------------------------------------------------


@pytest.mark.parametrize("connection", ["spheret", "pre-ln"])
def test_gpt2_small_preset_has_the_gpt2_small_parameter_count(connection):
    cfg = build_config("gpt2-small", overrides={"connection": connection})
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size) == (12, 768, 12, 1024)
    with torch.device("meta"):  # no 124M allocation
        model = build_model(cfg, vocab_size=50257)
    d, layers = 768, 12
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert matrices == 50257 * d + 1024 * d + layers * 12 * d * d  # wte (tied), wpe, blocks
    total = sum(p.numel() for p in model.parameters())
    assert total == pytest.approx(124e6, rel=0.005)
    if connection == "pre-ln":  # two LayerNorm gains per block and the final one, no biases
        assert total - matrices == (2 * layers + 1) * d
    assert cfg.batch_size * cfg.block_size == 491_520 and cfg.grad_accum_steps == 40


def test_every_preset_builds():
    for name in PRESETS:
        assert build_config(name).steps == PRESETS[name]["steps"]


# ---- the newcomer's view --------------------------------------------------------------------


@pytest.mark.parametrize("preset, shown", [
    (None, ["optimizer='manifold-muon'", "policy='unconstrained'", "steps=600"]),
    ("smoke", ["steps=30", "corpus='synthetic:60000'"]),
])
def test_help_shows_the_values_of_the_preset_it_runs(capsys, preset, shown):
    argv = ["--help"] if preset is None else ["--preset", preset, "--help"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    text = capsys.readouterr().out.replace("\n  ", " ")
    assert all(s in text for s in shown), text


def test_a_config_files_preset_is_the_one_help_shows_and_the_run_directory_names(tmp_path, capsys,
                                                                                monkeypatch):
    # --help and the default --out read the --config file's preset key as the run does (both
    # showed and wrote the default preset's: a smoke run from a file landed in runs/default)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fast.toml").write_text('preset = "smoke"\nsteps = 2\nsample_tokens = 0\n')
    with pytest.raises(SystemExit):
        main(["--config", "fast.toml", "--help"])
    text = capsys.readouterr().out.replace("\n  ", " ")
    assert "with the values of preset 'smoke' and config file fast.toml:" in text
    assert "steps=2" in text and "corpus='synthetic:60000'" in text
    assert main(["--config", "fast.toml"]) == 0
    assert (tmp_path / "runs" / "smoke" / "summary.json").exists()
    assert not (tmp_path / "runs" / "default").exists()
    # a file without a preset key starts from the dataclass defaults: named after the file
    (tmp_path / "plain.toml").write_text('steps = 2\nsample_tokens = 0\ncorpus = "synthetic:60000"\n'
                                         'n_layer = 1\nn_embd = 16\nn_head = 2\nblock_size = 16\n'
                                         'batch_size = 4\neval_interval = 2\n')
    with pytest.raises(SystemExit):
        main(["--config", "plain.toml", "--help"])
    assert "with the values of the dataclass defaults and config file plain.toml:" in capsys.readouterr().out
    assert main(["--config", "plain.toml"]) == 0
    assert (tmp_path / "runs" / "plain" / "summary.json").exists()


def test_progress_lines_without_a_terminal_and_the_resume_hint(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--preset", "smoke", "--sample_tokens", "0", "--steps", "10", "--stop_at", "6",
            "--progress_interval", "0", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "step 1/6: train " in text and "step 6/6: train " in text
    assert f"stopped at step 6 of 10; continue with: python -m models.train --resume --out {out}" \
        in text


def test_tensorboard_logging_is_optional(tmp_path):
    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*_quiet("--steps", "5", "--log", "tensorboard", "--out", str(out))]) == 0
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        assert any("tensorboard package" in str(w.message) for w in caught)
        assert not (out / "tensorboard").exists()
    else:
        assert any((out / "tensorboard").iterdir())
    assert read_metrics(out / "metrics.jsonl")


def test_a_run_without_matplotlib_finishes_without_its_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    out = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="loss.png needs the matplotlib package"):
        assert main([*_quiet("--steps", "5", "--eval_interval", "5", "--out", str(out))]) == 0
    assert "done: val loss" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["finished"]
    assert not (out / "loss.png").exists()


def test_diagnostics_cover_attention_angles_and_weight_tails():
    cfg = build_config("smoke")  # a spheret model
    from models.data import load_corpus

    corpus = load_corpus(cfg.corpus)
    model = GPT(dataclasses.replace(cfg.model, vocab_size=256))
    out = diagnostics(model, corpus, cfg, CPU)
    for key in ("q_spectral_norm_max", "k_spectral_norm_max", "max_attention_logit",
                "attention_entropy_min", "attention_max_prob", "step_angle_mean",
                "step_angle_max", "weight_kurtosis_mean", "weight_max_over_std"):
        assert math.isfinite(out[key]), key
    assert 0 < out["attention_max_prob"] <= 1 and out["step_angle_max"] >= out["step_angle_mean"] > 0
    assert 2.0 < out["weight_kurtosis_mean"] < 4.0  # Gaussian init: 3
    off_sphere = diagnostics(GPT(dataclasses.replace(cfg.model, vocab_size=256,
                                                     connection="pre-ln")), corpus, cfg, CPU)
    assert "step_angle_mean" not in off_sphere and "attention_entropy_min" in off_sphere
    assert "keel_branch_ratio_max" not in off_sphere and "keel_branch_ratio_max" not in out
    keel = GPT(dataclasses.replace(cfg.model, vocab_size=256, connection="keel"))
    x, _ = next(eval_batches(corpus.val, min(cfg.batch_size, 4), cfg.block_size, 1))
    assert diagnostics(keel, corpus, cfg, CPU)["keel_branch_ratio_max"] == pytest.approx(
        max(keel.keel_branch_ratios(x)[1:]), rel=1e-6)  # the first sub-layer's left out


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_diagnostics_of_a_non_finite_attention_weight_are_none_not_a_traceback(bad):
    """One entry of the last block's q map NaN: the spectral norm's SVD raised LinAlgError (did
    not converge). With inf it returned NaN on CPU, and Python's max() / min() kept the earlier
    blocks' finite values over the last block's NaN: the q norm, the attention statistics, the
    step angles and the weight tails read finite. Now each statistic the weight reaches is None
    (null in metrics.jsonl); the k maps' norm is still measured."""
    from models.data import load_corpus

    cfg = build_config("smoke")  # a spheret model: step angles too
    model = GPT(dataclasses.replace(cfg.model, vocab_size=256))
    with torch.no_grad():
        model.blocks[-1].attn.q.weight[0, 0] = bad
    out = diagnostics(model, load_corpus(cfg.corpus), cfg, CPU)
    for key in ("q_spectral_norm_max", "max_attention_logit", "attention_entropy_min",
                "attention_max_prob", "step_angle_max", "weight_kurtosis_mean",
                "weight_max_over_std"):
        assert key in out and out[key] is None, key
    assert math.isfinite(out["k_spectral_norm_max"])


@pytest.mark.slow
def test_compiled_training_through_the_cli_matches_eager(tmp_path):
    common = _quiet("--steps", "4", "--eval_interval", "4", "--log_interval", "1")
    assert main([*common, "--out", str(tmp_path / "eager")]) == 0
    assert main([*common, "--compile", "true", "--out", str(tmp_path / "compiled")]) == 0
    eager = read_metrics(tmp_path / "eager" / "metrics.jsonl")
    compiled = read_metrics(tmp_path / "compiled" / "metrics.jsonl")
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["compile"] is True
    assert eager[0]["step"] == compiled[0]["step"] == 0  # the initial model, evaluated
    assert compiled[0]["val_loss"] == pytest.approx(eager[0]["val_loss"], abs=1e-4)
    for a, b in zip(eager[1:], compiled[1:], strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-4)
    assert compiled[-1]["val_loss"] == pytest.approx(eager[-1]["val_loss"], abs=1e-4)


@pytest.mark.slow
def test_resume_is_exact_with_compile(tmp_path):
    common = _quiet("--steps", "6", "--eval_interval", "3", "--log_interval", "1",
                    "--compile", "true", "--dropout", "0.1")
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--stop_at", "3", "--out", str(tmp_path / "b")]) == 0
    assert main(["--resume", "--out", str(tmp_path / "b")]) == 0
    _same_rows(read_metrics(tmp_path / "a" / "metrics.jsonl"),
               read_metrics(tmp_path / "b" / "metrics.jsonl"))


@pytest.mark.slow
def test_compile_without_a_working_backend_fails_in_one_line(tmp_path):
    """A machine where torch.compile's backend cannot build (here no C++ compiler for
    inductor) gets one line naming the cause and the way out, not dynamo's traceback; the
    run, stopped before its first checkpoint, starts again without ``--compile``."""
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # nothing cached to reuse
    args = [sys.executable, "-m", "models.train", *_quiet("--steps", "2", "--compile", "true",
                                                         "--out", str(tmp_path / "run"))]
    done = subprocess.run(args, cwd=Path(__file__).parents[2], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--compile false" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert main([*_quiet("--steps", "2", "--out", str(tmp_path / "run"))]) == 0
