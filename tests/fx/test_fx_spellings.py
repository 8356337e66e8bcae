"""Every spelling of attention the pass must find: one rewrite each, outputs
and gradients equal to eager."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxutil import compile_and_compare, qkv

D = 16
SCALE = 1.0 / math.sqrt(D)


# --- products and key transposes -------------------------------------------

def matmul_op(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def torch_matmul_t23(q, k, v):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)) * SCALE, dim=-1), v)


def method_matmul_t32(q, k, v):
    return q.matmul(k.transpose(3, 2)).mul(SCALE).softmax(-1).matmul(v)


def mT(q, k, v):
    return (q @ k.mT * SCALE).softmax(dim=-1) @ v


def permute_last_two(q, k, v):
    return torch.softmax(q @ k.permute(0, 1, 3, 2) * SCALE, -1) @ v


def bmm_3d(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    p = torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) * SCALE, dim=-1)
    return torch.bmm(p, v3).view(b, h, n, d)


def einsum_bhnd(q, k, v):
    s = torch.einsum("bhnd,bhmd->bhnm", q, k) * SCALE
    return torch.einsum("bhnm,bhmd->bhnd", s.softmax(-1), v)


def einsum_bnhd(q, k, v):
    # q, k, v as (B, N, H, D): the subscripts do the transposes.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * SCALE
    return torch.einsum("bhnm,bmhd->bnhd", s.softmax(-1), v)


def baddbmm_bias(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    bias = torch.linspace(-1, 1, n * k3.shape[1]).view(1, n, -1)
    s = torch.baddbmm(bias.expand(b * h, -1, -1), q3, k3.transpose(1, 2), beta=1.0, alpha=SCALE)
    return torch.bmm(s.softmax(-1), v3)


# --- scales -------------------------------------------------------------------

def scale_on_q(q, k, v):
    return torch.softmax((q * SCALE) @ k.transpose(-2, -1), dim=-1) @ v


def scale_split(q, k, v):
    d = q.shape[-1]
    return torch.softmax((q * d**-0.25) @ (k * d**-0.25).transpose(-2, -1), dim=-1) @ v


def no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def scale_tensor_full(q, k, v):
    # GPT-2 style: divide by a 0-d tensor made in the graph.
    s = q @ k.transpose(-1, -2)
    s = s / torch.full([], v.size(-1) ** 0.5, dtype=s.dtype, device=s.device)
    return nn.functional.softmax(s, dim=-1) @ v


# --- casts, softmax spellings, dropout -----------------------------------------

def casts_float_type_as(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    return F.softmax(s.float(), dim=-1).type_as(q) @ v


def softmax_dtype_to(q, k, v):
    s = (q @ k.transpose(-2, -1)) * SCALE
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def dropout_eval_functional(q, k, v):
    p = F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1)
    return F.dropout(p, p=0.3, training=False) @ v


# --- masks ----------------------------------------------------------------------

def causal_tril_ones(q, k, v):
    n = q.size(-2)
    s = q @ k.transpose(-2, -1) * SCALE
    mask = torch.tril(torch.ones(n, n, device=q.device))
    s = s.masked_fill(mask == 0, float("-inf"))
    return s.softmax(-1) @ v


def causal_triu_additive(q, k, v):
    n = q.size(-2)
    mask = torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
    return torch.softmax(q @ k.transpose(-2, -1) * SCALE + mask, -1) @ v


def causal_arange_where(q, k, v):
    n, m = q.size(-2), k.size(-2)
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(m, device=q.device)[None, :]
    s = q @ k.transpose(-2, -1) * SCALE
    s = torch.where(j <= i, s, torch.finfo(s.dtype).min)
    return s.softmax(-1) @ v


def causal_masked_fill_inplace(q, k, v):
    n = q.size(-2)
    s = q @ k.transpose(-2, -1) * SCALE
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def causal_bottom_right(q, k, v):
    # KV-cache decoding: the n newest queries against m keys.
    n, m = q.size(-2), k.size(-2)
    mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
    s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def sliding_window(q, k, v):
    n = q.size(-2)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    keep = (j <= i) & (i - j < 3)
    s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(~keep, float("-inf"))
    return s.softmax(-1) @ v


def scale_after_mask(q, k, v):
    n = q.size(-2)
    s = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (s / math.sqrt(q.size(-1))).softmax(-1) @ v


_g = torch.Generator().manual_seed(1)
# A padding-like keep mask (True takes part) and a float bias, for (2, H, 8, 8) scores.
KEEP = (torch.rand(2, 1, 1, 8, generator=_g) > 0.3) | (torch.arange(8) == 0)
BIAS = torch.randn(2, 1, 8, 8, generator=_g)


def where_user_mask_finfo_min(q, k, v):
    s = q @ k.transpose(-2, -1) * SCALE
    return torch.where(KEEP, s, torch.finfo(s.dtype).min).softmax(-1) @ v


def bias_before_scale(q, k, v):
    return F.softmax((q @ k.transpose(-2, -1) + BIAS) / math.sqrt(q.size(-1)), dim=-1) @ v


def causal_plus_padding(q, k, v):
    n = q.size(-2)
    s = q @ k.transpose(-2, -1) * SCALE
    s = s + (~KEEP).float() * torch.finfo(s.dtype).min
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def _same_segment(pos, b, n):
    """True where query and key fall in the same run of consecutive
    positions (several sequences packed into one row)."""
    start = pos[:, :1] - 1
    segment = (torch.diff(pos, prepend=start, dim=-1) != 1).cumsum(-1)
    bi = torch.arange(b)[:, None, None, None]
    qi = torch.arange(n)[None, None, :, None]
    ki = torch.arange(n)[None, None, None, :]
    return qi.new_ones((), dtype=torch.bool) & (ki <= qi) & (segment[bi, qi] == segment[bi, ki])


def causal_packed_segments(q, k, v):
    # Training without a cache, as transformers builds the mask: causal AND
    # "same packed segment", with segments found from position ids. Position
    # ids from an arange make one segment, so the mask is plain causal.
    b, n = q.size(0), q.size(-2)
    pos = torch.arange(n).unsqueeze(0).expand(b, -1)
    keep = _same_segment(pos, b, n)
    s = q @ k.transpose(-2, -1) * SCALE
    return torch.where(keep, s, torch.finfo(s.dtype).min).softmax(-1) @ v


def causal_dunder_compare(q, k, v):
    # Comparisons called as dunder methods (recorded as such by some torch versions).
    n = q.size(-2)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = j.__le__(i).__eq__(torch.ones((), dtype=torch.bool))
    s = q @ k.transpose(-2, -1) * SCALE
    return s.masked_fill(keep.__eq__(False), float("-inf")).softmax(-1) @ v


def cast_type_method(q, k, v):
    s = (q @ k.transpose(-2, -1) * SCALE).type(torch.float32)
    return s.softmax(-1).type(q.dtype) @ v


# --- heads and layouts -------------------------------------------------------------

def cross_attention(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1) @ v


SPELLINGS = [
    matmul_op, torch_matmul_t23, method_matmul_t32, mT, permute_last_two, bmm_3d,
    einsum_bhnd, einsum_bnhd, baddbmm_bias, scale_on_q, scale_split, no_scale,
    scale_tensor_full, casts_float_type_as, softmax_dtype_to, dropout_eval_functional,
    causal_tril_ones, causal_triu_additive, causal_arange_where, causal_masked_fill_inplace,
    sliding_window, scale_after_mask, where_user_mask_finfo_min, bias_before_scale,
    causal_plus_padding, cast_type_method, causal_packed_segments, causal_dunder_compare,
]


@pytest.mark.parametrize("fn", SPELLINGS, ids=lambda f: f.__name__)
def test_spelling(fn):
    compile_and_compare(fn, *qkv(d=D), expect=1)


@pytest.mark.parametrize("fn", [cross_attention, causal_bottom_right], ids=lambda f: f.__name__)
def test_cross_lengths(fn):
    compile_and_compare(fn, *qkv(n=3, m=8, d=D), expect=1)


@pytest.mark.parametrize(
    "fn,facts",
    [
        (causal_tril_ones, {"causal": "top-left"}),
        (causal_triu_additive, {"causal": "top-left"}),
        (causal_arange_where, {"causal": "top-left"}),
        (causal_masked_fill_inplace, {"causal": "top-left"}),
        (sliding_window, {"window": "(2, 0) top_left"}),
        (scale_after_mask, {"causal": "top-left", "mask": "none"}),
        (matmul_op, {"mask": "none", "scale": f"{SCALE:.6g}"}),
        (scale_split, {"scale": f"{SCALE:.6g}"}),
        (causal_plus_padding, {"causal": "top-left", "mask": "additive"}),
        (causal_packed_segments, {"causal": "top-left", "mask": "none"}),
        (causal_dunder_compare, {"causal": "top-left", "mask": "none"}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_recognised(fn, facts):
    """Causal masks and windows built in the graph become op arguments
    (no mask tensor is passed)."""
    _, backend = compile_and_compare(fn, *qkv(d=D), expect=1, grad=False)
    (cand,) = backend.candidates
    for key, value in facts.items():
        assert cand.facts.get(key) == value, (key, cand.facts)
    assert facts.get("mask", "none") != "none" or (not cand.plan.additive and not cand.plan.hide)


def test_nn_dropout_training_probability():
    """nn.Dropout in training becomes dropout_p; in eval it disappears."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, q, k, v):
            return self.drop(F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1)) @ v

    from flashfuse.backend import make_backend

    for training, p in ((True, 0.1), (False, 0.0)):
        torch._dynamo.reset()
        backend = make_backend(compiler="eager", record=True)
        torch.compile(M().train(training), backend=backend)(*qkv(d=D, grad=False))
        assert backend.candidates[0].plan.dropout_p == p


def test_bottom_right_recognised():
    _, backend = compile_and_compare(causal_bottom_right, *qkv(n=3, m=8, d=D), expect=1, grad=False)
    assert backend.candidates[0].facts["causal"] == "bottom-right"


# --- module spellings --------------------------------------------------------------------

class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (slow path), unchanged in spirit."""

    def __init__(self, n_embd=64, n_head=4, block_size=32, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class ModuleSoftmaxScaleBuffer(nn.Module):
    """nn.Softmax, a learned temperature (0-d parameter) and a padding mask."""

    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)
        self.temperature = nn.Parameter(torch.tensor(0.3))
        self.dropout = nn.Dropout(0.2)

    def forward(self, q, k, v, pad):
        s = (q @ k.transpose(-2, -1)) * self.temperature
        s = s + (1.0 - pad[:, None, None, :].to(s.dtype)) * -10000.0
        return self.dropout(self.softmax(s)) @ v


class RepeatKV(nn.Module):
    """LLaMA's repeat_kv (expand + reshape) before the products."""

    def __init__(self, n_rep):
        super().__init__()
        self.n_rep = n_rep

    def forward(self, q, k, v):
        def repeat_kv(x):
            b, h, s, d = x.shape
            return x[:, :, None, :, :].expand(b, h, self.n_rep, s, d).reshape(b, h * self.n_rep, s, d)

        k, v = repeat_kv(k), repeat_kv(v)
        s = torch.matmul(q, k.transpose(2, 3)) * SCALE
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v)


def repeat_interleave_gqa(q, k, v):
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = torch.repeat_interleave(v, q.size(1) // v.size(1), dim=1)
    return F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1) @ v


def test_nanogpt_block():
    torch.manual_seed(0)
    m = NanoGPTAttention().eval()
    x = torch.randn(2, 12, 64, requires_grad=True)
    _, backend = compile_and_compare(m, x, expect=1)
    assert backend.candidates[0].facts["causal"] == "top-left"


def test_module_softmax_temperature_padding():
    torch.manual_seed(0)
    m = ModuleSoftmaxScaleBuffer().eval()
    q, k, v = qkv(d=D)
    pad = torch.ones(2, 8)
    pad[0, 5:] = 0
    compile_and_compare(m, q, k, v, pad, expect=1)
    assert m.temperature.grad is not None


@pytest.mark.parametrize("form", ["repeat_kv", "repeat_interleave"])
def test_grouped_heads_folded(form):
    fn = RepeatKV(2) if form == "repeat_kv" else repeat_interleave_gqa
    _, backend = compile_and_compare(fn, *qkv(h=4, hkv=2, d=D), expect=1)
    plan = backend.candidates[0].plan
    assert plan.enable_gqa
    # k and v are consumed unrepeated: the op reads the 2 kv heads.
    assert plan.key.node.meta["example_value"].shape[1] == 2


def test_mqa_broadcast():
    compile_and_compare(no_scale, *qkv(h=4, hkv=1, d=D), expect=1)


def test_value_head_dim_differs():
    compile_and_compare(matmul_op, *qkv(d=D, dv=32), expect=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_keeps_dtype(dtype):
    compile_and_compare(casts_float_type_as, *qkv(d=D, dtype=dtype), expect=1, atol=2e-2, rtol=2e-2)


def test_dropout_training_matches_op():
    """Dropout in training becomes the op's dropout_p; same seed, same draw."""
    from flashfuse.backend import make_backend

    def fn(q, k, v):
        p = F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1)
        return F.dropout(p, p=0.25, training=True) @ v

    q, k, v = qkv(d=D, grad=False)
    backend = make_backend(compiler="eager", record=True)
    torch.manual_seed(123)
    out = torch.compile(fn, backend=backend)(q, k, v)
    torch.manual_seed(123)
    expected = torch.ops.flashfuse.attention(q, k, v, dropout_p=0.25, scale=SCALE)
    assert backend.candidates[0].plan.dropout_p == 0.25
    torch.testing.assert_close(out, expected)
