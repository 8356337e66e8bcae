"""Tests of the warp-specialised Hopper kernels (``flashfuse.kernels.hopper``).

CPU: the selection rule and its reasons; the launch dispatch (the knob off
changes nothing, on it picks the kernels only where the rule allows); and
the kernels themselves in Triton's interpreter (which runs in-kernel tensor
descriptors and ignores warp specialisation), against the float64 reference
and the portable forward's lse. GPU (H100/H200): the op end to end with
``FLASHFUSE_HOPPER=1``, odd sizes, allocations poisoned.
"""

from __future__ import annotations

import pytest
import torch

import flashfuse  # noqa: F401  (registers the op)
from flashfuse import kernels
from flashfuse.kernels import hopper
from flashfuse.reference import reference_attention

from .padding import in_nan_padding, poison_empty

HOPPER = (9, 0)


def _qkv(B, Hq, Hkv, N, M, D, dtype=torch.float16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda H, L: torch.randn(B, H, L, D, generator=g).to(dtype=dtype, device=device)  # noqa: E731
    return mk(Hq, N), mk(Hkv, M), mk(Hkv, M)


def _rel(a, b):
    """Relative norm error, with rows of zeros on both sides (no visible
    key) counting as exact."""
    a, b = a.double(), b.double()
    assert not a.isnan().any(), "NaN in the result (an element left unwritten?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------------
# The selection rule
# ---------------------------------------------------------------------------


def _why(q=None, k=None, v=None, cap=HOPPER, **kw):
    if q is None:
        q, k, v = _qkv(1, 4, 2, 8, 8, 64)
    return hopper.hopper_unsuitable(q, k, v, device_capability=cap, **kw)


def test_rule_accepts_plain_call():
    assert _why() is None
    q, k, v = _qkv(1, 2, 2, 8, 8, 128, torch.bfloat16)
    assert _why(q, k, v) is None


@pytest.mark.parametrize("case,expect", [
    (dict(cap=(8, 0)), "compute capability 8.0"),
    (dict(cap=(10, 0)), "compute capability 10.0"),
    (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), "mask tensor"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(softcap=30.0), "soft-cap"),
    (dict(sinks=torch.zeros(4)), "sinks"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_rule_reasons(case, expect):
    why = _why(**case)
    assert why is not None and expect in why


def test_rule_reasons_of_tensors():
    q, k, v = _qkv(1, 2, 2, 8, 8, 64, torch.float32)
    assert "dtype torch.float32" in _why(q, k, v)
    q, k, v = _qkv(1, 2, 2, 8, 8, 96)
    assert "head dim 96" in _why(q, k, v)
    q, k, v = _qkv(1, 2, 2, 8, 8, 64)
    assert "head dims differ" in _why(q, k, v[..., :32])
    assert "dtypes differ" in _why(q, k.bfloat16(), v)
    # A transposed head dim (non-unit last stride) cannot be a descriptor.
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)
    assert "q's layout" in _why(qt, k, v)
    go = torch.randn(1, 2, 8, 64).half().transpose(2, 3).contiguous().transpose(2, 3)
    assert "grad_out's layout" in _why(q, k, v, grad_out=go)


def test_rule_row_limit():
    q = torch.empty(1, 1, 8, 64, dtype=torch.float16).expand(2**16, 2**8, 8, 64)  # 2**31 rows once padded
    k = v = torch.empty(1, 1, 8, 64, dtype=torch.float16).expand(2**16, 2**8, 8, 64)
    assert "2**31" in _why(q, k, v)


def test_rule_on_cpu_and_knob(monkeypatch):
    q, k, v = _qkv(1, 2, 2, 8, 8, 64)
    assert "not a CUDA GPU" in hopper.hopper_unsuitable(q, k, v)
    monkeypatch.delenv("FLASHFUSE_HOPPER", raising=False)
    assert "FLASHFUSE_HOPPER" in hopper.hopper_problem(q, k, v)
    monkeypatch.setenv("FLASHFUSE_HOPPER", "0")
    assert "FLASHFUSE_HOPPER" in hopper.hopper_problem(q, k, v)
    monkeypatch.setenv("FLASHFUSE_HOPPER", "1")
    assert "not a CUDA GPU" in hopper.hopper_problem(q, k, v)


def test_rule_old_triton(monkeypatch):
    monkeypatch.setattr(hopper, "_triton_version", lambda: (3, 3))
    assert "older than 3.6" in _why()


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------

_BAND = dict(dropout_p=0.0, scale=0.2, window_left=None, window_right=0, bottom_right=False, mask_fill=None)


def _forbid_hopper(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the Hopper kernels were chosen")
    monkeypatch.setattr(hopper, "hopper_forward", boom)
    monkeypatch.setattr(hopper, "hopper_backward", boom)


@pytest.mark.parametrize("knob", ["", "0", "1"])
def test_dispatch_leaves_unsuitable_calls_alone(monkeypatch, knob):
    """Off, or on for a call the rule declines (CPU tensors here): the
    portable kernels, as before."""
    monkeypatch.setenv("FLASHFUSE_HOPPER", knob)
    _forbid_hopper(monkeypatch)
    q, k, v = _qkv(1, 2, 1, 9, 11, 16)
    out, lse = kernels.attention_forward(q, k, v, None, None, **_BAND)
    ref = reference_attention(q, k, v, scale=0.2, window_right=0)
    assert _rel(out, ref) < 3e-3


def test_dispatch_picks_hopper_when_allowed(monkeypatch):
    """With the rule forced to accept (CPU tensors run the kernels in the
    interpreter), the op's forward and backward go through them."""
    monkeypatch.setenv("FLASHFUSE_HOPPER", "1")
    monkeypatch.setattr(hopper, "hopper_unsuitable", lambda *a, **k: None)
    calls = []
    for name in ("hopper_forward", "hopper_backward"):
        real = getattr(hopper, name)

        def spy(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)
        monkeypatch.setattr(hopper, name, spy)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 19, 23, 16))
    out = torch.ops.flashfuse.attention(q, k, v, None, is_causal=True, scale=0.25, enable_gqa=True)
    go = torch.randn_like(out)
    out.backward(go)
    assert calls == ["hopper_forward", "hopper_backward"]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, scale=0.25, window_right=0)
    ref.backward(go.double())
    assert _rel(out, ref) < 3e-3
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert _rel(got, want) < 5e-3


# ---------------------------------------------------------------------------
# The kernels in the interpreter
# ---------------------------------------------------------------------------

BANDS = {
    "full": dict(window_left=None, window_right=None, bottom_right=False),
    "causal": dict(window_left=None, window_right=0, bottom_right=False),
    "causal_br": dict(window_left=None, window_right=0, bottom_right=True),
    "window": dict(window_left=7, window_right=3, bottom_right=False),
}


@pytest.mark.parametrize("band", list(BANDS))
def test_interpreter_fwd_bwd(monkeypatch, band):
    poison_empty(monkeypatch)
    B, Hq, Hkv, N, M, D = 1, 4, 2, 37, 45, 16  # GQA, sizes off the 16-row tile
    q, k, v = _qkv(B, Hq, Hkv, N, M, D, seed=3)
    kw = BANDS[band]
    out, lse = hopper.hopper_forward(q, k, v, scale=0.3, **kw)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, scale=0.3, **kw)
    assert _rel(out, ref) < 3e-3
    # lse: the portable forward's, exactly the convention (natural log).
    _, lse_portable = kernels.attention_forward(q, k, v, None, None, dropout_p=0.0, scale=0.3, mask_fill=None, **kw)
    torch.testing.assert_close(lse, lse_portable, atol=2e-3, rtol=1e-4)
    go = torch.randn_like(out)
    ref.backward(go.double())
    dq, dk, dv = hopper.hopper_backward(go, q, k, v, out, lse, scale=0.3, **kw)
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert _rel(got, want) < 5e-3


def test_interpreter_empty_rows_and_grad_lse(monkeypatch):
    """Bottom-right causal with more queries than keys: the first N - M
    rows see nothing (out 0, lse +inf, no gradient); an lse gradient."""
    poison_empty(monkeypatch)
    # fp16: the interpreter mis-computes tl.dot on bfloat16 operands (the
    # portable kernels upcast there; these kernels are not meant for it).
    q, k, v = _qkv(1, 2, 1, 40, 21, 32, seed=5)
    kw = BANDS["causal_br"]
    out, lse = hopper.hopper_forward(q, k, v, scale=0.2, **kw)
    assert torch.isinf(lse[..., :19]).all() and (lse[..., :19] > 0).all()
    assert (out[..., :19, :] == 0).all() and torch.isfinite(lse[..., 19:]).all()
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, scale=0.2, **kw)
    rows = slice(19, None)  # the rows that see a key; d lse of the others is no gradient
    visible = torch.ones(40, 21, dtype=torch.bool).tril(21 - 40)[rows]
    scores = 0.2 * qd[..., rows, :] @ kd.transpose(-1, -2)
    ref_lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)
    torch.testing.assert_close(lse[..., rows].double(), ref_lse.detach(), atol=2e-3, rtol=1e-4)
    go = torch.randn_like(out)
    glse = torch.randn_like(lse)
    glse[..., :19] = 0
    (ref * go.double()).sum().add((ref_lse * glse[..., rows].double()).sum()).backward()
    dq, dk, dv = hopper.hopper_backward(go, q, k, v, out, lse, scale=0.2, grad_lse=glse, **kw)
    assert (dq[..., :19, :] == 0).all()
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert _rel(got, want) < 5e-3


# ---------------------------------------------------------------------------
# GPU (H100/H200): the op with FLASHFUSE_HOPPER=1
# ---------------------------------------------------------------------------

GPU_SHAPES = [(333, 300), (1, 4096), (4096, 1), (1024, 1024), (2000, 3000)]


def _on_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == HOPPER


def _run_op(monkeypatch, q, k, v, causal, bottom_right=False):
    """Forward and backward through the op, checking that both ran on the
    Hopper kernels."""
    monkeypatch.setenv("FLASHFUSE_HOPPER", "1")
    calls = []
    for name in ("hopper_forward", "hopper_backward"):
        real = getattr(hopper, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(hopper, name, spy)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    wr = 0 if causal else None
    out = torch.ops.flashfuse.attention(q, k, v, None, window_right=wr, enable_gqa=True,
                                        alignment="bottom_right" if bottom_right else "top_left")
    go = torch.randn_like(out)
    out.backward(go)
    assert calls == ["hopper_forward", "hopper_backward"], hopper.hopper_unsuitable(q, k, v, grad_out=go)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, window_right=wr, bottom_right=bottom_right)
    ref.backward(go.double())
    return (out, q.grad, k.grad, v.grad), (ref, qd.grad, kd.grad, vd.grad)


_GPU_TOL = {torch.float16: (3e-3, 5e-3), torch.bfloat16: (2e-2, 3e-2)}  # (out, grads) relative norm


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an H100/H200 (compute capability 9.0)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("N,M", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_op(monkeypatch, dtype, D, N, M, causal):
    poison_empty(monkeypatch)
    q, k, v = _qkv(2, 8, 2, N, M, D, dtype, device="cuda", seed=N + M)
    got, want = _run_op(monkeypatch, q, k, v, causal, bottom_right=causal and N > M)
    out_tol, grad_tol = _GPU_TOL[dtype]
    assert _rel(got[0], want[0]) < out_tol
    for g, w in zip(got[1:], want[1:]):
        assert _rel(g, w) < grad_tol


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an H100/H200 (compute capability 9.0)")
@pytest.mark.parametrize("band", list(BANDS))
def test_gpu_bands_nan_padding(monkeypatch, band):
    """Windows and alignments, inputs inside NaN padding (a read past an
    edge shows as NaN), (B, N, H, D) layout views."""
    poison_empty(monkeypatch)
    monkeypatch.setenv("FLASHFUSE_HOPPER", "1")
    q, k, v = (in_nan_padding(t) for t in _qkv(2, 6, 3, 777, 555, 128, torch.bfloat16, device="cuda", seed=9))
    kw = BANDS[band]
    assert hopper.hopper_unsuitable(q, k, v) is None
    out, lse = hopper.hopper_forward(q, k, v, scale=0.1, **kw)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, scale=0.1, **kw)
    assert _rel(out, ref) < 2e-2
    go = in_nan_padding(torch.randn_like(out))
    ref.backward(go.double())
    dq, dk, dv = hopper.hopper_backward(go, q, k, v, out, lse, scale=0.1, **kw)
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert _rel(got, want) < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an H100/H200 (compute capability 9.0)")
def test_gpu_lse_interchangeable(monkeypatch):
    """The portable backward on the Hopper forward's lse, and the Hopper
    backward on the portable forward's, agree with each other."""
    from flashfuse.kernels.backward import attention_backward
    from flashfuse.kernels.forward import attention_forward

    q, k, v = _qkv(1, 4, 4, 1000, 1000, 128, torch.bfloat16, device="cuda", seed=2)
    kw = dict(window_left=None, window_right=0, bottom_right=False)
    out_h, lse_h = hopper.hopper_forward(q, k, v, scale=0.09, **kw)
    out_p, lse_p = attention_forward(q, k, v, None, None, dropout_p=0.0, scale=0.09, **kw)
    torch.testing.assert_close(lse_h, lse_p, atol=1e-3, rtol=1e-4)
    go = torch.randn_like(out_h)
    a = hopper.hopper_backward(go, q, k, v, out_p, lse_p, scale=0.09, **kw)
    b = attention_backward(go, q, k, v, None, None, out_h, lse_h, dropout_p=0.0, scale=0.09, mask_grad=False, **kw)
    for x, y in zip(a, b[:3]):
        assert _rel(x, y) < 2e-2


def test_interpreter_single_row_odd_strides(monkeypatch):
    """One query (a size-1 row dimension with an odd stride) against a few
    keys; grouped heads of one key/value head (a size-1 head dimension)."""
    poison_empty(monkeypatch)
    q, k, v = _qkv(2, 3, 1, 1, 29, 16, seed=8)
    q = q.as_strided(q.shape, (q.stride(0), q.stride(1), 7, 1))  # stride 7: never used with one row
    k = k.as_strided(k.shape, (k.stride(0), 5, k.stride(2), 1))
    assert all(hopper._descriptor_layout(t) for t in (q, k, v))  # the rule takes them
    out, lse = hopper.hopper_forward(q, k, v, scale=0.25, window_left=None, window_right=None, bottom_right=False)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qd, kd, vd, scale=0.25)
    assert _rel(out, ref) < 3e-3
    go = torch.randn_like(out)
    ref.backward(go.double())
    dq, dk, dv = hopper.hopper_backward(go, q, k, v, out, lse, scale=0.25, window_left=None, window_right=None,
                                        bottom_right=False)
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert _rel(got, want) < 5e-3


def test_dispatch_falls_back_when_a_kernel_does_not_compile(monkeypatch):
    """A Hopper kernel the compiler refuses: the portable kernels run."""
    monkeypatch.setenv("FLASHFUSE_HOPPER", "1")
    monkeypatch.setattr(hopper, "hopper_unsuitable", lambda *a, **k: None)

    def refuse(*a, **k):
        raise hopper.HopperCompileFailed("_hopper_fwd does not compile here")
    monkeypatch.setattr(hopper, "hopper_forward", refuse)
    monkeypatch.setattr(hopper, "hopper_backward", refuse)
    q, k, v = _qkv(1, 2, 2, 9, 11, 16)
    out, lse = kernels.attention_forward(q, k, v, None, None, **_BAND)
    assert _rel(out, reference_attention(q, k, v, scale=0.2, window_right=0)) < 3e-3
    go = torch.randn_like(out)
    dq, dk, dv, dmask = kernels.attention_backward(go, q, k, v, None, None, out, lse, **_BAND, mask_grad=False)
    assert dmask is None and not dq.isnan().any()
    assert hopper._compile_failure(RuntimeError("PassManager::run failed"))
    assert not hopper._compile_failure(RuntimeError("CUDA error: an illegal memory access"))
