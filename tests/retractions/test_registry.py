"""The retraction registry: names, aliases, user registrations and error messages."""

from __future__ import annotations

import pytest
import torch

from manifoldlib import DGram, Euclidean, Sphere, Stiefel, get_manifold
from manifoldlib.retractions import (
    MANIFOLD_NAMES,
    AddRetraction,
    AngleRetraction,
    CayleyRetraction,
    DGramAlternatingRetraction,
    DGramColnormPolarRetraction,
    ExponentialRetraction,
    GnomonicRetraction,
    PRetraction,
    Retraction,
    StiefelCayleyRetraction,
    StiefelExpRetraction,
    StiefelPolarRetraction,
    StiefelQRRetraction,
    available_retractions,
    get_retraction,
    register_retraction,
    resolve_retraction,
)

DESIGN_NAMES = {
    "sphere": {"exp", "gnomonic", "projection", "cayley", "stereographic", "p"},
    "stiefel": {"polar", "qr", "cayley", "exp"},
    "dgram": {"alternating", "colnorm-polar"},
    "oblique": {"normalize"},
    "euclidean": {"add"},
}


@pytest.mark.parametrize("family", sorted(DESIGN_NAMES))
def test_design_names_are_registered(family):
    assert DESIGN_NAMES[family] <= set(available_retractions(family))
    for name in available_retractions(family):
        r = get_retraction(family, name)
        assert isinstance(r, Retraction) and r.manifold == family and r.order in (1, 2)


def test_aliases_resolve_to_the_same_class():
    assert type(get_retraction("sphere", "projection")) is GnomonicRetraction
    assert type(get_retraction("sphere", "stereographic")) is CayleyRetraction


@pytest.mark.parametrize(
    "family,bad",
    [("sphere", "gnomonik"), ("stiefel", "gnomonic"), ("dgram", "polar"), ("euclidean", "exp")],
)
def test_unknown_name_lists_valid_names(family, bad):
    with pytest.raises(ValueError) as info:
        get_retraction(family, bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in available_retractions(family):
        assert name in message


def test_unknown_name_through_manifold_constructor():
    with pytest.raises(ValueError, match="valid names: .*alternating.*colnorm-polar"):
        DGram(retraction="metric")
    with pytest.raises(ValueError, match="unknown manifold 'torus'"):
        get_retraction("torus", "exp")


def test_unknown_option_is_a_value_error_naming_it():
    with pytest.raises(
        ValueError, match=r"'gnomonic' got unexpected options \['p'\]; accepted options: none"
    ):
        Sphere(retraction="gnomonic", p=2.0)
    with pytest.raises(ValueError, match="accepted options: p"):
        get_retraction("sphere", "p", q=1.0)


def test_options_round_trip_and_equality():
    r = get_retraction("sphere", "p", p=1.5)
    assert r.options() == {"p": 1.5}
    assert r == PRetraction(1.5) and hash(r) == hash(PRetraction(1.5))
    assert r != PRetraction(2.0) and r != GnomonicRetraction()
    rebuilt = get_retraction(r.manifold, r.name, **r.options())
    assert rebuilt == r
    assert "p=1.5" in repr(r)


def test_resolve_retraction_rules():
    inst = PRetraction(2.0)
    assert resolve_retraction("sphere", inst) is inst
    with pytest.raises(ValueError, match="belongs to the 'stiefel' manifold"):
        resolve_retraction("sphere", StiefelQRRetraction())
    with pytest.raises(ValueError, match="options"):
        resolve_retraction("sphere", inst, p=3.0)
    with pytest.raises(ValueError, match="registered name or a Retraction instance, got 3"):
        resolve_retraction("sphere", 3)


def test_user_registration_by_name(clean_registry):
    @register_retraction("sphere", "test-p3", aliases=("test-p3-alias",))
    class P3(AngleRetraction):
        order = 2

        def angle(self, beta):
            return 3 * torch.atan(beta / 3)

    assert P3.name == "test-p3" and P3.manifold == "sphere"
    assert {"test-p3", "test-p3-alias"} <= set(available_retractions("sphere"))
    s = Sphere(2.0, retraction="test-p3-alias")
    g = torch.Generator().manual_seed(0)
    x = s.random(3, 4, generator=g, dtype=torch.float64)
    v = s.proju(x, torch.randn(x.shape, generator=g, dtype=torch.float64))
    expected = Sphere(2.0, retraction=PRetraction(3.0)).retr(x, v)
    assert torch.allclose(s.retr(x, v), expected, rtol=0, atol=1e-14)
    assert type(get_manifold("sphere", retraction="test-p3").retraction) is P3


def test_reregistering_needs_override_and_then_replaces(clean_registry):
    @register_retraction("euclidean", "test-add")
    class First(Retraction):
        order = 2

        def retract(self, x, v):
            return x + v

    class Second(First):
        pass

    with pytest.raises(ValueError, match=r"euclidean retraction 'test-add' is already registered "
                                         r"as .*First; .* pass override=True"):
        register_retraction("euclidean", "test-add")(Second)
    assert type(get_retraction("euclidean", "test-add")) is First
    assert Second.name == "test-add"  # inherited from First: the refusal set nothing on Second
    register_retraction("euclidean", "test-add", override=True)(Second)
    assert type(get_retraction("euclidean", "test-add")) is Second


@pytest.mark.parametrize("family, name, builtin", [
    ("sphere", "gnomonic", GnomonicRetraction),
    ("sphere", "p", PRetraction),
    ("stiefel", "polar", StiefelPolarRetraction),
    ("euclidean", "add", AddRetraction),
])
def test_a_builtin_name_is_not_replaced_by_accident(clean_registry, family, name, builtin):
    class Impostor(Retraction):
        order = 2

        def retract(self, x, v):
            return x

    with pytest.raises(ValueError, match=rf"{family} retraction {name!r} is already registered "
                                         rf"as {builtin.__qualname__}.*override=True"):
        register_retraction(family, name)(Impostor)
    assert type(get_retraction(family, name)) is builtin


def test_a_taken_alias_is_refused_as_a_name_or_an_alias(clean_registry):
    class Mine(AngleRetraction):
        def angle(self, beta):
            return beta

    with pytest.raises(ValueError, match=r"sphere retraction 'stereographic' \(an alias of "
                                         r"'cayley'\) is already registered"):
        register_retraction("sphere", "test-mine", aliases=("stereographic",))(Mine)
    with pytest.raises(ValueError, match=r"sphere retraction 'exp' is already registered"):
        register_retraction("sphere", "test-mine", aliases=("exp",))(Mine)
    assert "test-mine" not in available_retractions("sphere")
    with pytest.raises(ValueError, match="override must be True or False, got 1"):
        register_retraction("sphere", "test-mine", override=1)


def test_registration_errors(clean_registry):
    with pytest.raises(ValueError, match="unknown manifold 'hyperbolic'"):
        register_retraction("hyperbolic", "x")
    with pytest.raises(ValueError, match="non-empty string"):
        register_retraction("sphere", "")
    with pytest.raises(TypeError, match="Retraction subclasses"):
        register_retraction("sphere", "not-a-class")(lambda x, v: x)

    class ThirdOrder(AngleRetraction):
        order = 3

    with pytest.raises(ValueError, match="order must be 1 or 2, got 3"):
        register_retraction("sphere", "third")(ThirdOrder)


def test_a_name_replaced_with_override_reaches_optimizers_built_after_it(clean_registry):
    """ManifoldMuon caches its group manifolds by retraction name: after a notebook cell re-ran
    @register_retraction("stiefel", ..., override=True) with a fixed class, a new optimizer
    naming it went on stepping with the replaced class."""
    from manifoldlib.functional import stiefel_polar, stiefel_qr
    from manifoldlib.optim import ManifoldMuon

    calls = []

    @register_retraction("stiefel", "test-fixed-later")
    class Buggy(Retraction):
        def retract(self, x, v):
            calls.append("buggy")
            return stiefel_qr(x, v)

    def step():
        w = torch.nn.Parameter(torch.linalg.qr(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))[0])
        opt = ManifoldMuon([{"params": [w], "manifold": "stiefel", "retraction": "test-fixed-later"}], lr=0.1)
        w.grad = torch.ones(6, 4)
        opt.step()

    step()
    assert calls == ["buggy"]

    @register_retraction("stiefel", "test-fixed-later", override=True)
    class Fixed(Retraction):
        order = 2

        def retract(self, x, v):
            calls.append("fixed")
            return stiefel_polar(x, v)

    step()
    assert calls == ["buggy", "fixed"]


def test_registering_a_name_that_was_an_alias_makes_it_the_new_class(clean_registry):
    """'projection' aliased gnomonic; registering it (on purpose, with override=True) used to leave
    Sphere(retraction='projection') on gnomonic, the new class unreachable."""

    class MyProjection(AngleRetraction):
        order = 2

        def angle(self, beta):
            return 3 * torch.atan(beta / 3)

    with pytest.raises(ValueError, match=r"'projection' \(an alias of 'gnomonic'\) is already"):
        register_retraction("sphere", "projection")(MyProjection)
    register_retraction("sphere", "projection", override=True)(MyProjection)

    assert type(get_retraction("sphere", "projection")) is MyProjection
    assert type(Sphere(retraction="projection").retraction) is MyProjection
    assert type(get_retraction("sphere", "gnomonic")) is GnomonicRetraction
    assert available_retractions("sphere").count("projection") == 1


def test_bad_classes_and_aliases_are_refused_before_anything_changes(clean_registry):
    before = {family: available_retractions(family) for family in MANIFOLD_NAMES}

    class NoRetract(Retraction):
        order = 1

    with pytest.raises(TypeError, match="NoRetract does not define retract"):
        register_retraction("stiefel", "test-abstract")(NoRetract)

    class BoolOrder(AngleRetraction):
        order = True

        def angle(self, beta):
            return beta

    with pytest.raises(ValueError, match="BoolOrder.order must be 1 or 2, got True"):
        register_retraction("sphere", "test-bool-order")(BoolOrder)
    assert BoolOrder.name == "" and BoolOrder.manifold == "sphere"  # untouched by the refusal

    for aliases in ("xy", ("",), (3,)):
        with pytest.raises(ValueError, match=r"aliases must be a tuple of non-empty strings, got"):
            register_retraction("sphere", "test-aliases", aliases=aliases)
    assert {family: available_retractions(family) for family in MANIFOLD_NAMES} == before


@pytest.mark.parametrize("family", ["oblique", "stiefel", "dgram", "euclidean"])
def test_a_sphere_retraction_is_refused_for_another_manifold(clean_registry, family):
    """An angle retraction normalizes the last dimension: registered for Oblique (unit columns) it
    returned rows of norm 1, off the manifold, from Oblique.retr without an error."""
    before = {f: available_retractions(f) for f in MANIFOLD_NAMES}

    class Arctan(AngleRetraction):
        def angle(self, beta):
            return torch.atan(beta)

    with pytest.raises(ValueError, match=rf"Arctan is a sphere retraction \(manifold='sphere', set by "
                                         rf"AngleRetraction\); it cannot be registered for '{family}'"):
        register_retraction(family, "test-angle")(Arctan)
    assert Arctan.name == "" and Arctan.manifold == "sphere"
    assert {f: available_retractions(f) for f in MANIFOLD_NAMES} == before


def test_a_registered_class_is_refused_for_a_second_manifold(clean_registry):
    """Registering one class for two manifolds rewrote its ``manifold``: the first registry kept a
    class that resolve_retraction then refused as an instance of that registry's manifold."""

    @register_retraction("stiefel", "test-two-homes")
    class Polar(Retraction):
        order = 2

        def retract(self, x, v):
            return StiefelPolarRetraction().retract(x, v)

    with pytest.raises(ValueError, match=r"Polar is a stiefel retraction .* cannot be registered for 'dgram'"):
        register_retraction("dgram", "test-two-homes", override=True)(Polar)
    assert Polar.manifold == "stiefel" and "test-two-homes" not in available_retractions("dgram")
    assert type(Stiefel(retraction=Polar()).retraction) is Polar


@pytest.mark.parametrize(
    "manifold",
    [
        Sphere(1.5, retraction="cayley"),
        Stiefel(retraction="qr"),
        DGram(retraction="colnorm-polar"),
        Euclidean(1),
    ],
)
def test_with_retraction_keeps_geometry(manifold):
    name = available_retractions(manifold.name)[0]
    other = manifold.with_retraction(name)
    assert type(other) is type(manifold) and other is not manifold
    assert other.retraction == get_retraction(manifold.name, name)
    if isinstance(manifold, Sphere):
        assert other.radius == 1.5
    if isinstance(manifold, Euclidean):
        assert other.ndim == 1
    assert manifold.with_retraction(manifold.retraction).retraction is manifold.retraction


def test_sphere_with_p_option():
    s = Sphere(2.0).with_retraction("p", p=0.5)
    assert s.radius == 2.0 and s.retraction == PRetraction(0.5)


@pytest.mark.parametrize(
    "family,name,cls,order",
    [
        ("sphere", "exp", ExponentialRetraction, 2),
        ("sphere", "gnomonic", GnomonicRetraction, 2),
        ("sphere", "cayley", CayleyRetraction, 2),
        ("sphere", "p", PRetraction, 2),
        ("stiefel", "polar", StiefelPolarRetraction, 2),
        ("stiefel", "qr", StiefelQRRetraction, 1),
        ("stiefel", "cayley", StiefelCayleyRetraction, 1),
        ("stiefel", "exp", StiefelExpRetraction, 2),
        ("dgram", "alternating", DGramAlternatingRetraction, 2),
        ("dgram", "colnorm-polar", DGramColnormPolarRetraction, 1),
        ("euclidean", "add", AddRetraction, 2),
    ],
)
def test_public_classes_are_what_their_names_build(family, name, cls, order):
    # the orders are those of the table in docs/theory/retractions.rst; tests/testing measures them
    r = get_retraction(family, name)
    assert type(r) is cls and (cls.name, cls.manifold, cls.order) == (name, family, order)


def test_manifold_names_are_the_registries():
    assert set(MANIFOLD_NAMES) == set(DESIGN_NAMES)
    for family in MANIFOLD_NAMES:
        assert available_retractions(family)
    with pytest.raises(ValueError, match="unknown manifold 'torus' for a retraction; valid manifolds: "
                       + ", ".join(MANIFOLD_NAMES)):
        available_retractions("torus")


def test_the_add_retraction_object_broadcasts_as_euclidean_retr_and_names_other_batches():
    # the object refused any v of another shape than x's, where Euclidean.retr (and geoopt's x + u)
    # broadcasts: the two rules of one retraction now agree
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    v = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(AddRetraction()(x, v), x + v) and torch.equal(AddRetraction()(x, v), Euclidean().retr(x, v))
    with pytest.raises(ValueError, match=r"x of shape \(3, 4\) and v of shape \(5, 4\) are not one batch"):
        AddRetraction()(x, torch.ones(5, 4, dtype=torch.float64))
