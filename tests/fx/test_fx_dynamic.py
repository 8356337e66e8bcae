"""Dynamic shapes keep the rewrite: dynamic=True, automatic dynamic after a
recompile, symbolic scales, and symbolic head sizes guarded to the op's range."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fxutil import Recorder, compile_and_compare, qkv
from flashfuse.backend import make_backend
from test_fx_spellings import NanoGPTAttention, causal_bottom_right


def attn(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def _run(fn, backend, *shapes):
    outs = []
    compiled = torch.compile(fn, backend=backend, dynamic=None)
    for kw in shapes:
        q, k, v = qkv(**kw, grad=False)
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), atol=2e-5, rtol=2e-5)
    return outs


def test_dynamic_true_symbolic_scale():
    rec, backend = compile_and_compare(attn, *qkv(d=32), expect=1, dynamic=True)
    # The scale 1/sqrt(D) is a SymFloat here: it is folded into q.
    plan = backend.candidates[0].plan
    assert plan.q_factors and plan.scale == 1.0
    # Other sizes reuse the graph (no recompile) and stay correct.
    compiled = torch.compile(attn, backend=backend, dynamic=True)
    for kw in (dict(b=3, h=2, n=5, d=32), dict(b=3, h=4, n=11, d=48)):
        q, k, v = qkv(**kw)
        torch.testing.assert_close(compiled(q, k, v), attn(q, k, v), atol=2e-5, rtol=2e-5)
    assert len(rec.graphs) == 1


def test_automatic_dynamic_keeps_rewrite():
    rec = Recorder("aot_eager")
    backend = make_backend(compiler=rec, record=True)
    _run(attn, backend, dict(n=8, d=16), dict(n=12, d=16), dict(n=5, d=16))
    # The second call recompiles with a symbolic length; both graphs are rewritten.
    assert len(rec.graphs) == 2
    assert rec.ops == 2


def test_symbolic_head_size_out_of_range_recompiles():
    """A graph rewritten for a symbolic head size carries a guard on the op's
    range: an unsupported size recompiles and is left as it is."""
    rec = Recorder("aot_eager")
    backend = make_backend(compiler=rec, record=True)
    compiled = torch.compile(attn, backend=backend, dynamic=True)
    for d in (16, 32, 8):
        q, k, v = qkv(d=d, grad=False)
        torch.testing.assert_close(compiled(q, k, v), attn(q, k, v), atol=2e-5, rtol=2e-5)
    assert [sum(1 for n in g.graph.nodes if "flashfuse" in str(n.target)) for g in rec.graphs] == [1, 0]


def test_nanogpt_dynamic():
    torch.manual_seed(0)
    m = NanoGPTAttention().eval()
    _, backend = compile_and_compare(m, torch.randn(2, 12, 64), expect=1, dynamic=True, compiler="eager")
    assert backend.candidates[0].facts["causal"] == "top-left"
    compiled = torch.compile(m, backend=backend, dynamic=True)
    x = torch.randn(3, 7, 64)
    torch.testing.assert_close(compiled(x), m(x), atol=2e-5, rtol=2e-5)


def test_bottom_right_dynamic():
    _, backend = compile_and_compare(causal_bottom_right, *qkv(n=3, m=8, d=16), expect=1, dynamic=True)
    assert backend.candidates[0].facts["causal"] == "bottom-right"


def test_dropout_probability_symbolic_under_dynamic():
    """With dynamic=True, nn.Dropout's p reaches the graph as a SymFloat; the
    pass specialises on it, so changing p recompiles with the new value."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, q, k, v):
            return self.drop(F.softmax(q @ k.transpose(-2, -1), dim=-1)) @ v

    m = M().train()
    backend = make_backend(compiler="eager", record=True)
    compiled = torch.compile(m, backend=backend, dynamic=True)
    compiled(*qkv(d=16, grad=False))
    m.drop.p = 0.3
    compiled(*qkv(d=16, grad=False))
    assert [c.plan.dropout_p for c in backend.candidates] == [0.1, 0.3]
