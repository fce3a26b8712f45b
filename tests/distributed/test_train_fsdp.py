"""models.train with ``fsdp=True``: FSDP2 on two gloo ranks takes the single-process steps, and
its sharded checkpoints resume bit for bit, on another number of processes, and from the
previous checkpoint when a shard file is damaged.

One 2-process job (module-scoped fixture) runs every configuration and the clipping cases; the
parent compares it with single-process runs, and resumes two of its runs in one process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from manifoldlib.distributed import run_workers
from models.config import build_config
from models.storage import CHECKPOINT, DAMAGED_CHECKPOINT, SHARDS, load_checkpoint
from models.train import RunError, read_metrics, run_training

try:  # tests laid out as packages
    from . import train_fsdp_workers as workers
except ImportError:  # pytest's default rootdir-relative import puts this folder on sys.path
    import train_fsdp_workers as workers

# End-to-end FSDP2 training takes ~15 s of the default run; ManifoldMuon's FSDP2 steps, state and
# checkpoints are checked there by tests/distributed/test_muon_fsdp.py. CI runs these (-m slow).
pytestmark = pytest.mark.slow

WORLD_SIZE = 2
JOB_TIMEOUT_S = 300.0
#: eight steps of the smoke preset, evaluated (and checkpointed) every four
BASE = {"sample_tokens": "0", "steps": "8", "eval_interval": "4", "log_interval": "2",
        "fsdp": "true"}
#: the same with ManifoldMuon (hetero policy: Stiefel attention, DGram MLP, AdamW for the rest)
MUON = {**BASE, "optimizer": "manifold-muon", "policy": "hetero", "lr": "0.02"}
#: float32: the reduce-scattered gradient differs from one process's by rounding only; a change
#: of batch semantics moves the losses by 1e-2 or more
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-5
COMPARED = ("step", "train_loss", "val_loss", "lr", "tokens", "grad_norm")
#: (max_norm, loss scale) of the clipping cases: clipped, and squares that overflow float32
CLIP_CASES = [(0.05, 1.0), (1.0, 1e19)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fsdp")
    dirs = {name: root / name for name in ("full", "part", "accum", "moved", "from-one",
                                          "single", "muon", "muon-part", "muon-single")}
    # one process first (a group of one): the two processes resume it (1 -> 2)
    run_training(build_config("smoke", overrides={**BASE, "stop_at": "4"}), dirs["from-one"],
                 echo=False)
    jobs = [
        (BASE, str(dirs["full"]), False),
        ({**BASE, "stop_at": "4"}, str(dirs["part"]), False),
        (BASE, str(dirs["part"]), True),
        ({**BASE, "grad_accum_steps": "2"}, str(dirs["accum"]), False),
        ({**BASE, "eval_interval": "2", "stop_at": "6"}, str(dirs["moved"]), False),
        (BASE, str(dirs["from-one"]), True),
        (MUON, str(dirs["muon"]), False),
        ({**MUON, "stop_at": "4"}, str(dirs["muon-part"]), False),
        (MUON, str(dirs["muon-part"]), True),
    ]
    reports = run_workers(workers.trainer_job, WORLD_SIZE, jobs, CLIP_CASES,
                          timeout=JOB_TIMEOUT_S, collective_timeout=120.0)
    for name, overrides in (("single", BASE), ("muon-single", MUON)):
        run_training(build_config("smoke", overrides={**overrides, "fsdp": "false"}),
                     dirs[name], echo=False)
    return {"reports": reports, "dirs": dirs}


def _rows(out: Path) -> list[dict]:
    return [{k: r.get(k) for k in COMPARED} for r in read_metrics(out / "metrics.jsonl")]


def _close_rows(a: list[dict], b: list[dict], atol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in ("step", "lr", "tokens")} == \
            {k: rb[k] for k in ("step", "lr", "tokens")}
        for key in ("train_loss", "val_loss", "grad_norm"):
            if ra[key] is not None or rb[key] is not None:
                assert rb[key] == pytest.approx(ra[key], abs=atol, rel=0), (ra["step"], key)


def _saved_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint, whole (the shards read without a group)."""
    ckpt = torch.load(out / CHECKPOINT, weights_only=True)
    if SHARDS not in ckpt:
        return {f"model.{k}": v for k, v in ckpt["model"].items()}
    reader = dcp.FileSystemReader(out / ckpt[SHARDS]["folder"])
    template = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
                for name, meta in reader.read_metadata().state_dict_metadata.items()}
    dcp.load(template, storage_reader=reader, no_dist=True)
    return template


def _assert_close_models(a: Path, b: Path, atol: float) -> None:
    ta, tb = _saved_tensors(a), _saved_tensors(b)
    models = sorted(k for k in ta if k.startswith("model."))
    assert models and models == sorted(k for k in tb if k.startswith("model."))
    for name in models:
        torch.testing.assert_close(tb[name], ta[name], rtol=0, atol=atol, msg=name)


def test_two_fsdp_processes_take_the_single_process_steps(runs: dict) -> None:
    full, single = runs["dirs"]["full"], runs["dirs"]["single"]
    _close_rows(_rows(single), _rows(full), LOSS_ATOL)
    _assert_close_models(single, full, PARAM_ATOL)
    assert read_metrics(full / "metrics.jsonl")[-1]["train_loss"] < math.log(256) - 1.0
    summaries = [report["summaries"][0] for report in runs["reports"]]
    assert summaries[0]["val_loss"] == summaries[1]["val_loss"]
    assert summaries[0]["world_size"] == WORLD_SIZE and summaries[0]["finished"]
    assert json.loads((full / "config.json").read_text())["fsdp"] is True


def test_the_run_directory_holds_sealed_checkpoints_and_their_shard_folders(runs: dict) -> None:
    full = runs["dirs"]["full"]
    ckpt, note = load_checkpoint(full)
    assert note is None and ckpt["step"] == 8 and ckpt["world_size"] == WORLD_SIZE
    assert "model" not in ckpt and "optimizer" not in ckpt  # the tensors are in the shards
    assert set(ckpt[SHARDS]["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert ckpt["plain_state"]["optimizer"]["param_groups"]  # plain data sealed, not pickled
    # the newest and the previous checkpoint's folders, nothing else, no temporaries
    folders = sorted(p.name for p in full.iterdir() if p.is_dir())
    previous = torch.load(full / "checkpoint.prev.pt", weights_only=True)
    assert folders == sorted([ckpt[SHARDS]["folder"], previous[SHARDS]["folder"]])
    assert previous["step"] == 4
    assert not [p.name for p in full.iterdir() if p.name.startswith(".")]


def test_resume_at_the_same_world_size_is_bit_exact(runs: dict) -> None:
    full, part = runs["dirs"]["full"], runs["dirs"]["part"]
    assert _rows(part) == _rows(full)
    a, b = _saved_tensors(full), _saved_tensors(part)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.") for k in a)
    for name in a:  # parameters and optimizer state
        assert torch.equal(a[name], b[name]), name


def test_grad_accumulation_under_fsdp_takes_the_single_process_steps(runs: dict) -> None:
    accum = runs["dirs"]["accum"]
    _close_rows(_rows(runs["dirs"]["single"]), _rows(accum), LOSS_ATOL)
    assert json.loads((accum / "summary.json").read_text())["grad_accum_steps"] == 2


def test_a_run_of_one_process_resumes_on_two(runs: dict) -> None:
    resumed = runs["dirs"]["from-one"]
    _close_rows(_rows(runs["dirs"]["full"]), _rows(resumed), LOSS_ATOL)
    _assert_close_models(runs["dirs"]["full"], resumed, PARAM_ATOL)
    assert load_checkpoint(resumed)[0]["world_size"] == WORLD_SIZE


def test_a_damaged_shard_falls_back_and_a_two_process_run_resumes_in_one(
        runs: dict, capsys: pytest.CaptureFixture) -> None:
    moved = runs["dirs"]["moved"]
    newest = torch.load(moved / CHECKPOINT, weights_only=True)
    assert newest["step"] == 6
    shard = moved / newest[SHARDS]["folder"] / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit-pattern in rank 1's shard
    shard.write_bytes(bytes(data))
    summary = run_training(build_config("smoke", overrides=BASE), moved, resume=True)
    err = capsys.readouterr().err
    assert (f"shard file {newest[SHARDS]['folder']}/__1_0.distcp does not match its checksum); "
            f"resuming from the previous checkpoint checkpoint.prev.pt (step 4)") in err
    assert (moved / DAMAGED_CHECKPOINT).is_file()
    assert summary["finished"] and summary["world_size"] == 1 and summary["steps"] == 8
    _assert_close_models(runs["dirs"]["full"], moved, PARAM_ATOL)  # 2 -> 1 processes


def test_a_resume_must_keep_fsdp(runs: dict) -> None:
    full = runs["dirs"]["full"]
    cfg = build_config("smoke", overrides={**BASE, "steps": "12", "fsdp": "false"})
    with pytest.raises(RunError, match=r"fsdp \(True -> False\)"):
        run_training(cfg, full, resume=True, echo=False)
    single = runs["dirs"]["single"]
    cfg = build_config("smoke", overrides={**BASE, "steps": "12"})
    with pytest.raises(RunError, match=r"fsdp \(False -> True\)"):
        run_training(cfg, single, resume=True, echo=False)


def test_manifold_muon_under_fsdp_takes_the_single_process_steps_and_resumes_exactly(
        runs: dict) -> None:
    muon, part = runs["dirs"]["muon"], runs["dirs"]["muon-part"]
    _close_rows(_rows(runs["dirs"]["muon-single"]), _rows(muon), LOSS_ATOL)
    _assert_close_models(runs["dirs"]["muon-single"], muon, PARAM_ATOL)
    assert _rows(part) == _rows(muon)
    a, b = _saved_tensors(muon), _saved_tensors(part)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the warm starts of the Stiefel and DGram matrices travel with the shards
    corrections = [k for k in a if k.endswith(".dual_correction")]
    assert any(".attn." in k for k in corrections) and any(".mlp." in k for k in corrections)


@pytest.mark.parametrize("case", range(len(CLIP_CASES)))
def test_clipping_sharded_gradients_gives_the_single_process_norm(runs: dict, case: int) -> None:
    max_norm, _ = CLIP_CASES[case]
    for report in (r["clip"][case] for r in runs["reports"]):
        assert report["placements"] == ["()", "(Shard(dim=0),)"]  # 0-d parameters stay whole
        assert report["finite"]
        assert report["sharded_norm"] == pytest.approx(report["plain_norm"], rel=1e-6)
        assert report["plain_norm"] > max_norm  # the clip did something
        flat = torch.cat([g.flatten() for g in report["sharded_grads"].values()])
        assert float(flat.double().norm()) == pytest.approx(max_norm, rel=1e-5)
        for name, grad in report["plain_grads"].items():
            torch.testing.assert_close(report["sharded_grads"][name], grad,
                                       rtol=1e-5, atol=1e-6 * max_norm, msg=name)


def test_an_overflowing_gradient_entry_on_one_rank_stops_every_rank(runs: dict) -> None:
    """grad_clip 0: the second-moment check takes each gradient's largest entry over all ranks'
    shards (the entry is in the last rank's rows only)."""
    for report in runs["reports"]:
        assert report["overflow"].startswith("parameter 'blocks.0.attn.q.weight' has a gradient "
                                             "entry of 2e+19"), report["overflow"]


@pytest.mark.slow
def test_a_two_process_run_resumes_on_four(runs: dict, tmp_path: Path) -> None:
    """AdamW and ManifoldMuon (whose warm starts are sharded too) resharded from 2 to 4."""
    cases = {"full": (BASE, tmp_path / "adamw"), "muon": (MUON, tmp_path / "muon")}
    run_workers(workers.train_runs, 2,
                [({**overrides, "stop_at": "4"}, str(out), False) for overrides, out in
                 cases.values()], timeout=JOB_TIMEOUT_S)
    summaries = run_workers(workers.train_runs, 4,
                            [(overrides, str(out), True) for overrides, out in cases.values()],
                            timeout=JOB_TIMEOUT_S)
    for (reference, (_, out)), summary in zip(cases.items(), summaries[0]):
        assert summary["world_size"] == 4 and summary["finished"], summary
        _close_rows(_rows(runs["dirs"][reference]), _rows(out), LOSS_ATOL)
        _assert_close_models(runs["dirs"][reference], out, PARAM_ATOL)
        assert len(torch.load(out / CHECKPOINT, weights_only=True)[SHARDS]["files"]) == 5


@pytest.mark.slow
def test_fsdp_with_compile_compiles_the_sharded_model(runs: dict, tmp_path: Path) -> None:
    out = tmp_path / "compiled"
    compiled = {**BASE, "compile": "true", "steps": "8", "stop_at": "4"}
    summaries = run_workers(workers.train_runs, 2, [(compiled, str(out), False)],
                            timeout=JOB_TIMEOUT_S)
    assert "error" not in summaries[0][0], summaries[0][0]
    eager = [r for r in _rows(runs["dirs"]["full"]) if r["step"] <= 4]
    _close_rows(eager, _rows(out), 1e-4)  # inductor's fused kernels round differently
