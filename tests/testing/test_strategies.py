"""manifoldlib.testing.strategies, the sampling helpers, the hard instances' argument checks and
registered_manifolds."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib import DGram, Euclidean, Sphere, Stiefel
from manifoldlib.retractions import AngleRetraction, register_retraction
from manifoldlib.testing import (
    default_shape,
    hard_instance,
    nearly_normal_instance,
    point_norm,
    random_tangent,
    registered_manifolds,
)
from manifoldlib.testing import strategies as mst

MANIFOLDS = [Sphere(4.0), Stiefel(), DGram(), Euclidean(ndim=2)]
IDS = ["sphere", "stiefel", "dgram", "euclidean"]


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(data=st.data())
def test_points_follow_shape_dtype_and_lie_on_manifold(manifold, data):
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    x = data.draw(mst.points(manifold, batch=(2, 3), dim=(3, 5), dtype=dtype))
    assert x.dtype == dtype and x.shape[0] in (2, 3)
    assert all(3 <= s <= 5 for s in x.shape[1:2])
    if manifold.name in ("stiefel", "dgram"):
        assert 1 <= x.shape[-1] <= x.shape[-2]
    assert manifold.check_point_on_manifold(x)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(data=st.data())
def test_tangents_are_tangent_with_requested_relative_size(manifold, data):
    x = data.draw(mst.points(manifold, batch=None))
    v = data.draw(mst.tangents(manifold, x, scale=0.25))
    assert v.shape == x.shape and v.dtype == x.dtype
    assert torch.allclose(
        point_norm(manifold, v), 0.25 * point_norm(manifold, x), rtol=1e-12, atol=0
    )
    assert manifold.check_vector_on_tangent(x, v, atol=1e-13, rtol=0.0)


@given(data=st.data())
def test_point_and_tangent_pairs_share_the_point(data):
    s = Sphere(2.0)
    x, v = data.draw(mst.point_and_tangent(s, batch=4, dim=3, scale=(0.5, 2.0)))
    assert x.shape == (4, 3)
    assert (x * v).sum(-1).abs().max() <= 1e-13 * 4.0
    ratio = v.norm(dim=-1) / 2.0
    assert bool(((ratio >= 0.5 - 1e-12) & (ratio <= 2.0 + 1e-12)).all())


@given(data=st.data())
def test_matrix_cols_option(data):
    x = data.draw(mst.points(Stiefel(), dim=6, cols=(2, 3)))
    assert x.shape[-2] == 6 and x.shape[-1] in (2, 3)


def test_strategy_argument_errors():
    with pytest.raises(ValueError, match="batch must be an int >= 1 or a range"):
        mst.shapes(Sphere(), batch=(3, 1))
    with pytest.raises(ValueError, match="dim must be"):
        mst.shapes(Sphere(), dim=0)
    with pytest.raises(ValueError, match="scale must be >= 0"):
        mst.tangents(Sphere(), torch.ones(3), scale=-1.0)


@pytest.mark.parametrize("option, value", [("batch", True), ("dim", (2, 6.5)), ("cols", True)])
def test_sizes_that_are_not_ints_are_refused_naming_them(option, value):
    # batch=True drew batches of one, cols=True one column; floats a TypeError from unpacking
    # or from hypothesis
    with pytest.raises(ValueError, match=re.escape(f"{option} must be an int >= 1 or a range (lo, hi)")
                       + ".*" + re.escape(f"got {value!r}")):
        mst.shapes(Stiefel(), **{option: value})


def test_default_shape_refuses_a_batch_that_is_not_a_positive_int():
    # 2.7 was truncated to 2, True was a batch of 1, -1 a shape (-1, 5)
    assert default_shape(Sphere(), 3) == (3, 5) and default_shape(Stiefel(), None) == (5, 3)
    for batch in (2.7, True, -1, 0):
        with pytest.raises(ValueError, match=re.escape(f"batch must be None or an int >= 1, got {batch!r}")):
            default_shape(Sphere(), batch)


@pytest.mark.parametrize("build, option, value, needle", [
    (hard_instance, "noise", math.nan, "noise must be a finite number >= 0, got nan"),  # a NaN gradient
    (hard_instance, "rank", 2.5, "rank must be an int in 1..4, got 2.5"),
    (hard_instance, "dtype", torch.int64, "dtype must be a floating torch dtype, got torch.int64"),  # W of 0s
    (nearly_normal_instance, "m", 8.0, "m must be an int, got 8.0"),
    (nearly_normal_instance, "tangent", True, r"tangent must be a number in \(0, 1\], got True"),
])
def test_hard_instances_refuse_values_that_are_not_what_they_mean(build, option, value, needle):
    args = {"manifold": "stiefel", "m": 8, "n": 4, "seed": 0}
    args.update({"rank": 2, "noise": 0.1} if build is hard_instance else {"tangent": 0.1})
    with pytest.raises(ValueError, match=needle):
        build(**{**args, option: value})


def test_cols_is_refused_where_the_points_have_no_columns():
    # cols=3 on the sphere or Euclidean space drew points as if it were not there
    for manifold in (Sphere(), Euclidean(ndim=2)):
        for build in (mst.shapes, mst.points, mst.point_and_tangent):
            with pytest.raises(ValueError, match=f"cols applies to the matrix manifolds .*not {manifold.name}"):
                build(manifold, cols=3)


def test_a_scale_that_gives_infinite_tangents_is_refused():
    """random_tangent took any scale >= 0: scale=inf (and a range (0, inf) in the strategies, whose
    draws reach 1e308, past float64's largest number times ||x|| = 2.5) gave tangents of inf
    entries, True one of relative size 1."""
    s = Sphere(2.5)
    x = s.random(2, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for scale in (math.inf, math.nan, -1.0, True):
        with pytest.raises(ValueError, match=re.escape(f"scale must be >= 0 and finite (not a bool), got {scale!r}")):
            random_tangent(s, x, scale=scale)
    with pytest.raises(ValueError, match=r"scale=1e\+308 times the points' norm \(up to 2.5\) is past the largest "
                                         r"torch.float64 \(1.8e\+308\): the tangent would not be finite"):
        random_tangent(s, x, scale=1e308)
    for scale in (math.inf, (0.0, math.inf)):
        with pytest.raises(ValueError, match=r"scale must be >= 0 and finite, or a range \(lo, hi\) with 0 <= lo <= "
                                             r"hi < inf, got"):
            mst.point_and_tangent(s, scale=scale)


@given(data=st.data())
def test_a_cols_range_above_part_of_dim_draws_only_the_rows_that_admit_it(data):
    """cols=(4, 5) with dim=(2, 6) raised 'cols must allow 1 <= n <= m=2' from inside the draws
    of m = 2 or 3 only (a test failing on some examples, passing on others); a cols range above
    every m, or reversed, failed the same way or with hypothesis' InvalidArgument."""
    m, n = data.draw(mst.shapes(Stiefel(), batch=None, dim=(2, 6), cols=(4, 5)))
    assert 4 <= n <= min(5, m) and m <= 6
    with pytest.raises(ValueError, match=re.escape("cols must allow 1 <= n <= m for some m in dim (2, 3), got (4, 5)")):
        mst.shapes(Stiefel(), dim=(2, 3), cols=(4, 5))
    with pytest.raises(ValueError, match=re.escape("cols must be an int >= 1 or a range (lo, hi) with 1 <= lo <= hi, "
                                                   "got (3, 2)")):
        mst.shapes(Stiefel(), cols=(3, 2))


def test_seeds_from_different_streams_differ():
    # the same drawn integer gives different generators in stream 0 and stream 1
    a = torch.Generator().manual_seed(5)
    b = torch.Generator().manual_seed(5 + 2**31)
    assert not torch.equal(torch.randn(3, generator=a), torch.randn(3, generator=b))


def test_registered_manifolds_covers_new_registrations(clean_registry):
    before = {case_id for case_id, _ in registered_manifolds()}

    @register_retraction("sphere", "test-registered")
    class P4(AngleRetraction):
        def angle(self, beta):
            return 4 * torch.atan(beta / 4)

    cases = dict(registered_manifolds())
    assert set(cases) - before == {"sphere-test-registered"}
    assert isinstance(cases["sphere-test-registered"].retraction, P4)
    assert "sphere-projection" not in cases
    assert "sphere-projection" in dict(registered_manifolds(aliases=True))


def test_registered_manifolds_takes_one_name_as_that_family():
    # a str was iterated as its letters: "unknown manifold 's'"
    assert dict(registered_manifolds("sphere")).keys() == dict(registered_manifolds(("sphere",))).keys()
    assert all(case_id.startswith("sphere-") for case_id, _ in registered_manifolds("sphere"))


@pytest.mark.parametrize("families", [(), []])
def test_registered_manifolds_refuses_an_empty_selection(families):
    # no cases parametrized a suite that ran nothing and passed, silently
    with pytest.raises(ValueError, match=re.escape(f"families must name at least one manifold family, got {families!r}")):
        registered_manifolds(families)
