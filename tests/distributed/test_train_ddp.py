"""models.train under DistributedDataParallel: two gloo ranks take the single-process steps.

One 2-process job (module-scoped fixture, the workers call ``run_training`` inside the harness's
process group) runs every configuration; the parent compares it with single-process runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from manifoldlib.distributed import run_workers
from models.config import PRESETS, build_config
from models.data import BatchSampler, load_corpus
from models.train import read_metrics, run_training

try:  # tests laid out as packages
    from . import workers
except ImportError:  # pytest's default rootdir-relative import puts this folder on sys.path
    import workers

# End-to-end DDP training takes ~9 s of the default run; ManifoldMuon under DDP is checked there by
# tests/optim/test_distributed_muon.py. CI runs these (-m slow).
pytestmark = pytest.mark.slow

WORLD_SIZE = 2
JOB_TIMEOUT_S = 240.0
QUIET = {"sample_tokens": "0"}
#: float32 training: the all-reduced gradient differs from one process's by rounding only
#: (measured ~5e-7 on losses near 3 after 30 steps); any change of batch semantics moves the
#: losses by 1e-2 or more.
LOSS_ATOL = 1e-5
EXACT = ("step", "lr", "tokens")
CLOSE = ("train_loss", "val_loss", "grad_norm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ddp")
    dirs = {name: str(root / name)
            for name in ("plain", "full", "part", "odd", "muon", "muon-rep", "muon-part",
                         "accum")}
    muon = {**QUIET, "steps": "12", "eval_interval": "4", "log_interval": "2",
            "optimizer": "manifold-muon", "policy": "hetero", "lr": "0.02"}
    dropout = {**QUIET, "steps": "20", "dropout": "0.1", "eval_interval": "5"}
    jobs = [
        (QUIET, dirs["plain"], False),
        (dropout, dirs["full"], False),
        ({**dropout, "stop_at": "10"}, dirs["part"], False),
        ({**dropout, "steps": "20"}, dirs["part"], True),
        ({**QUIET, "batch_size": "7"}, dirs["odd"], False),
        (muon, dirs["muon"], False),  # muon_distributed=sharded, the default
        ({**muon, "muon_distributed": "replicated"}, dirs["muon-rep"], False),
        ({**muon, "stop_at": "8"}, dirs["muon-part"], False),
        (muon, dirs["muon-part"], True),
        ({**QUIET, "grad_accum_steps": "2"}, dirs["accum"], False),  # 2 micro-steps x 2 ranks
    ]
    reports = run_workers(
        workers.train_job, WORLD_SIZE, jobs, timeout=JOB_TIMEOUT_S, collective_timeout=120.0
    )
    single = root / "single"
    run_training(build_config("smoke", overrides=QUIET), single, echo=False)
    return {"reports": reports, "dirs": dirs, "single": single}


def _close_rows(a: list[dict], b: list[dict], atol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in EXACT} == {k: rb.get(k) for k in EXACT}
        assert ("val_loss" in ra) == ("val_loss" in rb)
        for key in CLOSE:
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], abs=atol, rel=0), (ra["step"], key)


def test_two_processes_take_the_single_process_steps(runs: dict) -> None:
    plain = Path(runs["dirs"]["plain"])
    single = runs["single"]
    _close_rows(read_metrics(single / "metrics.jsonl"), read_metrics(plain / "metrics.jsonl"),
                LOSS_ATOL)
    ddp = torch.load(plain / "checkpoint.pt", weights_only=False)
    one = torch.load(single / "checkpoint.pt", weights_only=False)
    assert ddp["world_size"] == WORLD_SIZE and len(ddp["rng_per_rank"]) == WORLD_SIZE
    assert ddp["model"].keys() == one["model"].keys()
    for name, value in one["model"].items():
        torch.testing.assert_close(ddp["model"][name], value, rtol=0, atol=1e-5, msg=name)
    # the parameters really moved: the tolerance is far below the training signal
    initial = build_config("smoke", overrides=QUIET)
    assert read_metrics(plain / "metrics.jsonl")[-1]["train_loss"] < math.log(256) - 1.0
    assert initial.batch_size % WORLD_SIZE == 0


def test_every_rank_reports_the_same_run(runs: dict) -> None:
    rank0, rank1 = (report["summaries"][0] for report in runs["reports"])
    single = json.loads((runs["single"] / "summary.json").read_text())
    on_disk = json.loads((Path(runs["dirs"]["plain"]) / "summary.json").read_text())
    assert rank0["world_size"] == rank1["world_size"] == on_disk["world_size"] == WORLD_SIZE
    assert single["world_size"] == 1
    assert rank0["val_loss"] == rank1["val_loss"] == on_disk["val_loss"]
    assert rank0["tokens"] == single["tokens"] == PRESETS["smoke"]["steps"] * \
        PRESETS["smoke"]["batch_size"] * PRESETS["smoke"]["block_size"]
    assert rank0["batch_size_per_rank"] == PRESETS["smoke"]["batch_size"] // WORLD_SIZE


def test_each_rank_trains_on_its_slice_of_the_global_batch(runs: dict) -> None:
    cfg = build_config("smoke", overrides=QUIET)
    corpus = load_corpus(cfg.corpus, val_fraction=cfg.val_fraction)
    x, _ = BatchSampler(corpus.train, cfg.batch_size, cfg.block_size, cfg.seed).next_batch()
    half = cfg.batch_size // WORLD_SIZE
    for rank, report in enumerate(runs["reports"]):
        assert report["input_rows"] == [half // 2, half]  # the accum run's micro-shards, the rest
        assert torch.equal(report["first_inputs"][0], x[rank * half : (rank + 1) * half])


def test_resume_with_dropout_is_exact_under_ddp(runs: dict) -> None:
    full, part = Path(runs["dirs"]["full"]), Path(runs["dirs"]["part"])
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, *range(5, 21, 5)]  # the initial evaluation first
    _close_rows(a, b, atol=0.0)  # bit for bit: data order and per-rank dropout RNG restored
    state_a = torch.load(full / "checkpoint.pt", weights_only=False)["model"]
    state_b = torch.load(part / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_manifold_muon_sharded_equals_replicated_and_resumes_exactly(runs: dict) -> None:
    sharded, replicated, part = (Path(runs["dirs"][k]) for k in ("muon", "muon-rep", "muon-part"))
    rows = read_metrics(sharded / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, *range(2, 13, 2)]  # the initial evaluation first
    _close_rows(rows, read_metrics(replicated / "metrics.jsonl"), atol=0.0)
    _close_rows(rows, read_metrics(part / "metrics.jsonl"), atol=0.0)  # sharded state resumed
    saved = torch.load(part / "checkpoint.pt", weights_only=False)
    # consolidated before saving: rank 0's checkpoint holds every matrix's dual state
    corrections = [s for s in saved["optimizer"]["state"].values() if "dual_correction" in s]
    muon_params = sum(len(g["params"]) for g in saved["optimizer"]["param_groups"]
                      if g.get("kind") == "muon")
    assert muon_params > 0 and len(corrections) == muon_params
    assert runs["reports"][0]["summaries"][5]["world_size"] == WORLD_SIZE


def test_indivisible_batch_size_fails_on_every_rank_with_a_clear_error(runs: dict) -> None:
    for report in runs["reports"]:
        message = report["summaries"][4]["error"]
        assert message.startswith("ConfigError: batch_size 7 is not divisible by the 2 "), message
    assert not Path(runs["dirs"]["odd"]).exists()  # refused before anything was written


def test_grad_accumulation_under_ddp_takes_the_single_process_steps(runs: dict) -> None:
    """2 micro-steps x 2 ranks (DDP synchronizing on the last micro-step only) train on the
    same global batch as one process with one step: the same losses up to rounding."""
    accum = Path(runs["dirs"]["accum"])
    _close_rows(read_metrics(runs["single"] / "metrics.jsonl"),
                read_metrics(accum / "metrics.jsonl"), LOSS_ATOL)
    assert json.loads((accum / "summary.json").read_text())["grad_accum_steps"] == 2
