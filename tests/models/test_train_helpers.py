"""Public helpers of models.data and models.train: tokenizers, Corpus, checkpoint and resume guards."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import pytest
import torch

from models.config import ConfigError, TrainConfig
from models.data import BPETokenizer, ByteTokenizer, Corpus, CorpusError, load_corpus
from models.train import (
    RESUMABLE_FIELDS,
    RunError,
    load_optimizer_state,
    resolve_device,
    save_checkpoint,
)


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'π'\n"
    ids = tok.encode(text.encode("utf-8"))
    assert tok.vocab_size == 256 and max(ids) < 256
    assert tok.decode(ids) == text


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed")
def test_bpe_without_the_extra_is_a_corpus_error_naming_it():
    with pytest.raises(CorpusError, match=r"optional 'tokenizers' package.*pip install -e '\.\[bpe\]'"):
        BPETokenizer.train([b"abc abc"], vocab_size=300)


def test_a_bpe_vocabulary_smaller_than_asked_is_announced():
    # a text with fewer merges than asked gave a smaller vocabulary without a word: a sweep over
    # --bpe_vocab_size 1024 / 4096 on synthetic:20000 trained one 334-id tokenizer under each name
    pytest.importorskip("tokenizers")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = BPETokenizer.train([b"abc abd abe " * 50], vocab_size=258)
    assert small.vocab_size == 258
    with pytest.warns(RuntimeWarning) as caught:
        tok = BPETokenizer.train([b"abc abd abe " * 50], vocab_size=4096)
    assert tok.vocab_size < 4096
    assert str(caught[0].message).startswith(f"the BPE trained {tok.vocab_size} ids of the 4096 asked")


def test_load_corpus_returns_a_corpus_with_a_deterministic_split():
    a = load_corpus("synthetic:20000")
    b = load_corpus("synthetic:20000")
    assert isinstance(a, Corpus) and isinstance(a.tokenizer, ByteTokenizer)
    assert a.fingerprint == b.fingerprint and torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.numel() > a.val.numel() > 0


def test_resumable_fields_are_train_config_fields_and_exclude_the_model():
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    assert RESUMABLE_FIELDS <= names
    assert not RESUMABLE_FIELDS & {"n_layer", "n_embd", "connection", "lr", "seed", "corpus", "policy"}


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda", "mps")
    with pytest.raises(ConfigError, match="got 'warp-drive'"):
        resolve_device("warp-drive")


def test_save_checkpoint_is_atomic_and_never_goes_back(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 10, "x": 1}, previous_step=-1)
    assert torch.load(path, weights_only=True)["x"] == 1
    save_checkpoint(path, {"step": 5, "x": 2}, previous_step=10)   # an earlier step: ignored
    assert torch.load(path, weights_only=True)["x"] == 1
    save_checkpoint(path, {"step": 20, "x": 3}, previous_step=10)
    assert torch.load(path, weights_only=True)["x"] == 3
    assert torch.load(tmp_path / "checkpoint.prev.pt", weights_only=True)["x"] == 1
    # no temporary left behind: the newest and the previous checkpoint only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]


def test_load_optimizer_state_refuses_an_optimizer_that_drops_state():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    saved = opt.state_dict()

    class Forgetful(torch.optim.AdamW):
        def load_state_dict(self, state_dict):
            super().load_state_dict({**state_dict, "state": {}})

    fresh = Forgetful([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(RunError, match="lost its per-parameter state"):
        load_optimizer_state(fresh, saved)
    good = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    load_optimizer_state(good, saved)
    assert len(good.state_dict()["state"]) == 1
