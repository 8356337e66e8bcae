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

from tests.kernels.padding import poison_empty

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


def _negative_logit_inputs(dtype, N, M, D, magnitude=200.0, seed=0):
    """q, k of unit entries except the first, -a in q and a in k: every
    q_i . k_j is -``magnitude`` (scale 1) plus an ordinary score, so each
    row's log-sum-exp lies far below -88, where exp2(-lse) of a score of 0
    overflows float32 (a key past the sequence's end that a kernel reads as
    zeros and forgets to hide scores 0). The common part sits in one
    coordinate, so the gradients stay as well conditioned as usual."""
    g = torch.Generator().manual_seed(seed)
    a = math.sqrt(magnitude)
    q = torch.randn(1, 2, N, D, generator=g)
    k = torch.randn(1, 2, M, D, generator=g)
    q[..., 0] = -a
    k[..., 0] = a
    v = torch.randn(1, 2, M, D, generator=g)
    return [t.to(DEVICE, dtype).requires_grad_(True) for t in (q, k, v)]


@pytest.mark.parametrize("N, causal", [(7, False), (45, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_only_very_negative_scores(path, dtype, N, causal):
    """Every score near -200: finite and exact, forward and gradients, with
    a key count that leaves the last key block part empty; no band, and a
    top-left causal band whose last rows see every key."""
    q, k, v = _negative_logit_inputs(dtype, N, 37, 16)
    assert (q.double() @ k.double().mT).max() < -150  # the test really reaches the range
    _check_against_reference(q, k, v, scale=1.0, is_causal=causal)


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
# Rows that a finite value hides entirely
# ---------------------------------------------------------------------------


@pytest.fixture
def poisoned_small_tiles(monkeypatch):
    """NaN in every floating tensor the implementations allocate with
    torch.empty / empty_like (an element left unwritten shows), and tiles of
    the blockwise path small enough that rows span several key tiles and
    query chunks."""
    poison_empty(monkeypatch)
    monkeypatch.setattr(flashfuse.reference, "KEY_BLOCK", 8)
    monkeypatch.setattr(flashfuse.reference, "TILE_ELEMENTS", 1)


def _visible_pairs(pattern, B, N, M, gen):
    """bool (B, 1, N, M), True where the mask lets a pair take part, with
    rows that see nothing: left padding (the first queries of batch 1 see
    only its padding keys, with the causal band), a strict causal mask j < i
    (row 0 sees nothing), or random pairs with rows 1 and 4 hidden."""
    i, j = torch.arange(N)[:, None], torch.arange(M)[None, :]
    if pattern == "left-pad":
        keep = (j <= i).expand(B, 1, N, M).clone()
        keep[1, :, :, :5] = False
    elif pattern == "strict-causal":
        keep = (j < i).expand(B, 1, N, M).clone()
    else:
        keep = torch.rand(B, 1, N, M, generator=gen) > 0.3
        keep[:, :, [1, 4]] = False
    return keep


def _eager_attention(q, k, v, mask, fill, band, scale):
    """What eager PyTorch computes (in q's dtype): scores plus a float mask,
    or masked_fill of a bool one; the band as -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.mT * scale
    s = s + mask if fill is None else s.masked_fill(~mask, fill)
    vis = reference_visibility(q.shape[2], k.shape[2], band)
    if vis is not None:
        s = s.masked_fill(~vis.to(s.device), float("-inf"))
    return torch.softmax(s, -1) @ v


def reference_visibility(N, M, band):
    from flashfuse.reference import visibility_mask

    return visibility_mask(N, M, window_left=band["window_left"], window_right=band["window_right"],
                           bottom_right=band["bottom_right"])


def _check_hidden_rows(pattern, mask_kind, dtype, band, Hq=2, Hkv=2, N=21, M=21, D=24, dropout_p=0.0,
                       device=DEVICE, grad_tol=None, seed=0):
    """The op (through its private forward, so dropout can be seeded) on
    rows hidden entirely, against the float64 reference: output and the
    gradients of q, k, v (and of a float mask that requires grad). fp32
    cases also against eager PyTorch."""
    fwd_tol, default_grad_tol = TOL[dtype]
    grad_tol = grad_tol or default_grad_tol
    B = 2
    gen = torch.Generator().manual_seed(seed)
    band = {"window_left": None, "window_right": None, "bottom_right": False, **band}
    q, k, v = (torch.randn(B, H, L, d, generator=gen).to(device, dtype).requires_grad_()
               for H, L, d in ((Hq, N, D), (Hkv, M, D), (Hkv, M, D + 8)))
    keep = _visible_pairs(pattern, B, N, M, gen)
    low = torch.finfo(dtype).min
    fill = None
    if mask_kind.startswith("additive"):
        # As Hugging Face builds it: 0 (or a learned bias) / the dtype's lowest.
        bias = torch.randn(keep.shape, generator=gen) if mask_kind == "additive-grad" else torch.zeros(keep.shape)
        mask = bias.masked_fill(~keep, low).to(device, dtype).requires_grad_(mask_kind == "additive-grad")
        mask64 = mask.detach().double().requires_grad_(mask.requires_grad)
    else:
        fill = -1e4 if mask_kind == "fill-1e4" else low
        mask = mask64 = keep.to(device)
    scale = D ** -0.5
    seed_t = torch.tensor(77 + seed, dtype=torch.int64, device=device) if dropout_p else None
    out, lse = torch.ops.flashfuse._attention_forward(
        q, k, v, mask, seed_t, dropout_p, scale, band["window_left"], band["window_right"], band["bottom_right"],
        fill)
    go = torch.randn(out.shape, generator=gen).to(device, dtype)
    leaves = [t for t in (q, k, v, mask) if t.requires_grad]
    grads = torch.autograd.grad(out, leaves, go)

    refs = [t.detach().double().requires_grad_() for t in (q, k, v)] + ([mask64] if mask64.requires_grad else [])
    drop = None
    if dropout_p:
        drop = flashfuse.reference.dropout_keep_mask(int(seed_t), B, Hq, N, M, dropout_p, device=device)
    want = reference_attention(refs[0], refs[1], refs[2], mask64, scale=scale, dropout_mask=drop,
                               dropout_p=dropout_p, mask_fill=fill, **band)
    want_grads = torch.autograd.grad(want, refs, go.double())
    assert torch.isfinite(out).all() and _rel(out, want) <= fwd_tol, f"forward relative error {_rel(out, want):.3g}"
    for name, got, exp in zip(("dq", "dk", "dv", "dmask"), grads, want_grads):
        assert torch.isfinite(got).all(), f"non-finite {name}"
        assert _rel(got, exp) <= grad_tol, f"{name} relative error {_rel(got, exp):.3g}"
    if fill is not None:
        # Filled pairs pass no gradient to q: rows hidden entirely get none.
        vis = reference_visibility(N, M, band)
        hidden = ~(keep.to(device) & (True if vis is None else vis.to(device))).any(-1)  # (B, 1, N)
        assert (grads[0].masked_select(hidden[..., None].expand_as(grads[0])) == 0).all()
    if dtype == torch.float32 and not dropout_p:
        # What the issue measures: eager PyTorch in float32.
        ins = [t.detach().requires_grad_() for t in (q, k, v)] + ([mask.detach().requires_grad_()]
                                                                   if mask.requires_grad else [])
        e = _eager_attention(ins[0], ins[1], ins[2], ins[3] if len(ins) > 3 else mask, fill, band, scale)
        # Rows the band leaves no key at all (N > M + window): eager gives NaN
        # there and the op 0 (documented); compare the rest.
        seen = torch.isfinite(e).all(-1, keepdim=True)
        assert (out.masked_select(~seen) == 0).all(), "rows with no visible key are 0"
        got_rows, want_rows = out.masked_select(seen.expand_as(out)), e.masked_select(seen.expand_as(e))
        assert _rel(got_rows, want_rows) <= fwd_tol, f"forward against eager: {_rel(got_rows, want_rows):.3g}"
        if seen.all():  # NaN rows would spread through eager's backward
            e_grads = torch.autograd.grad(e, ins, go)
            for name, got, exp in zip(("dq", "dk", "dv", "dmask"), grads, e_grads):
                assert _rel(got, exp) <= grad_tol, f"{name} against eager: relative error {_rel(got, exp):.3g}"
    return out, lse


HIDDEN_ROW_CASES = [
    # pattern, mask kind, dtype, band, heads (Hq, Hkv)
    ("left-pad", "additive", torch.float32, {"window_right": 0}, (4, 2)),
    ("strict-causal", "additive-grad", torch.float32, {"window_left": 6, "window_right": 0}, (2, 2)),
    ("random", "additive", torch.bfloat16, {}, (2, 1)),
    ("left-pad", "fill", torch.float32, {"window_right": 0}, (4, 2)),
    ("strict-causal", "fill-1e4", torch.float32, {}, (2, 2)),
    ("random", "fill", torch.float16, {"window_left": 5, "window_right": 3, "bottom_right": True}, (2, 2)),
]


@pytest.mark.parametrize("pattern, mask_kind, dtype, band, heads", HIDDEN_ROW_CASES,
                         ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}-{len(c[3])}" for c in HIDDEN_ROW_CASES])
@pytest.mark.usefixtures("poisoned_small_tiles")
def test_rows_hidden_by_a_finite_value(path, pattern, mask_kind, dtype, band, heads):
    """Rows whose every key a finite value hides (a float mask of the
    dtype's lowest, a bool mask with mask_fill) average their keys, forward
    and backward as eager softmax does: p = 1 / l at each of them."""
    _check_hidden_rows(pattern, mask_kind, dtype, band, Hq=heads[0], Hkv=heads[1], N=21, M=26)


@pytest.mark.parametrize("mask_kind", ["additive", "fill"])
@pytest.mark.usefixtures("poisoned_small_tiles")
def test_rows_hidden_by_a_finite_value_with_dropout(path, mask_kind):
    _check_hidden_rows("random", mask_kind, torch.float32, {"window_right": 2}, N=19, M=33, dropout_p=0.3)


def test_hidden_rows_lse_holds_the_number_of_keys(path):
    # lse of a row averaging l keys is the marker -FLT_MAX + l * 2**104,
    # within l * 2**-24 of the true lse for finfo(float32).min; others exact.
    _, lse = _check_hidden_rows("left-pad", "fill", torch.float32, {"window_right": 0}, N=9, M=9, Hq=1, Hkv=1)
    marked, count = flashfuse.reference.lse_marked_keys(lse.detach().cpu())
    # Batch 1: its queries 0-4 see only its padding keys 0..i: i + 1 of them.
    assert marked[1, 0, :5].all() and not marked[1, 0, 5:].any() and not marked[0].any()
    assert torch.equal(count[1, 0, :5], torch.arange(1.0, 6.0))
    true = torch.finfo(torch.float32).min + torch.log(torch.arange(1.0, 6.0, dtype=torch.float64))
    torch.testing.assert_close(lse[1, 0, :5].double().cpu(), true, rtol=1e-6, atol=0)


@pytest.mark.usefixtures("poisoned_small_tiles")
def test_left_padded_llama_mask_gives_eager_gradients(path):
    """A LLaMA-style 4-D additive mask (causal and left padding, 0 /
    finfo.min) with grouped heads: the padding queries see only padding keys,
    and their gradients (which reach dk, dv of the padding keys and dq of
    those rows) are eager's."""
    B, Hq, Hkv, T, D, pad = 2, 4, 2, 20, 16, 6
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, T, D, generator=gen).to(DEVICE).requires_grad_() for H in (Hq, Hkv, Hkv))
    attention_mask = torch.ones(B, T, dtype=torch.bool)
    attention_mask[0, :pad] = False
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    keep = causal[None, None] & attention_mask[:, None, None, :]
    mask = torch.zeros(B, 1, T, T).masked_fill(~keep, torch.finfo(torch.float32).min).to(DEVICE)
    go = torch.randn(B, Hq, T, D, generator=gen).to(DEVICE)
    out = flashfuse.attention(q, k, v, mask, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), go)
    e = _eager_attention(q, k, v, mask, None, {"window_left": None, "window_right": None, "bottom_right": False},
                         D ** -0.5)
    e_grads = torch.autograd.grad(e, (q, k, v), go)
    assert _rel(out, e) <= 2e-5
    for name, got, exp in zip("qkv", grads, e_grads):
        assert _rel(got, exp) <= 1e-4, f"d{name} relative error {_rel(got, exp):.3g}"


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
@pytest.mark.parametrize("N, M, causal", [(512, 700, False), (1500, 1300, True)])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_rows_of_only_very_negative_scores(D, N, M, causal):
    """As on the CPU, at sizes the Hopper backward takes: no band with 700
    keys (the last 128-key tile has one half partly and one wholly past the
    end), and top-left causal with 200 more queries than keys."""
    q, k, v = _negative_logit_inputs(torch.bfloat16, N, M, D)
    assert (q.double() @ k.double().mT).max() < -100
    _check_against_reference(q, k, v, scale=1.0, is_causal=causal)


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


@pytest.mark.gpu
@pytest.mark.parametrize("pattern, mask_kind, dtype, band, heads", HIDDEN_ROW_CASES,
                         ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}-{len(c[3])}" for c in HIDDEN_ROW_CASES])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("bwd", ["one_pass", "two_pass"])
def test_gpu_rows_hidden_by_a_finite_value(pattern, mask_kind, dtype, band, heads, dropout_p, bwd, monkeypatch):
    # Several blocks in every direction, D = 64 and 128, both backward schedules.
    monkeypatch.setenv("FLASHFUSE_BWD", bwd)
    for D, N, M in ((64, 333, 300), (128, 200, 257)):
        _check_hidden_rows(pattern, mask_kind, dtype, band, Hq=heads[0], Hkv=heads[1], N=N, M=M, D=D,
                           dropout_p=dropout_p)
