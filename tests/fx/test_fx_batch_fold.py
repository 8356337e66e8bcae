"""Scores with more than two batch dims (windowed or locally grouped
attention over (B, windows, heads, N, D), as timm's Twins writes it): the
leading batch dims are folded into the op's batch, exactly, and the result
unflattened back. Outputs and gradients equal eager (static and dynamic,
inference and training, odd sizes); masks broadcast over part of the folded
dims are expanded first (a copy ``explain`` names); the near misses are left
alone with a reason."""

from __future__ import annotations

import math

import pytest
import torch

from fxutil import compile_and_compare, left_alone_reasons

B, G, H, N, M, D = 2, 3, 2, 5, 7, 16
_g = torch.Generator().manual_seed(5)
# Masks in the 5-D scores' layout (B, G, H, N, M).
BIAS_5D = torch.randn(1, 1, 1, N, M, generator=_g)  # broadcast over every batch dim
BIAS_GROUP = torch.randn(G, 1, N, M, generator=_g)  # one per window (Swin's shifted-window mask)
BIAS_BATCH = torch.randn(B, 1, 1, N, M, generator=_g)  # one per sample, shared by its windows
KEEP_GROUP = (torch.rand(1, G, 1, N, M, generator=_g) > 0.3) | (torch.arange(M) == 0)


def rand(*shape, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape))
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def qkv5(b=B, g=G, h=H, n=N, m=M, d=D, hkv=None, grad=True):
    hkv = h if hkv is None else hkv
    return rand(b, g, h, n, d, grad=grad), rand(b, g, hkv, m, d, grad=grad, seed=1), rand(b, g, hkv, m, d, grad=grad, seed=2)


def qkv6(b=B, gh=2, gw=3, h=H, n=N, m=M, d=D, hkv=None, grad=True):
    hkv = h if hkv is None else hkv
    return (rand(b, gh, gw, h, n, d, grad=grad), rand(b, gh, gw, hkv, m, d, grad=grad, seed=1),
            rand(b, gh, gw, hkv, m, d, grad=grad, seed=2))


def windows_5d(q, k, v):
    q = q * q.shape[-1] ** -0.5
    return (q @ k.transpose(-2, -1)).softmax(dim=-1) @ v


def windows_6d(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(s, -1), v)


def windows_5d_bias(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(D) + BIAS_5D
    return s.softmax(-1) @ v


def windows_5d_group_bias(q, k, v):
    # Swin's spelling of the shifted-window mask: one (N, M) bias per window.
    s = q @ k.transpose(-2, -1) / math.sqrt(D) + BIAS_GROUP
    return s.softmax(-1) @ v


def windows_5d_batch_bias_bool(q, k, v):
    # A mask per sample, another per window: each broadcast over the other dim.
    s = (q @ k.transpose(-2, -1) + BIAS_BATCH).masked_fill(~KEEP_GROUP, float("-inf"))
    return (s / math.sqrt(D)).softmax(-1) @ v


def windows_6d_causal(q, k, v):
    n, m = q.shape[-2], k.shape[-2]
    keep = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    s = (q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf"))
    return (s * 0.25).softmax(-1) @ v


def windows_6d_one_kv_head(q, k, v):
    # k and v with one head, broadcast over the query heads, in every window.
    return ((q @ k.transpose(-2, -1)) * 0.25).softmax(-1) @ v


def windows_5d_shared_kv(q, k, v):
    # k and v shared by every sample and window: (H, M, D), the op broadcasts them.
    k, v = k[0, 0], v[0, 0]
    return ((q @ k.transpose(-2, -1)) * 0.25).softmax(-1) @ v


def windows_5d_kept_k_transposed(q, k, v):
    # k transposed by a permute of its last two dims, scores built as k @ qᵀ.
    s = (k @ q.transpose(-1, -2)).transpose(-1, -2) * 0.25
    return s.softmax(-1) @ v


CASES = [
    (windows_5d, qkv5), (windows_6d, qkv6), (windows_5d_bias, qkv5), (windows_5d_group_bias, qkv5),
    (windows_5d_batch_bias_bool, qkv5), (windows_6d_causal, qkv6),
    (windows_6d_one_kv_head, lambda **a: qkv6(hkv=1, **a)), (windows_5d_shared_kv, qkv5),
    (windows_5d_kept_k_transposed, lambda **a: qkv5(m=N, **a)),
]
DYNAMIC = {windows_5d, windows_6d, windows_5d_group_bias}
ids = lambda x: getattr(x, "__name__", "dynamic" if x is True else "static" if x is False else "")  # noqa: E731


@pytest.mark.parametrize("fn,make,dynamic", [(f, m, False) for f, m in CASES]
                         + [(f, m, True) for f, m in CASES if f in DYNAMIC], ids=ids)
def test_rewritten_with_gradients(fn, make, dynamic):
    _, backend = compile_and_compare(fn, *make(), expect=1, dynamic=dynamic, atol=1e-5, rtol=1e-4)
    assert "batch dims folded" in backend.candidates[0].facts["layout"], backend.candidates[0].facts


@pytest.mark.parametrize("fn,make", [(windows_5d_group_bias, qkv5), (windows_6d, qkv6)], ids=ids)
def test_inference(fn, make):
    compile_and_compare(fn, *make(grad=False), expect=1, grad=False, atol=1e-5, rtol=1e-4)


def test_odd_sizes():
    compile_and_compare(windows_5d_batch_bias_bool, *qkv5(b=B, g=G, h=3, d=24), expect=1, atol=1e-5, rtol=1e-4)
    compile_and_compare(windows_6d, *qkv6(b=3, gh=1, gw=5, h=1, n=3, m=9, d=24), expect=1, atol=1e-5, rtol=1e-4)


def test_explain_names_the_fold_and_its_copies():
    _, backend = compile_and_compare(windows_5d, *qkv5(grad=False), expect=1, grad=False)
    assert backend.candidates[0].facts["layout"] == "batch dims folded: (2, 3)"
    # A mask per window is expanded over the samples: one copy.
    _, backend = compile_and_compare(windows_5d_group_bias, *qkv5(grad=False), expect=1, grad=False)
    assert backend.candidates[0].facts["layout"] == "batch dims folded: (2, 3); copies mask"
    # q whose (B, G) dims do not merge in memory is copied by the flatten.
    q, k, v = qkv5(grad=False)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)
    _, backend = compile_and_compare(windows_5d, q, k, v, expect=1, grad=False)
    assert backend.candidates[0].facts["layout"] == "batch dims folded: (2, 3); copies q"


class LocalWindows(torch.nn.Module):
    """A train-mode block: a qkv projection split into (B, windows, heads,
    tokens, head dim), dropout on the probabilities, output merged back."""

    def __init__(self, dim=H * D, heads=H):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):  # x: (B, G, tokens, dim)
        b, g, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, g, n, 3, self.heads, c // self.heads).permute(3, 0, 1, 4, 2, 5).unbind(0)
        o = self.drop(((q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)).softmax(-1)) @ v
        return o.transpose(2, 3).reshape(b, g, n, c)


def test_training_step_module():
    torch.manual_seed(0)
    x = torch.randn(B, G, N, H * D, requires_grad=True)
    _, backend = compile_and_compare(LocalWindows().train(), x, expect=1, atol=1e-5, rtol=1e-4)
    # The permuted projection's (B, G) dims merge: q, k and v are views.
    assert backend.candidates[0].facts["layout"] == "batch dims folded: (2, 3)"


# --- near misses: left alone, with a reason ----------------------------------------------


def trap_softmax_over_a_batch_dim(q, k, v):
    return (q @ k.transpose(-2, -1)).softmax(1) @ v


def trap_k_broadcasts_over_one_window_dim(q, k, v):
    # k shared by the windows of one row only: no single batch index for it.
    return (q @ k[:, :1].transpose(-2, -1)).softmax(-1) @ v[:, :1]


def trap_v_broadcasts_over_one_window_dim(q, k, v):
    return (q @ k.transpose(-2, -1)).softmax(-1) @ v[:, :, :1]


def trap_mask_bigger_than_scores(q, k, v):
    # The mask broadcasts the scores up: not an attention mask.
    s = q @ k.transpose(-2, -1) + torch.zeros(4, 1, 1, 1, 1, 1, N, M)
    return s.softmax(-1) @ v


def trap_probs_regrouped(q, k, v):
    # The probabilities' windows are swapped before the value product.
    return (q @ k.transpose(-2, -1)).softmax(-1).transpose(1, 2) @ v.transpose(1, 2)


TRAPS = [
    (trap_softmax_over_a_batch_dim, qkv6, "softmax over dim 1"),
    (trap_k_broadcasts_over_one_window_dim, qkv6, "broadcasts over part of the leading batch dims"),
    (trap_v_broadcasts_over_one_window_dim, qkv6, "v broadcasts over part of the leading batch dims"),
    (trap_mask_bigger_than_scores, qkv6, "changes the shape of the scores"),
    (trap_probs_regrouped, qkv5, "not a product with v"),
]


@pytest.mark.parametrize("fn,make,why", TRAPS, ids=ids)
def test_near_miss_left_alone(fn, make, why):
    reasons = left_alone_reasons(fn, *make(grad=False))
    assert reasons and all(r for r in reasons)
    assert any(why in r for r in reasons), reasons


def test_explain_table_has_a_layout_column():
    from flashfuse.fx import explain

    result = explain(windows_5d_group_bias, *qkv5(grad=False), print_table=False)
    (row,) = result.rows
    assert row.rewritten and row.layout == "batch dims folded: (2, 3); copies mask", row
    assert "layout" in str(result) and "batch dims folded: (2, 3)" in str(result)
