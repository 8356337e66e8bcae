"""The launchers' shared description of a call (``kernels.problem``) and the
one band rule (``launch.kernel_band``) it and the table builder take."""

from __future__ import annotations

import math

import pytest
import torch

from flashfuse.kernels.common import MASK_BOOL, MASK_FLOAT, MASK_NONE, dropout_threshold
from flashfuse.kernels.launch import kernel_band, window_limit
from flashfuse.kernels.mask_ranges import mask_tables
from flashfuse.kernels.problem import AttentionProblem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(N=5, M=7, D=16, Dv=24):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, N, D, generator=g).to(DEVICE)
    k = torch.randn(2, 2, M, D, generator=g).to(DEVICE)
    v = torch.randn(2, 2, M, Dv, generator=g).to(DEVICE)
    return q, k, v


def test_fields_of_a_bool_masked_capped_dropout_call():
    q, k, v = _qkv()
    mask = torch.rand(1, 1, 5, 7, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.5
    kw = dict(dropout_p=0.25, scale=0.3, window_left=10**9, window_right=-2, bottom_right=True,
              mask_fill=-1.0e5, softcap=5.0)
    p = AttentionProblem.build(q, k, v, mask, **kw)
    assert (p.B, p.Hq, p.Hkv, p.N, p.M, p.D, p.Dv) == (2, 4, 2, 5, 7, 16, 24)
    assert p.mask_kind == MASK_BOOL and p.mask.dtype == torch.uint8, "a bool mask is read as bytes"
    assert p.mask_strides[:2] == (0, 0) and p.mask.shape == (2, 4, 5, 7), "broadcast through stride 0"
    assert (p.diag_off, p.window_left, p.window_right) == (2, window_limit(5, 7), -2)
    assert p.fill == 2 and p.fill_arg == pytest.approx(-1.0e5 * math.log2(math.e))
    assert p.threshold == dropout_threshold(0.25) and p.keep_scale == pytest.approx(1 / 0.75)
    assert p.qk_scale == pytest.approx(5.0 * math.log2(math.e)) and p.softcap_scale == pytest.approx(0.3 / 5.0)
    assert p.band() == kernel_band(5, 7, 10**9, -2, True)
    assert p.tables_apply(), "a fill at or below -65504 hides: tables apply"
    back = AttentionProblem.build(q, k, v, mask, **kw, backward=True)
    same = [f for f in p.__dataclass_fields__ if f not in ("mask", "kv_descriptors")]
    assert all(getattr(p, f) == getattr(back, f) for f in same), "one description for both passes"


@pytest.mark.parametrize("mask_dtype, kind", [(None, MASK_NONE), (torch.float32, MASK_FLOAT)])
def test_kinds_and_no_tables_without_a_mask(mask_dtype, kind):
    q, k, v = _qkv()
    mask = None if mask_dtype is None else torch.randn(5, 7, dtype=mask_dtype).to(DEVICE)
    p = AttentionProblem.build(q, k, v, mask, dropout_p=0.0, scale=0.25, window_left=None, window_right=None,
                               bottom_right=False)
    assert p.mask_kind == kind and p.tables_apply() == (mask is not None)
    assert (p.threshold, p.keep_scale, p.fill, p.softcap_scale) == (0, 1.0, 0, 0.0)
    assert p.mask_strides == ((0, 0, 0, 0) if mask is None else (0, 0, 7, 1))


def test_tables_do_not_depend_on_the_clamp_limit():
    """The forward and block masks clamped windows at N + M, the backward at
    window_limit; the one band rule takes the latter. The tables (like the
    forward) only see visibility, which any limit of at least N + M leaves
    the same: windows far past either end."""
    N, M = 21, 29
    g = torch.Generator().manual_seed(3)
    mask = (torch.randn(1, 2, N, M, generator=g) > 0.3).to(DEVICE).view(torch.uint8)
    for wl, wr in ((10**6, -(10**6)), (-(10**6), 3)):
        band = kernel_band(N, M, wl, wr, True)
        old = dict(band, window_left=max(-(N + M), min(wl, N + M)), window_right=max(-(N + M), min(wr, N + M)))
        got = mask_tables(mask, N, M, band, fills=False)
        want = mask_tables(mask, N, M, old, fills=False)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (wl, wr)


@pytest.mark.parametrize("M, full", [(7, False), (128, True), (130, False), (384, True), (448, False)])
def test_full_key_blocks_only_when_every_tile_divides_the_keys(M, full):
    # With full key blocks the kernels read the mask without per-key bounds:
    # a wrong yes reads past the mask's rows.
    q, k, v = _qkv(N=5, M=M)
    assert AttentionProblem.build(q, k, v, None, dropout_p=0.0, scale=0.25, window_left=None, window_right=None,
                                  bottom_right=False).full_key_blocks is full


def test_no_kernel_config_has_a_key_block_wider_than_the_rule_assumes():
    from flashfuse.kernels import backward, forward
    from flashfuse.kernels.problem import LARGEST_BLOCK_N

    widths = [c.kwargs["BLOCK_N"] for c in forward._FWD_CONFIGS + forward._FP32_LAST_RESORT]
    widths += [t[1] for tiles in (backward._DKDV_TILES, backward._DQ_TILES) for ts in tiles.values() for t in ts]
    widths += [forward._INTERPRET_BLOCK_N, backward._INTERPRET_META["BLOCK_N"]]
    assert max(widths) <= LARGEST_BLOCK_N
