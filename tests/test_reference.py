"""Tests of flashfuse.reference: the float64 reference, the PyTorch dropout
mask (bit-identical to the Triton rule) and the blockwise CPU implementation.
"""

import os
import types

import pytest
import torch
import torch.nn.functional as F

from flashfuse import reference as R

# Error allowed, relative to max(1, largest reference magnitude), per input
# dtype. Low-precision inputs are upcast exactly for the reference, so this
# only measures the implementation's own rounding. float64 runs in float64 but
# its backward reads the float32 lse, so its gradients carry float32 error.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 2e-6}
INT64_MAX = 2**63 - 1


def assert_close_scaled(actual, expected, dtype, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual = actual.to(torch.float64)
    assert not torch.isnan(actual).any(), f"{what}: NaN (unwritten or invalid elements)"
    bound = TOLERANCE[dtype] * max(1.0, expected.abs().max().item() if expected.numel() else 1.0)
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


class _PoisonedTorch(types.SimpleNamespace):
    """Stand-in for the ``torch`` module inside ``flashfuse.reference`` whose
    ``empty`` / ``empty_like`` return NaN-filled floating tensors, so any
    element the blockwise path forgets to write shows up as NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    @staticmethod
    def empty_like(*args, **kwargs):
        t = torch.empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(R, "torch", _PoisonedTorch())


@pytest.fixture
def small_tiles(monkeypatch, poisoned):
    """Force many query chunks and key tiles (and ragged last ones) on small shapes."""
    monkeypatch.setattr(R, "KEY_BLOCK", 64)
    monkeypatch.setattr(R, "TILE_ELEMENTS", 1)
    monkeypatch.setattr(R, "MIN_QUERY_ROWS", 40)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def make_qkv(B, Hq, Hkv, N, M, D, Dv, dtype, noncontiguous=False, gen=None):
    """Random q (B,Hq,N,D), k (B,Hkv,M,D), v (B,Hkv,M,Dv) in ``dtype``."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    if noncontiguous:
        # (B, L, H, D) memory read as (B, H, L, D), with padded last dims.
        q = rand(B, N, Hq, D + 2)[..., :D].transpose(1, 2)
        k = rand(B, M, Hkv, D + 1)[..., :D].transpose(1, 2)
        v = rand(B, Hkv, M, Dv + 3)[..., :Dv]
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    else:
        q, k, v = rand(B, Hq, N, D), rand(B, Hkv, M, D), rand(B, Hkv, M, Dv)
    return q, k, v


def make_mask(kind, B, Hq, N, M, dtype, gen):
    """Masks of several broadcast shapes; ``None`` for kind ``"none"``."""
    if kind == "none":
        return None
    if kind == "bool_keys":  # per-batch key padding, (B, 1, 1, M)
        m = torch.rand(B, 1, 1, M, generator=gen) < 0.8
        m[..., 0] = True
        return m
    if kind == "bool_empty_rows":  # (Hq, N, M) with whole rows masked out
        m = torch.rand(Hq, N, M, generator=gen) < 0.7
        m[:, ::3] = False
        return m
    if kind == "float_2d":  # (N, M) additive bias
        return torch.randn(N, M, generator=gen).to(dtype)
    if kind == "float_head_keys":  # (1, Hq, 1, M)
        return torch.randn(1, Hq, 1, M, generator=gen).to(dtype)
    if kind == "float_neg_inf":  # full shape with -inf entries and fully -inf rows
        m = torch.randn(B, Hq, N, M, generator=gen)
        m[torch.rand(B, Hq, N, M, generator=gen) < 0.3] = float("-inf")
        m[:, :, 1::4] = float("-inf")
        return m.to(dtype)
    raise ValueError(kind)


def check_blockwise(
    B, Hq, Hkv, N, M, D, Dv, dtype, *, mask_kind="none", window_left=None, window_right=None,
    bottom_right=False, dropout_p=0.0, seed=1234, noncontiguous=False, scale=None, rng_seed=0,
):
    """Run blockwise forward + backward and compare out, lse and all gradients
    with the float64 reference (autograd)."""
    gen = torch.Generator().manual_seed(rng_seed)
    q, k, v = make_qkv(B, Hq, Hkv, N, M, D, Dv, dtype, noncontiguous, gen)
    mask = make_mask(mask_kind, B, Hq, N, M, dtype, gen)
    float_mask = mask is not None and mask.dtype != torch.bool
    seed_t = torch.tensor(seed, dtype=torch.int64) if dropout_p > 0 else None
    window = dict(window_left=window_left, window_right=window_right, bottom_right=bottom_right)

    out, lse = R.blockwise_forward(q, k, v, mask, seed_t, dropout_p=dropout_p, scale=scale, **window)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == (B, Hq, N, Dv) and lse.shape == (B, Hq, N)
    # Layout contract: (B, N, Hq, Dv) in memory.
    assert out.transpose(1, 2).is_contiguous()

    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    m64 = mask.detach().to(torch.float64).requires_grad_() if float_mask else mask
    keep = R.dropout_keep_mask(seed, B, Hq, N, M, dropout_p) if dropout_p > 0 else None
    ref = R.reference_attention(q64, k64, v64, m64, scale=scale, dropout_mask=keep, dropout_p=dropout_p, **window)
    ref_lse = R.reference_lse(q64, k64, m64, scale=scale, **window)
    assert_close_scaled(out, ref, dtype, "out")
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "lse: +inf rows differ"
    # lse is float32 whatever the input dtype.
    lse_dtype = torch.float32 if dtype == torch.float64 else dtype
    assert_close_scaled(lse[~empty], ref_lse[~empty].detach(), lse_dtype, "lse")

    grad_out = torch.randn(B, Hq, N, Dv, generator=gen).to(dtype)
    inputs = (q64, k64, v64) + ((m64,) if float_mask else ())
    ref_grads = torch.autograd.grad(ref, inputs, grad_out.to(torch.float64))
    dq, dk, dv, dmask = R.blockwise_backward(
        grad_out, q, k, v, mask, seed_t, out, lse, dropout_p=dropout_p, scale=scale,
        mask_grad=float_mask, **window,
    )
    for name, got, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert got.dtype == like.dtype and got.stride() == torch.empty_like(like).stride(), name
    # The backward sees ``out`` rounded to ``dtype``: one more rounding step.
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), (dq, dk, dv, dmask), ref_grads):
        assert_close_scaled(got, want, dtype, name)
    if float_mask:
        assert dmask.shape == mask.shape and dmask.dtype == mask.dtype
    else:
        assert dmask is None


# ---------------------------------------------------------------------------
# the reference itself
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float", "scale", "gqa"])
def test_reference_matches_sdpa(case):
    gen = torch.Generator().manual_seed(1)
    B, H, N, M, D, Dv = 2, 3, 11, 11, 16, 12
    Hkv = 1 if case == "gqa" else H
    q = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, M, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, M, Dv, generator=gen, dtype=torch.float64)
    k_rep, v_rep = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    mask, kwargs, sdpa_kwargs = None, {}, {}
    if case == "causal":
        kwargs, sdpa_kwargs = {"window_right": 0}, {"is_causal": True}
    elif case == "bool":
        mask = torch.rand(B, 1, N, M, generator=gen) < 0.6
        mask[..., 0] = True
    elif case == "float":
        mask = torch.randn(1, H, N, M, generator=gen, dtype=torch.float64)
    elif case == "scale":
        kwargs = sdpa_kwargs = {"scale": 0.37}
    got = R.reference_attention(q, k, v, mask, **kwargs)
    want = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, **sdpa_kwargs)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    lse = R.reference_lse(q, k, mask, **{k_: v_ for k_, v_ in kwargs.items() if k_ != "dropout_p"})
    assert lse.shape == (B, H, N)


def test_reference_window_and_alignment():
    """Visibility window against an explicit loop over (i, j)."""
    gen = torch.Generator().manual_seed(2)
    B, H, N, M, D = 1, 2, 7, 12, 16
    q = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, M, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, M, D, generator=gen, dtype=torch.float64)
    for bottom_right in (False, True):
        off = M - N if bottom_right else 0
        wl, wr = 2, 1
        allowed = torch.tensor(
            [[i + off - wl <= j <= i + off + wr for j in range(M)] for i in range(N)]
        )
        got = R.reference_attention(q, k, v, window_left=wl, window_right=wr, bottom_right=bottom_right)
        empty = ~allowed.any(-1)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty[:, None])
        want[:, :, empty] = 0
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_reference_empty_rows_are_zero_without_nan():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mask[2] = float("-inf")
    mask.requires_grad_()
    out = R.reference_attention(q, k, v, mask)
    assert torch.all(out[:, :, 2] == 0) and not torch.all(out[:, :, 1] == 0)
    out.backward(torch.randn_like(out))
    for t in (q, k, v, mask):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, 2] == 0) and torch.all(mask.grad[2] == 0)
    lse = R.reference_lse(q, k, mask)
    assert torch.isinf(lse[:, :, 2]).all() and (lse[:, :, 2] > 0).all()
    assert torch.isfinite(lse[:, :, [0, 1, 3, 4]]).all()


def test_reference_dropout_rescales_kept_probabilities():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 9, 16, generator=gen, dtype=torch.float64)
    v = torch.eye(9, dtype=torch.float64).view(1, 1, 9, 9)  # out = probabilities
    keep = torch.rand(1, 1, 4, 9, generator=gen) < 0.5
    probs = R.reference_attention(q, k, v)
    dropped = R.reference_attention(q, k, v, dropout_mask=keep, dropout_p=0.25)
    torch.testing.assert_close(dropped, probs * keep / 0.75, atol=1e-15, rtol=1e-12)


# ---------------------------------------------------------------------------
# dropout mask: bit identity with the Triton rule
# ---------------------------------------------------------------------------


try:
    import triton
    import triton.language as tl

    from flashfuse.kernels.common import _dropout_keep
except ImportError:  # pragma: no cover - CPU-only install without Triton
    triton = None

if triton is not None:

    @triton.jit
    def _keep_kernel(Out, seed, N, M, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Writes ``_dropout_keep`` for one (BLOCK_M, BLOCK_N) tile of one (b, h)."""
        bh = tl.program_id(1)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(seed, offs_m, offs_n, bh, threshold)
        ptrs = Out + bh * N * M + offs_m[:, None] * M + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < N) & (offs_n[None, :] < M))


def _triton_keep_mask(seed, B, H, N, M, dropout_p, device):
    """Dropout mask from a tiny kernel around ``kernels.common._dropout_keep``."""
    # Poison with a value that is neither 0 nor 1.
    out = torch.full((B, H, N, M), 7, dtype=torch.int8, device=device)
    block_m, block_n = 16, 16
    grid = (triton.cdiv(N, block_m), B * H, triton.cdiv(M, block_n))
    _keep_kernel[grid](out, seed, N, M, R.dropout_threshold(dropout_p), BLOCK_M=block_m, BLOCK_N=block_n)
    assert ((out == 0) | (out == 1)).all(), "kernel left elements unwritten"
    return out.cpu().bool()


@pytest.mark.parametrize(
    "seed", [0, 1, 987654321, 2**32 + 5, 2**62 - 12345, 2**62 + 2**61 + 99, INT64_MAX, -7]
)
@pytest.mark.parametrize("shape,p", [((1, 1, 1, 1), 0.5), ((2, 3, 5, 13), 0.1), ((1, 2, 19, 37), 0.73)])
def test_dropout_mask_bit_identical_to_triton(seed, shape, p):
    if triton is None:
        pytest.skip("needs triton")
    if torch.cuda.is_available():
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    else:
        pytest.skip("needs a GPU or TRITON_INTERPRET=1 set before import")
    B, H, N, M = shape
    want = _triton_keep_mask(seed, B, H, N, M, p, device)
    got = R.dropout_keep_mask(seed, B, H, N, M, p)
    assert got.dtype == torch.bool and got.shape == shape
    assert torch.equal(got, want)


def test_dropout_mask_known_philox_vector():
    """Philox4x32-10 known-answer test (Random123's kat vector for counter and
    key all 0xffffffff), which pins the round function independently of Triton."""
    ones = torch.full((1,), 0xFFFFFFFF, dtype=torch.int64)
    words = R._philox4x32(2**64 - 1, ones, ones, ones, ones)
    assert [int(w) for w in words] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


@pytest.mark.parametrize("rows,cols", [((0, 37), (0, 41)), ((5, 6), (3, 4)), ((11, 30), (2, 39)), ((0, 37), (40, 41))])
def test_dropout_mask_subtile_matches_full(rows, cols):
    full = R.dropout_keep_mask(2**62 + 3, 2, 3, 37, 41, 0.3)
    tile = R.dropout_keep_mask(2**62 + 3, 2, 3, 37, 41, 0.3, rows=rows, cols=cols)
    assert torch.equal(tile, full[:, :, rows[0]:rows[1], cols[0]:cols[1]])


def test_dropout_mask_rate_and_independence():
    p = 0.3
    mask = R.dropout_keep_mask(42, 2, 4, 64, 256, p)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.01
    # Different seeds, heads and batch entries must give different streams.
    other = R.dropout_keep_mask(43, 2, 4, 64, 256, p)
    assert (mask != other).float().mean() > 0.3
    assert (mask[0, 0] != mask[0, 1]).float().mean() > 0.3
    assert (mask[0, 0] != mask[1, 0]).float().mean() > 0.3
    assert R.dropout_keep_mask(42, 1, 1, 8, 8, 0.0).all()


def test_dropout_mask_rejects_tile_outside_problem():
    with pytest.raises(ValueError, match="outside"):
        R.dropout_keep_mask(0, 1, 1, 4, 4, 0.5, rows=(2, 5))


# ---------------------------------------------------------------------------
# blockwise implementation vs reference
# ---------------------------------------------------------------------------

SHAPES = [
    # B, Hq, Hkv, N, M, D, Dv
    (1, 1, 1, 1, 1, 16, 16),
    (2, 3, 3, 17, 1, 40, 24),
    (1, 2, 2, 1, 113, 80, 80),
    (2, 2, 1, 113, 17, 16, 40),
    (1, 4, 2, 300, 113, 128, 64),
    (1, 2, 2, 113, 300, 40, 40),
    (1, 3, 1, 300, 300, 16, 16),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_blockwise_shapes(small_tiles, shape, dtype):
    check_blockwise(*shape, dtype)


VARIANTS = {
    "causal_top_left": dict(window_right=0),
    "causal_bottom_right": dict(window_right=0, bottom_right=True),
    "window_both": dict(window_left=9, window_right=4),
    "window_left_only_br": dict(window_left=30, bottom_right=True),
    "window_right_negative": dict(window_right=-3),
    "bool_keys": dict(mask_kind="bool_keys"),
    "bool_empty_rows_causal": dict(mask_kind="bool_empty_rows", window_right=0, bottom_right=True),
    "float_2d": dict(mask_kind="float_2d"),
    "float_head_keys_window": dict(mask_kind="float_head_keys", window_left=20, window_right=0),
    "float_neg_inf": dict(mask_kind="float_neg_inf"),
    "dropout": dict(dropout_p=0.2, seed=2**62 - 1),
    "dropout_mask_causal": dict(dropout_p=0.5, seed=7, mask_kind="float_2d", window_right=0),
    "noncontiguous": dict(noncontiguous=True, mask_kind="float_head_keys"),
    "scale": dict(scale=0.05),
}


# Each variant runs with one head layout (cycling MHA / GQA / MQA) to keep
# the suite fast; a few also run in bfloat16.
VARIANT_CASES = [
    (name, ("mha", "gqa", "mqa")[index % 3], torch.float32) for index, name in enumerate(VARIANTS)
] + [
    (name, "gqa", torch.bfloat16)
    for name in ("causal_bottom_right", "float_neg_inf", "dropout_mask_causal", "noncontiguous")
]


@pytest.mark.parametrize(
    "variant,heads,dtype", VARIANT_CASES, ids=[f"{n}-{h}-{str(d)[6:]}" for n, h, d in VARIANT_CASES]
)
def test_blockwise_variants(small_tiles, variant, heads, dtype):
    Hq, Hkv = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}[heads]
    for N, M in ((113, 75), (37, 130)):
        check_blockwise(2, Hq, Hkv, N, M, 32, 24, dtype, **VARIANTS[variant])


@pytest.mark.parametrize("N,M,bottom_right", [(40, 10, True), (10, 40, False)])
def test_blockwise_window_leaves_rows_empty(small_tiles, N, M, bottom_right):
    """Causal with N > M bottom-right (or a window that misses all keys)
    leaves rows with no key: out 0, lse +inf, gradients 0."""
    window = dict(window_right=0, bottom_right=True) if bottom_right else dict(window_left=-45, window_right=None)
    check_blockwise(1, 2, 2, N, M, 16, 16, torch.float32, **window)


def test_blockwise_default_tiles_and_float64(poisoned):
    check_blockwise(2, 4, 2, 300, 257, 64, 32, torch.float32, mask_kind="float_neg_inf", window_right=0)
    check_blockwise(1, 2, 1, 33, 45, 16, 8, torch.float64, mask_kind="float_2d", dropout_p=0.3)


def test_blockwise_gradcheck_float64():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 7, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 7, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    kw = dict(dropout_p=0.0, scale=0.3, window_left=4, window_right=1, bottom_right=True)

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask):
            out, lse = R.blockwise_forward(q, k, v, mask, None, **kw)
            ctx.save_for_backward(q, k, v, mask, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, mask, out, lse = ctx.saved_tensors
            return R.blockwise_backward(grad_out, q, k, v, mask, None, out, lse, mask_grad=True, **kw)

    assert torch.autograd.gradcheck(Attention.apply, (q, k, v, mask), atol=1e-5, rtol=1e-4)


def test_blockwise_errors():
    q, k, v = make_qkv(1, 3, 2, 4, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        R.blockwise_forward(q, k, v, None, None, dropout_p=0.0, scale=None,
                            window_left=None, window_right=None, bottom_right=False)
    q, k, v = make_qkv(1, 2, 2, 4, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="seed"):
        R.blockwise_forward(q, k, v, None, None, dropout_p=0.1, scale=None,
                            window_left=None, window_right=None, bottom_right=False)


# ---------------------------------------------------------------------------
# rows that a finite value hides entirely
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fill", [-1e4, torch.finfo(torch.float32).min])
def test_reference_mask_fill_is_masked_fill(fill):
    # float64 ground truth of mask_fill: eager masked_fill, gradients too
    # (none to the filled scores); a row hidden entirely averages its keys.
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, L, 16, generator=gen, dtype=torch.float64).requires_grad_() for L in (5, 7, 7))
    keep = torch.rand(5, 7, generator=gen) > 0.4
    keep[2] = False
    out = R.reference_attention(q, k, v, keep, mask_fill=fill)
    want = torch.softmax((q @ k.mT / 4.0).masked_fill(~keep, fill), -1) @ v
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, :, 2], v.mean(2).expand(1, 2, 16), rtol=1e-12, atol=1e-12)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_lse_marker_holds_the_key_count():
    counts = torch.tensor([1.0, 2.0, 3.0, 1000.0, 2.0 ** 23 - 1])
    marker = R.lse_marker(counts)
    assert marker.dtype == torch.float32 and (marker <= R.LSE_MARKED_BELOW).all()
    marked, got = R.lse_marked_keys(marker)
    assert marked.all() and torch.equal(got, counts)
    # Within l * 2**-24 of the true lse of a row of l scores at finfo.min.
    true = torch.finfo(torch.float32).min + torch.log(counts.double())
    assert ((marker.double() - true).abs() / true.abs() <= counts.double() * 2.0 ** -24 + 1e-7).all()
    marked, got = R.lse_marked_keys(torch.tensor([-5e8, 0.0, 3.0, float("inf")]))
    assert not marked.any() and (got == 1).all()
