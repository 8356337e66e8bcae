"""bench/flash_attn_adapter.py: flash-attn's interface on the op, checked on
a sample of the kinds of cases flash-attn's own tests run (soft-capping with
causal, local windows, ALiBi, grouped heads, N != M) against a reference
written from flash-attn's documented semantics, independent of flashfuse's."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("flash_attn_adapter", os.path.join(ROOT, "bench", "flash_attn_adapter.py"))
fa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fa)


def _flash_ref(q, k, v, causal, window, softcap, alibi):
    """flash-attn's semantics in float64, (B, N, H, D) layout."""
    q, k, v = (t.double() for t in (q, k, v))
    B, N, H, D = q.shape
    M, Hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hk, dim=2)
    v = v.repeat_interleave(H // Hk, dim=2)
    s = torch.einsum("bnhd,bmhd->bhnm", q / math.sqrt(D), k)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(N).view(N, 1) + (M - N)
    j = torch.arange(M).view(1, M)
    left, right = window
    if causal:
        right = 0
    hidden = torch.zeros(N, M, dtype=torch.bool)
    if right >= 0:
        hidden |= j > i + right
    if left >= 0:
        hidden |= j < i - left
    if alibi is not None:
        s = s - alibi.double().view(1, H, 1, 1) * (i - j).abs()
    s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhnm,bmhd->bnhd", p, v)


CASES = [
    # (N, M, H, Hk, causal, window, softcap, alibi)
    (7, 7, 2, 2, False, (-1, -1), 50.0, False),
    (7, 13, 4, 2, True, (-1, -1), 50.0, False),
    (13, 7, 2, 1, True, (-1, -1), 5.0, True),
    (9, 21, 2, 2, False, (3, 2), 5.0, False),
    (16, 16, 2, 2, False, (4, 0), 50.0, True),
    (5, 11, 2, 2, False, (-1, -1), 0.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-h{c[2]}/{c[3]}-c{int(c[4])}-w{c[5]}-cap{c[6]:g}"
                         f"{'-alibi' if c[7] else ''}")
def test_flash_attn_cases(blockwise_cpu, case):
    N, M, H, Hk, causal, window, softcap, alibi = case
    torch.manual_seed(0)
    q = (torch.randn(2, N, H, 32) * 3).requires_grad_()  # scores large enough to be capped
    k = torch.randn(2, M, Hk, 32).requires_grad_()
    v = torch.randn(2, M, Hk, 32).requires_grad_()
    slopes = torch.rand(H) if alibi else None
    out = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _flash_ref(qr, kr, vr, causal, window, softcap, slopes)
    assert out.shape == q.shape[:3] + (32,)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g.float()), torch.autograd.grad(ref, (qr, kr, vr), g)):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-3)


def test_interpreter_case_and_packed_forms():
    """One case through the Triton kernels (interpreter on CPU), and the
    packed entry points; ``return_attn_probs`` gives the lse."""
    torch.manual_seed(1)
    qkv = torch.randn(1, 9, 3, 2, 16) * 3
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, softcap=4.0)
    ref = _flash_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], True, (-1, -1), 4.0, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    out2, lse, probs = fa.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True, softcap=4.0,
                                                   return_attn_probs=True)
    torch.testing.assert_close(out2, out)
    assert lse.shape == (1, 2, 9) and probs is None


def test_install_provides_flash_attn_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    fa.install()
    from flash_attn import flash_attn_func  # noqa: F401 - the stand-in

    assert flash_attn_func is fa.flash_attn_func
    monkeypatch.delitem(sys.modules, "flash_attn")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [(128, 300, 8, 2, True, (-1, -1), 50.0, True),
                                  (255, 255, 4, 4, False, (64, 32), 30.0, False)])
def test_gpu_flash_attn_cases(case, dtype):
    N, M, H, Hk, causal, window, softcap, alibi = case
    torch.manual_seed(2)
    q = torch.randn(2, N, H, 128, device="cuda", dtype=dtype) * 3
    k = torch.randn(2, M, Hk, 128, device="cuda", dtype=dtype)
    v = torch.randn(2, M, Hk, 128, device="cuda", dtype=dtype)
    slopes = torch.rand(H, device="cuda") if alibi else None
    out = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    ref = _flash_ref(q.cpu(), k.cpu(), v.cpu(), causal, window, softcap, slopes.cpu() if alibi else None)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < (3e-3 if dtype == torch.float16 else 2e-2)
