"""The graph pass on soft-capped scores and attention sinks: the spellings
it rewrites (outputs and gradients equal to eager, the op called with
``softcap`` / ``sinks``) and the near misses it must leave alone."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxutil import OP, compile_and_compare, qkv

D = 16
SCALE = 1.0 / math.sqrt(D)
CAP = 3.0  # small enough that the cap changes the scores of random inputs


def _op_kwargs(rec):
    calls = [n for g in rec.graphs for n in g.graph.nodes if n.op == "call_function" and n.target is OP]
    assert len(calls) == 1
    return calls[0].kwargs


# --- soft-capping ------------------------------------------------------------

def gemma2_order(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * SCALE
    w = w / CAP
    w = torch.tanh(w)
    w = w * CAP
    w = w + mask
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def cap_first_factor(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * SCALE
    return (CAP * torch.tanh(s * (1.0 / CAP)) + mask).softmax(-1) @ v


def cap_method_tanh(q, k, v, mask):
    s = (q @ k.mT) / math.sqrt(D)
    return F.softmax((s / CAP).tanh().mul(CAP) + mask, dim=-1) @ v


def cap_scaled_q(q, k, v, mask):
    s = (q * SCALE) @ k.transpose(-2, -1)
    return torch.softmax(torch.tanh(s / CAP) * CAP + mask, -1) @ v


@pytest.mark.parametrize("fn", [gemma2_order, cap_first_factor, cap_method_tanh, cap_scaled_q],
                         ids=lambda f: f.__name__)
def test_softcap_spellings(fn):
    q, k, v = qkv(n=7, m=9, d=D)
    mask = torch.randn(2, 1, 7, 9, requires_grad=True)
    rec, backend = compile_and_compare(fn, q, k, v, mask, expect=1)
    assert _op_kwargs(rec)["softcap"] == pytest.approx(CAP)
    (cand,) = backend.candidates
    assert cand.facts["mask"] == f"softcap {CAP:g}, additive"
    assert cand.plan.scale == pytest.approx(SCALE)


def test_softcap_without_mask():
    """Formerly left alone (tests/fx/test_fx_safety.py): now the op's softcap."""

    def f(q, k, v):
        s = torch.tanh(q @ k.transpose(-2, -1) * SCALE / 5.0) * 5.0
        return F.softmax(s, dim=-1) @ v

    q, k, v = qkv(n=6, d=D)
    q.data.mul_(20)
    rec, backend = compile_and_compare(f, q, k, v, expect=1)
    assert _op_kwargs(rec)["softcap"] == 5.0 and backend.candidates[0].facts["mask"] == "softcap 5"


def test_softcap_causal_built_in_graph():
    def f(q, k, v):
        n = q.shape[-2]
        s = torch.tanh(q @ k.transpose(-1, -2) * SCALE / 50.0) * 50.0
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return s.masked_fill(~causal, float("-inf")).softmax(-1) @ v

    q, k, v = qkv(n=6, d=D)
    q.data.mul_(30)  # scores large enough for a cap of 50 to matter
    rec, backend = compile_and_compare(f, q, k, v, expect=1)
    assert backend.candidates[0].facts["causal"] == "top-left"
    assert backend.candidates[0].facts["mask"] == "softcap 50"


def mask_then_cap(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * SCALE + mask
    return torch.softmax(torch.tanh(s / CAP) * CAP, -1) @ v


def fill_then_cap(q, k, v, mask):
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(mask > 0, float("-inf"))
    return torch.softmax(torch.tanh(s / CAP) * CAP, -1) @ v


def cap_mismatch(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * SCALE
    return torch.softmax(torch.tanh(s / CAP) * (2 * CAP) + mask, -1) @ v


def tanh_alone(q, k, v, mask):
    return torch.softmax(torch.tanh(q @ k.transpose(-1, -2) * SCALE) + mask, -1) @ v


def cap_rescaled(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * SCALE
    return torch.softmax(torch.tanh(s / CAP) * CAP * 2.0 + mask, -1) @ v


def shift_inside_cap(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * SCALE
    return torch.softmax(torch.tanh((s + 1.0) / CAP) * CAP + mask, -1) @ v


def cap_reused(q, k, v, mask):
    s = q @ k.transpose(-1, -2) * SCALE
    t = torch.tanh(s / CAP)
    return torch.softmax(t * CAP + mask, -1) @ v, t


@pytest.mark.parametrize("fn,why", [
    (mask_then_cap, "before the soft-cap"),
    (fill_then_cap, "before the soft-cap"),
    (cap_mismatch, "not a soft-cap"),
    (tanh_alone, "tanh of the scores"),
    (cap_rescaled, "scaled again"),
    (shift_inside_cap, "before the soft-cap"),
    (cap_reused, "other users"),
], ids=lambda x: getattr(x, "__name__", ""))
def test_softcap_near_misses_left_alone(fn, why):
    q, k, v = qkv(n=5, m=6, d=D)
    mask = torch.randn(2, 1, 5, 6)
    _, backend = compile_and_compare(fn, q, k, v, mask, expect=0)
    (cand,) = backend.candidates
    assert why in cand.reason, cand.reason


# --- sinks -------------------------------------------------------------------

class GptOssLike(nn.Module):
    """gpt-oss's eager attention, as transformers writes it."""

    def __init__(self, heads, shift=True, slice_all=False, softcap=None):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(heads))
        self.shift, self.slice_all, self.softcap = shift, slice_all, softcap

    def forward(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * SCALE
        if self.softcap:
            w = torch.tanh(w / self.softcap) * self.softcap
        w = w + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        c = torch.cat([w, sinks], dim=-1)
        if self.shift:
            c = c - c.max(dim=-1, keepdim=True).values
        p = F.softmax(c, dim=-1, dtype=c.dtype)
        s = p[:, :, :, :-1] if self.slice_all else p[..., :-1]
        return torch.matmul(F.dropout(s, p=0.0, training=self.training).to(v.dtype), v)


@pytest.mark.parametrize("kw", [dict(), dict(shift=False), dict(slice_all=True), dict(softcap=CAP)],
                         ids=["gpt_oss", "no_shift", "slice_all_dims", "with_softcap"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_sinks_spelling(kw, dynamic):
    q, k, v = qkv(n=7, m=9, d=D)
    mask = torch.randn(2, 1, 7, 9)
    rec, backend = compile_and_compare(GptOssLike(4, **kw).eval(), q, k, v, mask, expect=1, dynamic=dynamic)
    kwargs = _op_kwargs(rec)
    assert kwargs["sinks"] is not None
    facts = backend.candidates[0].facts["mask"]
    assert facts.endswith("sinks") and ("softcap" in facts) == ("softcap" in kw)


def test_sinks_training_with_dropout_matches_op():
    """Dropout in training: the op draws its own mask, so compare with the
    op called directly under the same seed."""
    import flashfuse

    q, k, v = qkv(n=5, m=5, d=D, grad=False)
    mask = torch.zeros(2, 1, 5, 5)
    mod = GptOssLike(4).train()

    class WithDropout(GptOssLike):
        def forward(self, q, k, v, mask):
            w = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
            p = F.softmax(torch.cat([w, sinks], dim=-1), dim=-1)[..., :-1]
            return F.dropout(p, p=0.25, training=self.training) @ v

    m2 = WithDropout(4).train()
    m2.sinks.data.copy_(mod.sinks.data)
    from flashfuse.backend import make_backend

    backend = make_backend(compiler="eager", record=True)
    torch.manual_seed(0)
    out = torch.compile(m2, backend=backend)(q, k, v, mask)
    assert backend.candidates[0].plan.dropout_p == 0.25
    torch.manual_seed(0)
    expected = flashfuse.attention(q, k, v, mask, dropout_p=0.25, scale=SCALE, sinks=m2.sinks)
    torch.testing.assert_close(out, expected)


class SinkNearMiss(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4))
        self.case = case

    def forward(self, q, k, v):
        w = q @ k.transpose(-1, -2) * SCALE
        B, H, N, M = w.shape
        col = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, N, 1)
        if self.case == "sink_first":
            p = torch.cat([col, w], dim=-1).softmax(-1)[..., 1:]
        elif self.case == "not_dropped":
            return torch.cat([w, col], dim=-1).softmax(-1) @ torch.cat([v, v[:, :, :1]], dim=2)
        elif self.case == "per_row":
            col2 = w.mean(-1, keepdim=True)
            p = torch.cat([w, col2], dim=-1).softmax(-1)[..., :-1]
        elif self.case == "two_columns":
            p = torch.cat([w, col, col], dim=-1).softmax(-1)[..., :-2]
        elif self.case == "cap_after_sink":
            c = torch.cat([w, col], dim=-1)
            p = (torch.tanh(c / CAP) * CAP).softmax(-1)[..., :-1]
        elif self.case == "probs_reused":
            p = torch.cat([w, col], dim=-1).softmax(-1)
            return p[..., :-1] @ v, p[..., -1]
        elif self.case == "wrong_axis":
            col3 = self.sinks.reshape(1, 1, -1, 1).expand(B, H, -1, 1)
            p = torch.cat([w, col3], dim=-1).softmax(-1)[..., :-1]
        else:  # slice without a sink
            p = w.softmax(-1)[..., :-1]
            return p @ v[:, :, :-1]
        return p @ v


@pytest.mark.parametrize("case,why", [
    ("sink_first", "not a product with v"),
    ("not_dropped", "not dropped after the softmax"),
    ("per_row", "computed from the scores"),
    ("two_columns", "not a product with v"),
    ("cap_after_sink", "sliced, not a sink column"),
    ("probs_reused", "other users"),
    ("wrong_axis", "not a per-head sink"),
    ("slice_only", "sliced, not a sink column"),
])
def test_sink_near_misses_left_alone(case, why):
    q, k, v = qkv(n=4, m=4, d=D)  # N == H == M: a sink laid along the wrong axis still broadcasts
    _, backend = compile_and_compare(SinkNearMiss(case), q, k, v, expect=0)
    (cand,) = backend.candidates
    assert why in cand.reason, cand.reason


def test_explain_names_softcap_and_sinks():
    import flashfuse

    q, k, v = qkv(n=5, m=5, d=D, grad=False)
    rep = flashfuse.explain(GptOssLike(4, softcap=50.0).eval(), q, k, v, torch.zeros(2, 1, 5, 5),
                            print_table=False)
    assert rep.rewritten == 1
    assert rep.rows[0].mask == "softcap 50, additive, sinks"


def test_sinks_written_in_place_before_the_product_left_alone():
    """A write to the sinks after the pattern reads them and before the
    value product: the op would read the new value, eager the old."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("sinks", torch.randn(4))

        def forward(self, q, k, v):
            w = q @ k.transpose(-1, -2) * SCALE
            col = self.sinks.reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], 1)
            p = torch.cat([w, col], dim=-1).softmax(-1)[..., :-1]
            self.sinks.add_(1.0)
            return p @ v

    q, k, v = qkv(n=4, m=4, d=D, grad=False)
    _, backend = compile_and_compare(M(), q, k, v, expect=0, grad=False)
    (cand,) = backend.candidates
    assert "sinks" in cand.reason, cand.reason
