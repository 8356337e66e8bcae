"""Soft-capping (``softcap``) and attention sinks (``sinks``) in the op.

Every implementation (the Triton kernels through the interpreter here, the
blockwise CPU path, the kernels on a GPU) is compared against the float64
reference, forward and gradients, on fresh random inputs; the reference
itself is checked against the spellings the models use (Gemma 2's
scale-cap-mask order, gpt-oss's concatenate-softmax-slice).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import triton
import triton.language as tl

import flashfuse
from flashfuse import ops
from flashfuse import reference as ref
from flashfuse.kernels.common import _tanh_parts

from tests.kernels.padding import in_nan_padding, poison_empty

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2, torch.float64: 1e-6}


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """Unwritten output elements show up as NaN."""
    poison_empty(monkeypatch)


@pytest.fixture(params=["two_pass", "one_pass"])
def bwd_mode(request, monkeypatch):
    monkeypatch.setenv("FLASHFUSE_BWD", request.param)
    return request.param


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, Hq, Hkv, N, M, D, dtype, device=DEVICE, Dv=None):
    q = torch.randn(B, Hq, N, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, M, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, M, Dv or D, dtype=dtype, device=device)
    return q, k, v


def _leaf(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _check(q, k, v, sinks=None, attn_mask=None, *, tol, scale=None, **kw):
    """The op against the float64 reference, output and all gradients."""
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    grad_mask = attn_mask is not None and attn_mask.is_floating_point()
    if grad_mask:
        inputs.append(attn_mask)
    leaves = _leaf(*inputs)
    ql, kl, vl = leaves[:3]
    sl = leaves[3] if sinks is not None else None
    ml = leaves[-1] if grad_mask else attn_mask
    out = flashfuse.attention(ql, kl, vl, ml, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                              sinks=sl, **kw)
    causal = kw.pop("is_causal", False)
    align = kw.pop("alignment", "top_left")
    if causal:
        kw["window_right"] = 0 if kw.get("window_right") is None else min(kw["window_right"], 0)
    r_leaves = _leaf(*inputs)
    rs = r_leaves[3] if sinks is not None else None
    rm = r_leaves[-1] if grad_mask else attn_mask
    expected = ref.reference_attention(*r_leaves[:3], rm, scale=scale, sinks=rs,
                                       bottom_right=align == "bottom_right", **kw)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert _rel(out, expected) < tol
    g = torch.randn_like(expected)
    grads = torch.autograd.grad(out, leaves, g.to(out.dtype))
    r_grads = torch.autograd.grad(expected, r_leaves, g)
    for name, a, b in zip(["dq", "dk", "dv", "dsinks" if sinks is not None else "dmask", "dmask"], grads, r_grads):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < tol * 3, (name, _rel(a, b))
    return out


# ---------------------------------------------------------------------------
# the reference is what the models compute
# ---------------------------------------------------------------------------

def test_reference_matches_gemma2_and_gpt_oss_spellings():
    torch.manual_seed(0)
    q, k, v = _inputs(2, 3, 3, 5, 7, 16, torch.float64, "cpu")
    mask = torch.randn(2, 1, 5, 7, dtype=torch.float64)
    sinks = torch.randn(3, dtype=torch.float64)
    scale = 0.3
    # Gemma 2: scale, then cap, then the mask.
    s = q @ k.transpose(-1, -2) * scale
    s = torch.tanh(s / 20.0) * 20.0 + mask
    gemma = torch.softmax(s, -1) @ v
    assert torch.allclose(ref.reference_attention(q, k, v, mask, scale=scale, softcap=20.0), gemma, atol=1e-12)
    # gpt-oss: sink column, max subtraction, softmax, drop the column.
    s = q @ k.transpose(-1, -2) * scale + mask
    comb = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(2, -1, 5, 1)], dim=-1)
    comb = comb - comb.max(dim=-1, keepdim=True).values
    gpt = torch.softmax(comb, -1)[..., :-1] @ v
    assert torch.allclose(ref.reference_attention(q, k, v, mask, scale=scale, sinks=sinks), gpt, atol=1e-12)
    lse = ref.reference_lse(q, k, mask, scale=scale, sinks=sinks)
    assert torch.allclose(lse, torch.logsumexp(torch.cat([q @ k.transpose(-1, -2) * scale + mask,
                                                          sinks.reshape(1, -1, 1, 1).expand(2, -1, 5, 1)], -1), -1))


# ---------------------------------------------------------------------------
# blockwise CPU path: float64 gradcheck
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(softcap=1.7),
    dict(sinks=True),
    dict(softcap=2.5, sinks=True, is_causal=True),
    dict(softcap=0.9, sinks=True, window_left=2, window_right=1, mask=True),
])
def test_blockwise_gradcheck_float64(blockwise_cpu, kw, monkeypatch):
    monkeypatch.undo()  # gradcheck allocates through torch.empty: no poisoning
    torch.manual_seed(1)
    kw = dict(kw)
    q, k, v = _leaf(*_inputs(1, 2, 1, 5, 7, 16, torch.float64, "cpu"))
    extra = []
    if kw.pop("sinks", False):
        extra.append(torch.randn(2, dtype=torch.float64, requires_grad=True))
    use_mask = kw.pop("mask", False)
    if use_mask:
        extra.append(torch.randn(1, 1, 5, 7, dtype=torch.float64, requires_grad=True))

    def f(q, k, v, *rest):
        sinks = rest[0] if rest and rest[0].dim() == 1 else None
        mask = rest[-1] if use_mask else None
        return flashfuse.attention(q, k, v, mask, enable_gqa=True, sinks=sinks, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v, *extra), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blockwise_matches_reference(blockwise_cpu, dtype):
    torch.manual_seed(2)
    q, k, v = _inputs(2, 4, 2, 13, 29, 24, dtype, "cpu")
    sinks = torch.randn(4, dtype=dtype)
    mask = torch.randn(2, 1, 13, 29, dtype=dtype)
    _check(q, k, v, sinks, mask, tol=TOL[dtype], softcap=3.0, scale=0.6)
    _check(q, k, v, sinks, tol=TOL[dtype], softcap=5.0, is_causal=True, alignment="bottom_right")


# ---------------------------------------------------------------------------
# Triton kernels (interpreter on CPU)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,case", [
    (torch.float32, "softcap"), (torch.float32, "sinks"), (torch.float32, "both_causal"),
    (torch.float32, "both_float_mask"), (torch.float32, "softcap_bool_window"),
    (torch.float16, "both_float_mask"), (torch.float16, "softcap_bool_window"),
])
def test_kernels_match_reference(dtype, case, bwd_mode):
    torch.manual_seed(3)
    q, k, v = _inputs(1, 2, 1, 19, 37, 16, dtype)
    q, k, v = in_nan_padding(q), in_nan_padding(k), in_nan_padding(v)
    sinks = torch.randn(2, dtype=torch.float32, device=DEVICE) * 2
    kw, s, m = {}, None, None
    if case == "softcap":
        kw = dict(softcap=2.0, scale=0.8)  # caps most scores: the tanh's both ends
    elif case == "sinks":
        s = sinks
    elif case == "both_causal":
        kw, s = dict(softcap=1.5, is_causal=True), sinks
    elif case == "both_float_mask":
        kw, s = dict(softcap=3.0), sinks.to(dtype)
        m = torch.randn(1, 2, 19, 37, dtype=dtype, device=DEVICE)
    else:
        kw = dict(softcap=4.0, window_left=5)
        m = torch.rand(1, 1, 19, 37, device=DEVICE) > 0.3
    _check(q, k, v, s, m, tol=TOL[dtype], **kw)


def test_kernels_dropout_with_softcap_and_sinks(bwd_mode):
    """Dropout through the private op with a known seed: the reference gets
    the same keep mask; sinks still get their gradient."""
    torch.manual_seed(4)
    B, H, N, M, D, p = 1, 2, 17, 40, 16, 0.3
    q, k, v = _leaf(*_inputs(B, H, H, N, M, D, torch.float32))
    sinks = torch.randn(H, device=DEVICE, requires_grad=True)
    seed = torch.tensor(12345, dtype=torch.int64, device=DEVICE)
    out, lse = torch.ops.flashfuse._attention_forward(q, k, v, None, seed, p, 0.25, None, None, False, None,
                                                      softcap=2.0, sinks=sinks)
    keep = ref.dropout_keep_mask(12345, B, H, N, M, p, device=DEVICE)
    rq, rk, rv, rs = _leaf(q, k, v, sinks)
    expected = ref.reference_attention(rq, rk, rv, scale=0.25, softcap=2.0, sinks=rs, dropout_mask=keep,
                                       dropout_p=p)
    assert _rel(out, expected) < 2e-5
    assert _rel(lse, ref.reference_lse(q, k, scale=0.25, softcap=2.0, sinks=sinks)) < 1e-6
    g = torch.randn_like(expected)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, sinks), g.float()),
                    torch.autograd.grad(expected, (rq, rk, rv, rs), g)):
        assert _rel(a, b) < 5e-5


def test_rows_without_keys_and_rows_hidden_by_finite_values():
    """A row that sees no key gives 0 with a sink (the sink takes the whole
    row) and 0 without; a row that ``finfo.min`` hides gives the sink the
    whole row too, as eager's softmax does. Gradients stay finite."""
    torch.manual_seed(5)
    q, k, v = _inputs(1, 2, 2, 6, 33, 16, torch.float32)
    sinks = torch.randn(2, device=DEVICE)
    bmask = torch.rand(1, 1, 6, 33, device=DEVICE) > 0.4
    bmask[..., 2, :] = False
    _check(q, k, v, sinks, bmask, tol=2e-5, softcap=10.0)
    fmask = torch.zeros(1, 1, 6, 33, device=DEVICE)
    fmask[..., 3, :] = torch.finfo(torch.float32).min
    _check(q, k, v, sinks, fmask, tol=2e-5)


@triton.jit
def _tanh_kernel(X, T, S, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    t, s = _tanh_parts(x)
    tl.store(T + offs, t, mask=offs < n)
    tl.store(S + offs, s, mask=offs < n)


@pytest.mark.parametrize("path", ["kernels", "blockwise"])
@pytest.mark.parametrize("fill,sink", [(-1e4, -2e4), (-1e4, 0.5), (-3.4e38, 1.0)])
def test_rows_a_fill_hides_with_sinks_above_and_below(path, fill, sink, monkeypatch):
    """A row that ``mask_fill`` hides entirely averages its keys when the
    sink lies far below the fill, and gives the sink the whole row when it
    lies above, as eager's softmax over [fills..., sink] does."""
    if path == "blockwise":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(8)
    q, k, v = _inputs(1, 2, 2, 5, 33, 16, torch.float32)
    sinks = torch.tensor([sink, 0.3], device=DEVICE)
    bmask = torch.rand(1, 1, 5, 33, device=DEVICE) > 0.4
    bmask[..., 1, :] = False
    _check(q, k, v, sinks, bmask, tol=2e-5, mask_fill=fill)


def test_tanh_accuracy_in_fp32():
    """The kernels' exp2-based tanh and 1 - tanh**2 are within a few fp32
    ulps of float64 over the whole range (small |x| where 1 - e cancels,
    the branch point, and the saturated ends)."""
    x = torch.cat([torch.linspace(-12, 12, 1001), torch.logspace(-8, 1, 300), -torch.logspace(-8, 1, 300),
                   torch.tensor([0.0, 0.125, -0.125, 0.12499999, 30.0, -30.0])]).to(DEVICE)
    t, s = torch.empty_like(x), torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 256),)](x, t, s, x.numel(), BLOCK=256)
    x64 = x.double()
    t64 = torch.tanh(x64)
    e = torch.exp(-2 * x64.abs())
    s64 = 4 * e / (1 + e) ** 2
    assert ((t.double() - t64).abs() <= 4e-7 * t64.abs()).all()
    # exp(-2|x|) inherits the rounding of its fp32 argument: relative error
    # about 2|x| * 2**-24, under fp32's spacing of the scores themselves.
    assert ((s.double() - s64).abs() <= (1e-6 + 2.5e-7 * x64.abs()) * s64).all()


# ---------------------------------------------------------------------------
# argument checks, fake tensors, compile
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_softcap_raises(bad):
    q, k, v = _inputs(1, 2, 2, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        flashfuse.attention(q, k, v, softcap=bad)


def test_bad_sinks_raise():
    q, k, v = _inputs(1, 2, 2, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match=r"sinks must have shape \(query_heads,\) = \(2,\)"):
        flashfuse.attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks must have shape"):
        flashfuse.attention(q, k, v, sinks=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="sinks dtype torch.float64 is not supported"):
        flashfuse.attention(q, k, v, sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="sinks are on meta"):
        flashfuse.attention(q, k, v, sinks=torch.zeros(2, device="meta"))


def test_compile_forward_and_backward(blockwise_cpu, monkeypatch):
    """Through Dynamo and AOTAutograd: the fake implementations and the
    registered autograd carry both arguments and the sinks' gradient."""
    monkeypatch.undo()
    torch._dynamo.reset()
    torch.manual_seed(6)
    q, k, v = _leaf(*_inputs(1, 2, 1, 9, 11, 16, torch.float32, "cpu"))
    sinks = torch.randn(2, requires_grad=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, s):
        return flashfuse.attention(q, k, v, enable_gqa=True, softcap=3.0, sinks=s, is_causal=True)

    out = f(q, k, v, sinks)
    out.square().sum().backward()
    rq, rk, rv, rs = _leaf(q, k, v, sinks)
    expected = ref.reference_attention(rq, rk, rv, softcap=3.0, sinks=rs, window_right=0)
    expected.square().sum().backward()
    assert _rel(out, expected) < 1e-5
    for a, b in ((q, rq), (k, rk), (v, rv), (sinks, rs)):
        assert _rel(a.grad, b.grad) < 1e-4
    torch._dynamo.reset()


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_softcap_sinks(dtype, D, bwd_mode):
    torch.manual_seed(7)
    q, k, v = _inputs(2, 8, 2, 300, 517, D, dtype, "cuda")
    sinks = torch.randn(8, device="cuda")
    mask = torch.randn(2, 1, 300, 517, device="cuda", dtype=dtype)
    _check(q, k, v, sinks, None, tol=TOL[dtype], softcap=30.0, is_causal=True, alignment="bottom_right")
    _check(q, k, v, sinks.to(dtype), mask, tol=TOL[dtype], softcap=50.0)
    _check(q, k, v, None, None, tol=TOL[dtype], softcap=20.0, window_left=64)


@pytest.mark.gpu
def test_gpu_kernel_problem_with_softcap_and_sinks():
    q, k, v = _inputs(1, 4, 4, 128, 128, 64, torch.bfloat16, "cuda")
    assert ops.kernel_problem(q, k, v, softcap=30.0, sinks=torch.zeros(4, device="cuda"), backward=True) is None
