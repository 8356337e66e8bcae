"""Tests of the Triton forward kernel (flashfuse.kernels.forward).

Without a GPU these run on CPU tensors through Triton's interpreter (set up by
tests/conftest.py), so shapes are kept small. Every output is compared with
the float64 reference on fresh random inputs; the launcher's output buffers
are poisoned with NaN so an element the kernel forgets to write fails.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import flashfuse.kernels.forward as fwd
import flashfuse.kernels.problem as problem
from flashfuse.kernels.launch import config_tuple
from flashfuse.kernels.forward import attention_forward, dropout_keep_mask_triton
from flashfuse.reference import dropout_keep_mask, reference_attention, reference_lse

from tests.kernels.masks import HIDDEN, hiding_mask
from tests.kernels.padding import in_nan_padding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol) of the output against float64, per input dtype. fp16/bf16 lose
# precision when the probabilities are rounded for the P @ V product.
OUT_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# lse needs only q·k in fp32 accumulation: close for every dtype.
LSE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-4, 1e-4), torch.bfloat16: (1e-4, 1e-4)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _fixed_config_for_small_tests(request, monkeypatch):
    # On a GPU, the small-shape tests would each autotune (compile every
    # config) for little benefit; only the gpu-marked tests autotune.
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("FLASHFUSE_AUTOTUNE", "0")


@contextlib.contextmanager
def _nan_empty():
    """Make torch.empty return NaN-filled (floating) tensors, so any output
    element the kernel does not write shows up as NaN."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = real_empty


def _run(q, k, v, attn_mask=None, seed=None, *, dropout_p=0.0, scale=None,
         window_left=None, window_right=None, bottom_right=False):
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    with _nan_empty():
        out, lse = attention_forward(
            q, k, v, attn_mask, seed, dropout_p=dropout_p, scale=scale,
            window_left=window_left, window_right=window_right, bottom_right=bottom_right,
        )
    return out, lse


def _inputs(B, Hq, Hkv, N, M, D, Dv, dtype, device=DEVICE, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    q = torch.randn(B, Hq, N, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, M, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, M, Dv, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def _check(q, k, v, attn_mask=None, *, scale=None, window_left=None, window_right=None,
           bottom_right=False, dropout_p=0.0, seed=None, dropout_mask=None, out_tol=None, lse_tol=None):
    """Run the kernel and compare out and lse with the float64 reference."""
    out, lse = _run(q, k, v, attn_mask, seed, dropout_p=dropout_p, scale=scale,
                    window_left=window_left, window_right=window_right, bottom_right=bottom_right)
    B, Hq, N, _ = q.shape
    Dv = v.shape[-1]
    # Contract: layout and dtypes.
    assert out.shape == (B, Hq, N, Dv) and out.dtype == q.dtype and out.device == q.device
    assert out.stride() == torch.empty(B, N, Hq, Dv).transpose(1, 2).stride()
    assert lse.shape == (B, Hq, N) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    assert not lse.isnan().any(), "lse has unwritten (NaN) elements"

    ref = reference_attention(q, k, v, attn_mask, scale=scale, window_left=window_left,
                              window_right=window_right, bottom_right=bottom_right,
                              dropout_mask=dropout_mask, dropout_p=dropout_p)
    ref_lse = reference_lse(q, k, attn_mask, scale=scale, window_left=window_left,
                            window_right=window_right, bottom_right=bottom_right)
    atol, rtol = out_tol or OUT_TOL[q.dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    # +inf rows must match exactly; assert_close treats equal infinities as equal.
    latol, lrtol = lse_tol or LSE_TOL[q.dtype]
    torch.testing.assert_close(lse.double(), ref_lse, atol=latol, rtol=lrtol)
    return out, lse


# ---------------------------------------------------------------------------
# Shapes and dtypes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "B,Hq,N,M,D,Dv",
    [
        (1, 1, 1, 1, 16, 16),
        (1, 2, 17, 33, 40, 40),
        (2, 1, 47, 17, 64, 16),
        (1, 2, 33, 47, 16, 64),
        (1, 1, 70, 70, 32, 32),
    ],
)
def test_shapes(B, Hq, N, M, D, Dv, dtype):
    q, k, v = _inputs(B, Hq, Hq, N, M, D, Dv, dtype)
    _check(q, k, v)


def test_scale_and_large_scores():
    # A large scale makes the softmax peaky: checks the running-max rescaling.
    q, k, v = _inputs(1, 2, 2, 33, 47, 32, 32, torch.float32, gen_seed=1)
    _check(q, k, v, scale=3.0)
    _check(q, k, v, scale=0.01)
    _check(q, k, v, scale=-8.0)  # unusual but legal: the max must still be right
    _check(q, k, v, scale=0.0)


@pytest.mark.parametrize("D", [80, 96])
def test_non_power_of_two_head_dims(D):
    q, k, v = _inputs(1, 1, 1, 17, 33, D, D // 2 + 8, torch.float16)
    _check(q, k, v)


# ---------------------------------------------------------------------------
# Visibility: causal and windows
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window_left,window_right,bottom_right",
    [
        (None, 0, False),  # causal, top-left
        (None, 0, True),  # causal, bottom-right
        (4, 0, False),  # sliding window
        (4, 0, True),
        (3, 5, False),  # two-sided band
        (10, None, True),  # left bound only
        (0, 0, False),  # diagonal only
        (None, -3, False),  # strictly below the diagonal: first rows see nothing
        (40, 40, True),  # wider than the problem: everything visible
    ],
)
@pytest.mark.parametrize("N,M", [(33, 47), (47, 17), (1, 33)])
def test_visibility(N, M, window_left, window_right, bottom_right):
    q, k, v = _inputs(1, 1, 1, N, M, 16, 16, torch.float32, gen_seed=N * M)
    _check(q, k, v, window_left=window_left, window_right=window_right, bottom_right=bottom_right)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_causal_low_precision(dtype):
    q, k, v = _inputs(2, 2, 2, 47, 47, 40, 40, dtype)
    _check(q, k, v, window_right=0)


def test_empty_rows_bottom_right():
    # Bottom-right causal with N > M: the first N - M queries see no key.
    q, k, v = _inputs(1, 1, 1, 40, 17, 16, 16, torch.float32)
    out, lse = _check(q, k, v, window_right=0, bottom_right=True)
    assert (out[:, :, :23] == 0).all()
    assert torch.isposinf(lse[:, :, :23]).all()
    assert torch.isfinite(lse[:, :, 23:]).all()


def test_skips_invisible_blocks():
    # Keys outside the band (here the first 256: N=16 queries at the bottom
    # right with a 100-key window) are never loaded: NaN there must not leak.
    # 256 is a multiple of every BLOCK_N, so no visited block contains them.
    N, M = 16, 512
    q, k, v = _inputs(1, 1, 1, N, M, 16, 16, torch.float32)
    k[:, :, :256] = float("nan")
    v[:, :, :256] = float("nan")
    out, _ = _run(q, k, v, window_left=100, window_right=0, bottom_right=True)
    kc, vc = k[:, :, 256:], v[:, :, 256:]
    ref = reference_attention(q, kc, vc, window_left=100, window_right=0, bottom_right=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(DEVICE == "cuda", reason="tile sizes are fixed only under the interpreter")
@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32), (64, 32)])
def test_other_tile_sizes(block_m, block_n, monkeypatch):
    # The loop bounds (band start, interior, band end) depend on both tile
    # sizes; BLOCK_M != BLOCK_N puts the diagonal mid-block.
    monkeypatch.setattr(fwd, "_INTERPRET_BLOCK_M", block_m)
    monkeypatch.setattr(fwd, "_INTERPRET_BLOCK_N", block_n)
    q, k, v = _inputs(1, 1, 1, 70, 57, 16, 16, torch.float32)
    _check(q, k, v, window_right=0, bottom_right=True)
    _check(q, k, v, window_left=9, window_right=2)
    mask = torch.ones(1, 1, 1, 57, dtype=torch.bool)
    mask[..., 40:] = False
    _check(q, k, v, mask.to(DEVICE), window_left=30, window_right=0)


# ---------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------

MASK_SHAPES = [(17, 33), (2, 1, 1, 33), (2, 2, 17, 33), (1, 2, 1, 33), (1, 1, 17, 1)]


def _random_mask(shape, kind, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    if kind == "bool":
        m = torch.rand(shape, generator=g) > 0.3
        # Keep one visible key per broadcast row so no row is fully masked here.
        m[..., 0] = True
        return m.to(DEVICE)
    return torch.randn(shape, generator=g).to(DEVICE)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_mask_broadcast(shape, kind):
    q, k, v = _inputs(2, 2, 2, 17, 33, 16, 16, torch.float32)
    _check(q, k, v, _random_mask(shape, kind))


@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_mask_dtypes(mask_dtype):
    q, k, v = _inputs(1, 2, 2, 17, 33, 16, 16, torch.float16)
    mask = torch.randn(1, 2, 17, 33, generator=torch.Generator().manual_seed(3)).to(DEVICE, mask_dtype)
    _check(q, k, v, mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_with_causal(kind):
    q, k, v = _inputs(2, 1, 1, 33, 47, 16, 16, torch.float32)
    _check(q, k, v, _random_mask((2, 1, 1, 47), kind), window_right=0, bottom_right=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("N, M, band", [(45, 128, {}), (19, 256, dict(window_left=40, window_right=3)),
                                        (70, 128, dict(window_right=0, bottom_right=True))], ids=str)
def test_masks_with_whole_key_blocks(N, M, band, kind):
    # Key counts that are a multiple of every BLOCK_N: the kernel reads the
    # mask without per-key bounds (FULL_KEY_BLOCKS), and the result must
    # still be exact at the band's edges and in a partial query tile (odd
    # N). Whether the rule may say yes: test_problem.py.
    q, k, v = _inputs(2, 2, 1, N, M, 16, 16, torch.float32)
    _check(q, k, v, _random_mask((2, 1, N, M), kind), **band)


def test_fully_masked_rows_and_inf():
    # Float mask with -inf entries and whole rows of -inf; bool mask with whole
    # rows False. Masked rows: out 0 and lse +inf; the others: no NaN.
    B, H, N, M = 1, 1, 33, 47
    q, k, v = _inputs(B, H, H, N, M, 16, 16, torch.float32)
    g = torch.Generator().manual_seed(5)
    fmask = torch.randn(B, H, N, M, generator=g)
    fmask[torch.rand(B, H, N, M, generator=g) > 0.5] = float("-inf")
    fmask[..., 0] = 0.0
    fmask[:, :, [3, 20, 32]] = float("-inf")
    fmask = fmask.to(DEVICE)
    out, lse = _check(q, k, v, fmask)
    assert (out[:, :, [3, 20, 32]] == 0).all() and torch.isposinf(lse[:, :, [3, 20, 32]]).all()

    bmask = torch.isfinite(fmask)
    out, lse = _check(q, k, v, bmask)
    assert (out[:, :, [3, 20, 32]] == 0).all() and torch.isposinf(lse[:, :, [3, 20, 32]]).all()


def test_finfo_min_mask():
    # Masks built with finfo(float32).min (as Hugging Face does) must not
    # overflow to -inf: a row masked that way averages its values, like the
    # float64 reference, and partially masked rows ignore the masked keys.
    q, k, v = _inputs(1, 1, 1, 17, 33, 16, 16, torch.float32)
    mask = torch.zeros(17, 33)
    mask[:, 20:] = torch.finfo(torch.float32).min
    mask[5] = torch.finfo(torch.float32).min
    mask = mask.to(DEVICE)
    out, lse = _run(q, k, v, mask)
    ref = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    # lse of the fully masked row cannot be represented in base-2 fp32 units;
    # it only has to stay hugely negative (not +inf: the row is not empty).
    ref_lse = reference_lse(q, k, mask)
    rows = [i for i in range(17) if i != 5]
    torch.testing.assert_close(lse[:, :, rows].double(), ref_lse[:, :, rows], atol=1e-5, rtol=1e-5)
    assert (lse[:, :, 5] < -1e37).all()


def _hiding_mask(hidden, kind, values="bias"):
    return hiding_mask(hidden, kind, torch.Generator().manual_seed(0), values)


@pytest.mark.parametrize("kind", list(HIDDEN))
@pytest.mark.parametrize("row_broadcast", [True, False])
def test_key_padding_skips_blocks(row_broadcast, kind):
    # Right and left key padding hiding whole key blocks: those blocks are
    # skipped (their NaN keys and values must not leak) and the result is
    # exact. Block edges at multiples of 128 suit every BLOCK_N.
    N, M = 16, 512
    q, k, v = _inputs(2, 1, 1, N, M, 16, 16, torch.float32)
    hidden = torch.zeros(2, 1, 1, M, dtype=torch.bool)
    hidden[0, ..., 256:] = True
    hidden[1, ..., :128] = True
    hidden[1, ..., 384:] = True
    if not row_broadcast:
        hidden = hidden.expand(2, 1, N, M).clone()
        if kind in ("bool", "float32-inf"):
            # A row that sees nothing has no output either way: skipping stays on.
            hidden[1, :, 3] = True
    mask = _hiding_mask(hidden, kind).to(DEVICE)
    for t in (k, v):
        t[0, :, 256:] = float("nan")
        t[1, :, :128] = float("nan")
        t[1, :, 384:] = float("nan")
    out, lse = _run(q, k, v, mask)
    assert not out.isnan().any() and not lse.isnan().any()
    ref = reference_attention(q, k.nan_to_num(), v.nan_to_num(), mask)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    ref_lse = reference_lse(q, k.nan_to_num(), mask)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind, values", [(k, "bias") for k in HIDDEN] + [("float32-min", "zeros"),
                                                                           ("bfloat16-min", "zeros")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_mask_tensor(kind, values, dtype):
    # A causal mask given as a tensor (what a model compiled block by block
    # passes in) gives the causal result; the blocks above the diagonal are
    # skipped, and with zeros below it, most blocks there run without
    # reading the mask (mask_ranges). Sizes leave partial tiles at both ends.
    N = M = 83
    q, k, v = _inputs(2, 2, 2, N, M, 24, 24, dtype)
    hidden = torch.ones(N, M, dtype=torch.bool).triu(1)
    mask = _hiding_mask(hidden, kind, values).to(DEVICE)
    _check(q, k, v, mask)
    if kind == "bool":
        out, lse = _run(q, k, v, mask)
        want, want_lse = _run(q, k, v, window_right=0)
        torch.testing.assert_close(out, want, atol=OUT_TOL[dtype][0], rtol=OUT_TOL[dtype][1])
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["float32-min", "bfloat16-min", "float16-min"])
def test_causal_mask_tensor_with_fully_hidden_rows(kind):
    # Rows whose every key is hidden by the dtype's lowest value average all
    # their keys (the float64 reference does too), so their tiles must not
    # skip any key block; the other tiles still do.
    N = M = 83
    q, k, v = _inputs(1, 2, 2, N, M, 16, 16, torch.float32)
    hidden = torch.ones(N, M, dtype=torch.bool).triu(1)
    hidden[[4, 40]] = True
    mask = _hiding_mask(hidden, kind).to(DEVICE)
    out, lse = _run(q, k, v, mask)
    ref = reference_attention(q, k, v, mask)
    rows = [i for i in range(N) if i not in (4, 40)]
    torch.testing.assert_close(out[:, :, rows].double(), ref[:, :, rows], atol=1e-4, rtol=1e-4)
    # In float16 the hidden value (-65504) keeps the scores' differences, and
    # in float32 units of log2 they lose about 1e-2 of precision at that size;
    # a skipped block would change those rows' averages far more.
    tol = 3e-2 if kind == "float16-min" else 1e-4
    torch.testing.assert_close(out[:, :, [4, 40]].double(), ref[:, :, [4, 40]], atol=tol, rtol=tol)
    # Those rows' lse is hugely negative; the others match.
    torch.testing.assert_close(lse[:, :, rows].double(), reference_lse(q, k, mask)[:, :, rows],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bool", "float32-min"])
def test_mask_ranges_respect_the_band(kind):
    # Rows whose only visible mask entry lies outside the causal band: within
    # the band they see only hidden values (a float row then averages them),
    # so visibility must be judged inside the band.
    N, M = 40, 96
    q, k, v = _inputs(1, 1, 1, N, M, 16, 16, torch.float32)
    hidden = torch.ones(N, M, dtype=torch.bool)
    hidden[:, :8] = False
    hidden[5:9, :] = True
    hidden[5:9, 70] = False  # visible only beyond the diagonal
    mask = _hiding_mask(hidden, kind).to(DEVICE)
    out, _ = _run(q, k, v, mask, window_right=0)
    ref = reference_attention(q, k, v, mask, window_right=0)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------
# Heads and layouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (3, 1), (4, 4)])
def test_gqa_mqa(Hq, Hkv):
    q, k, v = _inputs(2, Hq, Hkv, 17, 33, 16, 24, torch.float16)
    _check(q, k, v, window_right=0)


def test_gqa_does_not_repeat_kv():
    # Distinct values per kv head: head h must read kv head h // group.
    q, k, v = _inputs(1, 4, 2, 5, 7, 16, 16, torch.float32)
    v[:, 0] += 100.0
    out, _ = _check(q, k, v)
    assert (out[:, :2] > 50).all() and (out[:, 2:] < 50).all()


def test_non_contiguous_inputs():
    # (B, N, H, D) tensors seen through transpose(1, 2), a packed qkv
    # projection, and a non-unit stride along the head dim.
    B, N, M, H, D = 2, 17, 33, 2, 16
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, N, 3, H, D, generator=g).to(DEVICE)
    q = qkv[:, :, 0].transpose(1, 2)
    kv = torch.randn(B, M, 2, H, 2 * D, generator=g).to(DEVICE)
    k = kv[:, :, 0, :, ::2].transpose(1, 2)  # stride 2 along D
    v = kv[:, :, 1, :, D:].transpose(1, 2)
    assert not q.is_contiguous() and k.stride(-1) == 2
    _check(q, k, v, window_right=0)
    # Expanded (stride-0) batch dimension.
    k0, v0 = k[:1].expand(B, -1, -1, -1), v[:1].expand(B, -1, -1, -1)
    _check(q, k0, v0)


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1234567, -5, 2**62 + 12345])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
def test_dropout_mask_matches_reference(seed, p, block_n):
    # block_n 16 takes the per-element rule, the others the block draw.
    B, H, N = 2, 3, 17
    M = 37 if block_n < 128 else 300  # 300: more than one 128-key block
    s = torch.tensor(seed, dtype=torch.int64, device=DEVICE)
    keep = dropout_keep_mask_triton(s, B, H, N, M, p, block_n=block_n)
    assert keep.shape == (B, H, N, M) and keep.dtype == torch.bool
    ref = dropout_keep_mask(seed, B, H, N, M, p, device=DEVICE)
    assert torch.equal(keep, ref)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.05


@pytest.mark.parametrize("p", [0.2, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dropout(p, dtype):
    B, H, N, M = 1, 2, 17, 33
    q, k, v = _inputs(B, H, H, N, M, 16, 16, dtype)
    seed = torch.tensor(987654321, dtype=torch.int64, device=DEVICE)
    dmask = dropout_keep_mask_triton(seed, B, H, N, M, p)
    # lse ignores dropout; the output uses the kept probabilities / (1 - p).
    _check(q, k, v, seed=seed, dropout_p=p, dropout_mask=dmask, window_right=0)
    # Different seeds give different outputs.
    out2, _ = _run(q, k, v, None, seed + 1, dropout_p=p, window_right=0)
    out1, _ = _run(q, k, v, None, seed, dropout_p=p, window_right=0)
    assert not torch.equal(out1, out2)


def test_dropout_with_gqa_and_mask():
    B, Hq, Hkv, N, M = 2, 2, 1, 17, 33
    q, k, v = _inputs(B, Hq, Hkv, N, M, 16, 16, torch.float32)
    seed = torch.tensor(42, dtype=torch.int64, device=DEVICE)
    dmask = dropout_keep_mask_triton(seed, B, Hq, N, M, 0.3)
    _check(q, k, v, _random_mask((B, 1, 1, M), "bool"), seed=seed, dropout_p=0.3, dropout_mask=dmask)


@pytest.mark.parametrize("case", ["gqa causal", "mask window", "dropout", "odd head dims"])
def test_descriptor_loads(case, monkeypatch):
    """K and V through tensor descriptors (FLASHFUSE_TMA=1): rows past the
    keys and columns past the head dim must arrive as zeros, so K and V sit
    in NaN padding here; the results must match the reference."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9 or more")
    monkeypatch.setenv("FLASHFUSE_TMA", "1")
    seen = []
    real = problem.descriptor_loads
    monkeypatch.setattr(problem, "descriptor_loads", lambda *ts, **kw: seen.append(real(*ts, **kw)) or seen[-1])
    if case == "gqa causal":
        q, k, v = _inputs(2, 4, 2, 45, 37, 40, 24, torch.bfloat16)
        _check(q, in_nan_padding(k), in_nan_padding(v), window_right=0, bottom_right=True)
    elif case == "mask window":
        q, k, v = _inputs(1, 2, 2, 33, 70, 32, 32, torch.float16)
        _check(q, in_nan_padding(k), in_nan_padding(v), _random_mask((1, 2, 33, 70), "float"),
               window_left=20, window_right=5)
    elif case == "dropout":
        q, k, v = _inputs(1, 2, 1, 17, 45, 16, 16, torch.float16)
        seed = torch.tensor(7, dtype=torch.int64, device=DEVICE)
        dmask = dropout_keep_mask_triton(seed, 1, 2, 17, 45, 0.3)
        _check(q, in_nan_padding(k), in_nan_padding(v), _random_mask((1, 1, 1, 45), "bool"), seed=seed,
               dropout_p=0.3, dropout_mask=dmask)
    else:  # 72 and 8 columns: padded tiles of 128 and 16
        q, k, v = _inputs(1, 1, 1, 20, 50, 72, 8, torch.bfloat16)
        _check(q, in_nan_padding(k), in_nan_padding(v))
    assert seen == [True]


# ---------------------------------------------------------------------------
# Larger sweep (CPU interpreter: slow)
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,M", [(65, 130), (130, 65), (128, 128)])
@pytest.mark.parametrize("D", [16, 40, 64, 128])
@pytest.mark.parametrize("window", [(None, None, False), (None, 0, False), (None, 0, True), (20, 5, True)])
def test_sweep(dtype, N, M, D, window):
    wl, wr, br = window
    q, k, v = _inputs(1, 2, 1, N, M, D, D, dtype)
    _check(q, k, v, window_left=wl, window_right=wr, bottom_right=br)


# ---------------------------------------------------------------------------
# GPU (larger shapes, autotuned configs)
# ---------------------------------------------------------------------------


# A short list rather than a full product: each new (size bucket, head dim,
# flags) key autotunes, which compiles every candidate config.
GPU_CASES = [
    # dtype, D, N, M, causal
    (torch.float16, 64, 4096, 4096, True),
    (torch.float16, 128, 4096, 4096, True),
    (torch.float16, 256, 2048, 2048, True),
    (torch.float16, 80, 1000, 3001, False),
    (torch.bfloat16, 128, 4096, 1024, True),
    (torch.bfloat16, 64, 1000, 3001, False),
    (torch.float32, 64, 2048, 2048, False),
    (torch.float32, 128, 1000, 1500, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,N,M,causal", GPU_CASES, ids=str)
def test_gpu_large(dtype, D, N, M, causal):
    q, k, v = _inputs(1, 4, 2, N, M, D, D, dtype, device="cuda")
    # Long rows sum many rounded terms: loosen the tolerances a little.
    atol, rtol = OUT_TOL[dtype]
    tol = (atol * 2, rtol * 2) if dtype != torch.float32 else (1e-4, 1e-4)
    _check(q, k, v, window_right=0 if causal else None, bottom_right=True, out_tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_gpu_masks_windows_dropout(dtype, kind):
    B, Hq, Hkv, N, M, D = 2, 8, 2, 1500, 2100, 128
    q, k, v = _inputs(B, Hq, Hkv, N, M, D, D, dtype, device="cuda")
    g = torch.Generator().manual_seed(11)
    if kind == "bool":
        mask = torch.rand(B, 1, N, M, generator=g) > 0.2
        mask[:, :, :, 1800:] = False  # key padding: whole blocks skipped
    else:
        mask = torch.randn(B, 1, 1, M, generator=g)
    mask = mask.cuda()
    tol = (OUT_TOL[dtype][0] * 2, OUT_TOL[dtype][1] * 2)
    _check(q, k, v, mask, window_left=300, window_right=0, bottom_right=True, out_tol=tol)
    seed = torch.tensor(777, dtype=torch.int64, device="cuda")
    dmask = dropout_keep_mask_triton(seed, B, Hq, N, M, 0.1)
    _check(q, k, v, mask, seed=seed, dropout_p=0.1, dropout_mask=dmask, out_tol=tol)


@pytest.mark.gpu
def test_gpu_fp32_tf32():
    q, k, v = _inputs(1, 2, 2, 1024, 1024, 64, 64, torch.float32, device="cuda")
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        _check(q, k, v, out_tol=(5e-3, 5e-3), lse_tol=(5e-3, 5e-4))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.gpu_alone
def test_gpu_long_sequence_int64_offsets():
    # B=1, H=16, N=2M tokens, D=128 in (B, N, H, D) layout: row offsets pass
    # 2**31 elements. A sliding window keeps the work small; check a sample
    # of rows (including the last ones) against the reference.
    B, H, N, D, W = 1, 16, 2 * 1024 * 1024, 128, 127
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.float16, generator=g)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    out, lse = _run(q, k, v, window_left=W, window_right=0)
    assert not out.isnan().any() and not lse.isnan().any()
    for start in (0, N // 2 + 17, N - 200):
        rows = slice(start, start + 200)
        k0 = max(0, start - W)
        # Queries [start, start+200) see keys [k0, start+200): re-index the window.
        ref = reference_attention(q[:, :, rows], k[:, :, k0:start + 200], v[:, :, k0:start + 200],
                                  window_left=W, window_right=0, bottom_right=True)
        torch.testing.assert_close(out[:, :, rows].double(), ref, atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("mask_kind", [0, 1, 2])
def test_forward_candidates_order(dropout, head_dim, mask_kind):
    """Dropout or a mask tensor at head dims up to 64 starts from the 64-row
    tiles, everything else from the shared list's first tile that fits."""
    q = torch.empty(1, dtype=torch.bfloat16)
    block = max(16, 1 << (head_dim - 1).bit_length())
    meta = dict(BLOCK_D=block, BLOCK_DV=block, MASK_KIND=mask_kind, DROPOUT=dropout)
    kept = fwd._prune_configs(fwd._FWD_CONFIGS, {"Q": q, "Mask": q}, **meta)
    first = config_tuple(kept[0])
    if (dropout or mask_kind) and head_dim <= 64:
        assert first == fwd._SMALL_HEAD_FIRST
    else:
        assert first == fwd._CUDA_CONFIGS[0]
    assert sorted(map(config_tuple, kept)) == sorted(set(map(config_tuple, kept))), "no duplicates"


@pytest.mark.parametrize("mask_kind", [0, 2])
def test_forward_candidates_with_descriptors(mask_kind):
    """With descriptor loads the 64-row, one-warp-group tile comes first, and
    no two-stage pipeline is offered (Triton 3.6's ptxas crashes on them)."""
    q = torch.empty(1, dtype=torch.bfloat16)
    meta = dict(BLOCK_D=128, BLOCK_DV=128, MASK_KIND=mask_kind, DROPOUT=False, KV_DESC=True)
    kept = [config_tuple(c) for c in fwd._prune_configs(fwd._FWD_CONFIGS, {"Q": q, "Mask": q}, **meta)]
    assert kept[0] == fwd._DESCRIPTOR_FIRST
    assert all(t[3] >= 3 for t in kept), kept
