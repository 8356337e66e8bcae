"""Spellings of real code (issue 20): views between the products, bias-first
products, per-head tensor scales, scores in another dtype through a view.
Each is rewritten exactly (outputs and gradients equal to eager, static and
dynamic); each near miss is left alone with a reason."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fxutil import compile_and_compare, left_alone_reasons, qkv
from flashfuse.backend import make_backend

B, H, N, D = 2, 4, 8, 16
SCALE = 1.0 / math.sqrt(D)
_g = torch.Generator().manual_seed(7)
BIAS4 = torch.randn(B, 1, N, N, generator=_g)
KEEP = (torch.rand(B, 1, 1, N, generator=_g) > 0.3) | (torch.arange(N) == 0)
WINDOW_MASK = torch.randn(2, N, N, generator=_g)  # Swin: one mask per window


def _flat(q, k, v):
    b, h, n, d = q.shape
    return b, h, n, d, *(t.reshape(b * h, -1, t.shape[-1]) for t in (q, k, v))


def bmm_view_mask(q, k, v):
    # fairseq / Bloom: (B·H, N, M) scores viewed to (B, H, N, M) for the mask.
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    s = torch.bmm(q3, k3.transpose(1, 2)) * SCALE
    p = F.softmax(s.view(b, h, n, -1) + BIAS4, -1).view(b * h, n, -1)
    return torch.bmm(p, v3).view(b, h, n, d)


def bmm_view_reshape_softmax_3d(q, k, v):
    # The softmax on the (B·H, N, M) view, the mask on the 4-D one (reshape).
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    s = torch.bmm(q3 * SCALE, k3.transpose(1, 2)).reshape(b, h, n, n)
    s = s.masked_fill(~KEEP, float("-inf")).reshape(b * h, n, n)
    return torch.bmm(s.softmax(-1), v3)


def alibi_baddbmm(q, k, v):
    # Bloom: alibi.baddbmm(batch1=q, batch2=kᵀ, beta=1, alpha=scale), fp32 softmax.
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    slopes = torch.linspace(0.1, 0.5, h).repeat(b)[:, None, None]
    alibi = slopes * torch.arange(n, dtype=q.dtype)[None, None, :]
    s = alibi.baddbmm(batch1=q3, batch2=k3.transpose(-1, -2), beta=1.0, alpha=SCALE)
    w = s.view(b, h, n, -1) + BIAS4
    p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(b * h, n, -1), v3)


def alibi_baddbmm_beta(q, k, v):
    # beta != 1 scales the bias.
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    alibi = torch.linspace(-1, 1, b * h * n).view(b * h, 1, n)
    s = torch.baddbmm(alibi, q3, k3.transpose(-1, -2), beta=0.5, alpha=SCALE)
    return torch.bmm(F.softmax(s, -1), v3)


def bias_before_scale_mul(q, k, v):
    return F.softmax((q @ k.transpose(-2, -1) + BIAS4) * SCALE, -1) @ v


def per_head_logit_scale(q, k, v, logit_scale):
    # Swin-v2 cosine attention: a clamped, exponentiated (H, 1, 1) scale.
    s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    s = s * torch.clamp(logit_scale, max=math.log(1.0 / 0.01)).exp()
    return F.softmax(s + BIAS4, -1) @ v


def per_head_temperature_div(q, k, v, temperature):
    # A learned temperature per head, (1, H, 1, 1), divided, bias added before.
    s = (q @ k.transpose(-2, -1) + BIAS4) / temperature
    return F.softmax(s, -1) @ v


def swin_window_mask(q, k, v, logit_scale):
    # Swin-v2 shifted windows: scores viewed to (B/nW, nW, H, N, N) for the
    # window mask, then back to (B, H, N, N).
    s = (q @ k.transpose(-2, -1)) * logit_scale.exp()
    nw = WINDOW_MASK.shape[0]
    s = s.view(q.shape[0] // nw, nw, q.shape[1], N, N) + WINDOW_MASK.unsqueeze(1).unsqueeze(0)
    return F.softmax(s.view(-1, q.shape[1], N, N), -1) @ v


def float_softmax_type_as_view(q, k, v):
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    s = torch.bmm(q3, k3.transpose(1, 2)).view(b, h, n, n) * SCALE
    p = F.softmax(s.float(), -1).type_as(s)
    return torch.bmm(p.view(b * h, n, n), v3)


def deberta_like(q, k, v):
    # DeBERTa-v2: a 0-d tensor scale on kᵀ, view(-1, H, N, M), finfo.min fill.
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    scale = torch.sqrt(torch.tensor(q3.size(-1), dtype=torch.float) * 2)
    s = torch.bmm(q3, k3.transpose(-1, -2) / scale.to(dtype=q3.dtype))
    s = s.view(-1, h, s.size(-2), s.size(-1)).masked_fill(~KEEP, torch.finfo(q.dtype).min)
    p = F.softmax(s, -1)
    return torch.bmm(p.view(-1, p.size(-2), p.size(-1)), v3)


def _scale_param(shape):
    # Away from 0: a temperature near 0 makes the comparison ill-conditioned.
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(3)) + 0.5).requires_grad_()


CASES = [
    (bmm_view_mask, ()), (bmm_view_reshape_softmax_3d, ()), (alibi_baddbmm, ()),
    (alibi_baddbmm_beta, ()), (bias_before_scale_mul, ()), (per_head_logit_scale, ((H, 1, 1),)),
    (per_head_temperature_div, ((1, H, 1, 1),)), (swin_window_mask, ((H, 1, 1),)),
    (float_softmax_type_as_view, ()), (deberta_like, ()),
]


# Dynamic compiles for the cases whose sizes reach the views as arguments.
DYNAMIC = {bmm_view_mask, alibi_baddbmm, per_head_logit_scale, deberta_like}


@pytest.mark.parametrize(
    "fn,extra,dynamic",
    [(f, e, False) for f, e in CASES] + [(f, e, True) for f, e in CASES if f in DYNAMIC],
    ids=lambda x: getattr(x, "__name__", "dynamic" if x is True else "static" if x is False else ""),
)
def test_rewritten_with_gradients(fn, extra, dynamic):
    scales = [_scale_param(s) for s in extra]
    _, backend = compile_and_compare(fn, *qkv(b=B, h=H, n=N, d=D), *scales, expect=1, dynamic=dynamic,
                                     atol=1e-5, rtol=1e-4)
    for s in scales:
        assert s.grad is not None and s.grad.abs().sum() > 0


def test_explain_names_alibi_and_per_head_scale():
    _, backend = compile_and_compare(alibi_baddbmm, *qkv(b=B, h=H, n=N, d=D), expect=1, grad=False)
    assert "alibi bias" in backend.candidates[0].facts["mask"]
    _, backend = compile_and_compare(per_head_logit_scale, *qkv(b=B, h=H, n=N, d=D), _scale_param((H, 1, 1)),
                                     expect=1, grad=False)
    assert "per-head scale" in backend.candidates[0].facts["scale"]


def test_bmm_view_odd_sizes():
    # Odd batch, heads, length and head size.
    compile_and_compare(float_softmax_type_as_view, *qkv(b=3, h=3, n=5, d=24), expect=1, atol=1e-5, rtol=1e-4)


def test_training_step_bloom_like():
    """A train-mode module (dropout on the probabilities) with a batch view."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.0)
            self.proj = torch.nn.Linear(D, D)

        def forward(self, q, k, v):
            b, h, n, d, q3, k3, v3 = _flat(self.proj(q), k, v)
            s = torch.baddbmm(torch.zeros(b * h, 1, n), q3, k3.transpose(1, 2), alpha=SCALE)
            p = self.drop(F.softmax(s.view(b, h, n, n) + BIAS4, -1))
            return torch.bmm(p.view(b * h, n, n), v3)

    m = M().train()
    compile_and_compare(m, *qkv(b=B, h=H, n=N, d=D), expect=1, atol=1e-5, rtol=1e-4)


def test_automatic_dynamic_with_new_head_count_and_separate_inputs():
    """Automatic dynamic shapes after calls with new batch, length, head count
    and head dim: q, k and v are separate inputs with their own size symbols,
    and only the bmm's guard says their batch totals are equal. The rewrite
    unflattens each to the canonical (B, H) by sizes the graph holds, so the
    third compile is rewritten too (it was refused: "batch sizes do not
    provably match")."""
    torch._dynamo.reset()
    backend = make_backend(record=True)

    def fn(q, k, v, bias):
        b, h, n, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, -1, d) for t in (q, k, v))
        s = bias.baddbmm(q3, k3.transpose(-1, -2), beta=1.0, alpha=d ** -0.5)
        p = F.softmax(s.view(b, h, n, -1), dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(p.view(b * h, n, -1), v3).view(b, h, n, d)

    compiled = torch.compile(fn, backend=backend)
    for i, (b, h, n, d) in enumerate([(2, 4, 11, 16), (3, 4, 7, 16), (2, 6, 11, 24)]):
        q, k, v = qkv(b=b, h=h, n=n, d=d, seed=i)
        bias = torch.randn(b * h, 1, n, generator=torch.Generator().manual_seed(i))
        out = compiled(q, k, v, bias)
        hi = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = fn(*hi, bias.double())
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        for a, e in zip(grads, torch.autograd.grad(ref, hi, g.double())):
            torch.testing.assert_close(a.double(), e, atol=1e-5, rtol=1e-4)
    assert len(backend.candidates) == 3
    assert all(c.rewritten for c in backend.candidates), [c.reason for c in backend.candidates]


# --- near misses: left alone, with a reason ------------------------------------------


def trap_view_splits_query_dim(q, k, v):
    # A view that moves query rows into the batch: not a batch view.
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    s = torch.bmm(q3, k3.transpose(1, 2)).view(b, h * 2, n // 2, n)
    return torch.bmm(s.softmax(-1).view(b * h, n, n), v3)


def trap_view_mixes_keys_and_queries(q, k, v):
    # (B·H, N, M) viewed as (B·H, M, N) with N == M: same sizes, other data.
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    s = torch.bmm(q3, k3.transpose(1, 2)).view(b * h, n * n).view(b * h, n, n).transpose(-1, -2).reshape(b * h, n, n)
    return torch.bmm(s.softmax(-1), v3)


def trap_probs_view_permutes(q, k, v):
    # After the softmax the probabilities are viewed into another key order.
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    p = torch.bmm(q3, k3.transpose(1, 2)).softmax(-1)
    return torch.bmm(p.view(b * h, n * n).view(b * h, n, n // 2, 2).transpose(-1, -2).reshape(b * h, n, n), v3)


def trap_view_softmax_other_user(q, k, v):
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    p = torch.bmm(q3, k3.transpose(1, 2)).view(b, h, n, n).softmax(-1)
    return torch.bmm(p.view(b * h, n, n), v3), p


def trap_mask_multiplied_into_probs(q, k, v):
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    p = torch.bmm(q3, k3.transpose(1, 2)).view(b, h, n, n).softmax(-1) * KEEP
    return torch.bmm(p.view(b * h, n, n), v3)


def trap_scale_varies_over_keys(q, k, v):
    # A (H, 1, M) factor is not a per-head scale: it reweights keys.
    w = torch.linspace(0.5, 1.5, H * N).view(H, 1, N)
    return F.softmax((q @ k.transpose(-2, -1)) * w, -1) @ v


def trap_scale_varies_over_queries(q, k, v):
    w = torch.linspace(0.5, 1.5, N).view(N, 1)
    return F.softmax((q @ k.transpose(-2, -1)) * w, -1) @ v


def trap_baddbmm_post_softmax_not_value_product(q, k, v):
    b, h, n, d, q3, k3, v3 = _flat(q, k, v)
    p = torch.baddbmm(torch.zeros(b * h, 1, n), q3, k3.transpose(1, 2), alpha=SCALE).softmax(-1)
    return torch.bmm(p.view(b, h, n, n).exp().view(b * h, n, n), v3)


TRAPS = [
    (trap_view_splits_query_dim, "query, key"),
    (trap_view_mixes_keys_and_queries, ""),
    (trap_probs_view_permutes, ""),
    (trap_view_softmax_other_user, "other users"),
    (trap_mask_multiplied_into_probs, "not a product with v"),
    (trap_scale_varies_over_keys, "varies over the query or key dim"),
    (trap_scale_varies_over_queries, "varies over the query or key dim"),
    (trap_baddbmm_post_softmax_not_value_product, "not a product with v"),
]


@pytest.mark.parametrize("fn,why", TRAPS, ids=lambda x: getattr(x, "__name__", ""))
def test_near_miss_left_alone(fn, why):
    reasons = left_alone_reasons(fn, *qkv(b=B, h=H, n=N, d=D, grad=False))
    assert reasons and all(r for r in reasons)
    assert any(why in r for r in reasons), reasons


def test_swin_window_view_dynamic_batch_unprovable_or_exact():
    """With a symbolic batch the (B/nW, nW) split may not be provable: then
    it is left alone with a reason; when rewritten it must be exact."""
    args = (*qkv(b=4, h=H, n=N, d=D, grad=False), _scale_param((H, 1, 1)).detach())
    backend = make_backend(compiler="eager", record=True)
    compiled = torch.compile(swin_window_mask, backend=backend, dynamic=True)
    torch.testing.assert_close(compiled(*args), swin_window_mask(*args), atol=1e-5, rtol=1e-4)
    assert backend.candidates
    for c in backend.candidates:
        assert c.rewritten or "batch" in c.reason, c.reason
