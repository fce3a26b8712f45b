"""ManifoldMuon under DDP: sharded == replicated bit for bit, == one process within 1e-6.

Two 2-process gloo jobs (module-scoped fixtures; the workers live in
``tests/distributed/workers.py``) train DDP copies of a small float64 chain of Stiefel, DGram and
Euclidean matrices, and a tiny GPT with ``build_optimizer``; the parent runs the same code in a
plain process as the single-process reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp._common_utils import _set_fsdp_flattened

from manifoldlib.distributed import UnsupportedParameterError, run_workers
from manifoldlib.optim import Distribution, ManifoldMuon, build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import workers  # after the path insert; the spawned workers import it by this name too

WORLD_SIZE = 2
STEPS = 10
JOB_TIMEOUT_S = 180.0
#: "warm": the defaults (warm-started dual solves; on the CPU these narrow matrices take the
#: sync-free products path); "cold": warm_start=False; "eigh": the early-stopping eigh path;
#: "plain": the products path without smoothing, so that the tall Stiefel pair (16, 8) and (8, 16)
#: is one bank of the plain dual (sharded: each rank solves the members it owns, a bank of one).
#: All are compared with a single process, whose gradients differ from DDP's by all-reduce rounding.
OPTION_SETS = {
    "warm": {},
    "cold": {"dual": {"warm_start": False}},
    "eigh": {"dual": {"spectral": "eigh"}},
    "plain": {"dual": {"spectral": "products", "smoothing": None}},
}
MODES = ("sharded", "replicated")


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_workers(workers.muon_ddp_jobs, WORLD_SIZE, STEPS, OPTION_SETS,
                       timeout=JOB_TIMEOUT_S, collective_timeout=120.0)


@pytest.fixture(scope="module")
def single() -> dict:
    return {name: workers.muon_ddp_job(0, STEPS, o) for name, o in OPTION_SETS.items()}


@pytest.fixture(scope="module")
def combined() -> list[dict]:
    return run_workers(workers.combined_ddp_job, WORLD_SIZE, 5, timeout=JOB_TIMEOUT_S,
                       collective_timeout=120.0)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_a_sharded_step_checks_the_ranks_layout_once_and_then_reads_nothing_back(reports: list[dict]) -> None:
    # the first step of a plan checks that every rank passed the same shapes, dtypes and owners
    # (sharded_apply reads the gathered digests on the host); later steps of the sync-free
    # products path read nothing back, on every rank
    for report in reports:
        first, *later = report["sharded_step_syncs"]
        assert first >= 1
        assert later == [0] * len(later)


@pytest.mark.parametrize("options", OPTION_SETS)
def test_sharded_equals_replicated_bit_for_bit(reports: list[dict], options: str) -> None:
    for report in reports:
        run = report[options]
        assert _equal(run["weights"]["sharded"], run["weights"]["replicated"])
        assert _equal(run["resumed"]["sharded"], run["resumed"]["replicated"])


@pytest.mark.parametrize("options", OPTION_SETS)
def test_resuming_from_the_consolidated_state_dict_is_exact(
    reports: list[dict], options: str
) -> None:
    for report in reports:
        for mode in MODES:
            run = report[options]
            assert _equal(run["resumed"][mode], run["continued"][mode]), mode
            assert not _equal(run["resumed"][mode], run["weights"][mode])  # it did step on


@pytest.mark.parametrize("options", OPTION_SETS)
def test_every_rank_holds_identical_parameters(reports: list[dict], options: str) -> None:
    first, second = (report[options] for report in reports)
    for mode in MODES:
        assert _equal(first["weights"][mode], second["weights"][mode])
        assert _equal(first["resumed"][mode], second["resumed"][mode])


@pytest.mark.parametrize("options", OPTION_SETS)
def test_ddp_matches_one_process_within_1e_6_after_ten_steps(
    reports: list[dict], single: dict, options: str
) -> None:
    reference = single[options]
    initial = [p.detach() for p in workers.MuonNet().weights]
    for report in reports:
        for mode in MODES:
            assert _max_diff(report[options]["weights"][mode], reference["weights"][mode]) <= 1e-6
    # the tolerance is far below the distance travelled
    moved = [float((w - w0).abs().max()) for w, w0 in zip(reference["weights"]["sharded"], initial)]
    assert min(moved) > 1e-2


@pytest.mark.parametrize("options", OPTION_SETS)
def test_the_owner_holds_a_matrix_state_and_every_rank_its_momentum(reports: list[dict], options: str) -> None:
    owners = reports[0][options]["owners"]
    assert all(report[options]["owners"] == owners for report in reports)
    assert set(owners) == set(range(WORLD_SIZE))  # both ranks solve something
    manifolds = [m for _, m in workers.MUON_LAYERS]
    for rank, report in enumerate(reports):
        run = report[options]
        for i, (held, replicated) in enumerate(zip(run["held"], run["held_replicated"])):
            solved = {"dual_correction", "dual_iterations", "dual_residual"} if manifolds[i] != "euclidean" else set()
            assert solved | {"momentum_buffer", "skipped_steps"} <= set(replicated), (i, replicated)
            if owners[i] == rank:
                assert set(held) == set(replicated), (rank, i, held)  # what one process holds
            else:
                assert set(held) == {"momentum_buffer"}, (rank, i, held)  # replicated on every rank


@pytest.mark.parametrize("options", OPTION_SETS)
def test_consolidation_gives_every_rank_the_whole_state(reports: list[dict], options: str) -> None:
    # skipped_steps and retraction_residual too (before 2026-12-06 they stayed on the owner, and a
    # checkpoint saved by rank 0 lost the skip counts of rank 1's matrices)
    for report in reports:
        run = report[options]
        for i, (after, replicated) in enumerate(zip(run["held_after"], run["held_replicated"])):
            assert set(after) == set(replicated), (i, after, replicated)


def _assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        other = b["state"][index]
        assert state.keys() == other.keys(), index
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[key]), (index, key)
            else:
                assert value == other[key], (index, key)


@pytest.mark.parametrize("options", OPTION_SETS)
def test_the_consolidated_state_agrees_with_the_replicated_one_where_it_is_shared(
    reports: list[dict], options: str
) -> None:
    # every entry the consolidated sharded state dict has equals the replicated one's bit for bit
    for report in reports:
        sharded, replicated = (report[options]["state_dicts"][m] for m in MODES)
        assert sharded["param_groups"] == replicated["param_groups"]
        assert sharded["state"].keys() == replicated["state"].keys()
        for index, state in sharded["state"].items():
            assert "momentum_buffer" in state, index
            for key, value in state.items():
                assert torch.equal(value, replicated["state"][index][key]), (index, key)


def test_consolidation_keeps_the_dtype_of_the_dual_residual(reports: list[dict]) -> None:
    # (before 2026-12-06 consolidation stored every dual_residual as float32)
    for report in reports:
        sharded, replicated = (report["warm"]["state_dicts"][m] for m in MODES)
        for index, state in sharded["state"].items():
            if "dual_residual" in state:
                assert state["dual_residual"].dtype == replicated["state"][index]["dual_residual"].dtype, index


@pytest.mark.parametrize("options", OPTION_SETS)
def test_consolidated_state_dict_equals_the_replicated_one(
    reports: list[dict], options: str
) -> None:
    for report in reports:
        states = report[options]["state_dicts"]
        _assert_state_dicts_equal(states["sharded"], states["replicated"])


def test_build_optimizer_under_ddp(combined: list[dict]) -> None:
    single = workers.combined_ddp_job(0, 5)
    first, second = combined
    assert first["kinds"]["sharded"] == ["dgram", "stiefel"]  # attention, MLP
    for mode in MODES:
        assert first["params"][mode].keys() == single["params"][mode].keys()
        for name, value in first["params"][mode].items():
            assert torch.equal(value, second["params"][mode][name]), (mode, name)  # ranks agree
            assert torch.equal(value, first["params"]["replicated"][name]), name  # modes agree
            assert torch.allclose(value, single["params"][mode][name], rtol=0, atol=1e-6), name
    assert first["state_sizes"]["sharded"] == first["state_sizes"]["replicated"] > 0


# ---- single process: options, guards, pass-through -----------------------------------------


def test_bad_distribution_options_name_the_value() -> None:
    w = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="distribution mode must be one of replicated, sharded, got 'zero'"):
        ManifoldMuon([w], distribution="zero")
    with pytest.raises(ValueError, match="distribution strategy must be one of .*, got 'x'"):
        ManifoldMuon([w], distribution={"mode": "sharded", "strategy": "x"})
    with pytest.raises(TypeError, match=r"unknown distribution option\(s\) \['shard_strategy'\]"):
        ManifoldMuon([w], distribution={"mode": "sharded", "shard_strategy": "size"})
    with pytest.raises(TypeError, match="distribution must be None, a mode name, a dict or a Distribution, got int"):
        ManifoldMuon([w], distribution=2)


def test_fsdp_flattened_parameters_are_refused_at_construction() -> None:
    w = torch.nn.Parameter(torch.randn(6, 4))
    _set_fsdp_flattened(w)
    with pytest.raises(UnsupportedParameterError, match="'blocks.0.attn.q' was flattened by FSDP"):
        ManifoldMuon([{"params": [w], "param_names": ["blocks.0.attn.q"], "manifold": "stiefel"}])


def test_sharded_mode_in_one_process_is_the_plain_step() -> None:
    nets = [workers.MuonNet(), workers.MuonNet()]
    opts = [workers.make_muon(nets[0]), workers.make_muon(nets[1], distribution="sharded")]
    workers._train_steps(list(zip(nets, opts)), 3, slice(None))
    assert _equal(list(nets[0].weights), list(nets[1].weights))
    opts[1].consolidate_state_dict()  # nothing to share: a no-op
    _assert_state_dicts_equal(opts[1].state_dict(), opts[0].state_dict())


@pytest.mark.parametrize("distribution", [{"mode": "sharded", "strategy": "round-robin"},
                                          Distribution("sharded", strategy="round-robin")])
def test_build_optimizer_passes_the_distribution_through(distribution) -> None:
    model = workers.MuonNet().float()
    model.attn = torch.nn.Linear(4, 4, bias=False)
    opt = build_optimizer(model, policy="all-stiefel", distribution=distribution)
    muon = opt.optimizers["muon"]
    assert muon.distribution == Distribution(mode="sharded", process_group=None, strategy="round-robin")
    assert ManifoldMuon([torch.nn.Parameter(torch.randn(4, 3))], distribution="sharded").distribution == \
        Distribution("sharded")
    opt.consolidate_state_dict()  # forwards to ManifoldMuon; a no-op in one process
