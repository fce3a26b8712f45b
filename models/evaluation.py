"""Evaluation of a training run: validation loss, eval-time diagnostics, the final sample."""

from __future__ import annotations

import contextlib
import math

import torch

from .config import TrainConfig
from .data import Corpus, eval_batches

__all__ = ["diagnostics", "evaluate", "generate_sample", "perplexity"]


def perplexity(loss: float) -> float:
    """``exp(loss)``, ``inf`` on overflow."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig, device: torch.device,
             autocast=contextlib.nullcontext, *, world_size: int = 1) -> float:
    """Mean validation loss over ``eval_batches`` fixed batches (no random state is touched).

    Each batch of ``batch_size`` sequences runs in ``grad_accum_steps * world_size`` equal
    chunks (the micro-batch one of ``world_size`` ranks trains on, so that memory stays
    bounded where training fits); the mean of the chunks' mean losses is the batch's mean loss.
    """
    was_training = model.training
    model.eval()
    chunk = cfg.batch_size // (cfg.grad_accum_steps * world_size)
    losses = []
    for x, y in eval_batches(corpus.val, cfg.batch_size, cfg.block_size, cfg.eval_batches):
        for start in range(0, len(x), chunk):
            with autocast():
                _, loss = model(x[start:start + chunk].to(device),
                                y[start:start + chunk].to(device))
            losses.append(float(loss))
    model.train(was_training)
    return sum(losses) / len(losses)


def _nan_max(values) -> float:
    """``max(values)``, NaN where one is NaN (Python's ``max`` keeps or drops a NaN by position)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _nan_min(values) -> float:
    """``min(values)``, NaN where one is NaN."""
    return math.nan if any(math.isnan(v) for v in values) else min(values)


def _spectral_norm(w: torch.Tensor) -> torch.Tensor:
    """The largest singular value of ``w`` (``(m, n)``), NaN where an entry is not finite: the SVD
    of such a matrix does not converge (``LinAlgError``), so it runs on zeros instead, chosen on
    the device without a host sync."""
    w = w.float()
    finite = torch.isfinite(w).all()
    norm = torch.linalg.matrix_norm(torch.where(finite, w, torch.zeros_like(w)), ord=2)
    return torch.where(finite, norm, torch.full_like(norm, math.nan))


def _weight_tails(model: torch.nn.Module) -> dict[str, float]:
    """Heavy-tail statistics of the (effective, under a chart) block weights: the mean kurtosis
    :math:`E[(w-\\mu)^4]/\\sigma^4` (3 for a Gaussian) and the largest max|w|/std."""
    kurtosis, ratios = [], []
    for name, module in model.named_modules():
        if name.startswith("blocks.") and isinstance(module, torch.nn.Linear):
            w = module.weight.detach().double().flatten()
            centered = w - w.mean()
            var = float(centered.square().mean())
            if var > 0 or math.isnan(var):  # a non-finite weight: NaN statistics
                kurtosis.append(float(centered.pow(4).mean()) / var**2)
                ratios.append(float(w.abs().max()) / math.sqrt(var))
    if not kurtosis:
        return {}
    return {"weight_kurtosis_mean": sum(kurtosis) / len(kurtosis),
            "weight_max_over_std": _nan_max(ratios)}


@torch.no_grad()
def diagnostics(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig, device: torch.device
                ) -> dict[str, float | None]:
    """Eval-time statistics of the model (on up to 4 validation sequences); one that is not
    finite (NaN, inf) is ``None``, which ``metrics.jsonl`` holds as null: measured and not a
    number, where a key the model has no statistic for is absent.

    The largest spectral norm of the attention ``q`` / ``k`` maps; over the layers of
    ``model.attention_statistics(x)`` (where the model has it) the largest attention logit, the
    smallest mean attention entropy and the largest mean max-probability; the mean and largest
    rotation angle of the sphere residuals (``model.step_angles``, radians); Keel's largest
    sub-layer-to-highway ratio after the first sub-layer (``model.keel_branch_ratios``); the heavy-tail
    statistics of the block weights.
    """
    out: dict[str, float] = {}
    qk = {"q": [], "k": []}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in qk and ".attn" in f".{name}" and isinstance(module, torch.nn.Linear):
            qk[last].append(float(_spectral_norm(module.weight)))
    for key, values in qk.items():
        if values:
            out[f"{key}_spectral_norm_max"] = _nan_max(values)
    x, _ = next(eval_batches(corpus.val, min(cfg.batch_size, 4), cfg.block_size, 1))
    x = x.to(device)
    if hasattr(model, "attention_statistics"):
        layers = model.attention_statistics(x)
        out["max_attention_logit"] = _nan_max([layer["max_logit"] for layer in layers])
        out["attention_entropy_min"] = _nan_min([layer["entropy"] for layer in layers])
        out["attention_max_prob"] = _nan_max([layer["max_prob"] for layer in layers])
    angles = model.step_angles(x) if hasattr(model, "step_angles") else []
    if angles:
        out["step_angle_mean"] = sum(angles) / len(angles)
        out["step_angle_max"] = _nan_max(angles)
    ratios = model.keel_branch_ratios(x) if hasattr(model, "keel_branch_ratios") else []
    if ratios:  # the first sub-layer's highway is the raw embedding: not comparable
        out["keel_branch_ratio_max"] = _nan_max(ratios[1:] or ratios)
    out.update(_weight_tails(model))
    return {k: v if math.isfinite(v) else None for k, v in out.items()}


def generate_sample(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig,
                    device: torch.device) -> str:
    """``sample_tokens`` tokens after ``sample_prompt``, decoded (reproducible: own generator)."""
    prompt = corpus.tokenizer.encode(cfg.sample_prompt.encode()) or [int(corpus.train[0])]
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    was_training = model.training
    model.eval()
    out = model.generate(idx, cfg.sample_tokens, temperature=cfg.temperature,
                         top_k=cfg.top_k or None, generator=gen,
                         vocab_limit=corpus.tokenizer.vocab_size)  # (1, T0 + n)
    model.train(was_training)
    return corpus.tokenizer.decode(out[0].tolist())
