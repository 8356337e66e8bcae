"""Tests of the split-KV decoding kernels (``flashfuse.kernels.decode``)
against the float64 reference: forced split counts (1, 2, many, more
splits than key blocks, so some see no key), GQA ratios 1, 4 and 8, one and
a few queries, bottom-right causal bands and windows; unwritten outputs show
as NaN (allocations are poisoned). Through the op, the decode forward's
out and lse feed the existing backward kernels."""

from __future__ import annotations

import pytest
import torch

import flashfuse
from flashfuse import reference as ref
from flashfuse.kernels import decode
from flashfuse.kernels.decode import choose_splits, decode_forward, decode_suits

from .padding import in_nan_padding, poison_empty

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    poison_empty(monkeypatch)
    real = torch.empty_strided

    def empty_strided(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty_strided", empty_strided)


def _check(q, k, v, out, lse, tol=2e-6, **band):
    want = ref.reference_attention(q, k, v, scale=0.5, **band)
    want_lse = ref.reference_lse(q, k, scale=0.5, **band)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("group,n", [(1, 1), (4, 3), (8, 1)])
def test_split_counts_and_groups(splits, group, n):
    torch.manual_seed(splits * 10 + group)
    Hkv, M = 2, 45  # 3 key blocks of 16 under the interpreter: 5 splits leave 2 empty
    q = torch.randn(2, Hkv * group, n, 32, device=DEVICE)
    k = torch.randn(2, Hkv, M, 32, device=DEVICE)
    v = torch.randn(2, Hkv, M, 16, device=DEVICE)
    band = dict(window_right=0, bottom_right=True)
    out, lse = decode_forward(q, k, v, scale=0.5, num_splits=splits, **band)
    _check(q, k, v, out, lse, **band)


@pytest.mark.parametrize("band", [dict(), dict(window_left=5, window_right=0, bottom_right=True),
                                  dict(window_right=2, bottom_right=True)])
def test_bands_and_rows_that_see_nothing(band):
    torch.manual_seed(1)
    # N > M: under bottom-right causal alignment the first rows see no key.
    q = torch.randn(1, 4, 7, 16, device=DEVICE)
    k = torch.randn(1, 2, 5, 16, device=DEVICE)
    v = torch.randn(1, 2, 5, 16, device=DEVICE)
    out, lse = decode_forward(q, k, v, scale=0.5, num_splits=2, **band)
    _check(q, k, v, out, lse, **band)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_and_strided_inputs(dtype):
    torch.manual_seed(2)
    q = in_nan_padding(torch.randn(1, 8, 2, 24, device=DEVICE).to(dtype))
    k = in_nan_padding(torch.randn(1, 2, 40, 24, device=DEVICE).to(dtype))
    v = in_nan_padding(torch.randn(1, 2, 40, 24, device=DEVICE).to(dtype))
    out, lse = decode_forward(q, k, v, scale=0.5, window_right=0, bottom_right=True, num_splits=3)
    assert out.dtype == dtype
    _check(q, k, v, out, lse, tol=1e-2, window_right=0, bottom_right=True)


def test_split_choice():
    # Enough programs for the SMs, no split below MIN_SPLIT_KEYS keys.
    assert choose_splits(1, 8, 1, 4096, 132) == 4096 // decode.MIN_SPLIT_KEYS
    assert choose_splits(1, 8, 1, 1 << 17, 132) == -(-decode.WAVES * 132 // 8)
    assert choose_splits(8, 8, 1, 1 << 17, 132) == -(-decode.WAVES * 132 // 64)
    assert choose_splits(64, 8, 1, 100, 132) == 1


def test_split_count_env_knob(monkeypatch):
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "5")
    assert choose_splits(1, 1, 1, 10, 4) == 5


def test_dispatch_rule(monkeypatch):
    q = torch.empty(1, 32, 1, 128)
    k = torch.empty(1, 8, 4096, 128)
    assert decode_suits(q, k, None, 0.0, None, 0, True, None)
    assert not decode_suits(q, k, None, 0.0, None, 0, False, None)  # top-left causal
    assert not decode_suits(q, k, torch.ones(1, dtype=torch.bool), 0.0, None, None, True, None)
    assert not decode_suits(q, k, None, 0.1, None, None, True, None)
    assert not decode_suits(q, k[:, :, :64], None, 0.0, None, 0, True, None)  # few keys
    assert not decode_suits(torch.empty(1, 32, 64, 128), k, None, 0.0, None, 0, True, None)
    monkeypatch.setenv("FLASHFUSE_DECODE", "0")
    assert not decode_suits(q, k, None, 0.0, None, 0, True, None)


def test_op_takes_decode_path_and_its_gradients(monkeypatch):
    """Through ``flashfuse.attention``: the decode forward, then the
    existing backward from its out and lse."""
    monkeypatch.setenv("FLASHFUSE_DECODE", "1")
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "3")
    calls = []
    real = decode.decode_forward
    monkeypatch.setattr(decode, "decode_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(3)
    q = torch.randn(1, 4, 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 1, 37, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 1, 37, 16, device=DEVICE, requires_grad=True)
    out = flashfuse.attention(q, k, v, is_causal=True, alignment="bottom_right", enable_gqa=True, scale=0.5)
    assert calls
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want_out = ref.reference_attention(q, k, v, scale=0.5, window_right=0, bottom_right=True)
    want = torch.autograd.grad(want_out, (q, k, v), g.double())
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=2e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,M", [(1, 1, 4096), (8, 1, 32768), (2, 16, 65536), (3, 4, 1000)])
def test_gpu_real_sizes(B, N, M):
    torch.manual_seed(4)
    q = torch.randn(B, 32, N, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, 8, M, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, 8, M, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = decode_forward(q, k, v, scale=0.5, window_right=0, bottom_right=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), scale=0.5, enable_gqa=True,
        attn_mask=torch.ones(N, M, dtype=torch.bool, device="cuda").tril(M - N))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert torch.isfinite(lse).all()
