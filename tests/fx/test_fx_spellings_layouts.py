"""Other layouts of the scores (issue 20): einsum scores with the heads after
the query axis, scores built transposed (``(k @ qᵀ).transpose(-1, -2)``) and
grouped heads as a 5-D broadcast. Each is rewritten exactly (outputs and
gradients equal to eager, static and dynamic, inference and training); each
near miss is left alone with a reason."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fxutil import compile_and_compare, left_alone_reasons, qkv

B, H, HKV, N, M, D = 2, 4, 2, 8, 12, 16
SCALE = 1.0 / math.sqrt(D)
_g = torch.Generator().manual_seed(11)
# Masks in the layouts the spellings apply them in.
BIAS_NHM = torch.randn(N, 1, M, generator=_g)  # (b, n, h, m) scores: varies over queries and keys
BIAS_MN = torch.randn(B, 1, M, N, generator=_g)  # scores built transposed, before the transpose
KEEP_5D = (torch.rand(B, 1, 1, N, M, generator=_g) > 0.3) | (torch.arange(M) == 0)
BIAS_5D = torch.randn(1, HKV, 1, N, M, generator=_g)  # one bias per kv head, shared by its group


def _bnhd(*ts):
    # (B, H, N, D) test tensors seen as the (B, N, H, D) projections code holds.
    return [t.transpose(1, 2) for t in ts]


# --- 1. einsum with the heads after the query axis ------------------------------------

def einsum_bnhm(q, k, v):
    q, k, v = _bnhd(q, k, v)
    s = torch.einsum("bnhd,bmhd->bnhm", q, k) * SCALE
    return torch.einsum("bnhm,bmhd->bnhd", s.softmax(-1), v)


def einsum_bnhm_renamed_swapped(q, k, v):
    # Other letters, the key operand first: the same contraction.
    q, k, v = _bnhd(q, k, v)
    s = torch.einsum("zkhc,zqhc->zqhk", k, q)
    return torch.einsum("xyzw,xwzv->xyzv", F.softmax(s / math.sqrt(D), dim=-1), v)


def einsum_bnhm_mask(q, k, v):
    # A bias in the (b, n, h, m) layout, and (b, h, n, d) value output.
    q, k, v = _bnhd(q, k, v)
    s = torch.einsum("bnhd,bmhd->bnhm", q * SCALE, k) + BIAS_NHM
    return torch.einsum("bnhm,bmhd->bhnd", s.softmax(-1), v)


def einsum_bnhm_causal(q, k, v):
    q, k, v = _bnhd(q, k, v)
    n, m = q.shape[1], k.shape[1]
    keep = torch.ones(n, m, dtype=torch.bool).tril(m - n)[:, None, :]
    s = torch.einsum("bnhd,bmhd->bnhm", q, k).masked_fill(~keep, float("-inf")) * SCALE
    return torch.einsum("bnhm,bmhd->bnhd", s.softmax(-1), v)


# --- 2. scores built transposed ---------------------------------------------------------

def k_at_qT_transposed(q, k, v):
    s = (k @ q.transpose(-1, -2)).transpose(-1, -2)
    return F.softmax(s * SCALE, dim=-1) @ v


def k_at_qT_mask_before_transpose(q, k, v):
    # The scale and a bias applied while the scores are (M, N), another after.
    s = (k @ (q * SCALE).transpose(-1, -2) + BIAS_MN).mT
    return torch.softmax(s + BIAS_MN.transpose(-1, -2) * 0.5, -1) @ v


def q_at_kT_transposed(q, k, v):
    # Transposed q @ kᵀ is k @ qᵀ: attention with k's rows as the queries
    # (and v indexed by q's rows). Exact, if unusual.
    s = (q @ k.transpose(-1, -2)).transpose(-1, -2)
    return s.softmax(-1) @ v


def k_at_qT_tril_before_transpose(q, k, v):
    # A tril mask on the (M, N) scores keeps keys at or after each query:
    # not causal once transposed (it must stay a tensor, not become a band).
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    s = (k @ q.transpose(-1, -2)).masked_fill(~keep, float("-inf")).transpose(-1, -2)
    return (s * SCALE).softmax(-1) @ v


def k_at_qT_bmm(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
    s = torch.bmm(k3, q3.transpose(1, 2)).transpose(1, 2) * SCALE
    return torch.bmm(s.softmax(-1), v3).view(b, h, n, d)


# --- 3. grouped heads as a 5-D broadcast ------------------------------------------------

def grouped_5d(q, k, v):
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    s = q.view(b, hkv, hq // hkv, n, d) @ k[:, :, None].transpose(-2, -1) * SCALE
    return (s.softmax(-1) @ v[:, :, None]).view(b, hq, n, -1)


def grouped_5d_kept(q, k, v):
    # Output kept 5-D; k unsqueezed with .unsqueeze, a bool mask and a per-kv-head bias.
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, n, d)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(3, 4)) / math.sqrt(d) + BIAS_5D
    s = s.masked_fill(~KEEP_5D, float("-inf"))
    return torch.matmul(F.softmax(s, dim=-1), v.unsqueeze(2))


def grouped_5d_transposed_scores(q, k, v):
    # Spellings 2 and 3 together.
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    s = (k[:, :, None] @ q.view(b, hkv, hq // hkv, n, d).transpose(-2, -1)).transpose(-2, -1)
    return ((s * SCALE).softmax(-1) @ v[:, :, None]).reshape(b, hq, n, d)


GQA = dict(h=H, hkv=HKV)
CASES = [
    (einsum_bnhm, {}), (einsum_bnhm_renamed_swapped, {}), (einsum_bnhm_mask, dict(m=M)),
    (einsum_bnhm_causal, dict(m=M)), (k_at_qT_transposed, dict(m=M)),
    (k_at_qT_mask_before_transpose, dict(m=M)), (k_at_qT_bmm, {}), (q_at_kT_transposed, {}),
    (k_at_qT_tril_before_transpose, {}),
    (grouped_5d, dict(m=M, **GQA)),
    (grouped_5d_kept, dict(m=M, **GQA)), (grouped_5d_transposed_scores, GQA),
]
DYNAMIC = {einsum_bnhm, k_at_qT_transposed, grouped_5d}


@pytest.mark.parametrize(
    "fn,shape,dynamic",
    [(f, s, False) for f, s in CASES] + [(f, s, True) for f, s in CASES if f in DYNAMIC],
    ids=lambda x: getattr(x, "__name__", "dynamic" if x is True else "static" if x is False else ""),
)
def test_rewritten_with_gradients(fn, shape, dynamic):
    args = dict(b=B, h=H, n=N, d=D)
    args.update(shape)
    compile_and_compare(fn, *qkv(**args), expect=1, dynamic=dynamic, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", [einsum_bnhm_mask, k_at_qT_mask_before_transpose, grouped_5d_kept],
                         ids=lambda f: f.__name__)
def test_inference(fn):
    compile_and_compare(fn, *qkv(b=B, h=H, n=N, m=M, d=D, hkv=HKV if fn is grouped_5d_kept else None,
                                 grad=False), expect=1, grad=False, atol=1e-5, rtol=1e-4)


def test_odd_sizes():
    # Odd batch, lengths and head size; three query heads per kv head.
    compile_and_compare(grouped_5d, *qkv(b=3, h=6, hkv=2, n=5, m=7, d=24), expect=1, atol=1e-5, rtol=1e-4)
    compile_and_compare(einsum_bnhm, *qkv(b=1, h=3, n=7, d=24), expect=1, atol=1e-5, rtol=1e-4)


def test_explain_names_grouped_heads():
    _, backend = compile_and_compare(grouped_5d, *qkv(b=B, n=N, d=D, grad=False, **GQA), expect=1, grad=False)
    facts = backend.candidates[0].facts
    assert backend.candidates[0].plan.enable_gqa and "4q/2kv" in facts["gqa"], facts


class GroupedBlock(torch.nn.Module):
    """A train-mode block: projections, 5-D grouped scores, (B, N, H, D) einsum-free output."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(H * D, H * D)
        self.kv = torch.nn.Linear(H * D, 2 * HKV * D)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HKV, H // HKV, D).permute(0, 2, 3, 1, 4)
        k, v = self.kv(x).view(b, n, 2, HKV, D).permute(2, 0, 3, 1, 4)
        s = (k[:, :, None] @ q.transpose(-1, -2)).transpose(-1, -2) * SCALE
        o = self.drop(s.softmax(-1)) @ v[:, :, None]
        return o.permute(0, 3, 1, 2, 4).reshape(b, n, H * D)


def test_training_step_module():
    torch.manual_seed(0)
    x = torch.randn(B, N, H * D, requires_grad=True)
    compile_and_compare(GroupedBlock().train(), x, expect=1, atol=1e-5, rtol=1e-4)


# --- near misses: left alone, with a reason ----------------------------------------------


def trap_einsum_sums_heads(q, k, v):
    # The score einsum also sums over the heads: not one score per head.
    q, k, v = _bnhd(q, k, v)
    s = torch.einsum("bnhd,bmhd->bnm", q, k)
    return torch.einsum("bnm,bmhd->bnhd", s.softmax(-1), v)


def trap_einsum_softmax_over_heads(q, k, v):
    # Scores laid out (b, n, m, h): the last dim is the heads.
    q, k, v = _bnhd(q, k, v)
    s = torch.einsum("bnhd,bmhd->bnmh", q, k)
    return torch.einsum("bnmh,bmhd->bnhd", s.softmax(-1), v)


def trap_einsum_value_reads_heads_as_queries(q, k, v):
    # The value einsum reads the (b, n, h, m) probabilities as (b, h, n, m) (H == N).
    q, k, v = _bnhd(q, k, v)
    s = torch.einsum("bnhd,bmhd->bnhm", q, k)
    return torch.einsum("bhnm,bmhd->bhnd", s.softmax(-1), v)


def trap_einsum_value_contracts_queries(q, k, v):
    q, k, v = _bnhd(q, k, v)
    s = torch.einsum("bnhd,bmhd->bnhm", q, k)
    return torch.einsum("bnhm,bnhd->bmhd", s.softmax(-1), v)


def trap_transpose_heads_and_keys(q, k, v):
    s = (k @ q.transpose(-1, -2)).transpose(1, 2)
    return s.softmax(-1) @ v.transpose(1, 2)


def trap_transposed_softmax_dim(q, k, v):
    s = (k @ q.transpose(-1, -2)).transpose(-1, -2)
    return s.softmax(-2).transpose(-1, -2) @ v


def trap_einsum_head_scale_meets_queries(q, k, v):
    # An (H, 1, 1) factor on (b, n, h, m) scores varies over the queries (N == H).
    q, k, v = _bnhd(q, k, v)
    w = torch.linspace(0.5, 1.5, q.shape[2]).view(-1, 1, 1)
    s = torch.einsum("bnhd,bmhd->bnhm", q, k) * w
    return torch.einsum("bnhm,bmhd->bnhd", s.softmax(-1), v)


def _g5(q):
    b, hq, n, d = q.shape
    return b, hq, n, d, HKV, hq // HKV


def trap_grouped_wrong_order(q, k, v):
    # Groups outer, kv heads inner: query head h would read kv head h % Hkv.
    b, hq, n, d, hkv, g = _g5(q)
    s = q.view(b, g, hkv, n, d) @ k[:, None].transpose(-2, -1)
    return (s.softmax(-1) @ v[:, None]).reshape(b, hq, n, d)


def trap_grouped_k_v_differ(q, k, v):
    # k broadcast over the groups, v over the kv heads (Hkv == G).
    b, hq, n, d, hkv, g = _g5(q)
    s = q.view(b, hkv, g, n, d) @ k[:, :, None].transpose(-2, -1)
    return (s.softmax(-1) @ v[:, None]).reshape(b, hq, n, d)


def trap_grouped_softmax_over_groups(q, k, v):
    b, hq, n, d, hkv, g = _g5(q)
    s = q.view(b, hkv, g, n, d) @ k[:, :, None].transpose(-2, -1)
    return (s.softmax(2) @ v[:, :, None]).reshape(b, hq, n, d)


def trap_grouped_query_broadcast(q, k, v):
    # q broadcast over the kv heads: one query head for every kv head.
    b, hq, n, d, hkv, g = _g5(q)
    s = q[:, :g, None].transpose(1, 2) @ k[:, :, None].transpose(-2, -1)
    return s.softmax(-1) @ v[:, :, None]


TRAPS = [
    (trap_einsum_sums_heads, {}, "sums over more than the head dim"),
    (trap_einsum_softmax_over_heads, {}, "not a key"),
    (trap_einsum_value_reads_heads_as_queries, {}, "not probs x v"),
    (trap_einsum_value_contracts_queries, {}, "not probs x v"),
    (trap_einsum_head_scale_meets_queries, {}, "varies over the query or key dim"),
    (trap_transpose_heads_and_keys, {}, "not understood"),
    (trap_transposed_softmax_dim, {}, "softmax over dim -2"),
    (trap_grouped_wrong_order, GQA, "h // G"),
    (trap_grouped_k_v_differ, GQA, "kv head h % Hkv"),
    (trap_grouped_softmax_over_groups, GQA, "softmax over dim 2"),
    (trap_grouped_query_broadcast, GQA, "q broadcasts"),
]


@pytest.mark.parametrize("fn,shape,why", TRAPS, ids=lambda x: getattr(x, "__name__", ""))
def test_near_miss_left_alone(fn, shape, why):
    # N == H == 4 so that the traps that confuse heads and queries still run.
    args = dict(b=B, h=4, n=4, d=D, grad=False)
    args.update(shape)
    reasons = left_alone_reasons(fn, *qkv(**args))
    assert reasons and all(r for r in reasons)
    assert any(why in r for r in reasons), reasons
