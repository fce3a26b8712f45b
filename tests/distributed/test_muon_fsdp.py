"""ManifoldMuon on FSDP2's row shards (gloo, 2 and 4 processes) equals the single-process step.

The optimizer cases give every manifold and option set the same matrices and gradients as a single
process: tall, wide and square, rows not divisible by the world size (a rank with one row or none),
float32, float64 and bfloat16 in one optimizer, a ``Conv1D``-layout matrix, one non-finite
gradient, and a case where a rank owns no matrix. The model cases train a GPT under ``fully_shard``
with every ``build_optimizer`` policy, and save and resume it with ``torch.distributed.checkpoint``
on 1, 2 and 4 processes. Placements other than FSDP2's are refused, naming them.
"""

from __future__ import annotations

import pytest
import torch

from manifoldlib.distributed import assign_owners, run_workers, row_chunks

try:  # tests laid out as packages
    from . import muon_fsdp_workers as fw
except ImportError:  # pytest's default rootdir-relative import puts this folder on sys.path
    import muon_fsdp_workers as fw

JOB_TIMEOUT_S = 240.0
POLICIES = ("hetero", "hetero-inv", "all-stiefel", "all-dgram", "unconstrained")
CASES_2 = [(m, o, None) for m in fw.MANIFOLDS for o in fw.OPTION_SETS] + [("stiefel", "default", (2,))]
CASES_4 = [(m, "default", None) for m in fw.MANIFOLDS] + [("dgram", "products", None)]
#: Tolerances of "equal to rounding" per dtype (the runs here agree bit for bit; a bank of other
#: members may round differently on other BLAS builds).
TOLERANCE = {torch.float64: (1e-12, 1e-14), torch.float32: (1e-5, 1e-7), torch.bfloat16: (1e-2, 1e-3)}


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run one thread: the same reduction order
    yield
    torch.set_num_threads(threads)


class _Runs(dict):
    """The optimizer jobs by world size, each started when a test first asks for it (the
    4-process one only by the tests marked slow)."""

    def __missing__(self, world: int) -> list[dict]:
        self[world] = run_workers(fw.optimizer_job, world, CASES_2 if world == 2 else CASES_4,
                                  timeout=JOB_TIMEOUT_S)
        return self[world]


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return _Runs()


@pytest.fixture(scope="module")
def references(single_thread) -> dict:
    return {case: fw.single_process(case[0], fw.OPTION_SETS[case[1]], case[2]) for case in {*CASES_2, *CASES_4}}


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    rtol, atol = TOLERANCE.get(expected.dtype, (0, 0))
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _all_cases():
    """Two processes in the default suite, four under ``-m slow``."""
    return [(2, c) for c in CASES_2] + [pytest.param(4, c, marks=pytest.mark.slow) for c in CASES_4]


@pytest.mark.parametrize(("world", "case"), _all_cases(), ids=lambda v: str(v))
def test_every_rank_gets_the_single_process_parameters_and_state(runs, references, world, case) -> None:
    expected = references[case]
    for rank, report in enumerate(runs[world]):
        got = report[case]
        for i, (p, e) in enumerate(zip(got["params"], expected["params"])):
            _close(p, e, f"rank {rank}, matrix {i}")
        for i, (state, e) in enumerate(zip(got["state"], expected["state"])):
            assert set(state) == set(e), (rank, i, sorted(state), sorted(e))
            for key in e:
                _close(state[key], e[key], f"rank {rank}, matrix {i}, {key}")


@pytest.mark.parametrize(("world", "case"), _all_cases(), ids=lambda v: str(v))
def test_momentum_and_warm_start_stay_on_the_row_shards(runs, world, case) -> None:
    for report in runs[world]:
        for kinds in report[case]["kinds"]:
            assert kinds["momentum_buffer"] == "(Shard(dim=0),)"
            if case[0] != "euclidean":
                assert kinds["dual_correction"] == "(Shard(dim=0),)"
            assert all(kinds[key] == "plain" for key in fw.SCALAR_KEYS if key in kinds)


def test_a_non_finite_gradient_skips_its_matrix_on_every_rank(runs, references) -> None:
    case = ("stiefel", "default", None)
    assert int(references[case]["state"][1]["skipped_steps"]) == 1  # the reference skipped it too
    for report in runs[2]:
        skips = [int(s["skipped_steps"]) for s in report[case]["state"]]
        assert skips == [0, 1] + [0] * (len(skips) - 2)


@pytest.mark.slow
def test_the_cases_cover_uneven_rows_an_empty_rank_and_an_idle_owner(runs) -> None:
    rows = runs[4][0][("stiefel", "default", None)]["local_rows"]
    assert [row_chunks(m, 4)[0] for m, *_ in fw.MATRICES] == rows
    last = [r[("stiefel", "default", None)]["local_rows"] for r in runs[4]][-1]
    assert 0 in last  # the 3-row matrix: rank 3 holds none of it
    assert any(m % 4 for m, *_ in fw.MATRICES)
    # one matrix on two ranks: rank 1 solves nothing (and still ends with its values, above)
    assert assign_owners([fw.MATRICES[2][:2]], 2) == [0]
    assert ("stiefel", "default", (2,)) in CASES_2


@pytest.fixture(scope="module")
def gpt_runs() -> dict[int, list[dict]]:
    return {2: run_workers(fw.gpt_fsdp_job, 2, list(POLICIES), 3, timeout=JOB_TIMEOUT_S)}


def _check_gpt(reports_by_world: dict, policy: str) -> None:
    expected = fw.gpt_single(policy, 3)
    diagnostics = expected.pop("diagnostics")
    for world, reports in reports_by_world.items():
        for rank, report in enumerate(reports):
            assert report[policy, "diagnostics"].keys() == diagnostics.keys()
            for name, row in diagnostics.items():  # the whole matrices' residuals and norms, every rank
                got = report[policy, "diagnostics"][name]
                assert got.keys() == row.keys() and got["manifold"] == row["manifold"], name
                for key in ("residual", "spectral_norm", "dual_residual", "retraction_residual"):
                    # NaN where nothing was measured (a Euclidean matrix's residuals), on both
                    assert got[key] == pytest.approx(row[key], rel=1e-9, abs=1e-12, nan_ok=True), (name, key)
                assert (got["dual_iterations"], got["skipped_steps"]) == (row["dual_iterations"], row["skipped_steps"])
            assert set(report[policy]) == set(expected)
            for name, value in expected.items():
                _close(report[policy][name], value, f"{world} ranks, rank {rank}, {name}")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_fully_sharded_gpt_trains_as_in_one_process(gpt_runs, single_thread, policy) -> None:
    _check_gpt(gpt_runs, policy)


@pytest.mark.slow
def test_a_fully_sharded_gpt_on_four_processes_trains_as_in_one(single_thread) -> None:
    _check_gpt({4: run_workers(fw.gpt_fsdp_job, 4, ["hetero"], 3, timeout=JOB_TIMEOUT_S)}, "hetero")


@pytest.mark.parametrize("worlds", [(2, 1), pytest.param((4,), marks=pytest.mark.slow)])
def test_a_checkpoint_resumes_bit_exactly_on_any_world_size(tmp_path, worlds) -> None:
    folder = str(tmp_path / "checkpoint")
    uninterrupted = run_workers(fw.checkpoint_job, 2, "save", folder, "hetero", 2, timeout=JOB_TIMEOUT_S)[0]
    for world in worlds:
        resumed = run_workers(fw.checkpoint_job, world, "resume", folder, "hetero", 2, timeout=JOB_TIMEOUT_S)
        for report in resumed:
            assert set(report) == set(uninterrupted)
            for name, value in uninterrupted.items():
                assert torch.equal(report[name], value), (world, name)


def test_tensor_parallel_placements_and_edited_points_are_refused_naming_them() -> None:
    for report in run_workers(fw.refusal_job, 2, timeout=JOB_TIMEOUT_S):
        assert report["row_sharded"] == [True, False, False]  # is_row_sharded: FSDP2's placement only
        assert report["shard1"].startswith("UnsupportedParameterError: ")
        assert "(Shard(dim=1),)" in report["shard1"] and "fully_shard" in report["shard1"]
        assert "(Replicate(),)" in report["replicate"]
        assert "Shard(dim=1)" in report["builder"] and "attn.weight" in report["builder"]
        for spectral in ("products", "eigh"):  # the sync-free path as the host-checked one: every rank
            for when in ("edited", "loaded"):  # before the first step; loaded after it
                assert "(12, 6) matrix on stiefel: W is not a Stiefel point" in report[f"{when}_{spectral}"]
                assert report[f"{when}_{spectral}_unchanged"]


@pytest.mark.parametrize("manifold", ["stiefel", "euclidean"])
def test_the_bytes_moved_are_the_plans(manifold) -> None:
    from manifoldlib.distributed.redistribute import ALIGNMENT, piece_bytes
    from manifoldlib.optim.execution import Execution
    from manifoldlib.optim.fsdp import SCALARS, redistribution_plan

    shapes = [(12, 12)] * 3 + [(40, 12), (12, 40), (7, 5)]  # a GPT-like set; uneven rows on 3 ranks
    sent = run_workers(fw.bytes_job, 3, shapes, manifold, 2, timeout=JOB_TIMEOUT_S)
    plan = redistribution_plan(shapes, torch.float32, 3, constrained=manifold != "euclidean",
                               ns_dtype=Execution.resolve("cpu").ns_dtype)
    assert sum(sent) == plan["total"] > 0
    if manifold == "euclidean":
        # U there and D back, nothing else: the minimum (each row moved once each way, in the
        # weights' dtype) plus, per piece, the scalars' record and the alignment of U and D; a D in
        # bfloat16 (ns_dtype on a CPU with native bfloat16) moves less
        pieces = len(shapes) * (3 - 1)
        overhead = piece_bytes((len(SCALARS),), torch.float64) + 2 * (ALIGNMENT - 1)
        assert plan["total"] <= plan["minimum"] + pieces * overhead
    else:
        assert plan["minimum"] < plan["total"] <= 2.5 * plan["minimum"]
