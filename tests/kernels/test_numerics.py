"""Numerical edge cases of ``flashfuse.attention``, end to end through the op.

Each test runs on both CPU implementations (the blockwise PyTorch path and
the Triton kernels through the interpreter; tiny shapes on the latter), and
the ``gpu``-marked tests repeat the checks with larger shapes on CUDA.

What is checked:

* large scores (logits near +-1e4 in fp16/bf16) neither overflow nor lose
  the row maximum;
* fully masked rows give 0 with zero gradients and no NaN anywhere;
* N = 1, M = 1 and decoding shapes (a few queries, a long key sequence);
* every supported kind of head size;
* NaN / inf in the inputs propagate exactly as eager attention propagates
  them (stated per case below);
* ``gradcheck`` in float64 on the blockwise path.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashfuse
from flashfuse.reference import reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tolerances against the float64 reference: (forward, gradients).
TOL = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (3e-3, 1e-2),
    torch.bfloat16: (2e-2, 6e-2),
    torch.float64: (1e-10, 1e-9),
}


@pytest.fixture(params=["blockwise", "interpreter"])
def path(request, monkeypatch):
    """Both CPU implementations (on a GPU machine: the CUDA kernels once)."""
    if DEVICE == "cuda":
        if request.param != "blockwise":
            pytest.skip("CUDA tensors always run the compiled kernels")
        return "cuda"
    if request.param == "interpreter" and not flashfuse.ops._kernels.BUILT_FOR_INTERPRETER:
        pytest.skip("kernels were not built for the Triton interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.param == "blockwise" else "1")
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("FLASHFUSE_AUTOTUNE", "0")
    return request.param


@pytest.fixture
def blockwise(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _qkv(B, Hq, Hkv, N, M, D, Dv=None, dtype=torch.float32, seed=0, scale=1.0, grad=True, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    mk = lambda *s: (torch.randn(*s, generator=g) * scale).to(device, dtype).requires_grad_(grad)  # noqa: E731
    return mk(B, Hq, N, D), mk(B, Hkv, M, D), mk(B, Hkv, M, Dv)


def _rel(x, ref):
    """Relative error in norm, floored at entries of size 1e-2: gradients that
    are zero up to rounding (a one-hot softmax, a single key) compare by
    absolute error instead of blowing up the ratio."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / max(ref.norm().item(), 1e-2 * max(ref.numel(), 1) ** 0.5)).item()


def _check_against_reference(q, k, v, mask=None, grad=True, grad_tol=None, **kw):
    """Forward and (optionally) gradients of the op against the float64
    reference; returns the op's output and gradients."""
    fwd_tol, default_grad_tol = TOL[q.dtype]
    grad_tol = grad_tol or default_grad_tol
    op_kw = {key: kw[key] for key in ("scale", "window_left", "window_right", "is_causal", "alignment") if key in kw}
    gqa = q.shape[1] != k.shape[1]
    out = flashfuse.attention(q, k, v, mask, enable_gqa=gqa, **op_kw)
    assert torch.isfinite(out).all(), "non-finite output"
    ref_kw = dict(scale=kw.get("scale"), window_left=kw.get("window_left"),
                  window_right=0 if kw.get("is_causal") else kw.get("window_right"),
                  bottom_right=kw.get("alignment") == "bottom_right")
    leaves = [t for t in (q, k, v) if t.requires_grad]
    refs = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)]
    ref = reference_attention(*refs, mask, **ref_kw)
    assert _rel(out, ref) <= fwd_tol, f"forward relative error {_rel(out, ref):.3g}"
    if not grad or not leaves:
        return out, None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    grads = torch.autograd.grad(out, leaves, g.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, [r for r in refs if r.requires_grad], g.double())
    for name, a, b in zip("qkv", grads, ref_grads):
        assert torch.isfinite(a).all(), f"non-finite d{name}"
        assert _rel(a, b) <= grad_tol, f"d{name} relative error {_rel(a, b):.3g}"
    return out, grads


# ---------------------------------------------------------------------------
# Large scores
# ---------------------------------------------------------------------------


def _large_logit_inputs(dtype, N, M, D, magnitude=1e4, seed=0):
    """q, k with q_i . k_j close to +-``magnitude`` (scale 1): entries of size
    sqrt(magnitude / D) with random signs, so scores sit near the top of the
    fp16 range's comfortable zone and far above exp's."""
    g = torch.Generator().manual_seed(seed)
    a = math.sqrt(magnitude / D)
    q = (torch.randint(0, 2, (1, 2, N, D), generator=g) * 2 - 1) * a
    k = (torch.randint(0, 2, (1, 2, M, D), generator=g) * 2 - 1) * a
    k = k + torch.randn(k.shape, generator=g) * 0.01 * a  # distinct scores per key
    v = torch.randn(1, 2, M, D, generator=g)
    return [t.to(DEVICE, dtype).requires_grad_(True) for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_scores_do_not_overflow(path, dtype):
    q, k, v = _large_logit_inputs(dtype, 5, 37, 16)
    scores = (q.double() @ k.double().mT).abs()
    assert scores.max() > 5e3  # the test really reaches the large range
    # The forward is as exact as ever. The gradient of a near one-hot softmax
    # is a difference of nearly equal terms (dP - rowsum(dP * P)), so the
    # rounding of dO and P to 8-11 bits shows up amplified: looser bound.
    _check_against_reference(q, k, v, scale=1.0, grad_tol=5 * TOL[dtype][1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_scores_with_large_negative_mask(path, dtype):
    """Scores of +-1e4 plus an additive -1e4 bias: still finite, still exact;
    and a causal band on top."""
    q, k, v = _large_logit_inputs(dtype, 6, 6, 16, seed=1)
    mask = torch.zeros(6, 6)
    mask[:, 3:] = -1e4
    _check_against_reference(q, k, v, mask.to(DEVICE, dtype), scale=1.0, is_causal=True,
                             grad_tol=5 * TOL[dtype][1])


# ---------------------------------------------------------------------------
# Fully masked rows
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "float", "causal"])
def test_fully_masked_rows_are_zero_with_zero_gradients(path, kind):
    """Rows that see no key: output 0 (eager: NaN), no NaN anywhere, dq = 0
    on those rows, and the other rows' results and dk, dv are exact."""
    B, H, N, M, D = 1, 2, 6, 9, 16
    q, k, v = _qkv(B, H, H, N, M, D)
    empty = [1, 4]
    mask, kw = None, {}
    if kind == "bool":
        mask = torch.rand(B, 1, N, M, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[..., 0] = True
        mask[:, :, empty] = False
        mask = mask.to(DEVICE)
    elif kind == "float":
        mask = torch.randn(N, M, generator=torch.Generator().manual_seed(1))
        mask[empty] = float("-inf")
        mask = mask.to(DEVICE)
    else:
        # Bottom-right causal with N > M: query i sees keys j <= i - (N - M),
        # so the first N - M = 3 queries see none.
        q, k, v = _qkv(B, H, H, N, 3, D)
        kw = dict(is_causal=True, alignment="bottom_right")
        empty = [0, 1, 2]
    out, grads = _check_against_reference(q, k, v, mask, **kw)
    assert (out[:, :, empty] == 0).all()
    dq = grads[0]
    assert (dq[:, :, empty] == 0).all()


# ---------------------------------------------------------------------------
# Degenerate and decoding shapes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("N,M", [(1, 1), (1, 7), (7, 1), (1, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_query_or_key(path, N, M, dtype):
    q, k, v = _qkv(2, 2, 1, N, M, 16, 24, dtype=dtype)
    _check_against_reference(q, k, v)
    # bottom-right causal: the single query sees every key.
    _check_against_reference(q, k, v, is_causal=True, alignment="bottom_right")


@pytest.mark.parametrize("N", [1, 2, 4])
def test_decoding_long_keys(path, N):
    """A few new queries against a long KV cache, bottom-right causal."""
    M = 1000 if path != "interpreter" else 300
    q, k, v = _qkv(1, 2, 1, N, M, 32)
    _check_against_reference(q, k, v, is_causal=True, alignment="bottom_right")
    _check_against_reference(q, k, v, window_left=50, window_right=0, alignment="bottom_right", grad=False)


# ---------------------------------------------------------------------------
# Head sizes
# ---------------------------------------------------------------------------

ALL_D = [16, 40, 64, 80, 96, 128, 256]
INTERPRETER_D = [16, 40, 128]


@pytest.mark.parametrize("D", ALL_D)
def test_head_dims(path, D):
    if path == "interpreter" and D not in INTERPRETER_D:
        pytest.skip("covered on the blockwise path (the interpreter is slow)")
    q, k, v = _qkv(1, 2, 2, 9, 13, D)
    _check_against_reference(q, k, v, is_causal=True)


@pytest.mark.parametrize("D,Dv", [(16, 256), (256, 16), (40, 80)])
def test_value_head_dim_differs(path, D, Dv):
    q, k, v = _qkv(1, 1, 1, 5, 11, D, Dv)
    _check_against_reference(q, k, v)


# ---------------------------------------------------------------------------
# NaN and inf in the inputs
# ---------------------------------------------------------------------------


def _eager(q, k, v, mask=None, scale=None):
    """Eager attention as models write it (the behaviour flashfuse must keep):
    softmax(q k^T * scale + mask) v with a bool mask applied by masked_fill."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.double() @ k.double().mT) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, dim=-1) @ v.double()


def _same_nan_pattern(out, ref):
    """Same NaN positions; the finite entries agree."""
    nan_out, nan_ref = torch.isnan(out), torch.isnan(ref)
    assert torch.equal(nan_out, nan_ref), (
        f"NaN pattern differs: op has {int(nan_out.sum())} NaN, eager has {int(nan_ref.sum())}"
    )
    torch.testing.assert_close(out.double()[~nan_ref], ref[~nan_ref], atol=1e-5, rtol=1e-5)


def _nan_inputs():
    q, k, v = _qkv(1, 2, 2, 5, 7, 16, grad=False)
    q, k, v = q.clone(), k.clone(), v.clone()
    return q, k, v


def test_nan_in_query_poisons_only_its_row(path):
    """Eager: a NaN in q_i makes row i of the scores NaN, so output row i is
    NaN; every other row is unaffected."""
    q, k, v = _nan_inputs()
    q[0, 1, 2, 3] = float("nan")
    out = flashfuse.attention(q, k, v)
    _same_nan_pattern(out, _eager(q, k, v))
    assert torch.isnan(out[0, 1, 2]).all() and torch.isfinite(out[0, 0]).all()


def test_nan_in_visible_key_poisons_every_row_of_its_head(path):
    """Eager: a NaN in k_j makes column j of the scores NaN, so every row that
    sees key j (here: all rows of that batch and head) is NaN."""
    q, k, v = _nan_inputs()
    k[0, 0, 4, 0] = float("nan")
    out = flashfuse.attention(q, k, v)
    _same_nan_pattern(out, _eager(q, k, v))
    assert torch.isnan(out[0, 0]).all() and torch.isfinite(out[0, 1]).all()


def test_nan_in_key_hidden_by_bool_mask_is_ignored(path):
    """Eager masked_fill replaces the NaN score of a hidden key with -inf,
    so a NaN key that no row sees changes nothing."""
    q, k, v = _nan_inputs()
    k[0, 0, 6, :] = float("nan")
    mask = torch.ones(5, 7, dtype=torch.bool, device=DEVICE)
    mask[:, 6] = False
    out = flashfuse.attention(q, k, v, mask)
    _same_nan_pattern(out, _eager(q, k, v, mask))
    assert torch.isfinite(out).all()


def test_nan_in_value_poisons_its_column(path):
    """Eager: P @ v with a NaN in v[j, d] gives NaN in column d of every
    row that sees key j (all rows here), the other columns are exact."""
    q, k, v = _nan_inputs()
    v[0, 1, 3, 5] = float("nan")
    out = flashfuse.attention(q, k, v)
    _same_nan_pattern(out, _eager(q, k, v))
    assert torch.isnan(out[0, 1, :, 5]).all() and torch.isfinite(out[0, 1, :, :5]).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_plus_inf_in_float_mask_poisons_its_row(path, value):
    """Eager: NaN or +inf added to one score makes that row's softmax NaN
    (NaN max, or inf - inf); other rows unaffected."""
    q, k, v = _nan_inputs()
    mask = torch.zeros(5, 7, device=DEVICE)
    mask[3, 2] = value
    out = flashfuse.attention(q, k, v, mask)
    _same_nan_pattern(out, _eager(q, k, v, mask))
    assert torch.isnan(out[:, :, 3]).all()


def test_inf_in_query_poisons_its_row(path):
    """Eager: q_i containing +inf gives row i scores of +-inf (or NaN), whose
    softmax is NaN (inf - inf); the other rows are exact."""
    q, k, v = _nan_inputs()
    q[0, 0, 1, 0] = float("inf")
    out = flashfuse.attention(q, k, v)
    _same_nan_pattern(out, _eager(q, k, v))
    assert torch.isnan(out[0, 0, 1]).all()


# ---------------------------------------------------------------------------
# gradcheck in float64 (blockwise CPU path; CPU tensors on any machine)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "N,M,kw",
    [
        (1, 1, {}),
        (1, 9, dict(is_causal=True, alignment="bottom_right")),
        (6, 4, dict(window_left=1, window_right=2)),
        (5, 5, dict(scale=2.5, is_causal=True)),
    ],
    ids=["N1M1", "decode", "window", "scale-causal"],
)
def test_gradcheck_float64(blockwise, N, M, kw):
    q, k, v = _qkv(1, 2, 1, N, M, 16, 16, dtype=torch.float64, device="cpu")
    bias = torch.randn(N, M, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias):
        return flashfuse.attention(q, k, v, bias, enable_gqa=True, **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_gradcheck_float64_bool_mask_with_empty_row(blockwise):
    """Gradients stay exact (and zero on the empty row) with a bool mask."""
    q, k, v = _qkv(1, 1, 1, 4, 6, 16, dtype=torch.float64, device="cpu")
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(3)) > 0.5
    mask[:, 0] = True
    mask[2] = False
    assert torch.autograd.gradcheck(lambda q, k, v: flashfuse.attention(q, k, v, mask), (q, k, v))


# ---------------------------------------------------------------------------
# The same checks at GPU sizes
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_large_scores(dtype):
    q, k, v = _large_logit_inputs(dtype, 512, 1024, 128)
    _check_against_reference(q, k, v, scale=1.0, grad_tol=5 * TOL[dtype][1])


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decoding(N, dtype):
    q, k, v = _qkv(2, 8, 2, N, 16384, 128, dtype=dtype)
    _check_against_reference(q, k, v, is_causal=True, alignment="bottom_right")


@pytest.mark.gpu
@pytest.mark.parametrize("D", ALL_D)
def test_gpu_head_dims(D):
    q, k, v = _qkv(2, 4, 4, 300, 700, D, dtype=torch.bfloat16)
    _check_against_reference(q, k, v, is_causal=True)


@pytest.mark.gpu
def test_gpu_fully_masked_rows():
    q, k, v = _qkv(2, 4, 4, 257, 129, 64, dtype=torch.float16)
    out, grads = _check_against_reference(q, k, v, is_causal=True, alignment="bottom_right")
    assert (out[:, :, :128] == 0).all() and (grads[0][:, :, :128] == 0).all()


@pytest.mark.gpu
def test_gpu_nan_propagation():
    q, k, v = _qkv(1, 2, 2, 300, 500, 64, grad=False)
    q, k, v = q.clone(), k.clone(), v.clone()
    q[0, 1, 7, 3] = float("nan")
    v[0, 0, 100, 5] = float("nan")
    _same_nan_pattern(flashfuse.attention(q, k, v), _eager(q, k, v))
