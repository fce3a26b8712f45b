"""Bad input across the API and the CLI: each case asserts the exception type (or the exit
status and one ``error:`` line) and that the message names the bad value."""

from __future__ import annotations

import json
import math
import re

import geoopt
import pytest
import torch
from torch import nn

from manifoldlib.charts import SEL
from manifoldlib.manifolds import DGram, Euclidean, Oblique, Sphere, Stiefel
from manifoldlib.manifolds.base import check_tensor
from manifoldlib.nn import ScaleNorm, SphereResidual
from manifoldlib.optim import build_optimizer, get_policy, register_policy
from manifoldlib.retractions import (
    GnomonicRetraction,
    PRetraction,
    get_retraction,
    register_retraction,
)
from models.config import ConfigError, TrainConfig, build_config, load_toml
from models.gpt import GPT, GPTConfig
from models.train import main

NAN, INF = float("nan"), float("inf")


def _point(manifold, m=6, n=3):
    return manifold.random(m, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def _poisoned(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t[0, 0] = value
    return t


# ---- manifolds: non-finite input -------------------------------------------------------------


@pytest.mark.parametrize("cls", [Stiefel, DGram])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_projx_of_a_non_finite_matrix_is_a_value_error(cls, value):
    m = cls()
    with pytest.raises(ValueError, match=rf"{m.name}\.projx: 'x' holds 1 non-finite value"):
        m.projx(_poisoned(_point(m), value))


@pytest.mark.parametrize("cls", [Stiefel, DGram])
def test_retr_from_a_nan_point_is_a_value_error(cls):
    m = cls()
    x = _poisoned(_point(m), NAN)
    with pytest.raises(ValueError, match=rf"{m.name}\.retr: 'x' holds 1 non-finite value"):
        m.retr(x, torch.zeros_like(x))


def test_dgram_retr_of_an_infinite_step_is_a_value_error():
    m = DGram()
    x = _point(m)
    with pytest.raises(ValueError, match=r"dgram\.retr: 'u' holds 1 non-finite value"):
        m.retr(x, _poisoned(torch.randn_like(x), INF))


@pytest.mark.parametrize("retraction", ["polar", "qr", "cayley", "exp"])
@pytest.mark.parametrize("value", [NAN, INF])
def test_stiefel_retr_of_a_non_finite_step_names_it(retraction, value):
    m = Stiefel(retraction=retraction)
    x = _point(m)
    with pytest.raises(ValueError, match=r"stiefel\.retr: 'u' holds 1 non-finite value"):
        m.retr(x, _poisoned(m.proju(x, torch.randn_like(x)), value))


@pytest.mark.parametrize("cls", [Stiefel, Oblique])
def test_expmap_of_an_infinite_step_names_it(cls):
    m = cls()
    x = _point(m)
    with pytest.raises(ValueError, match=rf"{m.name}\.expmap: 'u' holds 1 non-finite value"):
        m.expmap(x, _poisoned(torch.zeros_like(x), INF))


# ---- the sphere: points, steps, radii --------------------------------------------------------


def _sphere_case(radius=2.0, retraction="gnomonic"):
    s = Sphere(radius, retraction=retraction)
    g = torch.Generator().manual_seed(0)
    x = s.random(3, 4, generator=g, dtype=torch.float64)
    u = s.proju(x, torch.randn(x.shape, generator=g, dtype=torch.float64))
    return s, x, u


@pytest.mark.parametrize("call, name", [
    (lambda s, x, u: s.retr(x, u), "retr"),
    (lambda s, x, u: s.expmap(x, u), "expmap"),
    (lambda s, x, u: s.proju(x, u), "proju"),
    (lambda s, x, u: s.egrad2rgrad(x, u), "proju"),
    (lambda s, x, u: s.logmap(x, s.projx(u)), "logmap"),
    (lambda s, x, u: s.dist(x, s.projx(u)), "dist"),
])
def test_a_point_of_norm_5r_is_named(call, name):
    s, x, u = _sphere_case()
    x = x.clone()
    x[1] *= 5
    with pytest.raises(ValueError, match=rf"sphere\.{name}: 'x' is not a point of the sphere of radius 2: "
                                         rf"row 1 has norm 10 \(relative tolerance 1e-05"):
        call(s, x, u)


def test_transp_names_a_target_point_off_the_sphere():
    s, x, u = _sphere_case()
    with pytest.raises(ValueError, match=r"sphere\.transp: 'y' is not a point .* row 0 has norm 6"):
        s.transp(x, 3 * x, u)


@pytest.mark.parametrize("retraction", ["exp", "gnomonic", "cayley", "p"])
def test_retr_from_the_zero_vector_is_refused(retraction):
    s, _, u = _sphere_case(retraction=retraction)
    with pytest.raises(ValueError, match=r"sphere\.retr: 'x' is not a point .* row 0 has norm 0 "):
        s.retr(torch.zeros_like(u), u)


@pytest.mark.parametrize("retraction", ["exp", "gnomonic", "cayley", "p"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_sphere_retr_of_a_non_finite_step_names_it(retraction, value):
    s, x, u = _sphere_case(retraction=retraction)
    with pytest.raises(ValueError, match=r"sphere\.retr: 'u' holds 1 non-finite value"):
        s.retr(x, _poisoned(u, value))
    with pytest.raises(ValueError, match=r"sphere\.expmap: 'u' holds 1 non-finite value"):
        s.expmap(x, _poisoned(u, value))


def test_sphere_retr_from_a_nan_point_names_it():
    s, x, u = _sphere_case()
    with pytest.raises(ValueError, match=r"sphere\.retr: 'x' holds 1 non-finite value"):
        s.retr(_poisoned(x, NAN), u)


@pytest.mark.parametrize("retraction", ["gnomonic", "cayley", "exp"])
def test_a_1e300_step_is_a_point_of_the_sphere_not_zero(retraction):
    s, x, u = _sphere_case(retraction=retraction)
    u_hat = u / u.norm(dim=-1, keepdim=True)
    y = s.retr(x, 1e300 * u_hat)
    assert torch.allclose(y.norm(dim=-1), torch.full((3,), 2.0, dtype=torch.float64), rtol=1e-15, atol=0)
    if retraction == "gnomonic":  # the angle saturates at pi / 2: r u_hat
        assert torch.allclose(y, 2.0 * u_hat, rtol=0, atol=1e-15)


@pytest.mark.parametrize("x_shape", [(0, 4), (2, 4)])
def test_projx_of_a_zero_or_non_finite_row_is_refused(x_shape):
    s = Sphere()
    x = torch.ones(x_shape, dtype=torch.float64)
    if x.numel():
        x[1] = 0.0
        with pytest.raises(ValueError, match=r"sphere\.projx: 'x' has zero rows \(flat indices \[1\]\)"):
            s.projx(x)
        with pytest.raises(ValueError, match=r"sphere\.projx: 'x' holds 1 non-finite value"):
            s.projx(_poisoned(torch.ones(x_shape, dtype=torch.float64), NAN))
    else:
        assert s.projx(x).shape == x_shape


@pytest.mark.parametrize("radius", [1e-30, 1e-300, 1e30, 1e200, 1e-16, 2e15, True, "2"])
def test_a_radius_outside_the_range_is_refused_with_the_range(radius):
    with pytest.raises(ValueError, match=rf"radius must be a finite number in \[1e-15, 1e\+15\], got "
                                         rf"{re.escape(repr(radius))}$"):
        Sphere(radius)


def test_logmap_and_dist_at_the_antipode_do_not_depend_on_rounding():
    s = Sphere(1.5)
    x = s.random(20, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.allclose(s.dist(x, -x), torch.full((20,), 1.5 * math.pi, dtype=torch.float64), rtol=1e-15, atol=0)
    assert torch.allclose(s.logmap(x, -x).norm(dim=-1), s.dist(x, -x), rtol=1e-15, atol=0)


@pytest.mark.parametrize("make", [
    lambda p: geoopt.optim.RiemannianSGD([p], lr=0.1, momentum=0.9),
    lambda p: geoopt.optim.RiemannianAdam([p], lr=0.1),
], ids=["sgd-momentum", "adam"])
def test_geoopt_steps_on_a_sphere_parameter_stay_on_the_sphere(make):
    s = Sphere()
    p = geoopt.ManifoldParameter(s.random(6, generator=torch.Generator().manual_seed(0),
                                          dtype=torch.float64), manifold=s)
    opt = make(p)
    (p * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    opt.step()
    assert abs(float(p.detach().norm()) - 1.0) <= 4e-16


# ---- nn: SphereResidual and ScaleNorm --------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("parallel", [1.0, 10.0, 100.0])
def test_sphere_residual_keeps_norm_100_for_an_update_parallel_to_h(dtype, fused, parallel):
    h = torch.randn(4, 64, generator=torch.Generator().manual_seed(0), dtype=dtype)
    h = 100.0 * h / h.norm(dim=-1, keepdim=True)
    out = SphereResidual(dim=64, fused=fused).to(dtype)(h, parallel * h)
    assert torch.allclose(out.norm(dim=-1), torch.full((4,), 100.0, dtype=dtype),
                          rtol=4 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_scalenorm_refuses_a_non_real_floating_input(dtype):
    with pytest.raises(ValueError, match=rf"ScaleNorm expects a real floating-point input .* got dtype {dtype}"):
        ScaleNorm(4)(torch.ones(2, 4).to(dtype))


# ---- registries ------------------------------------------------------------------------------


def test_registering_over_a_builtin_retraction_is_refused():
    impostor = type("Impostor", (PRetraction,), {})
    with pytest.raises(ValueError, match=r"sphere retraction 'gnomonic' is already registered as "
                                         r"GnomonicRetraction; .* pass override=True"):
        register_retraction("sphere", "gnomonic")(impostor)
    assert type(get_retraction("sphere", "gnomonic")) is GnomonicRetraction


def test_registering_over_a_builtin_policy_is_refused():
    hetero = get_policy("hetero")
    with pytest.raises(ValueError, match=r"policy 'hetero' is already registered; .* pass override=True"):
        register_policy("hetero")(lambda name, module, param: None)
    assert get_policy("hetero") is hetero


def test_override_true_replaces_a_registered_policy(clean_policies):
    def first(name, module, param):
        return None

    def second(name, module, param):
        return None

    register_policy("test-bad-inputs-override")(first)
    with pytest.raises(ValueError, match="'test-bad-inputs-override' is already registered"):
        register_policy("test-bad-inputs-override")(second)
    register_policy("test-bad-inputs-override", override=True)(second)
    assert get_policy("test-bad-inputs-override") is second


@pytest.mark.parametrize("p", [True, False, "2", None])
def test_p_retraction_refuses_a_bool_or_a_string(p):
    with pytest.raises(ValueError, match=rf"p must be a number in \(0, inf\], got {re.escape(repr(p))}"):
        PRetraction(p)


# ---- manifolds: dtypes -----------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Stiefel, DGram, Sphere, Euclidean])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_manifolds_refuse_non_real_floating_tensors(cls, dtype):
    m = cls()
    x = torch.ones(4, 2).to(dtype)
    with pytest.raises(ValueError, match=rf"'x' must be a real floating-point tensor .* got "
                                         rf"dtype {dtype}"):
        m.projx(x)


@pytest.mark.parametrize("cls", [Stiefel, Sphere])
def test_a_tangent_vector_of_integer_dtype_is_refused(cls):
    m = cls()
    x = m.random(4, 2, dtype=torch.float64) if cls is Stiefel else m.random(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="'u' must be a real floating-point tensor .* got dtype torch.int64"):
        m.proju(x, torch.ones_like(x, dtype=torch.int64))


def test_check_tensor_refuses_a_non_tensor():
    with pytest.raises(ValueError, match="'x' must be a torch.Tensor, got list"):
        check_tensor([1.0], "x", "stiefel.projx")


@pytest.mark.parametrize("x_shape, u_shape", [((3, 4), (4,)), ((4,), (3, 4))])
def test_euclidean_retr_broadcasts_a_step_as_every_manifold_does(x_shape, u_shape):
    x, u = torch.randn(x_shape, dtype=torch.float64), torch.randn(u_shape, dtype=torch.float64)
    torch.testing.assert_close(Euclidean().retr(x, u), x + u, rtol=0, atol=0)


def test_euclidean_retr_refuses_a_step_of_another_batch_naming_both_shapes():
    with pytest.raises(ValueError, match=r"x of shape \(2, 3\) and u of shape \(3, 2\) are not one batch"):
        Euclidean().retr(torch.zeros(2, 3), torch.ones(3, 2))


@pytest.mark.parametrize("ndim", [-1, 1.5])
def test_euclidean_ndim(ndim):
    with pytest.raises(ValueError, match=f"ndim must be an int >= 0, got {ndim}"):
        Euclidean(ndim=ndim)


# ---- build_optimizer -------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8, bias=False)
        self.norm = nn.LayerNorm(8)


@pytest.mark.parametrize("kwargs, needle", [
    ({"lr": -1.0}, "lr must be a finite number > 0, got -1.0"),
    ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
    ({"lr": NAN}, "lr must be a finite number > 0, got nan"),
    ({"lr": "fast"}, "lr must be a finite number > 0, got 'fast'"),
    ({"adamw_lr": -1}, "adamw_lr must be a finite number > 0, got -1"),
    ({"adamw_lr": INF}, "adamw_lr must be a finite number > 0, got inf"),
    ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0, got -0.1"),
    ({"adamw_weight_decay": NAN}, "adamw_weight_decay must be a finite number >= 0, got nan"),
    ({"adamw_betas": (1.0, 0.9)}, r"adamw_betas must be two numbers in \[0, 1\), got \(1.0, 0.9\)"),
    ({"adamw_betas": (0.9,)}, r"adamw_betas must be two numbers in \[0, 1\), got \(0.9,\)"),
])
def test_build_optimizer_names_the_bad_argument(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        build_optimizer(_Tiny(), policy="unconstrained", **kwargs)


def test_a_policy_that_raises_is_reported_with_the_parameter_name():
    def policy(name, module, param):
        raise KeyError("boom")

    with pytest.raises(ValueError, match=r"raised KeyError on parameter 'attn.weight' of shape "
                                         r"\(8, 8\): 'boom'"):
        build_optimizer(_Tiny(), policy=policy)


def test_a_policy_returning_an_unknown_manifold_names_it():
    with pytest.raises(ValueError, match="to unknown manifold 'torus'"):
        build_optimizer(_Tiny(), policy=lambda name, module, p: "torus" if p.dim() == 2 else None)


# ---- the GPT and SEL -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt():
    return GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=16))


@pytest.mark.parametrize("bad, needle", [
    (50, r"token ids must be in \[0, 50\) \(vocab_size\), got ids from 0 to 50"),
    (999, "got ids from 0 to 999"),
    (-1, "got ids from -1 to"),
])
def test_token_ids_outside_the_vocabulary(gpt, bad, needle):
    idx = torch.zeros(1, 4, dtype=torch.long)
    idx[0, 2] = bad
    with pytest.raises(ValueError, match=needle):
        gpt(idx)


def test_float_token_ids(gpt):
    with pytest.raises(ValueError, match="token ids must be an integer tensor, got dtype "
                                         "torch.float32"):
        gpt(torch.zeros(1, 4))


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0,)])
def test_sel_on_an_empty_weight(shape):
    with pytest.raises(ValueError, match=rf"SEL needs a non-empty weight, got shape "
                                         rf"{shape}".replace("(", r"\(").replace(")", r"\)")):
        SEL(torch.empty(shape))


def test_sel_on_an_integer_weight():
    with pytest.raises(ValueError, match="weight must be a floating-point tensor"):
        SEL(torch.ones(3, 3, dtype=torch.int64))


# ---- configuration values --------------------------------------------------------------------


@pytest.mark.parametrize("key, value, needle", [
    ("lr", "inf", "lr must be a finite number, got inf"),
    ("lr", "nan", "lr must be a finite number, got nan"),
    ("adamw_lr", "-inf", "adamw_lr must be a finite number, got -inf"),
    ("weight_decay", "inf", "weight_decay must be a finite number, got inf"),
    ("grad_clip", "nan", "grad_clip must be a finite number, got nan"),
    ("temperature", "inf", "temperature must be a finite number, got inf"),
    ("sel_scale_lr", "inf", "sel_scale_lr must be a finite number, got inf"),
    ("beta1", "nan", "beta1 must be a finite number, got nan"),
    ("p", "nan", r"p must be a number in \(0, inf\], got nan"),
    ("seed", "-1", r"seed must be in \[0, 4294967295\] \(numpy's seed range\), got -1"),
    ("seed", str(2**70), f"got {2**70}"),
    ("seed", "2**70", r"--seed expects an integer, got '2\*\*70'"),
    ("device", "meta", "device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got 'meta'"),
    ("device", "gpu", "got 'gpu'"),
    ("device", "cuda:x", "got 'cuda:x'"),
    ("steps", "0", "steps must be >= 1, got 0"),
    ("top_k", "-3", "top_k must be >= 0, got -3"),
])
def test_config_values_are_checked_at_the_door(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        build_config("smoke", overrides={key: value})


@pytest.mark.parametrize("key, value, needle", [
    ("lr", "abc", "lr must be a number, got 'abc'"),
    ("lr", [1], r"lr must be a number, got \[1\]"),
    ("lr", True, "lr must be a number, got True"),
    ("steps", 20.5, "steps must be an integer, got 20.5"),
    ("steps", "20", "steps must be an integer, got '20'"),
    ("checkpoint", "no", "checkpoint must be a boolean, got 'no'"),
    ("corpus", None, "corpus must be a string, got None"),
])
def test_from_dict_refuses_a_value_of_the_wrong_type(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_dict({key: value})


def test_from_dict_takes_an_integer_for_a_number():
    assert TrainConfig.from_dict({"lr": 1}).lr == 1


def test_p_may_be_infinite():
    assert build_config("smoke", overrides={"p": "inf"}).p == math.inf


def test_a_config_directory_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_toml(tmp_path)


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("lr = = 3\n")
    with pytest.raises(ConfigError, match=f"config file {path} is not valid TOML"):
        load_toml(path)


# ---- the command line: exit 2, one error line ------------------------------------------------


def _one_error_line(capsys, needle: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("args, needle", [
    (["--lr", "inf"], "lr must be a finite number, got inf"),
    (["--seed", "-1"], "seed must be in [0, 4294967295]"),
    (["--seed", str(2**70)], f"got {2**70}"),
    (["--device", "meta"], "got 'meta'"),
    (["--steps", "many"], "--steps expects an integer, got 'many'"),
    (["--out", ""], "--out must name a run directory, got ''"),
    (["--out", "   "], "--out must name a run directory, got ''"),
    (["--resume", "--out", "{tmp}/nothing"], "has no checkpoint.pt"),
])
def test_cli_bad_values_exit_2(tmp_path, capsys, args, needle):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    argv = ["--preset", "smoke", *args] if "--resume" not in args else args
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "r")]
    assert main(argv) == 2
    _one_error_line(capsys, needle)
    assert not (tmp_path / "r").exists()


def test_cli_config_naming_a_directory_exits_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    _one_error_line(capsys, f"config file {tmp_path} is a directory")


def test_cli_resume_with_a_malformed_config_json_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert main(["--resume", "--out", str(tmp_path)]) == 2
    _one_error_line(capsys, f"cannot resume: {tmp_path / 'config.json'} is not a valid "
                            f"configuration")


@pytest.mark.parametrize("key, value, needle", [
    ("lr", "abc", "lr must be a number, got 'abc'"),
    ("steps", 20.5, "steps must be an integer, got 20.5"),
    ("colour", "red", "unknown config key 'colour'"),
])
def test_cli_resume_with_a_bad_value_in_config_json_names_the_file(tmp_path, capsys, key, value,
                                                                   needle):
    saved = {**build_config("smoke").to_dict(), key: value}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert main(["--resume", "--out", str(tmp_path)]) == 2
    _one_error_line(capsys, f"cannot resume: {tmp_path / 'config.json'} is not a valid "
                            f"configuration ({needle}")


def test_cli_resume_of_an_unsealed_checkpoint_exits_2(tmp_path, capsys):
    torch.save({"step": 1}, tmp_path / "checkpoint.pt")
    (tmp_path / "config.json").write_text(json.dumps(build_config("smoke").to_dict()))
    assert main(["--resume", "--out", str(tmp_path)]) == 2
    _one_error_line(capsys, "has no checksum")


def test_cli_out_below_a_regular_file_is_an_environment_fault(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["--preset", "smoke", "--out", str(blocker / "run")]) == 1
    _one_error_line(capsys, f"{blocker / 'run'}: Not a directory (ENOTDIR)")
