"""Settings the configuration never reads (models.config.INERT_RULES): a user's are refused by
the command line, a preset's and a saved run's are not, and every rule is what the code does.
GPTConfig refuses the model's own (models.gpt.READ_RULES, the same rules), while a TrainConfig
holds a preset's or a saved run's outside its model and builds the model it always built.
Likewise a given tokenizer that is not the one the bin: shards were made with, and the one they
record, which a run on them takes when none is given."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from models.cli import config_from_args, parse_args
from models.config import (
    ConfigError,
    TrainConfig,
    build_config,
    config_keys,
    inert_settings,
    refuse_inert_settings,
)
from models.connections import CONNECTIONS
from models.data import CorpusError, check_given_tokenizer, resolve_tokenizer
from models.gpt import GPT, SPHERE_FIELDS, GPTConfig, unread_fields
from models.prepare import prepare
from models.shards import META_FILE, SHARD_FORMAT, recorded_tokenizer
from models.storage import load_checkpoint, save_checkpoint
from models.tokenizer import BPETokenizer
from models.train import build_model, build_train_optimizer, lr_scale, main, run_training

MUON = "only --optimizer manifold-muon reads it"
SPHERET = "only --connection spheret reads it (geonorm is spheret with the exponential map)"


def _refused(capsys, argv: list[str], line: str) -> None:
    """``argv`` exits 2 with exactly ``error: line`` and writes nothing."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {line}\n"


@pytest.mark.parametrize("args, line", [
    (["--optimizer", "adamw", "--muon_ns_dtype", "float32"],
     f"--muon_ns_dtype does nothing with optimizer=adamw: {MUON}"),
    (["--adamw_lr", "1e-3"], f"--adamw_lr does nothing with optimizer=adamw: {MUON}"),
    (["--policy", "hetero"], f"--policy does nothing with optimizer=adamw: {MUON}"),
    (["--muon-recipe", "reference"], f"--muon-recipe does nothing with optimizer=adamw: {MUON}"),
    (["--optimizer", "manifold-muon", "--policy", "hetero", "--muon_weight_decay", "0.2"],
     ("--muon_weight_decay does nothing with policy=hetero: it acts on Euclidean matrices, and "
      "this policy puts none of the GPT's there (--policy unconstrained does)")),
    (["--optimizer", "manifold-muon", "--policy", "unconstrained", "--muon_recipe", "reference",
      "--muon_ns_dtype", "float32"],
     ("--muon_ns_dtype does nothing with muon_recipe=reference: only --muon_recipe library reads "
      "it")),
    (["--optimizer", "manifold-muon", "--block_lr", "0"],
     ("--block_lr does nothing with optimizer=manifold-muon: only --optimizer adamw reads it "
      "(ManifoldMuon steps the block matrices at --lr)")),
    (["--sel_kappa", "2"], ("--sel_kappa does nothing with sel=none: only --sel mismatched, "
                            "congruent or no-linear reads it")),
    (["--schedule", "constant", "--min_lr_ratio", "0.5"],
     "--min_lr_ratio does nothing with schedule=constant: only --schedule cosine reads it"),
    (["--bpe_vocab_size", "512"],
     "--bpe_vocab_size does nothing with tokenizer=byte: only --tokenizer bpe reads it"),
    (["--corpus", "bin:shards", "--val_fraction", "0.2"],
     ("--val_fraction does nothing with corpus=bin:shards: token shards carry their tokenizer and "
      "their split; only a text corpus reads it")),
    (["--shard_dtype", "meta"],
     "--shard_dtype does nothing with corpus=synthetic:60000: only a --corpus bin:DIR reads it"),
    (["--sample_tokens", "0", "--top_k", "5"],
     "--top_k does nothing with sample_tokens=0: only --sample_tokens N > 0 reads it"),
    (["--progress", "false", "--progress_interval", "5"],
     "--progress_interval does nothing with progress=false: only --progress true reads it"),
    (["--connection", "geonorm", "--retraction", "cayley"],
     f"--retraction does nothing with connection=geonorm: {SPHERET}"),
    (["--retraction", "gnomonic", "--p", "2"],
     "--p does nothing with retraction=gnomonic: only --retraction p reads it"),
    (["--connection", "keel", "--sphere_step", "literal"],
     ("--sphere_step does nothing with connection=keel: only --connection geonorm or spheret "
      "reads it")),
    (["--damping", "none", "--damping_depth", "block"],
     "--damping_depth does nothing with damping=none: only --damping sqrt or linear reads it"),
    (["--connection", "pre-ln", "--dyt_alpha_init", "0.3"],
     "--dyt_alpha_init does nothing with connection=pre-ln: only --connection pre-dyt reads it"),
    (["--connection", "pre-ln", "--periln_embed_norm", "false"],
     ("--periln_embed_norm does nothing with connection=pre-ln: only --connection peri-ln reads "
      "it")),
    (["--connection", "pre-dyt", "--keel_alpha", "4"],
     "--keel_alpha does nothing with connection=pre-dyt: only --connection keel reads it"),
])
def test_a_setting_the_configuration_never_reads_is_refused(tmp_path, capsys, args, line):
    """Each was accepted and silently did nothing: a sweep over it trained the same run under
    other names."""
    _refused(capsys, ["--preset", "smoke", *args, "--out", str(tmp_path / "r")], line)
    assert not (tmp_path / "r").exists()


def test_every_inert_setting_is_named_in_one_line(tmp_path, capsys):
    _refused(capsys, ["--preset", "smoke", "--connection", "pre-ln", "--p", "2", "--muon_ns_dtype",
                      "float32", "--lr", "1e-3", "--sel_anneal_steps", "5",
                      "--out", str(tmp_path / "r")],
             f"--p does nothing with connection=pre-ln: {SPHERET}; --muon_ns_dtype does nothing "
             f"with optimizer=adamw: {MUON}; --sel_anneal_steps does nothing with sel=none: only "
             f"--sel mismatched, congruent or no-linear reads it")


def test_a_config_files_inert_key_is_named_as_a_key_of_that_file(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "smoke"\nconnection = "pre-ln"\nkeel_alpha = 3.0\n')
    _refused(capsys, ["--config", str(toml), "--out", str(tmp_path / "r")],
             f"'keel_alpha' in config file {toml} does nothing with connection=pre-ln: only "
             f"--connection keel reads it")


def _config(argv: list[str], out: Path):
    args, overrides = parse_args(argv)
    return config_from_args(args, overrides, out)


def test_presets_and_the_settings_that_read_them_are_accepted(tmp_path):
    """A preset's values are not the user's (smoke sets adamw_lr under adamw, default keeps its
    sphere settings under --connection pre-ln); a setting with what reads it is accepted."""
    assert _config(["--preset", "smoke"], tmp_path).adamw_lr == 1e-2
    assert _config(["--preset", "default", "--connection", "pre-ln"], tmp_path).p == 1.0
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "smoke"\n')
    assert _config(["--config", str(toml)], tmp_path).optimizer == "adamw"
    cfg = _config(["--preset", "smoke", "--optimizer", "manifold-muon", "--policy",
                   "unconstrained", "--muon_ns_dtype", "float32", "--muon_weight_decay", "0",
                   "--adamw_lr", "1e-3", "--connection", "pre-dyt", "--dyt_alpha_init", "0.3",
                   "--schedule", "cosine", "--min_lr_ratio", "0.2"], tmp_path)
    assert (cfg.muon_ns_dtype, cfg.dyt_alpha_init, cfg.min_lr_ratio) == ("float32", 0.3, 0.2)


def test_a_resume_refuses_an_inert_setting_and_keeps_resuming_without_one(tmp_path, capsys):
    """config.json holds every field, inert ones too: they are the saved run's, not the user's,
    so a plain --resume (and a bookkeeping change) still works."""
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--sample_tokens", "0", "--steps", "6", "--stop_at", "3",
                 "--eval_interval", "3", "--progress", "false", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["optimizer"] == "adamw" and "muon_ns_dtype" in saved
    capsys.readouterr()
    _refused(capsys, ["--resume", "--temperature", "0.5", "--out", str(out)],
             "--temperature does nothing with sample_tokens=0: only --sample_tokens N > 0 reads it")
    assert main(["--resume", "--eval_batches", "1", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]


def test_every_rule_names_config_keys():
    from models.config import INERT_RULES

    for settings, cause, _, used in INERT_RULES:
        assert set(settings) | {cause} <= set(config_keys()), settings
        assert used


def _trained(cfg, steps: int = 3) -> torch.Tensor:
    """Every parameter after ``steps`` of the loop's updates (schedule and multipliers) on a
    fixed batch, flattened: what a setting that is read changes."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, vocab_size=256)
    opt, mults = build_train_optimizer(model, cfg)
    base = [g["lr"] for g in opt.param_groups]
    x = torch.randint(0, 256, (4, cfg.block_size), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        for group, lr, mult in zip(opt.param_groups, base, mults):
            group["lr"] = lr * lr_scale(step, cfg) * mult(step)
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


MUON_ON = {"optimizer": "manifold-muon", "policy": "unconstrained", "lr": 0.02}


@pytest.mark.parametrize("inert, setting, used", [
    ({}, {"adamw_lr": 1e-4}, MUON_ON),
    ({}, {"muon_weight_decay": 0.5}, MUON_ON),
    ({}, {"muon_ns_dtype": "bfloat16"}, {**MUON_ON, "muon_ns_dtype": "float32"}),
    ({}, {"muon_recipe": "reference"}, MUON_ON),
    ({}, {"policy": "all-stiefel"}, MUON_ON),
    ({**MUON_ON, "muon_recipe": "reference", "muon_ns_dtype": "float32"},
     {"muon_ns_dtype": "bfloat16"}, None),
    ({**MUON_ON, "policy": "hetero"}, {"muon_weight_decay": 0.5}, MUON_ON),
    ({**MUON_ON, "policy": "hetero-inv", "muon_ns_dtype": "float32"},
     {"muon_ns_dtype": "bfloat16"}, {**MUON_ON, "muon_ns_dtype": "float32"}),
    ({}, {"sel_kappa": 2.0}, {"sel": "mismatched"}),
    ({}, {"sel_scale_lr": 0.1}, {"sel": "mismatched"}),
    ({}, {"sel_anneal_steps": 2}, {"sel": "mismatched"}),
    ({"schedule": "constant"}, {"min_lr_ratio": 0.9}, {"schedule": "cosine"}),
    ({"schedule": "constant"}, {"lr_schedule_version": 1}, {"schedule": "cosine"}),
    ({"connection": "pre-ln"}, {"retraction": "cayley"}, {"connection": "spheret"}),
    ({"connection": "geonorm"}, {"p": 2.0}, {"connection": "spheret"}),
    ({"retraction": "gnomonic"}, {"p": 2.0}, {"retraction": "p"}),
    ({"connection": "pre-ln"}, {"sphere_step": "literal"}, {"connection": "geonorm"}),
    ({"connection": "keel"}, {"alpha_init": 0.9}, {"connection": "spheret"}),
    ({"connection": "pre-ln"}, {"damping": "none"}, {"connection": "spheret"}),
    ({"connection": "peri-ln"}, {"norm_eps": 0.5}, {"connection": "spheret"}),
    ({"connection": "pre-ln"}, {"learn_alpha": False}, {"connection": "spheret"}),
    ({"connection": "pre-ln"}, {"learn_radius": False}, {"connection": "spheret"}),
    ({"connection": "pre-ln"}, {"fused": False}, None),
    ({"damping": "none"}, {"damping_depth": "block"}, {"damping": "sqrt"}),
    ({"connection": "pre-ln"}, {"dyt_alpha_init": 0.9}, {"connection": "pre-dyt"}),
    ({"connection": "spheret"}, {"dyt_alpha_attn": 0.1}, {"connection": "pre-dyt"}),
    ({"connection": "pre-ln"}, {"dyt_embed_scale": False}, {"connection": "pre-dyt"}),
    ({"connection": "pre-ln"}, {"periln_embed_norm": False}, {"connection": "peri-ln"}),
    ({"connection": "post-ln"}, {"keel_alpha": 1.0}, {"connection": "keel"}),
])
def test_an_inert_setting_changes_no_step_and_a_read_one_does(inert, setting, used):
    """The rules are the code's: where a rule calls a setting inert, training with another value
    of it gives the same parameters bit for bit; where it is read, different ones."""
    from models.config import inert_settings

    def trained(over):
        return _trained(build_config("smoke", overrides={"warmup_steps": 1, "steps": 4, **over}))

    cfg = build_config("smoke", overrides=inert)
    assert set(setting) <= inert_settings(cfg).keys()
    assert torch.equal(trained(inert), trained({**inert, **setting}))
    if used is not None:
        assert not set(setting) & inert_settings(build_config("smoke", overrides=used)).keys()
        assert not torch.equal(trained(used), trained({**used, **setting}))


def test_refuse_inert_settings_names_the_given_inert_settings_only():
    # the library function behind the command line's refusal: a preset's inert values pass, a
    # given one is named with the label the caller chose for it
    cfg = build_config("smoke", overrides={"optimizer": "adamw", "muon_ns_dtype": "float32"})
    refuse_inert_settings(cfg, {})  # the same settings from a preset: nothing given
    refuse_inert_settings(cfg, {"lr": "--lr"})  # read under adamw
    with pytest.raises(ConfigError, match=rf"^--muon_ns_dtype does nothing with optimizer=adamw: {MUON}$"):
        refuse_inert_settings(cfg, {"lr": "--lr", "muon_ns_dtype": "--muon_ns_dtype"})



# ---- the Python API: GPTConfig refuses a field its connection never reads --------------------

TINY = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
GEONORM = "(geonorm is spheret with the exponential map)"


@pytest.mark.parametrize("given, line", [
    ({"connection": "geonorm", "p": 2.0},
     (f"p=2.0 does nothing with connection='geonorm': only connection='spheret' reads it "
      f"{GEONORM}; leave p at its default 1.0")),
    ({"connection": "pre-ln", "retraction": "cayley"},
     (f"retraction='cayley' does nothing with connection='pre-ln': only connection='spheret' "
      f"reads it {GEONORM}; leave retraction at its default 'p'")),
    ({"connection": "spheret", "retraction": "exp", "p": 3},
     ("p=3 does nothing with retraction='exp': only retraction='p' reads it; leave p at its "
      "default 1.0")),
    ({"connection": "keel", "dyt_alpha_init": 0.5},
     ("dyt_alpha_init=0.5 does nothing with connection='keel': only connection='pre-dyt' reads "
      "it; leave dyt_alpha_init at its default 0.2")),
    ({"connection": "pre-ln", "alpha_init": 1.0},
     ("alpha_init=1.0 does nothing with connection='pre-ln': only connection='geonorm' or "
      "'spheret' reads it; leave alpha_init at its default 0.5")),
    ({"connection": "geonorm", "damping": "none", "damping_depth": "block"},
     ("damping_depth='block' does nothing with damping='none': only damping='sqrt' or 'linear' "
      "reads it; leave damping_depth at its default 'sublayer'")),
    ({"connection": "pre-dyt", "periln_embed_norm": False},
     ("periln_embed_norm=False does nothing with connection='pre-dyt': only connection='peri-ln' "
      "reads it; leave periln_embed_norm at its default True")),
    ({"connection": "peri-ln", "keel_alpha": 4.0},
     ("keel_alpha=4.0 does nothing with connection='peri-ln': only connection='keel' reads it; "
      "leave keel_alpha at its default 0.0")),
    ({"connection": "post-ln", "p": 2.0, "fused": False},
     (f"p=2.0 does nothing with connection='post-ln': only connection='spheret' reads it "
      f"{GEONORM}; leave p at its default 1.0; fused=False does nothing with "
      f"connection='post-ln': only connection='geonorm' or 'spheret' reads it; leave fused at "
      f"its default True")),
])
def test_gpt_config_refuses_a_field_its_configuration_never_reads(given, line):
    """Each was accepted and ignored: GPTConfig(connection="geonorm", p=2.0) built the
    exponential map, not the Cayley retraction the user asked for."""
    with pytest.raises(ValueError) as info:
        GPTConfig(**TINY, **given)
    assert str(info.value) == line


#: Values other than the defaults of the fields each connection reads besides the common ones.
READ_BY = {
    "pre-ln": {}, "post-ln": {},
    "peri-ln": {"periln_embed_norm": False},
    "pre-dyt": {"dyt_alpha_init": 0.3, "dyt_alpha_attn": 0.5, "dyt_embed_scale": False},
    "keel": {"keel_alpha": 3.0},
    "geonorm": {"damping": "linear", "damping_depth": "block", "sphere_step": "literal",
                "alpha_init": 1.0, "norm_eps": 1e-5, "learn_alpha": False,
                "learn_radius": False, "fused": False},
    "spheret": {"retraction": "p", "p": 2.0, "damping": "none", "sphere_step": "literal",
                "alpha_init": 1.0, "norm_eps": 1e-5, "learn_alpha": False,
                "learn_radius": False, "fused": False},
}


@pytest.mark.parametrize("connection", CONNECTIONS)
def test_every_connection_takes_the_defaults_and_the_fields_it_reads(connection):
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    for fields in ({}, READ_BY[connection]):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY, connection=connection, dropout=0.1, bias=True,
                              tie_weights=False, **fields))
        logits, _ = model(idx)
        assert logits.shape == (2, 8, 32) and torch.isfinite(logits).all()


#: A value other than the default for every field that some configuration leaves unread.
OTHER = {"retraction": "cayley", "p": 2.0, "damping": "linear", "sphere_step": "literal",
         "alpha_init": 1.0, "damping_depth": "block", "dyt_alpha_init": 0.3,
         "dyt_alpha_attn": 0.5, "dyt_embed_scale": False, "periln_embed_norm": False,
         "keel_alpha": 3.0, "norm_eps": 1e-5, "learn_alpha": False, "learn_radius": False,
         "fused": False, "dropout": 0.1, "bias": True, "tie_weights": False}


def test_gpt_config_refuses_exactly_the_model_fields_the_command_line_calls_inert():
    """One set of rules for both: under every connection, retraction and damping, a model field
    at another value than its default is refused by GPTConfig iff inert_settings names it."""
    assert OTHER.keys() | TINY.keys() | {"connection"} == set(GPTConfig.__dataclass_fields__)
    checked = 0
    for connection in CONNECTIONS:
        for retraction, damping in (("p", "sqrt"), ("exp", "sqrt"), ("p", "none")):
            base = {"connection": connection, "retraction": retraction, "damping": damping}
            if connection not in ("spheret", "geonorm") and (retraction, damping) != ("p", "sqrt"):
                continue  # unread themselves
            if connection == "geonorm" and retraction != "p":
                continue
            inert = inert_settings(build_config("smoke", overrides=base)).keys()
            for name, value in OTHER.items():
                if name in base:
                    continue
                try:
                    GPTConfig(**TINY, **base, **{name: value})
                    refused = False
                except ValueError as exc:
                    refused = True
                    assert str(exc).startswith(f"{name}={value!r} does nothing with "), exc
                assert refused == (name in inert), (base, name)
                checked += refused
    assert checked > 50


def test_from_settings_keeps_what_the_configuration_reads_and_checks_every_value():
    cfg = GPTConfig.from_settings(**TINY, connection="geonorm", p=2.0, retraction="cayley",
                                  alpha_init=1.0, keel_alpha=3.0)
    assert cfg == GPTConfig(**TINY, connection="geonorm", alpha_init=1.0)
    with pytest.raises(ValueError, match=r"^p must be a number in \(0, inf\], got -1.0$"):
        GPTConfig.from_settings(connection="pre-ln", p=-1.0)  # unread, and still a bad value
    with pytest.raises(ValueError, match=r"^unknown sphere retraction 'cayly'"):
        GPTConfig.from_settings(connection="pre-ln", retraction="cayly")
    with pytest.raises(TypeError, match=r"^GPTConfig has no field 'pp'$"):
        GPTConfig.from_settings(pp=2.0)


def _state(model: torch.nn.Module) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("read, unread", [
    ({"connection": "pre-ln"},
     {"retraction": "cayley", "p": 3.0, "alpha_init": 1.0, "fused": False}),
    ({"connection": "geonorm"}, {"p": 2.0, "retraction": "cayley", "dyt_alpha_init": 0.5}),
    ({"connection": "spheret", "retraction": "exp", "damping": "none"},
     {"p": 3.0, "damping_depth": "block", "keel_alpha": 2.0, "periln_embed_norm": False}),
])
def test_a_train_config_holding_unread_model_values_builds_the_model_it_always_built(read, unread):
    """A preset, a config file loaded without the command line or an older run's config.json may
    hold them (only the command line refuses them): the TrainConfig holds them outside its
    model, and build_model builds the model it built before, parameter for parameter."""
    clean = build_config("smoke", overrides=read)
    for held in (build_config("smoke", overrides={**read, **unread}),
                 TrainConfig.from_dict({**clean.to_dict(), **unread})):
        assert held.model == clean.model and held.to_dict() == {**clean.to_dict(), **unread}
        assert all(getattr(held, name) == value for name, value in unread.items())
        torch.manual_seed(0)
        built = _state(build_model(held, vocab_size=256))
        torch.manual_seed(0)
        expected = _state(build_model(clean, vocab_size=256))
        assert built.keys() == expected.keys()
        assert all(torch.equal(built[name], expected[name]) for name in expected)


def test_a_train_config_holds_only_values_its_model_leaves_unread():
    """unread_model_values reads through like a model field; one the model reads (or holds at
    that value) would make two descriptions of one configuration, and is refused."""
    model = GPTConfig(connection="pre-ln")
    cfg = TrainConfig(model=model, unread_model_values=(("alpha_init", 1.0),))
    assert cfg.alpha_init == 1.0 and cfg.to_dict()["alpha_init"] == 1.0
    assert build_model(cfg, vocab_size=256).config == GPTConfig(connection="pre-ln",
                                                               vocab_size=256)
    for pairs, match in [((("n_layer", 3),), "holds n_layer=3, which is not a value the model"),
                         ((("p", 1.0),), "holds p=1.0, which is not"),
                         ((("p", -1.0),), r"p must be a number in \(0, inf\], got -1.0")]:
        with pytest.raises(ConfigError, match=match):
            TrainConfig(model=model, unread_model_values=pairs)


def test_a_saved_run_holding_unread_model_values_resumes(tmp_path):
    """An older run may have saved values its connection never read, and no periln_embed_norm
    (which a resume takes as False, the behaviour before the field): a plain --resume finishes
    it, and its config.json keeps them."""
    out = tmp_path / "run"
    cfg = build_config("smoke", overrides={
        "connection": "pre-ln", "sample_tokens": 0, "progress": False, "eval_interval": 2,
        "warmup_steps": 1, "steps": 4, "stop_at": 2})
    run_training(cfg, out, echo=False)
    ckpt = load_checkpoint(out, move_damaged=False)[0]
    unread = {"retraction": "cayley", "p": 3.0, "alpha_init": 1.0, "keel_alpha": 2.0}
    old = {k: v for k, v in {**ckpt["config"], **unread}.items() if k != "periln_embed_norm"}
    save_checkpoint(out / "checkpoint.pt", {**ckpt, "config": old}, -1)
    (out / "config.json").write_text(json.dumps(old))
    assert main(["--resume", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]
    saved = json.loads((out / "config.json").read_text())
    assert {k: saved[k] for k in unread} == unread and saved["periln_embed_norm"] is False


# ---- a given tokenizer on token shards of another one --------------------------------------

needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="needs the optional tokenizers package")


def _recorded_as_bpe(folder: Path) -> Path:
    """Shards whose meta.json records the BPE tokenizer, as models.prepare writes it, without the
    tokenizer.json beside it (which needs the tokenizers package): the refusal reads meta.json
    alone, before any shard is opened."""
    folder.mkdir(parents=True)
    ids = {"train": np.arange(4000) % 300, "val": np.arange(400) % 300}
    sha = {}
    for split, tokens in ids.items():
        data = tokens.astype("<u2").tobytes()
        (folder / f"{split}.bin").write_bytes(data)
        sha[split] = hashlib.sha256(data).hexdigest()
    meta = {"format": SHARD_FORMAT, "version": 1, "tokenizer": "bpe", "vocab_size": 300,
            "dtype": "uint16", "train_tokens": 4000, "val_tokens": 400, "sha256": sha,
            "source": {}, "tokenizer_file": "tokenizer.json"}
    (folder / META_FILE).write_text(json.dumps(meta))
    return folder


def _without_meta(folder: Path) -> Path:
    """nanoGPT's shards: uint16 ids, no meta.json."""
    folder.mkdir(parents=True)
    for split, n in (("train", 4000), ("val", 400)):
        (np.arange(n) % 300).astype("<u2").tofile(folder / f"{split}.bin")
    return folder


def test_a_sample_prompt_on_shards_of_ids_is_refused(tmp_path, capsys):
    """On nanoGPT shards (tokenizer ids) the prompt encodes to no ids and the sample starts from
    the first training token: --sample_prompt hello gave the sample of the default 'def '."""
    from models.data import load_corpus
    from models.evaluation import generate_sample

    nano, out = _without_meta(tmp_path / "nano"), tmp_path / "r"
    _refused(capsys, ["--preset", "smoke", "--corpus", f"bin:{nano}", "--shard_dtype", "uint16",
                      "--steps", "2", "--sample_prompt", "hello", "--out", str(out)],
             "--sample_prompt does nothing with tokenizer=ids: ids read as they are have no text "
             "to encode a prompt with (the sample starts from the first training token); only a "
             "corpus with a tokenizer reads it")
    assert not out.exists()
    cfg = build_config("smoke", overrides={"sample_tokens": "4"})
    for spec, kw, prompts_read in ((f"bin:{nano}", {"shard_dtype": "uint16"}, False),
                                   ("synthetic:20000", {}, True)):
        corpus = load_corpus(spec, **kw)
        torch.manual_seed(0)
        model = build_model(cfg, corpus.vocab_size)
        samples = {generate_sample(model, corpus, cfg.replace(sample_prompt=prompt),
                                   torch.device("cpu")) for prompt in ("hello", "def ")}
        assert len(samples) == (2 if prompts_read else 1)
        assert ("sample_prompt" in inert_settings(resolve_tokenizer(cfg.replace(corpus=spec, **kw)))
                ) is not prompts_read


def _disagrees(given: str, label: str, folder: Path, made_with: str) -> str:
    return (f"tokenizer {given!r} ({label}) disagrees with the token shards {folder}: they were "
            f"made with the {made_with!r} tokenizer (their meta.json says so), which a run on "
            f"them always uses; drop {label}, or use shards made with the {given!r} tokenizer")


def test_recorded_tokenizer_reads_meta_json_alone(tmp_path):
    """byte and BPE as meta.json records them (no tokenizer.json is opened: the BPE folder has
    none), "ids" without meta.json, None without a folder; a damaged meta.json is refused as
    opening the shards refuses it."""
    byte = tmp_path / "byte"
    prepare("synthetic:20000", byte)
    assert recorded_tokenizer(byte) == "byte"
    assert recorded_tokenizer(str(_recorded_as_bpe(tmp_path / "bpe"))) == "bpe"
    assert recorded_tokenizer(_without_meta(tmp_path / "nano")) == "ids"
    assert recorded_tokenizer(tmp_path / "missing") is None
    assert recorded_tokenizer(byte / "train.bin") is None  # a file, not a folder
    (byte / META_FILE).write_text("{")
    with pytest.raises(CorpusError, match=f"^{re.escape(str(byte / META_FILE))} cannot be read as JSON: "):
        recorded_tokenizer(byte)
    meta = json.loads((tmp_path / "bpe" / META_FILE).read_text())
    (byte / META_FILE).write_text(json.dumps({**meta, "tokenizer": "gpt2"}))
    with pytest.raises(CorpusError, match=re.escape(
            f"{byte / META_FILE}: 'tokenizer' must be one of ['byte', 'bpe'], got 'gpt2'")):
        recorded_tokenizer(byte)


def test_check_given_tokenizer_passes_the_shards_own_and_refuses_another(tmp_path):
    bpe, nano = _recorded_as_bpe(tmp_path / "bpe"), _without_meta(tmp_path / "nano")
    byte = tmp_path / "byte"
    prepare("synthetic:20000", byte)
    for spec, tokenizer in (("synthetic:20000", "bpe"), ("stdlib", "byte"), (f"bin:{bpe}", "bpe"),
                            (f"bin:{byte}", "byte"), (f"bin:{tmp_path / 'missing'}", "bpe"),
                            ("bin:", "byte")):
        assert check_given_tokenizer(spec, tokenizer, "--tokenizer") is None
    with pytest.raises(CorpusError) as refused:
        check_given_tokenizer(f"bin:{bpe}", "byte", "--tokenizer")
    assert str(refused.value) == _disagrees("byte", "--tokenizer", bpe, "bpe")
    label = "'tokenizer' in config file run.toml"
    with pytest.raises(CorpusError) as refused:
        check_given_tokenizer(f"bin:{byte}", "bpe", label)
    assert str(refused.value) == _disagrees("bpe", label, byte, "byte")
    for tokenizer in ("byte", "bpe"):  # nanoGPT shards take no tokenizer at all
        with pytest.raises(CorpusError) as refused:
            check_given_tokenizer(f"bin:{nano}", tokenizer, "--tokenizer")
        assert str(refused.value) == (
            f"tokenizer {tokenizer!r} (--tokenizer) cannot apply to the token shards {nano}: they "
            f"have no meta.json, so a run reads their ids as they are, with no tokenizer; drop "
            f"--tokenizer, or write the shards with python -m models.prepare --tokenizer "
            f"{tokenizer}, which records it")


def test_resolve_tokenizer_takes_the_tokenizer_of_the_corpus(tmp_path):
    """The configuration a run on the corpus is: tokenizer "auto" becomes the shards' recorded
    one, "ids" for nanoGPT shards, "byte" for a text corpus (a missing folder keeps it, refused
    when opened); a named one is kept (and judged by check_given_tokenizer); bpe_vocab_size
    stays inert on shards for the corpus's reason."""
    bpe, nano = _recorded_as_bpe(tmp_path / "bpe"), _without_meta(tmp_path / "nano")
    byte = tmp_path / "byte"
    prepare("synthetic:20000", byte)
    cfg = build_config("smoke", overrides={"corpus": f"bin:{bpe}"})
    adopted = resolve_tokenizer(cfg)
    assert (cfg.tokenizer, adopted.tokenizer) == ("auto", "bpe")
    assert adopted.replace(tokenizer="auto") == cfg
    assert inert_settings(adopted) == inert_settings(cfg)
    assert inert_settings(adopted)["bpe_vocab_size"] == (
        f"does nothing with corpus=bin:{bpe}: token shards carry their tokenizer and their split; "
        f"only a text corpus reads it")
    for corpus, tokenizer in (("synthetic:20000", "byte"), (f"bin:{byte}", "byte"),
                              (f"bin:{nano}", "ids"), (f"bin:{tmp_path / 'missing'}", "auto"),
                              ("bin:", "auto")):
        auto = build_config("smoke", overrides={"corpus": corpus})
        assert resolve_tokenizer(auto).tokenizer == tokenizer
        for named in ("byte", "bpe"):
            kept = auto.replace(tokenizer=named)
            assert resolve_tokenizer(kept) is kept
    (byte / META_FILE).write_text("[]")
    with pytest.raises(CorpusError, match="is not token-shard metadata"):
        resolve_tokenizer(build_config("smoke", overrides={"corpus": f"bin:{byte}"}))


def test_a_fresh_run_on_shards_is_configured_with_their_tokenizer_and_a_resumed_one_keeps_its_own(
        tmp_path, capsys):
    """Without --tokenizer a fresh configuration on BPE shards said byte (the default), while
    the run read BPE ids; a saved run's configuration stays as saved."""
    bpe, nano = _recorded_as_bpe(tmp_path / "bpe"), _without_meta(tmp_path / "nano")
    out = tmp_path / "run"
    assert _config(["--preset", "smoke", "--corpus", f"bin:{bpe}"], out).tokenizer == "bpe"
    toml = tmp_path / "run.toml"
    toml.write_text(f'preset = "smoke"\ncorpus = "bin:{bpe}"\n')
    assert _config(["--config", str(toml)], out).tokenizer == "bpe"
    assert _config(["--preset", "smoke", "--corpus", f"bin:{nano}", "--shard_dtype", "uint16"],
                   out).tokenizer == "ids"  # no tokenizer recorded: their ids as they are
    # bpe_vocab_size is refused on shards for the corpus's reason, as before; not the tokenizer's
    _refused(capsys, ["--preset", "smoke", "--corpus", f"bin:{bpe}", "--bpe_vocab_size", "512",
                      "--out", str(out)],
             f"--bpe_vocab_size does nothing with corpus=bin:{bpe}: token shards carry their "
             f"tokenizer and their split; only a text corpus reads it")
    # a run saved as byte on these shards (before this change) resumes as byte, not as bpe
    out.mkdir()
    saved = build_config("smoke", overrides={"corpus": f"bin:{bpe}", "tokenizer": "byte"}).to_dict()
    (out / "config.json").write_text(json.dumps(saved))
    assert _config(["--resume", "--out", str(out)], out).tokenizer == "byte"


def test_a_given_tokenizer_the_shards_were_not_made_with_is_refused_before_the_run(tmp_path,
                                                                                    capsys):
    """--tokenizer byte on BPE shards trained on the BPE ids, the given tokenizer silently
    ignored; byte is also the default, so only a given one is refused (below: the default
    trains)."""
    out = tmp_path / "r"
    bpe = _recorded_as_bpe(tmp_path / "bpe")
    _refused(capsys, ["--preset", "smoke", "--corpus", f"bin:{bpe}", "--tokenizer", "byte",
                      "--out", str(out)], _disagrees("byte", "--tokenizer", bpe, "bpe"))
    toml = tmp_path / "run.toml"
    toml.write_text(f'preset = "smoke"\ncorpus = "bin:{bpe}"\ntokenizer = "byte"\n')
    label = f"'tokenizer' in config file {toml}"
    _refused(capsys, ["--config", str(toml), "--out", str(out)],
             _disagrees("byte", label, bpe, "bpe"))
    byte = tmp_path / "byte"
    prepare("synthetic:20000", byte)
    _refused(capsys, ["--preset", "smoke", "--corpus", f"bin:{byte}", "--tokenizer", "bpe",
                      "--out", str(out)], _disagrees("bpe", "--tokenizer", byte, "byte"))
    nano = _without_meta(tmp_path / "nano")
    _refused(capsys, ["--preset", "smoke", "--corpus", f"bin:{nano}", "--shard_dtype", "uint16",
                      "--tokenizer", "byte", "--out", str(out)],
             f"tokenizer 'byte' (--tokenizer) cannot apply to the token shards {nano}: they have "
             f"no meta.json, so a run reads their ids as they are, with no tokenizer; drop "
             f"--tokenizer, or write the shards with python -m models.prepare --tokenizer byte, "
             f"which records it")
    assert not out.exists()
    # agreeing with the shards, or on a text corpus, a given tokenizer is accepted
    assert _config(["--preset", "smoke", "--corpus", f"bin:{bpe}", "--tokenizer", "bpe"],
                   out).tokenizer == "bpe"
    assert _config(["--preset", "smoke", "--corpus", f"bin:{byte}", "--tokenizer", "byte"],
                   out).tokenizer == "byte"
    assert _config(["--preset", "smoke", "--tokenizer", "byte"], out).tokenizer == "byte"


@needs_tokenizers
def test_bpe_shards_train_with_the_default_tokenizer_and_refuse_a_given_byte(tmp_path, capsys):
    """Without --tokenizer BPE shards train with their tokenizer and the run records it (its
    config.json said byte, the default, and it kept no tokenizer.json); a resumed run's saved
    tokenizer is not the user's either, a --tokenizer given to the resume is."""
    shards, out = tmp_path / "bpe", tmp_path / "run"
    prepare("synthetic:20000", shards, tokenizer="bpe", vocab_size=300)
    base = ["--preset", "smoke", "--corpus", f"bin:{shards}", "--sample_tokens", "0",
            "--progress", "false", "--eval_interval", "2"]
    _refused(capsys, [*base, "--steps", "2", "--tokenizer", "byte", "--out", str(out)],
             _disagrees("byte", "--tokenizer", shards, "bpe"))
    assert not out.exists()
    assert main([*base, "--steps", "4", "--stop_at", "2", "--out", str(out)]) == 0
    assert json.loads((out / "corpus.json").read_text())["tokenizer"] == "bpe"
    # recorded as the shards' tokenizer (it said byte, the default), and kept like a BPE run's
    assert json.loads((out / "config.json").read_text())["tokenizer"] == "bpe"
    assert load_checkpoint(out, move_damaged=False)[0]["config"]["tokenizer"] == "bpe"
    shards_json = BPETokenizer.load(shards / "tokenizer.json").to_json()
    assert (out / "tokenizer.json").read_text() == shards_json
    capsys.readouterr()
    _refused(capsys, ["--resume", "--tokenizer", "byte", "--out", str(out)],
             _disagrees("byte", "--tokenizer", shards, "bpe"))
    # the resume reads the shards' own tokenizer.json, not the run's copy
    (out / "tokenizer.json").write_text("not a tokenizer")
    assert main(["--resume", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]
    assert json.loads((out / "config.json").read_text())["tokenizer"] == "bpe"


@needs_tokenizers
def test_a_run_on_bpe_shards_saved_as_byte_still_resumes_as_saved(tmp_path, capsys):
    """Runs made before the shards' tokenizer was recorded say byte in config.json and their
    checkpoint, and have no tokenizer.json: a resume through run_training with tokenizer "auto"
    and a plain --resume finish them, as byte."""
    shards, out = tmp_path / "bpe", tmp_path / "run"
    prepare("synthetic:20000", shards, tokenizer="bpe", vocab_size=300)
    cfg = build_config("smoke", overrides={
        "corpus": f"bin:{shards}", "sample_tokens": "0", "progress": "false",
        "eval_interval": "2", "steps": "6", "stop_at": "2"})
    run_training(cfg, out, echo=False)
    # what earlier versions saved: byte, and no copy of the tokenizer
    ckpt = load_checkpoint(out, move_damaged=False)[0]
    save_checkpoint(out / "checkpoint.pt", {**ckpt, "config": {**ckpt["config"],
                                                               "tokenizer": "byte"}}, -1)
    (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "tokenizer": "byte"}))
    (out / "tokenizer.json").unlink()
    assert cfg.tokenizer == "auto"
    run_training(cfg.replace(stop_at=4), out, resume=True, echo=False)
    assert json.loads((out / "config.json").read_text())["tokenizer"] == "byte"
    assert main(["--resume", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]
    assert json.loads((out / "config.json").read_text())["tokenizer"] == "byte"
    assert load_checkpoint(out, move_damaged=False)[0]["config"]["tokenizer"] == "byte"


def test_unread_fields_names_what_each_connection_leaves_unread_and_why():
    pre_ln = unread_fields(GPTConfig(connection="pre-ln"))
    assert set(SPHERE_FIELDS) | {"retraction", "p", "keel_alpha", "dyt_alpha_init"} <= set(pre_ln)
    assert pre_ln["p"] == ("connection", ("spheret",), "geonorm is spheret with the exponential map")
    geonorm = unread_fields(GPTConfig(connection="geonorm"))
    assert not set(SPHERE_FIELDS) & set(geonorm) and {"retraction", "p"} <= set(geonorm)
    spheret = unread_fields(GPTConfig(connection="spheret", retraction="p", p=2.0))
    assert not {"retraction", "p", *SPHERE_FIELDS} & set(spheret)
    assert "p" in unread_fields(GPTConfig(connection="spheret", retraction="cayley"))
