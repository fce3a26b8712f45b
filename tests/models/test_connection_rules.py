"""Each connection of the reference GPT computes its published rule: the whole tiny model against a
float64 forward written out by hand, and the dtypes the stream keeps under autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import GPTConfig
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
