"""The tokenizer a run records is the one it trained with, whatever started it (the command line,
models.compare or run_training called directly), a configuration that names another one than
the token shards' is refused, and a resume refuses a tokenizer.json that is not the file the run
started with."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil

import numpy as np
import pytest

from models.config import build_config
from models.data import CorpusError
from models.prepare import prepare
from models.storage import RunError, load_checkpoint
from models.tokenizer import BPETokenizer
from models.train import run_training

needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="needs the optional tokenizers package")

#: Two steps of four, an evaluation (and a checkpoint) at each: a run to resume, in a second.
_SHORT = {"sample_tokens": "0", "progress": "false", "eval_interval": "2", "steps": "4",
          "stop_at": "2"}


def _config(corpus: str, **overrides):
    return build_config("smoke", overrides={"corpus": corpus, **_SHORT, **overrides})


def _saved_tokenizers(out) -> tuple[str, str, str]:
    """What config.json, the checkpoint's configuration and corpus.json say."""
    return (json.loads((out / "config.json").read_text())["tokenizer"],
            load_checkpoint(out, move_damaged=False)[0]["config"]["tokenizer"],
            json.loads((out / "corpus.json").read_text())["tokenizer"])


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards") / "bpe"
    prepare("synthetic:20000", folder, tokenizer="bpe", vocab_size=300)
    return folder


@needs_tokenizers
def test_run_training_records_the_tokenizer_of_the_shards_it_trained_on(tmp_path, bpe_shards):
    """run_training with a configuration that names no tokenizer, on BPE shards: config.json
    and the checkpoint said "byte" (the old default) while the run read BPE ids (corpus.json:
    "bpe"), and the run directory kept no tokenizer.json. A resume with the same configuration
    resumes the run as it saved itself."""
    cfg, out = _config(f"bin:{bpe_shards}"), tmp_path / "run"
    run_training(cfg, out, echo=False)
    assert _saved_tokenizers(out) == ("bpe", "bpe", "bpe")
    shards_json = BPETokenizer.load(bpe_shards / "tokenizer.json").to_json()
    assert (out / "tokenizer.json").read_text() == shards_json
    assert cfg.tokenizer == "auto"  # the default: the corpus's own
    assert run_training(cfg.replace(stop_at=0), out, resume=True, echo=False)["finished"]
    assert _saved_tokenizers(out) == ("bpe", "bpe", "bpe")


def _nanogpt_shards(folder):
    folder.mkdir(parents=True)
    for split, n in (("train", 4000), ("val", 400)):
        (np.arange(n) % 300).astype("<u2").tofile(folder / f"{split}.bin")
    return folder


def test_a_run_records_the_tokenizer_of_a_text_corpus_and_the_ids_of_nanogpt_shards(tmp_path):
    """nanoGPT shards (no meta.json) are read as ids, with no tokenizer (corpus.json: "ids"),
    and their config.json said "byte"; a text corpus's run says "byte" as before."""
    nano = _nanogpt_shards(tmp_path / "nano")
    run_training(_config(f"bin:{nano}", shard_dtype="uint16"), tmp_path / "nano-run", echo=False)
    assert _saved_tokenizers(tmp_path / "nano-run") == ("ids", "ids", "ids")
    run_training(_config("synthetic:20000"), tmp_path / "text-run", echo=False)
    assert _saved_tokenizers(tmp_path / "text-run") == ("byte", "byte", "byte")


def _disagrees(named: str, folder, made_with: str) -> str:
    return (f"tokenizer {named!r} (the configuration's) disagrees with the token shards "
            f"{folder}: they were made with the {made_with!r} tokenizer (their meta.json says "
            f"so), which a run on them always uses; set tokenizer='auto' for theirs, or use "
            f"shards made with the {named!r} tokenizer")


@needs_tokenizers
def test_a_configuration_naming_another_tokenizer_than_the_shards_is_refused(tmp_path,
                                                                            bpe_shards):
    """tokenizer="byte" given to run_training on BPE shards trained on the BPE ids under a
    configuration that said bytes; "byte" on nanoGPT shards likewise. Each is refused before
    anything is written, naming the folder and both tokenizers."""
    out = tmp_path / "run"
    with pytest.raises(CorpusError) as refused:
        run_training(_config(f"bin:{bpe_shards}", tokenizer="byte"), out, echo=False)
    assert str(refused.value) == _disagrees("byte", bpe_shards, "bpe")
    byte = tmp_path / "byte"
    prepare("synthetic:20000", byte)
    with pytest.raises(CorpusError) as refused:
        run_training(_config(f"bin:{byte}", tokenizer="bpe"), out, echo=False)
    assert str(refused.value) == _disagrees("bpe", byte, "byte")
    nano = _nanogpt_shards(tmp_path / "nano")
    with pytest.raises(CorpusError) as refused:
        run_training(_config(f"bin:{nano}", shard_dtype="uint16", tokenizer="byte"), out,
                     echo=False)
    assert str(refused.value) == (
        f"tokenizer 'byte' (the configuration's) cannot apply to the token shards {nano}: they "
        f"have no meta.json, so a run reads their ids as they are, with no tokenizer; set "
        f"tokenizer='auto' for theirs, or write the shards with python -m models.prepare "
        f"--tokenizer byte, which records it")
    assert not out.exists()
    # the shards' own tokenizer, named, trains
    run_training(_config(f"bin:{bpe_shards}", tokenizer="bpe"), out, echo=False)
    assert _saved_tokenizers(out) == ("bpe", "bpe", "bpe")


# ---- a resume reads the tokenizer the run started with, or refuses -------------------------


def _edit_decoder(path) -> bytes:
    """Drop the decoder of ``path`` (the ids it encodes stay the same); the original bytes."""
    original = path.read_bytes()
    path.write_text(json.dumps({**json.loads(original), "decoder": None}))
    return original


def _drop_recorded_digest(folder) -> None:
    """``meta.json`` as ``models.prepare`` wrote it before it recorded ``tokenizer_sha256``."""
    meta = json.loads((folder / "meta.json").read_text())
    meta.pop("tokenizer_sha256", None)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _changed(path, now: str, saved: str, detail: str = "",
             advice: str = "restore that file") -> str:
    return (f"cannot resume: the tokenizer file {path} changed since the run started (SHA-256 "
            f"{now[:12]} != {saved[:12]}, which the checkpoint records{detail}): the run's token "
            f"ids were made with the one it started with, so its samples would decode "
            f"otherwise; {advice}, or start a fresh run")


@needs_tokenizers
def test_a_resume_refuses_a_shard_tokenizer_file_changed_since_the_run_started(tmp_path,
                                                                                bpe_shards):
    """The shards' tokenizer.json edited after the run started (decoder dropped: the shards and
    their ids unchanged) resumed the run without a word, and its sample then decoded with the
    edited file. The checkpoint and corpus.json now record the file's SHA-256, and the resume is
    refused naming the file, both digests, the section that differs from the run's copy and how
    to restore it; restored, it resumes."""
    shards, out = tmp_path / "bpe", tmp_path / "run"
    shutil.copytree(bpe_shards, shards)
    _drop_recorded_digest(shards)  # else opening the shards refuses the edit before the resume
    cfg = _config(f"bin:{shards}")
    run_training(cfg, out, echo=False)
    digest = hashlib.sha256((shards / "tokenizer.json").read_bytes()).hexdigest()
    original = _edit_decoder(shards / "tokenizer.json")
    now = hashlib.sha256((shards / "tokenizer.json").read_bytes()).hexdigest()
    with pytest.raises(RunError) as refused:
        run_training(cfg.replace(stop_at=0), out, resume=True, echo=False)
    copy = out / "tokenizer.json"
    assert str(refused.value) == _changed(
        shards / "tokenizer.json", now, digest,
        f"; sections that differ from the run's copy {copy}: 'decoder'",
        f"copy {copy} (the file the run started with) back to {shards / 'tokenizer.json'}")
    assert load_checkpoint(out, move_damaged=False)[0]["tokenizer_sha256"] == digest
    assert json.loads((out / "corpus.json").read_text())["tokenizer_sha256"] == digest
    (shards / "tokenizer.json").write_bytes(original)
    assert run_training(cfg.replace(stop_at=0), out, resume=True, echo=False)["finished"]


@needs_tokenizers
def test_a_resume_refuses_a_runs_own_tokenizer_file_changed_where_the_ids_are_not(tmp_path):
    """A BPE run on text reads its own tokenizer.json on resume; the token ids were checked, so
    an edit that leaves them (the decoder) resumed silently and changed the decoded samples."""
    out = tmp_path / "run"
    cfg = _config("synthetic:20000", tokenizer="bpe", bpe_vocab_size="300")
    run_training(cfg, out, echo=False)
    saved = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    _edit_decoder(out / "tokenizer.json")
    now = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    with pytest.raises(RunError) as refused:
        run_training(cfg.replace(stop_at=0), out, resume=True, echo=False)
    assert str(refused.value) == _changed(out / "tokenizer.json", now, saved)


@needs_tokenizers
def test_a_fresh_run_refuses_shards_whose_tokenizer_file_changed_since_prepare(tmp_path,
                                                                               bpe_shards):
    """Only a resume checked the tokenizer file (against the checkpoint's digest): a fresh run on
    BPE shards whose tokenizer.json was edited after models.prepare made them (decoder dropped,
    the shards and their ids unchanged) trained without a word and decoded with the edited
    file. meta.json now records the SHA-256 of the tokenizer.json prepare wrote, and opening the
    shards refuses another one, naming the file, both digests and what to do, before anything
    is written. Restored, the folder trains; a meta.json from before the digest (none recorded)
    trains as before."""
    shards, out = tmp_path / "bpe", tmp_path / "run"
    shutil.copytree(bpe_shards, shards)
    digest = hashlib.sha256((shards / "tokenizer.json").read_bytes()).hexdigest()
    original = _edit_decoder(shards / "tokenizer.json")
    now = hashlib.sha256((shards / "tokenizer.json").read_bytes()).hexdigest()
    with pytest.raises(CorpusError) as refused:
        run_training(_config(f"bin:{shards}"), out, echo=False)
    assert str(refused.value) == (
        f"tokenizer file {shards / 'tokenizer.json'} changed since {shards / 'meta.json'} was "
        f"written (SHA-256 {now[:12]} != {digest[:12]}, which it records): the shards' token ids "
        f"were made with that file, so a run would decode them otherwise; restore it, or "
        f"prepare the shards again with python -m models.prepare")
    assert not out.exists()
    assert json.loads((shards / "meta.json").read_text())["tokenizer_sha256"] == digest
    (shards / "tokenizer.json").write_bytes(original)
    run_training(_config(f"bin:{shards}"), out, echo=False)
    assert _saved_tokenizers(out) == ("bpe", "bpe", "bpe")
    _drop_recorded_digest(shards)
    run_training(_config(f"bin:{shards}"), tmp_path / "old-format", echo=False)
    assert _saved_tokenizers(tmp_path / "old-format") == ("bpe", "bpe", "bpe")
