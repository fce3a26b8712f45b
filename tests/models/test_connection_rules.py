"""Each connection of the reference GPT computes its published rule: the whole tiny model against a
float64 forward written out by hand, and the dtypes the stream keeps under autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import GPT, GPTConfig
from models.connections import make_connection

WIDTH = 16


def test_peri_ln_output_norm_runs_in_the_stream_dtype_under_cpu_autocast():
    """CPU autocast does not put layer_norm in float32 (CUDA's does): LN_out normalized the
    bfloat16 sub-layer output in bfloat16 and added its rounded values to the float32 stream."""
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=WIDTH,
                    connection="peri-ln", bias=True)
    conn = make_connection(cfg, layer=1)
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        for p in (*conn.parameters(), *linear.parameters()):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    x = torch.randn(4, 8, WIDTH, generator=gen)  # (B, T, C), float32 stream
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = conn(x, linear)
        f = linear(conn.norm_in(x))  # (B, T, C) bfloat16: the sub-layer output
    assert f.dtype == torch.bfloat16 and out.dtype == torch.float32
    norm = conn.norm_out
    with torch.no_grad():
        want = x + F.layer_norm(f.float(), (WIDTH,), norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


# ---- the published rules, written out in float64 ------------------------------------------------

LAYERS = 2
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which every LayerNorm of the GPT keeps
STEP_EPS = 1e-6  # SphereResidual's relative floor of the normalized step


def _layer_norm(x, norm, fresh):
    """LayerNorm: (x - mean) / sqrt(var + eps) * gamma + beta; at init gamma = 1, beta = 0."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + LN_EPS) * (torch.ones(WIDTH) if fresh else norm.weight)
    if norm.bias is None:
        return y
    return y + (torch.zeros(WIDTH) if fresh else norm.bias)


def _dyt(x, dyt, alpha0, fresh):
    """DyT: gamma * tanh(alpha x) + beta; at init alpha = alpha0, gamma = 1, beta = 0."""
    if fresh:
        return torch.tanh(alpha0 * x)
    return dyt.weight * torch.tanh(dyt.alpha * x) + dyt.bias


def _linear(x, layer):
    return x @ layer.weight.T + (0.0 if layer.bias is None else layer.bias)


def _attention(x, attn):
    B, T, C = x.shape
    heads = [_linear(x, m).view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2)
             for m in (attn.q, attn.k, attn.v)]  # q, k, v: (B, nh, T, hd)
    q, k, v = heads
    scores = q @ k.transpose(-1, -2) / (C // attn.n_head) ** 0.5  # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, -torch.inf).softmax(-1)
    return _linear((probs @ v).transpose(1, 2).reshape(B, T, C), attn.o)


def _mlp(x, mlp):
    h = _linear(x, mlp.fc)
    return _linear(0.5 * h * (1.0 + torch.erf(h / 2.0**0.5)), mlp.proj)  # exact GELU


def _angle(beta, cfg):
    """theta(beta) of the retraction: exp (GeoNorm) beta, gnomonic arctan(beta), Cayley
    2 arctan(beta/2), the p-family p arctan(beta/p)."""
    name = "exp" if cfg.connection == "geonorm" else cfg.retraction
    p = {"gnomonic": 1.0, "cayley": 2.0, "exp": torch.inf, "p": cfg.p}[name]
    return beta if p == torch.inf else p * torch.atan(beta / p)


def _sphere_step(h, f, cfg, sublayer, conn, fresh):
    """h' = cos(theta) h + sin(theta) r v/|v|: the rotation by theta(beta) in span(h, P_h f),
    beta = |v|/r of v = alpha_l lambda_l P_h f (literal) or alpha_l lambda_l r P_h f/|P_h f|
    (normalized, with its relative floor), lambda_l the damping of depth l."""
    depth = sublayer if cfg.damping_depth == "sublayer" else (sublayer + 1) // 2
    damping = {"sqrt": depth**-0.5, "linear": 1.0 / depth, "none": 1.0}[cfg.damping]
    alpha = cfg.alpha_init if fresh else conn.residual.log_alpha.exp()
    r = h.norm(dim=-1, keepdim=True)
    u = f - (h * f).sum(-1, keepdim=True) / r**2 * h  # P_h f
    if cfg.sphere_step == "normalized":
        u = r * u / torch.sqrt((u * u).sum(-1, keepdim=True) + STEP_EPS**2 * r**2)
    v = alpha * damping * u
    beta = v.norm(dim=-1, keepdim=True) / r
    theta = _angle(beta, cfg)
    return torch.cos(theta) * h + torch.sin(theta) * r * v / (beta * r)


def _reference_logits(model, idx, fresh):
    """The logits of ``model`` by the published rules. ``fresh``: every norm, scale and step
    at its published initial value (only the linear maps and embeddings read from ``model``);
    else every parameter read from ``model``."""
    cfg = model.config
    c, d = cfg.connection, WIDTH
    x = model.wte.weight[idx] + model.wpe.weight[: idx.shape[1]]  # (B, T, C)
    if c in ("geonorm", "spheret"):  # ScaleNorm onto the sphere of radius g = sqrt(d)
        x = (d**0.5 if fresh else model.embed_norm.scale) * x / x.norm(dim=-1, keepdim=True)
    elif c == "pre-dyt":  # the DyT LLM recipe's scalar after the embedding, sqrt(d) at init
        x = (d**0.5 if fresh else model.embed_norm.scale) * x
    elif c == "peri-ln":  # Peri-LN's initial embedding normalization
        x = _layer_norm(x, model.embed_norm, fresh)
    keel_alpha = cfg.keel_alpha or 2 * cfg.n_layer  # Keel: alpha = number of sub-layers
    for i, block in enumerate(model.blocks):
        for sublayer, conn, fn in ((2 * i + 1, block.conn1, lambda t, b=block: _attention(t, b.attn)),
                                   (2 * i + 2, block.conn2, lambda t, b=block: _mlp(t, b.mlp))):
            if c == "pre-ln":
                x = x + fn(_layer_norm(x, conn.norm, fresh))
            elif c == "post-ln":
                x = _layer_norm(x + fn(x), conn.norm, fresh)
            elif c == "peri-ln":
                x = x + _layer_norm(fn(_layer_norm(x, conn.norm_in, fresh)), conn.norm_out, fresh)
            elif c == "pre-dyt":  # alpha0 0.8 before attention, 0.2 before the MLP
                x = x + fn(_dyt(x, conn.norm, 0.8 if sublayer % 2 else 0.2, fresh))
            elif c == "keel":
                x = _layer_norm(keel_alpha * x + fn(_layer_norm(x, conn.norm_in, fresh)),
                                conn.norm_out, fresh)
            else:
                x = _sphere_step(x, fn(x), cfg, sublayer, conn, fresh)
    if c in ("pre-ln", "peri-ln"):
        x = _layer_norm(x, model.norm_f, fresh)
    elif c == "pre-dyt":
        x = _dyt(x, model.norm_f, 0.2, fresh)
    elif c in ("geonorm", "spheret"):  # the head reads s h, s = 1 at init
        x = (1.0 if fresh else model.norm_f.scale) * x
    return x @ model.lm_head.weight.T  # (B, T, V)


RULES = {
    "pre-ln": {}, "post-ln": {}, "peri-ln": {}, "pre-dyt": {}, "keel": {}, "geonorm": {},
    "spheret-p1": {"connection": "spheret", "retraction": "p", "p": 1.0},
    "spheret-gnomonic": {"connection": "spheret", "retraction": "gnomonic"},
    "spheret-cayley": {"connection": "spheret", "retraction": "cayley"},
    "spheret-p0.5-literal": {"connection": "spheret", "p": 0.5, "sphere_step": "literal",
                             "alpha_init": 1.0},
    "spheret-p3-linear-by-block": {"connection": "spheret", "p": 3.0, "damping": "linear",
                                   "damping_depth": "block"},
}


@pytest.mark.parametrize("name", RULES)
def test_every_connection_computes_its_published_rule_in_float64(name):
    """The 2-layer GPT against its rule written out above (entry, both sub-layers of every block,
    exit), at its initialization (where the norms, scales and steps must have their published
    initial values) and with every parameter moved off it (biases on), values and gradients."""
    overrides = RULES[name] or {"connection": name}
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # built in float64: its initial scalars exact
    try:
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=LAYERS, n_head=2,
                              n_embd=WIDTH, bias=True, **overrides))
    finally:
        torch.set_default_dtype(default)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    idx = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(idx)[0], _reference_logits(model, idx, fresh=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            param.copy_(0.3 * noise if param.dim() == 2 else param + 0.2 * noise)
    got, want = model(idx)[0], _reference_logits(model, idx, fresh=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))
    weights = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((got * weights).sum(), params)
    expected = torch.autograd.grad((want * weights).sum(), params)
    scale = max(float(g.abs().max()) for g in expected)  # k's bias has gradient 0 (softmax)
    for param_grad, want_grad in zip(grads, expected):
        torch.testing.assert_close(param_grad, want_grad, rtol=0, atol=1e-10 * scale)
