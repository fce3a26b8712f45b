"""Named starting points of ``python -m models.train --preset NAME`` (flat config keys).

- ``smoke`` runs in seconds (the tests use it);
- ``default`` is the README's main job, a few minutes on a 2-core CPU; its method choices
  (connection, optimizer/policy, sel) follow what ``python -m models.compare`` measured (see
  ``docs/results``);
- ``gpt2-small`` is the seeds' model for GPUs: 12 layers, width 768, 12 heads, context 1024 —
  124M parameters with GPT-2's 50257-token vocabulary (a ``bin:DIR`` corpus of GPT-2 tokens),
  86M with bytes. The recipe is nanoGPT's GPT-2 one: a global batch of 480 sequences
  (491,520 tokens) per step, linear warm-up then cosine decay to a tenth, weight decay 0.1,
  betas (0.9, 0.95), clipping at 1; with 1-SpheretNorm and ManifoldMuon's ``hetero`` policy
  (the seeds' pairing; pass ``--connection pre-ln --optimizer adamw --lr 6e-4`` for the
  baseline). ``grad_accum_steps=40`` gives micro-batches of 12 sequences on one GPU; with N
  GPUs pass ``--grad_accum_steps 40/N`` to keep 12 per device (``docs/guides/training.rst``).
"""

from __future__ import annotations

__all__ = ["PRESETS"]

#: Preset name -> flat config values (applied over the dataclass defaults).
PRESETS: dict[str, dict] = {
    "smoke": {
        "corpus": "synthetic:60000", "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32,
        "batch_size": 8, "steps": 30, "warmup_steps": 5, "lr": 1e-2, "adamw_lr": 1e-2,
        "eval_interval": 10, "eval_batches": 2, "log_interval": 5, "sample_tokens": 40},
    # 1-SpheretNorm (normalized step) with plain (unconstrained) ManifoldMuon: the best policy of
    # the manifolds suite (docs/results/training.rst)
    "default": {
        "corpus": "stdlib", "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128,
        "connection": "spheret", "retraction": "p", "p": 1.0, "sphere_step": "normalized",
        "optimizer": "manifold-muon", "policy": "unconstrained", "sel": "none",
        "batch_size": 16, "steps": 600, "warmup_steps": 30, "lr": 0.02, "adamw_lr": 3e-3,
        "eval_interval": 100, "eval_batches": 8, "log_interval": 10},
    "gpt2-small": {
        "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768, "dropout": 0.0,
        "bias": False, "connection": "spheret", "retraction": "p", "p": 1.0,
        "optimizer": "manifold-muon", "policy": "hetero", "sel": "none",
        "lr": 0.02, "adamw_lr": 6e-4, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
        "grad_clip": 1.0, "batch_size": 480, "grad_accum_steps": 40, "steps": 10000,
        "warmup_steps": 200,
        "schedule": "cosine", "min_lr_ratio": 0.1, "dtype": "bfloat16", "compile": True,
        "eval_interval": 500, "eval_batches": 20, "log_interval": 10, "sample_tokens": 200},
}
