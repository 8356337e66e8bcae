"""Tests of the Hopper (Gluon) kernels, ``flashfuse.kernels.hopper``.

The kernels run only on a Hopper GPU (Gluon kernels do not run in Triton's
interpreter), so their numerics are ``gpu`` tests: the float64 reference on
fresh random inputs, odd sizes (one query, one key, partial tiles), every
band (causal top-left and bottom-right, with rows that see nothing, windows
on both sides), grouped heads, inputs in NaN padding (a read past an edge
shows) and outputs poisoned (an unwritten element shows), the same bits on
repeated runs (a race would move them), and gradients through the op, eager
and compiled. The selection rules, forward and backward, are tested on the
CPU as well.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import flashfuse
from flashfuse import reference as ref
from flashfuse.kernels import hopper
from flashfuse.kernels.problem import AttentionProblem

from tests.kernels.padding import in_nan_padding, poison_empty

BANDS = {
    "none": {},
    "causal": dict(window_right=0),
    "causal_bottom_right": dict(window_right=0, bottom_right=True),
    "window": dict(window_left=100, window_right=0),
    "two_sided_bottom_right": dict(window_left=37, window_right=50, bottom_right=True),
}

# ‖out − ref‖ / ‖ref‖ bounds for 16-bit operands (P is rounded to the input dtype).
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _kernel_band(band: dict) -> dict:
    """A ``BANDS`` entry as the launchers and ``AttentionProblem.build`` take it."""
    return dict(window_left=band.get("window_left"), window_right=band.get("window_right"),
                bottom_right=band.get("bottom_right", False))


def _op_band(band: dict) -> dict:
    """A ``BANDS`` entry as ``flashfuse.attention`` takes it."""
    return dict(window_left=band.get("window_left"), window_right=band.get("window_right"),
                alignment="bottom_right" if band.get("bottom_right") else "top_left")


def _problem(q, k, v, mask=None, *, mask_fill=None, backward=False, **band):
    return AttentionProblem.build(q, k, v, mask, dropout_p=0.0, scale=0.125, mask_fill=mask_fill,
                                  backward=backward, **_kernel_band(band))


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _assert_float64_close(out, grads, q, k, v, dout, mask=None, scale=0.125, **band):
    """``out`` and the gradients of q, k, v (``grads``) of a 16-bit call
    against the float64 reference on the same inputs: no NaN, relative
    errors below 1e-2 (output) and 2e-2 (gradients)."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want = ref.reference_attention(*leaves, None if mask is None else mask.cpu(), scale=scale, **band)
    want.backward(dout.cpu().double())
    assert _rel(out.detach().cpu(), want.detach()) < 1e-2
    for got, exp in zip(grads, leaves):
        assert not got.isnan().any()
        assert _rel(got.cpu(), exp.grad) < 2e-2


def _inputs(B, Hq, Hkv, N, M, D, dtype, layout, gen):
    def make(H, L):
        if layout == "bnhd":  # (B, L, H, D) transposed, as projections leave it
            return torch.randn(B, L, H, D, generator=gen, device="cuda").to(dtype).transpose(1, 2)
        t = torch.randn(B, H, L, D, generator=gen, device="cuda").to(dtype)
        return in_nan_padding(t) if layout == "nan_padded" else t
    return make(Hq, N), make(Hkv, M), make(Hkv, M)


# ---------------------------------------------------------------------------
# The selection rule (CPU)
# ---------------------------------------------------------------------------

def _as_hopper_call(monkeypatch, p):
    """``p`` as if its tensors were on a Hopper GPU with a supported Triton."""
    monkeypatch.setattr(hopper, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(hopper, "gluon_available", lambda: True)
    return dataclasses.replace(p, device=torch.device("cuda", 0), interpret=False)


def test_refusal_reasons(monkeypatch):
    q, k, v = (torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    p = _problem(q, k, v)
    assert "CUDA" in hopper.hopper_refusal(p, q, k, v, dropout_p=0.0, softcap=None, sinks=None)
    hp = _as_hopper_call(monkeypatch, p)
    assert hopper.hopper_refusal(hp, q, k, v, dropout_p=0.0, softcap=None, sinks=None) is None
    assert hopper.hopper_refusal(hp, q, k, v, dropout_p=0.1, softcap=None, sinks=None) == "dropout"
    assert "soft-cap" in hopper.hopper_refusal(hp, q, k, v, dropout_p=0.0, softcap=30.0, sinks=None)
    for scale in (0.0, -0.125):  # hidden scores are -inf before the kernels scale them
        ps = dataclasses.replace(hp, scale=scale)
        assert "scale" in hopper.hopper_refusal(ps, q, k, v, dropout_p=0.0, softcap=None, sinks=None)
        assert "scale" in hopper.problem_refusal(ps, 0.0, None, None, backward=True)
    monkeypatch.setenv("FLASHFUSE_HOPPER", "0")
    assert hopper.hopper_refusal(hp, q, k, v, dropout_p=0.0, softcap=None, sinks=None) == "FLASHFUSE_HOPPER=0"
    monkeypatch.delenv("FLASHFUSE_HOPPER")
    # Head dims, dtypes, masks and layouts the kernel does not cover.
    q96 = torch.randn(1, 2, 1024, 96, dtype=torch.bfloat16)
    p96 = _as_hopper_call(monkeypatch, _problem(q96, q96, q96))
    assert "head dims" in hopper.hopper_refusal(p96, q96, q96, q96, dropout_p=0.0, softcap=None, sinks=None)
    q32 = q.float()
    p32 = _as_hopper_call(monkeypatch, _problem(q32, q32, q32))
    assert "dtype" in hopper.hopper_refusal(p32, q32, q32, q32, dropout_p=0.0, softcap=None, sinks=None)
    # Masks: bool or float, read through their key table; not a bool mask
    # whose hidden pairs take part (a mask_fill).
    mask = torch.ones(1024, 1024, dtype=torch.bool)
    for m, fill in ((mask, None), (mask.float(), None), (mask, -1e4)):
        pm = _as_hopper_call(monkeypatch, _problem(q, k, v, m, mask_fill=fill))
        why = hopper.hopper_refusal(pm, q, k, v, dropout_p=0.0, softcap=None, sinks=None)
        assert why == (None if fill is None else "a bool mask with a mask_fill")
    pm = _as_hopper_call(monkeypatch, _problem(q, k, v, mask))
    monkeypatch.setattr("flashfuse.kernels.forward.SKIP_HIDDEN_BLOCKS", False)
    assert "without its tables" in hopper.hopper_refusal(pm, q, k, v, dropout_p=0.0, softcap=None, sinks=None)
    monkeypatch.undo()
    monkeypatch.setattr(hopper, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(hopper, "gluon_available", lambda: True)
    odd = torch.randn(1, 2, 1024, 129, dtype=torch.bfloat16)[..., :128]  # rows 258 bytes apart
    assert "copy engine" in hopper.hopper_refusal(hp, odd, k, v, dropout_p=0.0, softcap=None, sinks=None)
    monkeypatch.setattr(hopper, "_capability", lambda index: (8, 0))
    assert "Hopper" in hopper.hopper_refusal(hp, q, k, v, dropout_p=0.0, softcap=None, sinks=None)


def test_cpu_calls_never_take_it():
    q, k, v = (torch.randn(1, 2, 64, 128, dtype=torch.bfloat16) for _ in range(3))
    assert hopper.hopper_refusal(_problem(q, k, v), q, k, v, dropout_p=0.0, softcap=None, sinks=None) is not None


def test_supported_triton_versions_only(monkeypatch):
    import triton

    hopper.gluon_available.cache_clear()
    try:
        assert hopper.gluon_available() == triton.__version__.startswith(hopper.SUPPORTED_TRITON)
    finally:
        hopper.gluon_available.cache_clear()


# ---------------------------------------------------------------------------
# Numerics (GPU)
# ---------------------------------------------------------------------------

def _require_hopper():
    if torch.cuda.get_device_capability()[0] != 9 or not hopper.gluon_available():
        pytest.skip("needs a Hopper GPU and a Triton whose Gluon API the kernel targets")


# The forward's grids: one program per tile or a persistent grid (with
# three programs, each takes many tiles of different heads, lengths and
# bands, in rounds of alternating order).
GRIDS = {"tiles": (False, None), "persistent": (True, None), "three_programs": (True, 3)}


def _grid(monkeypatch, name):
    """``persistent`` for ``hopper_forward``, with the SM count patched where the grid names one."""
    persistent, sms = GRIDS[name]
    if sms is not None:
        monkeypatch.setattr(hopper, "multiprocessors", lambda index: sms)
    return persistent


def test_forward_grid_rule(monkeypatch):
    """A persistent grid where the plan finds it faster, one program per
    tile otherwise."""
    q, k, v = (torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    assert not hopper.forward_persistent(_problem(q, k, v))  # 16 tiles: one program each
    plan = hopper._grid_plan
    # (heads, N, M, diag_off, window_left, window_right, has_left, has_right, SMs)
    assert plan(256, 1024, 1024, 0, 0, 0, False, False, 132) == (132, True)  # short rows: the fixed costs hide
    assert plan(256, 1024, 1024, 0, 0, 0, False, True, 132) == (132, True)  # causal: the hand-out balances
    # Causal 16k, 16 heads: 128 query blocks a head; with 128 programs each
    # round is one head, and the reversed rounds pair long tiles with short.
    assert plan(16, 16384, 16384, 0, 0, 0, False, True, 132) == (128, True)
    # 16k without a band, 16 heads: 15.5 tiles a program either way, one program per tile is kept.
    assert plan(16, 16384, 16384, 0, 0, 0, False, False, 132) == (132, False)
    assert plan(4, 256, 256, 0, 0, 0, False, False, 132) == (8, False)  # fewer tiles than SMs
    assert hopper.forward_programs(_problem(q, k, v), False) == 16
    many = torch.randn(3, 16, 1024, 128, dtype=torch.bfloat16)
    assert hopper.forward_persistent(_problem(many, many, many))
    assert hopper.forward_programs(_problem(many, many, many), True) == 132  # off the GPU: an H100's SMs
    monkeypatch.setattr(hopper, "FWD_PERSISTENT", False)
    assert not hopper.forward_persistent(_problem(many, many, many))


def test_backward_grid_rule(monkeypatch):
    """The fused backward's grid: a persistent one whenever there are more
    key tiles than SMs, sized by the plan; a tile's work is its q/dO blocks
    as the kernel's query range counts them."""
    plan = hopper._backward_grid_plan
    # (B x kv heads, group, N, M, diag_off, window_left, window_right, has_left, has_right, SMs)
    assert plan(4, 1, 1024, 1024, 0, 0, 0, False, False, 132) == (32, False)  # fewer tiles than SMs
    assert plan(256, 1, 1024, 1024, 0, 0, 0, False, False, 132) == (132, True)  # 2048 short tiles
    # Causal 16k, 16 heads: 128 key tiles a head; 128 programs pair long tiles with short.
    assert plan(16, 1, 16384, 16384, 0, 0, 0, False, True, 132)[0] == 128
    # On 128-row q/dO blocks the plan weighs each tile in 64-row units: the
    # same work per tile as on 64-row blocks, give or take the block at the
    # band's edge, and so the same grid.
    weights = {}

    def recording(per_tile, sms, fixed):
        weights[len(weights)] = per_tile.clone()
        return real_balanced(per_tile, sms, fixed)

    real_balanced = hopper._balanced_grid
    monkeypatch.setattr(hopper, "_balanced_grid", recording)
    plan.cache_clear()
    assert plan(16, 1, 16384, 16384, 0, 0, 0, False, True, 132, 64)[0] == 128
    assert plan(16, 1, 16384, 16384, 0, 0, 0, False, True, 132, 128)[0] == 128
    assert torch.all((weights[1] - weights[0]).abs() <= 1)  # uncounted, 128-row blocks would weigh half
    monkeypatch.undo()
    q, k, v = (torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    p = _problem(q, k, v)
    assert not hopper.backward_persistent(p) and hopper.backward_programs(p, False) == 16
    grouped_q = torch.empty(8, 32, 1024, 128, dtype=torch.bfloat16)
    grouped_kv = torch.empty(8, 8, 1024, 128, dtype=torch.bfloat16)
    pg = _problem(grouped_q, grouped_kv, grouped_kv)  # 512 tiles of 64 blocks
    assert hopper.backward_programs(pg, False) == 8 * 8 * 8
    assert hopper.backward_persistent(pg) and hopper.backward_programs(pg, True) <= 132
    monkeypatch.setattr(hopper, "BWD_PERSISTENT", False)
    assert not hopper.backward_persistent(pg)


@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("N,M,band", [(1000, 1000, {}), (1000, 1000, dict(window_right=0)),
                                      (129, 4097, dict(window_right=0, bottom_right=True)),
                                      (2048, 640, dict(window_left=100, window_right=0)),
                                      (300, 1, dict(window_left=37, window_right=50, bottom_right=True))])
def test_backward_plan_counts_the_kernels_blocks(N, M, band, bm):
    """The plan's per-tile work is the ``bm``-row q/dO blocks each key tile
    streams: from the first block with a row that sees one of the tile's
    keys under the band to the last, give or take a block at the band's
    edge."""
    q, k = torch.randn(1, 1, N, 64), torch.randn(1, 1, M, 64)
    p = _problem(q, k, k, **band)
    seen = ref.visibility_mask(N, M, **_kernel_band(band))
    if seen is None:
        seen = torch.ones(N, M, dtype=torch.bool)
    blocks = hopper._key_tile_blocks(N, M, p.diag_off, p.window_left, p.window_right, p.has_window_left,
                                     p.has_window_right, bm)
    bn = hopper.BWD_BLOCK_N
    assert blocks.numel() == -(-M // bn)
    for t in range(blocks.numel()):
        rows = seen[:, t * bn:(t + 1) * bn].any(dim=1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        span = int(rows.max()) // bm - int(rows.min()) // bm + 1
        assert span <= int(blocks[t]) <= span + 1, (t, span, int(blocks[t]))


def test_grid_plan_under_a_dispatch_mode():
    """The plan is CPU arithmetic even when a fake-tensor mode is active
    around the launch (its tensors would have no values to read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    hopper._grid_plan.cache_clear()
    with FakeTensorMode():
        assert hopper._grid_plan(256, 1024, 1024, 0, 0, 0, False, True, 132) == (132, True)


def _kernel_hand_out(tiles: int, programs: int) -> list[list[int]]:
    """The tiles each program takes, as ``_program_rounds`` and ``_round_tile`` compute them."""
    out = []
    for p in range(programs):
        full = tiles // programs
        last_pos = p if full % 2 == 0 else programs - 1 - p
        rounds = full + (last_pos < tiles - full * programs)
        out.append([r * programs + (p if r % 2 == 0 else programs - 1 - p) for r in range(rounds)])
    return out


@pytest.mark.parametrize("tiles,programs", [(1, 1), (7, 7), (2048, 132), (2048, 128), (1000, 3), (131, 132),
                                            (265, 132), (396, 132), (5, 2)])
def test_hand_out_takes_every_tile_once(tiles, programs):
    programs = min(programs, tiles)
    taken = sorted(t for ts in _kernel_hand_out(tiles, programs) for t in ts)
    assert taken == list(range(tiles))


def test_descriptor_strides_of_single_element_dims():
    """A dimension of one element may carry any stride in PyTorch (0 when
    expanded); the descriptor gets a dense one, a multiple of 16 bytes."""
    t = torch.as_strided(torch.randn(64, dtype=torch.bfloat16), (1, 1, 1, 64), (0, 3, 5, 1))
    assert hopper._descriptor_strides(t) == (64, 64, 64)
    u = torch.randn(2, 300, 4, 128).transpose(1, 2)
    assert hopper._descriptor_strides(u) == u.stride()[:3]
    w = torch.randn(3, 1, 7, 128)[:, :, :5]
    assert hopper._descriptor_strides(w) == (7 * 128, 5 * 128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("B,Hq,Hkv,N,M", [(2, 4, 4, 1000, 1000), (1, 8, 2, 129, 4097), (1, 2, 2, 1, 300),
                                          (1, 4, 1, 300, 1), (2, 2, 1, 2048, 640)])
def test_forward_against_reference(monkeypatch, grid, dtype, D, band, B, Hq, Hkv, N, M):
    _require_hopper()
    poison_empty(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(D * 1000003 + N * 31 + M)
    q, k, v = _inputs(B, Hq, Hkv, N, M, D, dtype, "nan_padded", gen)
    kw = BANDS[band]
    p = _problem(q, k, v, **kw)
    why = hopper.hopper_refusal(p, q, k, v, dropout_p=0.0, softcap=None, sinks=None)
    assert why is None or "visible keys" in why, why  # short rows: the kernel runs when called directly
    out, lse = hopper.hopper_forward(p, q, k, v, _grid(monkeypatch, grid))
    want = ref.reference_attention(q.cpu(), k.cpu(), v.cpu(), scale=0.125, **kw)
    want_lse = ref.reference_lse(q.cpu(), k.cpu(), scale=0.125, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    assert _rel(out.cpu(), want) < REL_TOL[dtype]
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.cpu().double()[fin], want_lse[fin], atol=2e-3, rtol=1e-3)
    hidden = torch.isinf(want_lse)
    assert (out.cpu()[hidden] == 0).all()  # rows that see no key are 0


# The forward's softmax variants (hopper.FWD_SOFTMAX): (row-max folds,
# exponentials of each eight on the FMA units); the defaults (0, 0) are the
# other tests' cases.
SOFTMAX_VARIANTS = [(3, 0), (0, 1), (3, 2), (0, 3)]


def _softmax_variant(monkeypatch, D, folds, poly):
    monkeypatch.setattr(hopper, "FWD_SOFTMAX", {**hopper.FWD_SOFTMAX, D: dict(row_max_folds=folds, exp_poly=poly)})


@pytest.mark.gpu
@pytest.mark.parametrize("folds,poly", SOFTMAX_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_forward_softmax_variants_against_reference(monkeypatch, folds, poly, D, dtype):
    """Each softmax variant: every band with rows that see no key, partial
    tiles, grouped heads, NaN padding and poisoned outputs, as the default's
    forward test checks it."""
    _softmax_variant(monkeypatch, D, folds, poly)
    for band, shape in (("causal_bottom_right", (1, 8, 2, 129, 4097)), ("two_sided_bottom_right", (2, 4, 4, 1000, 1000)),
                        ("none", (1, 2, 2, 1, 300))):
        test_forward_against_reference(monkeypatch, "persistent", dtype, D, band, *shape)


@pytest.mark.gpu
@pytest.mark.parametrize("folds,poly", SOFTMAX_VARIANTS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", ["float_hidden_rows", "bool_padding"])
def test_masked_forward_softmax_variants(monkeypatch, folds, poly, D, kind):
    """Each softmax variant with a mask: -inf and rows a finite value hides
    entirely, whose lse marker holds their key count (2^0 must be exact)."""
    _softmax_variant(monkeypatch, D, folds, poly)
    test_masked_forward_against_reference(monkeypatch, "persistent", D, kind, "causal", 2, 4, 2, 1000, 1000)


@pytest.mark.gpu
@pytest.mark.parametrize("folds,poly", SOFTMAX_VARIANTS)
@pytest.mark.parametrize("D", [64, 128])
def test_softmax_variants_gradients_through_the_op(monkeypatch, folds, poly, D):
    """The backward from each variant's lse: gradients against float64."""
    _require_hopper()
    _softmax_variant(monkeypatch, D, folds, poly)
    _causal_gradients_against_float64(D, seed=13)


def _causal_gradients_against_float64(D, seed):
    """A causal grouped-head call through the op, forward and backward,
    against float64; its inputs ``(q, k, v)``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = _inputs(2, 4, 2, 1500, 1500, D, torch.bfloat16, "contiguous", gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashfuse.attention(*leaves, scale=0.125, is_causal=True, enable_gqa=True)
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    out.backward(dout)
    _assert_float64_close(out, [t.grad for t in leaves], q, k, v, dout, window_right=0)
    return q, k, v


def _consumers(monkeypatch, D, n):
    """``n`` consumer warp groups at head dim ``D``, at every length."""
    monkeypatch.setattr(hopper, "FWD_CONSUMERS", {**hopper.FWD_CONSUMERS, D: n})
    monkeypatch.setattr(hopper, "FWD_THREE_CONSUMERS_MIN", 0)


def test_forward_consumer_rule(monkeypatch):
    """Three consumer warp groups (192-row tiles) only where FWD_CONSUMERS
    asks for them and the call has no mask; the grid counts 192-row tiles."""
    q, k, v = (torch.randn(1, 2, 1000, 64, dtype=torch.bfloat16) for _ in range(3))
    _consumers(monkeypatch, 64, 3)
    p = _problem(q, k, v)
    assert hopper.forward_consumers(p) == 3 and hopper.forward_block_m(p) == 192
    assert hopper.forward_programs(p, False) == 2 * 6  # cdiv(1000, 192) tiles a head
    meta = hopper.kernel_args(p, q, k, v, torch.empty_like(q), torch.empty(1, 2, 1000), False)[1]
    assert (meta["BLOCK_M"], meta["CONSUMERS"], meta["maxnreg"]) == (192, 3, 128)
    masked = _problem(q, k, v, torch.ones(1000, 1000, dtype=torch.bool))
    assert hopper.forward_consumers(masked) == 2 and hopper.forward_block_m(masked) == 128
    q128 = torch.randn(1, 2, 1000, 128, dtype=torch.bfloat16)
    assert hopper.forward_consumers(_problem(q128, q128, q128)) == hopper.FWD_CONSUMERS[128]
    # Below FWD_THREE_CONSUMERS_MIN queries or keys: two.
    monkeypatch.setattr(hopper, "FWD_THREE_CONSUMERS_MIN", 1001)
    assert hopper.forward_consumers(p) == 2
    long_q = torch.randn(1, 2, 2000, 64, dtype=torch.bfloat16)
    assert hopper.forward_consumers(_problem(long_q, k, v)) == 2  # 1000 keys
    assert hopper.forward_consumers(_problem(long_q, long_q, long_q)) == 3
    # The plan's per-tile blocks for 192-row tiles under a causal band, last
    # tile first: a tile's last row r sees keys 0..r, cdiv(r + 1, 128) blocks.
    blocks = hopper._query_tile_blocks(1000, 1000, 0, 0, 0, False, True, 192)
    assert blocks.tolist() == [8.0, 8.0, 6.0, 5.0, 3.0, 2.0]


def _shaped(B, Hq, Hkv, N, M, D=64):
    """CPU tensors of an attention call's shapes (the rules read only shapes)."""
    return (torch.empty(B, Hq, N, D, dtype=torch.bfloat16), torch.empty(B, Hkv, M, D, dtype=torch.bfloat16),
            torch.empty(B, Hkv, M, D, dtype=torch.bfloat16))


def test_forward_split_tail_rule(monkeypatch):
    """Split tails where three consumers leave one part of rows in a head's
    last block (N % 192 in 1..64), at the head dims FWD_SPLIT_TAIL lists,
    without a mask, under any band."""
    assert hopper.forward_split_tail(_problem(*_shaped(4, 32, 32, 4096, 4096)))  # 4096 = 21 x 192 + 64
    assert hopper.forward_split_tail(_problem(*_shaped(1, 2, 2, 4225, 4225)))  # a 1-row tail
    assert not hopper.forward_split_tail(_problem(*_shaped(4, 32, 32, 4160, 4160)))  # two parts of rows left
    assert not hopper.forward_split_tail(_problem(*_shaped(4, 32, 32, 4032, 4096)))  # 21 x 192: no tail
    assert not hopper.forward_split_tail(_problem(*_shaped(4, 16, 16, 4096, 4096, D=128)))  # two consumers
    q, k, v = _shaped(4, 32, 32, 4096, 4096)
    assert not hopper.forward_split_tail(_problem(q, k, v, torch.ones(4096, 4096, dtype=torch.bool)))  # masked
    assert hopper.forward_split_tail(_problem(q, k, v, window_right=0))  # causal
    p = _problem(q, k, v)
    meta = hopper.kernel_args(p, q, k, v, torch.empty_like(q), torch.empty(4, 32, 4096), True)[1]
    assert (meta["BLOCK_M"], meta["CONSUMERS"], meta["SPLIT_TAIL"]) == (192, 3, True)
    monkeypatch.setattr(hopper, "FWD_SPLIT_TAIL", ())
    assert not hopper.forward_split_tail(p)
    assert hopper.kernel_args(p, q, k, v, torch.empty_like(q), torch.empty(4, 32, 4096), True)[1]["SPLIT_TAIL"] is False


def test_forward_split_tail_plan(monkeypatch):
    """The plan's tiles in the kernel's numbering with split tails: every
    head's full tiles, then every head's tail at FWD_TAIL_COST of its
    blocks; at 4k without a band the busiest program then runs 21 full
    tiles instead of 22, and the op's plan is made with the tails."""
    per_head = hopper._query_tile_blocks(4096, 4096, 0, 0, 0, False, True, 192)
    order = hopper._tiles_in_order(per_head, 3, True)
    assert order[:21 * 3].tolist() == per_head[1:].repeat(3).tolist()
    assert order[21 * 3:].tolist() == [32 * hopper.FWD_TAIL_COST] * 3  # the causal tails see every key
    flat = hopper._query_tile_blocks(4096, 4096, 0, 0, 0, False, False, 192)
    fixed = hopper.FWD_FIXED_BLOCKS["persistent"]
    full = 32 + fixed  # one full tile of 32 key blocks
    assert hopper._balanced_grid(hopper._tiles_in_order(flat, 128, False), 132, fixed)[1] == pytest.approx(22 * full)
    assert hopper._balanced_grid(hopper._tiles_in_order(flat, 128, True), 132, fixed)[1] == pytest.approx(21 * full)
    hopper._grid_plan.cache_clear()
    assert hopper._grid_plan(128, 4096, 4096, 0, 0, 0, False, False, 132, 192, False)[1]  # persistent both ways
    assert hopper._grid_plan(128, 4096, 4096, 0, 0, 0, False, False, 132, 192, True)[1]
    planned = []
    monkeypatch.setattr(hopper, "_grid_plan", lambda *a: planned.append(a[-2:]) or (132, True))
    hopper._plan(_problem(*_shaped(4, 32, 32, 4096, 4096)))
    hopper._plan(_problem(*_shaped(4, 32, 32, 4224, 4224)))  # 22 x 192: no tail
    assert planned == [(192, True), (192, False)]  # the op's plan takes the split tails where the rule does


@pytest.mark.gpu
@pytest.mark.parametrize("grid", list(GRIDS))
def test_forward_split_tails_against_reference(monkeypatch, grid):
    """Three consumers at D = 64 with each head's last query block (one
    part of rows) split over the consumers by key blocks and merged: 64-row
    and 1-row tails, every band (windows narrow enough that a consumer
    takes no block of the tail), grouped heads, M != N, NaN padding and
    poisoned outputs, on every grid (with three programs each takes many
    tails, so the merge's barriers change phase), both dtypes."""
    cases = (("none", (1, 4, 4, 4096, 4096)), ("causal", (1, 2, 1, 4225, 4225)),
             ("window", (2, 4, 2, 4287, 4500)), ("two_sided_bottom_right", (1, 4, 4, 4096, 5000)),
             ("causal_bottom_right", (1, 2, 2, 4096, 4097)))
    for i, (band, shape) in enumerate(cases):
        assert hopper.forward_split_tail(_problem(*_shaped(*shape), **BANDS[band]))
        dtype = torch.float16 if i % 2 else torch.bfloat16
        test_forward_against_reference(monkeypatch, grid, dtype, 64, band, *shape)


@pytest.mark.gpu
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_forward_consumer_counts_against_reference(monkeypatch, consumers, dtype, D):
    """Two and three consumer warp groups at both head dims: every band,
    partial 192-row tiles, rows that see no key, grouped heads, NaN padding
    and poisoned outputs, on both grids."""
    _consumers(monkeypatch, D, consumers)
    for grid in ("tiles", "persistent"):
        for band, shape in (("causal_bottom_right", (1, 8, 2, 129, 4097)), ("two_sided_bottom_right", (2, 4, 4, 1000, 1000)),
                            ("none", (1, 2, 2, 1, 300)), ("causal", (2, 2, 1, 2048, 640)), ("window", (2, 4, 4, 1000, 1000))):
            test_forward_against_reference(monkeypatch, grid, dtype, D, band, *shape)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_three_consumers_gradients_and_repeatability(monkeypatch, D):
    """The backward from the three-consumer forward's lse against float64,
    and the forward's bits the same over three runs."""
    _require_hopper()
    _consumers(monkeypatch, D, 3)
    q, k, v = _causal_gradients_against_float64(D, seed=17)
    p = _problem(q, k, v, window_right=0)
    runs = [hopper.hopper_forward(p, q, k, v, True) for _ in range(3)]
    for o, lse in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "bnhd"])
def test_layouts_and_repeatability(monkeypatch, layout, D, grid):
    _require_hopper()
    poison_empty(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = _inputs(2, 8, 2, 3000, 3000, D, torch.bfloat16, layout, gen)
    p = _problem(q, k, v, window_right=0)
    persistent = _grid(monkeypatch, grid)
    runs = [hopper.hopper_forward(p, q, k, v, persistent) for _ in range(3)]
    for out, lse in runs[1:]:  # a race would move bits between runs
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    want = ref.reference_attention(q.cpu(), k.cpu(), v.cpu(), scale=0.125, window_right=0)
    assert _rel(runs[0][0].cpu(), want) < REL_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("band,N,M", [("none", 777, 1025), ("causal", 2000, 2000),
                                      ("causal_bottom_right", 1000, 2100)])
def test_gradients_through_the_op(monkeypatch, band, N, M):
    """The op's forward and backward on the Hopper kernels."""
    _require_hopper()
    calls = []
    real = hopper.hopper_backward
    monkeypatch.setattr(hopper, "hopper_backward", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = _inputs(2, 4, 2, N, M, 128, torch.bfloat16, "contiguous", gen)
    kw = BANDS[band]
    assert hopper.hopper_refusal(_problem(q, k, v, **kw), q, k, v, dropout_p=0.0, softcap=None, sinks=None) is None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashfuse.attention(*leaves, scale=0.125, is_causal="causal" in band, enable_gqa=True,
                              alignment="bottom_right" if kw.get("bottom_right") else "top_left")
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    out.backward(dout)
    assert calls, "the Hopper backward did not run"
    _assert_float64_close(out, [t.grad for t in leaves], q, k, v, dout, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_scales_at_or_below_zero_stay_exact(scale):
    """A causal call with a scale of 0 or below, which the Hopper kernels
    would turn into NaN or +inf (they hide scores with -inf before scaling
    them), takes the portable kernels both ways and matches float64."""
    _require_hopper()
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = _inputs(2, 4, 4, 1024, 1024, 64, torch.bfloat16, "contiguous", gen)
    for name in (flashfuse.ops.forward_kernel(q, k, v, is_causal=True, scale=scale),
                 flashfuse.ops.backward_kernel(q, k, v, is_causal=True, scale=scale)):
        assert name.startswith("portable") and "scale" in name, name
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashfuse.attention(*leaves, is_causal=True, scale=scale)
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    out.backward(dout)
    if scale < 0:
        _assert_float64_close(out, [t.grad for t in leaves], q, k, v, dout, scale=scale, window_right=0)
        return
    # Scale 0: every row averages its visible values, and q and k get no gradient.
    dq, dk, dv = (t.grad for t in leaves)
    assert not (dq.any() or dk.any())
    weights = torch.ones(1024, 1024, dtype=torch.float64).tril()
    weights /= weights.sum(1, keepdim=True)  # each row's visible keys, alike
    assert _rel(out.detach().cpu(), weights @ v.double().cpu()) < 1e-2
    assert _rel(dv.cpu(), weights.T @ dout.double().cpu()) < 2e-2


# ---------------------------------------------------------------------------
# Mask tensors in the forward (GPU)
# ---------------------------------------------------------------------------

MASKS = ("bool_padding", "bool_blocks", "float_causal", "float_hidden_rows")


def _mask(kind, B, Hq, N, M, dtype, seed):
    """A mask of each kind the forward reads: a bool key-padding mask
    (B, 1, 1, M) with one batch row seeing every key and one none; a bool
    (B, Hq, N, M) mask per head of 16 x 32 blocks that are all visible, all
    hidden or random (so tables skip, run without the mask and read it); a
    float causal mask of 0 and the dtype's lowest as Hugging Face builds
    them; and a float32 (1, 1, N, M) mask of random values with -inf blocks
    and entries, rows hidden entirely by the lowest float32 (which average
    their keys) and rows hidden entirely by -inf (which give 0)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "bool_padding":
        lens = torch.randint(0, M + 1, (B,), generator=gen)
        lens[0] = M
        if B > 1:
            lens[-1] = 0
        return (torch.arange(M)[None] < lens[:, None])[:, None, None, :].cuda()
    if kind == "bool_blocks":
        coarse = torch.randint(0, 3, (B, Hq, -(-N // 16), -(-M // 32)), generator=gen)
        full = coarse.repeat_interleave(16, 2)[:, :, :N].repeat_interleave(32, 3)[..., :M]
        rand = torch.rand(B, Hq, N, M, generator=gen) < 0.5
        return torch.where(full == 0, True, torch.where(full == 1, False, rand)).cuda()
    if kind == "float_causal":
        low = torch.finfo(dtype).min
        return torch.full((N, M), low, dtype=dtype).triu(1)[None, None].expand(B, 1, N, M).cuda()
    m = torch.randn(1, 1, N, M, generator=gen) * 2
    m[torch.rand(1, 1, N, M, generator=gen) < 0.1] = float("-inf")
    blocks = (torch.rand(1, 1, -(-N // 16), -(-M // 128), generator=gen) < 0.3)
    m[blocks.repeat_interleave(16, 2)[:, :, :N].repeat_interleave(128, 3)[..., :M]] = float("-inf")
    m[..., 3:8, :] = torch.finfo(torch.float32).min
    m[..., 10:13, :] = float("-inf")
    return m.cuda()


def _portable_forward(q, k, v, mask, **kw):
    from flashfuse.kernels import forward

    return forward.attention_forward(q, k, v, mask, None, dropout_p=0.0, scale=0.125, **_kernel_band(kw))


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["persistent", "three_programs"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("band", ["none", "causal", "two_sided_bottom_right"])
@pytest.mark.parametrize("B,Hq,Hkv,N,M", [(2, 4, 2, 1000, 1000), (3, 2, 2, 300, 777), (1, 2, 1, 129, 4097)])
def test_masked_forward_against_reference(monkeypatch, grid, D, kind, band, B, Hq, Hkv, N, M):
    """The forward reading a mask through its key table: the output against
    the float64 reference (rows that see no key 0), the lse against the
    portable kernel's (the same conventions: +inf for rows that see no key,
    the marker holding the key count for rows a finite value hides)."""
    _require_hopper()
    poison_empty(monkeypatch)
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(D * 7919 + N * 31 + M)
    q, k, v = _inputs(B, Hq, Hkv, N, M, D, dtype, "nan_padded", gen)
    mask = _mask(kind, B, Hq, N, M, dtype, seed=N + M + D)
    kw = BANDS[band]
    p = _problem(q, k, v, mask, **kw)
    why = hopper.hopper_refusal(p, q, k, v, dropout_p=0.0, softcap=None, sinks=None)
    assert why is None or "visible keys" in why, why
    out, lse = hopper.hopper_forward(p, q, k, v, _grid(monkeypatch, grid))
    want = ref.reference_attention(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), scale=0.125, **kw)
    p_out, p_lse = _portable_forward(q, k, v, mask, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    seen = torch.isfinite(p_lse.cpu())
    assert _rel(out.cpu()[seen], want[seen]) < REL_TOL[dtype]
    assert (out.cpu()[~seen] == 0).all()  # rows that see no key are 0
    assert torch.equal(torch.isinf(lse), torch.isinf(p_lse))
    marked, count = ref.lse_marked_keys(lse.cpu())
    p_marked, p_count = ref.lse_marked_keys(p_lse.cpu())
    assert torch.equal(marked, p_marked) and torch.equal(count[marked], p_count[marked])
    if kind == "float_hidden_rows":
        assert marked.any()
    elif kind.startswith("bool"):
        assert not marked.any()  # (a float causal mask against a shifted band may hide rows entirely)
    fin = seen & ~marked
    torch.testing.assert_close(lse.cpu()[fin], p_lse.cpu()[fin], atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bool_padding", "float_causal"])
def test_masked_forward_through_the_op(monkeypatch, kind):
    """``flashfuse.attention`` with a mask takes the Hopper forward (eager,
    with a block mask's tables, and compiled), all with the same bits, and
    its gradients (the portable backward, from the Hopper forward's lse)
    match the float64 reference."""
    _require_hopper()
    calls = []
    real = hopper.hopper_forward
    monkeypatch.setattr(hopper, "hopper_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(5)
    B, Hq, Hkv, N, D = 2, 8, 2, 1536, 128
    q, k, v = _inputs(B, Hq, Hkv, N, N, D, torch.bfloat16, "bnhd", gen)
    mask = _mask(kind, B, Hq, N, N, torch.bfloat16, seed=3)
    assert flashfuse.ops.forward_kernel(q, k, v, attn_mask=mask, enable_gqa=True) == "hopper"

    def f(q, k, v, m):
        return flashfuse.attention(q, k, v, attn_mask=m, enable_gqa=True)

    outs = []
    for fn, m in ((f, mask), (f, flashfuse.block_mask(mask, N, N, find_band=False)), (torch.compile(f, fullgraph=True), mask)):
        calls.clear()
        with torch.no_grad():
            outs.append(fn(q, k, v, m))
        assert calls, "the Hopper forward did not run"
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = f(*leaves, mask)
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    out.backward(dout)
    _assert_float64_close(out, [t.grad for t in leaves], q, k, v, dout, mask, scale=D ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["tiles", "persistent"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("band", ["none", "causal", "two_sided_bottom_right"])
@pytest.mark.parametrize("B,Hq,Hkv,N,M", [(2, 4, 4, 1000, 1000), (3, 4, 1, 300, 777), (1, 2, 2, 1100, 4097)])
def test_masked_backward_against_reference(monkeypatch, grid, D, kind, band, B, Hq, Hkv, N, M):
    """The op's gradients with a mask tensor on the Hopper kernels (the
    forward and the fused backward reading the mask's tables) against the
    float64 reference: rows that see no key give zero gradients, rows a
    finite value hides entirely average their keys. A mask that differs
    between the query heads of one key/value head takes the portable
    backward, which must agree as well."""
    _require_hopper()
    poison_empty(monkeypatch)
    persistent = _grid(monkeypatch, grid)
    # Every kernel variant, whatever the rule's crossovers (speed, not results).
    monkeypatch.setattr(hopper, "BWD_MASK_MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(hopper, "BWD_FLOAT_MASK_DIMS", (64, 128))
    calls = []
    real = hopper.hopper_backward_fused

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **dict(kw, persistent=persistent))

    monkeypatch.setattr(hopper, "hopper_backward_fused", counted)
    gen = torch.Generator(device="cuda").manual_seed(D * 131 + N + M)
    q, k, v = _inputs(B, Hq, Hkv, N, M, D, torch.bfloat16, "contiguous", gen)
    mask = _mask(kind, B, Hq, N, M, torch.bfloat16, seed=N * 3 + M + D)
    kw = BANDS[band]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashfuse.attention(*leaves, attn_mask=mask, scale=0.125, enable_gqa=True, **_op_band(kw))
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    out.backward(dout)
    named = flashfuse.ops.backward_kernel(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True, **_op_band(kw))
    assert bool(calls) == (named == "hopper"), named
    if mask.shape[1] > 1 and Hq != Hkv:
        assert "query heads" in named
    elif band == "none" and N >= 1000:
        assert named == "hopper"  # so that every mask kind runs on the Hopper backward somewhere
    _assert_float64_close(out, [t.grad for t in leaves], q, k, v, dout, mask, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("band", ["none", "causal", "two_sided_bottom_right"])
def test_masked_tiles_in_the_loop_shape_not_taken_by_default(monkeypatch, direction, D, kind, band):
    """A masked tile's blocks in the loop shape the defaults do not take at
    this head dim (``hopper.FWD_MASK_SPLIT_RUNS`` / ``BWD_MASK_SPLIT_RUNS``
    flipped): one loop whose blocks branch on whether they read the mask,
    or three with the middle one free of mask code. Checked as the default
    shape is, so that either setting stays correct."""
    if direction == "forward":
        monkeypatch.setattr(hopper, "FWD_MASK_SPLIT_RUNS", not hopper.FWD_MASK_SPLIT_RUNS)
        test_masked_forward_against_reference(monkeypatch, "three_programs", D, kind, band, 2, 4, 2, 1000, 1000)
        test_masked_forward_against_reference(monkeypatch, "persistent", D, kind, band, 1, 2, 1, 129, 4097)
    else:
        monkeypatch.setattr(hopper, "BWD_MASK_SPLIT_RUNS", {**hopper.BWD_MASK_SPLIT_RUNS,
                                                            D: not hopper.BWD_MASK_SPLIT_RUNS[D]})
        test_masked_backward_against_reference(monkeypatch, "persistent", D, kind, band, 2, 4, 4, 1000, 1000)
        test_masked_backward_against_reference(monkeypatch, "tiles", D, kind, band, 1, 2, 2, 1100, 4097)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,D", [("bool_padding", 128), ("float_causal", 64), ("bool_blocks", 64)])
@pytest.mark.parametrize("how", ["compiled_op", "backend_rewrite"])
def test_masked_backward_in_a_compiled_graph(monkeypatch, kind, D, how):
    """Inside a compiled graph a masked backward runs on the fused Hopper
    kernel through ``flashfuse::_hopper_backward`` (its mask and both
    tables): the op compiled whole, and an eager spelling (scores, mask,
    softmax, ·v) that the backend rewrites. The compiled gradients match
    the eager op's (dQ is summed in a different order, so not bit for bit)
    and the float64 reference."""
    _require_hopper()
    calls = []
    real = hopper.hopper_backward
    monkeypatch.setattr(hopper, "hopper_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(D + len(kind))
    B, Hq, Hkv, N = 2, 4, 4, 2304  # past BWD_MASK_MIN_KEYS at both head dims
    q, k, v = _inputs(B, Hq, Hkv, N, N, D, torch.bfloat16, "contiguous", gen)
    mask = _mask(kind, B, Hq, N, N, torch.bfloat16, seed=N + D)
    if kind == "bool_padding":  # every row sees some keys, so the rule's visible-key count stays high
        mask = mask.clone()
        mask[..., : N - 100] = True
    scale = D ** -0.5

    def op(q, k, v, m):
        return flashfuse.attention(q, k, v, attn_mask=m, scale=scale)

    def spelled(q, k, v, m):
        s = (q @ k.transpose(-2, -1)) * scale
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    assert flashfuse.ops.backward_kernel(q, k, v, attn_mask=mask, scale=scale) == "hopper"
    torch._dynamo.reset()
    compiled = (torch.compile(op, fullgraph=True) if how == "compiled_op"
                else torch.compile(spelled, backend=flashfuse.backend))
    dout = torch.randn(B, Hq, N, D, generator=gen, device="cuda").to(torch.bfloat16)
    results = []
    for fn in (op, compiled):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        calls.clear()
        out = fn(*leaves, mask)
        out.backward(dout)
        assert calls, f"the Hopper backward did not run ({'eager' if fn is op else how})"
        results.append((out.detach(), *(t.grad for t in leaves)))
    (eo, *eg), (co, *cg) = results
    _assert_float64_close(co, cg, q, k, v, dout, mask, scale=scale)
    for e, c in zip(eg, cg):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,D", [("bool_padding", 128), ("float_causal", 64), ("bool_blocks", 64),
                                    ("float_hidden_rows", 64)])
def test_mask_loads_agree(monkeypatch, kind, D):
    """The fused backward's two ways of loading a mask tile
    (``hopper.BWD_MASK_LOADS``) read the same values: dK and dV bit for bit
    (each written by one program), dQ to rounding (its adds land in any
    order), odd sizes so that tiles hang over both edges."""
    _require_hopper()
    poison_empty(monkeypatch)
    monkeypatch.setattr(hopper, "BWD_MASK_MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(hopper, "BWD_FLOAT_MASK_DIMS", (64, 128))
    B, Hq, Hkv, N, M = 2, 4, 2, 777, 1001
    gen = torch.Generator(device="cuda").manual_seed(D + N)
    q, k, v = _inputs(B, Hq, Hkv, N, M, D, torch.bfloat16, "contiguous", gen)
    # One mask for every head: the fused backward takes no mask that differs
    # between the query heads of a key/value head.
    mask = _mask(kind, B, 1, N, M, torch.bfloat16, seed=M)
    dout = torch.randn(B, Hq, N, D, generator=gen, device="cuda").to(torch.bfloat16)
    grads = {}
    for how in ("coalesced", "direct"):
        monkeypatch.setattr(hopper, "BWD_MASK_LOADS", {64: how, 128: how})
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashfuse.attention(*leaves, attn_mask=mask, scale=0.125, enable_gqa=True)
        out.backward(dout)
        grads[how] = [t.grad for t in leaves]
    assert flashfuse.ops.backward_kernel(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True) == "hopper"
    (cq, ck, cv), (dq, dk, dv) = grads["coalesced"], grads["direct"]
    assert torch.equal(ck, dk) and torch.equal(cv, dv)
    torch.testing.assert_close(cq, dq, atol=1e-2, rtol=1e-2)


def test_hopper_forward_op_fake_layout_with_a_mask():
    """The opaque op with a mask and a block mask's key table traces."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 300, 128, dtype=torch.bfloat16)
        mask = torch.empty(2, 1, 1, 300, dtype=torch.bool)
        table = torch.empty(2, 1, 19, 5, dtype=torch.int32)
        out, lse = torch.ops.flashfuse._hopper_forward(q, q, q, 0.1, None, None, False, mask, table)
    assert out.shape == (2, 8, 300, 128) and lse.shape == (2, 8, 300)


def test_mean_visible_keys_and_crossover_rule():
    # No band: every key; causal top-left at N = M: about half; bottom-right
    # with more keys than queries: the extra keys too; a window: its width.
    assert hopper.mean_visible_keys(1024, 1024, 0, 0, 0, False, False) == 1024
    assert abs(hopper.mean_visible_keys(1024, 1024, 0, 0, 0, False, True) - 512) < 20
    assert abs(hopper.mean_visible_keys(100, 4100, 4000, 0, 0, False, True) - 4050) < 5
    assert hopper.mean_visible_keys(4096, 4096, 0, 100, 0, True, True) <= 101


def test_crossover_refusals(monkeypatch):
    q, k, v = (torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    full = _as_hopper_call(monkeypatch, _problem(q, k, v))
    short = q[:, :, :hopper.MIN_KEYS[128]]
    causal = _as_hopper_call(monkeypatch, _problem(short, short, short, window_right=0))
    assert hopper.hopper_refusal(full, q, k, v, dropout_p=0.0, softcap=None, sinks=None) is None
    why = hopper.hopper_refusal(causal, short, short, short, dropout_p=0.0, softcap=None, sinks=None)
    assert f"fewer than {hopper.MIN_KEYS[128]} at D = 128" in why
    q64 = torch.randn(1, 2, hopper.MIN_KEYS[64], 64, dtype=torch.bfloat16)
    p64 = _as_hopper_call(monkeypatch, _problem(q64, q64, q64, window_right=0))
    assert f"fewer than {hopper.MIN_KEYS[64]} at D = 64" in hopper.hopper_refusal(p64, q64, q64, q64, dropout_p=0.0,
                                                                                softcap=None, sinks=None)
    p64 = _as_hopper_call(monkeypatch, _problem(q64, q64, q64))
    assert hopper.hopper_refusal(p64, q64, q64, q64, dropout_p=0.0, softcap=None, sinks=None) is None


def test_hopper_forward_op_fake_layout():
    """The opaque op a traced graph records gives the launcher's layouts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 300, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 500, 128, dtype=torch.bfloat16)
        out, lse = torch.ops.flashfuse._hopper_forward(q, k, k, 0.1, None, 0, True)
    assert out.shape == (2, 8, 300, 128) and out.stride() == (300 * 8 * 128, 128, 8 * 128, 1)
    assert lse.shape == (2, 8, 300) and lse.dtype == torch.float32


@pytest.mark.gpu
def test_compiled_graph_takes_the_hopper_kernel(monkeypatch):
    """Inside torch.compile the forward and backward run on the Hopper
    kernels (through flashfuse::_hopper_forward and _hopper_backward), the
    forward with the same bits as the eager call."""
    _require_hopper()
    calls = []
    real = hopper.hopper_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hopper, "hopper_forward", counted)
    bwd_calls = []
    real_bwd = hopper.hopper_backward
    monkeypatch.setattr(hopper, "hopper_backward", lambda *a: bwd_calls.append(1) or real_bwd(*a))
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = _inputs(2, 8, 2, 2048, 2048, 128, torch.bfloat16, "bnhd", gen)
    dout = torch.randn(2, 8, 2048, 128, generator=gen, device="cuda").to(torch.bfloat16)

    def f(q, k, v):
        return flashfuse.attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        calls.clear()
        bwd_calls.clear()
        out = fn(*leaves)
        out.backward(dout)
        assert calls, "the Hopper kernel did not run"
        assert bwd_calls, "the Hopper backward did not run"
        results.append((out.detach(), *(t.grad for t in leaves)))
    (eo, *eg), (co, *cg) = results
    assert torch.equal(eo, co)
    for a, b in zip(eg, cg):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_forward_kernel_names_the_path():
    from flashfuse import kernels

    q, k, v = (torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    name = kernels.forward_kernel(q, k, v, None, None, 0.0, 0.125, None, None, False)
    assert name.startswith("portable: not a CUDA tensor")
    assert flashfuse.ops.forward_kernel(q, k, v) is None  # not on CUDA: no kernel to name


def test_dispatch_routes_through_the_one_rule(monkeypatch):
    """``kernels.attention_forward`` takes the kernel ``_route`` names: on fake
    CUDA tensors (a trace) that the Hopper kernel suits, the opaque
    ``flashfuse::_hopper_forward``; on real tensors the rule admits, the
    Hopper launcher itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashfuse import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the suite's setting: a CUDA tensor would interpret
    monkeypatch.setattr(hopper, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(hopper, "gluon_available", lambda: True)
    band = dict(dropout_p=0.0, scale=0.125, window_left=None, window_right=0, bottom_right=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(1, 4, 2048, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        assert kernels._route(q, k, v, None, band)[0] == "hopper-op"
        assert kernels.forward_kernel(q, k, v, None, None, **band) == "hopper"
        out, lse = kernels.attention_forward(q, k, v, None, None, **band)
        assert out.stride() == (2048 * 4 * 128, 128, 4 * 128, 1) and lse.shape == (1, 4, 2048)
    calls = []
    monkeypatch.setattr(kernels, "_route", lambda *a: kernels.Route("hopper", "problem", None))
    monkeypatch.setattr(hopper, "hopper_forward", lambda p, q, k, v, key_table=None: calls.append(p) or ("out", "lse"))
    cq = torch.randn(1, 2, 8, 64)
    assert kernels.attention_forward(cq, cq, cq, None, None, **band) == ("out", "lse") and calls == ["problem"]


# ---------------------------------------------------------------------------
# The backward kernels: the rule (CPU), numerics (GPU)
# ---------------------------------------------------------------------------

def _bwd_problem(q, k, v, mask=None, **band):
    return _problem(q, k, v, mask, backward=True, **band)


def test_backward_refusal_reasons(monkeypatch):
    q, k, v = (torch.randn(1, 2, 1024, 128, dtype=torch.bfloat16) for _ in range(3))
    go = torch.randn_like(q)
    p = _bwd_problem(q, k, v)
    rule = dict(dropout_p=0.0, softcap=None)
    assert "CUDA" in hopper.backward_refusal(p, go, q, k, v, **rule)
    hp = _as_hopper_call(monkeypatch, p)
    assert hopper.backward_refusal(hp, go, q, k, v, **rule) is None
    assert hopper.backward_refusal(hp, go, q, k, v, dropout_p=0.1, softcap=None) == "dropout"
    assert "soft-cap" in hopper.backward_refusal(hp, go, q, k, v, dropout_p=0.0, softcap=20.0)
    assert hopper.backward_refusal(hp, go, q, k, v, **rule, mask_grad=True) == "a mask gradient"
    assert "grad_out dtype" in hopper.backward_refusal(hp, go.half(), q, k, v, **rule)
    # ``out.sum().backward()`` hands the backward an expanded dO (strides 0).
    ones = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16).expand_as(q)
    assert "copy engine" in hopper.backward_refusal(hp, ones, q, k, v, **rule)
    # Masks: read through their query table, unless they differ between the
    # query heads of a key/value head, or deterministic algorithms are asked.
    mask = torch.ones(1024, 1024, dtype=torch.bool)
    pm = _as_hopper_call(monkeypatch, _bwd_problem(q, k, v, mask))
    assert f"reads masks from {hopper.BWD_MASK_MIN_KEYS[128]}" in hopper.backward_refusal(pm, go, q, k, v, **rule)
    pf = _as_hopper_call(monkeypatch, _bwd_problem(q, k, v, mask.float()))
    assert "a float mask at D = 128" in hopper.backward_refusal(pf, go, q, k, v, **rule)
    monkeypatch.setattr(hopper, "BWD_MASK_MIN_KEYS", {64: 0, 128: 0})
    assert hopper.backward_refusal(pm, go, q, k, v, **rule) is None
    assert hopper.backward_refusal(pm, go, q, k, v, **rule, mask_grad=True) == "a mask gradient"
    with _deterministic():
        assert "deterministic" in hopper.backward_refusal(pm, go, q, k, v, **rule)
    kv = k[:, :1]
    per_head = _as_hopper_call(monkeypatch, _bwd_problem(q, kv, kv, torch.ones(1, 2, 1024, 1024, dtype=torch.bool)))
    assert "query heads" in hopper.backward_refusal(per_head, go, q, kv, kv, **rule)
    shared = _as_hopper_call(monkeypatch, _bwd_problem(q, kv, kv, torch.ones(1, 1, 1024, 1024, dtype=torch.bool)))
    assert hopper.backward_refusal(shared, go, q, kv, kv, **rule) is None
    filled = _as_hopper_call(monkeypatch, _bwd_problem(q, k, v, mask, mask_fill=-1e4))
    assert hopper.backward_refusal(filled, go, q, k, v, **rule) == "a bool mask with a mask_fill"
    monkeypatch.setenv("FLASHFUSE_HOPPER", "0")
    assert hopper.backward_refusal(hp, go, q, k, v, **rule) == "FLASHFUSE_HOPPER=0"
    monkeypatch.delenv("FLASHFUSE_HOPPER")
    # The backward's own crossover: short rows stay on the portable kernels.
    qs = q[:, :, :256].contiguous()
    ps = _as_hopper_call(monkeypatch, _bwd_problem(qs, qs, qs, window_right=0))
    why = hopper.backward_refusal(ps, qs, qs, qs, qs, **rule)
    assert f"fewer than {hopper.BWD_MIN_KEYS[128]} at D = 128" in why


def test_backward_dispatch_routes_through_the_one_rule(monkeypatch):
    """``kernels.attention_backward`` takes the kernels ``_backward_route``
    names: on fake CUDA tensors (a trace) that the Hopper kernels suit, the
    opaque ``flashfuse::_hopper_backward`` (gradients laid out as
    ``empty_like`` their inputs); on real tensors the rule admits, the
    Hopper launcher with the portable preprocess kernel's delta."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashfuse import kernels
    # Imported before TRITON_INTERPRET is unset: Triton reads it when a
    # kernel is defined, and a kernel module first imported without it would
    # stay built for the GPU in this process (later CPU tests then fail).
    from flashfuse.kernels import backward

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(hopper, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(hopper, "gluon_available", lambda: True)
    band = dict(dropout_p=0.0, scale=0.125, window_left=None, window_right=0, bottom_right=False, mask_grad=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 2048, 4, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        k = torch.empty(1, 1, 2048, 128, dtype=torch.bfloat16, device="cuda")
        go = torch.empty(1, 4, 2048, 128, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(1, 4, 2048, dtype=torch.float32, device="cuda")
        assert kernels._backward_route(go, q, k, k, None, band)[0] == "hopper-op"
        assert kernels.backward_kernel(go, q, k, k, None, None, go, lse, **band) == "hopper"
        dq, dk, dv, dmask = kernels.attention_backward(go, q, k, k, None, None, go, lse, **band)
        assert dq.stride() == q.stride() and dk.shape == k.shape and dmask is None
        dropout = dict(band, dropout_p=0.1)
        assert kernels.backward_kernel(go, q, k, k, None, None, go, lse, **dropout) == "portable: dropout"
    calls = []
    monkeypatch.setattr(kernels, "_backward_route", lambda *a: ("hopper", "problem", None))
    monkeypatch.setattr(backward, "row_delta", lambda p, out, go, lse, grad_lse: ("delta", None))
    monkeypatch.setattr(hopper, "hopper_backward",
                        lambda p, go, q, k, v, lse, delta, kt, qt: calls.append((p, delta)) or ("dq", "dk", "dv"))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    cq = torch.randn(1, 2, 8, 64)
    got = kernels.attention_backward(cq, cq, cq, cq, None, None, cq, cq[..., 0], **band)
    assert got == ("dq", "dk", "dv", None) and calls == [("problem", "delta")]


def test_masked_calls_route_through_the_rule(monkeypatch):
    """With a mask: a traced call the Hopper kernels suit records the opaque
    ops with the mask and a block mask's tables (their schemas take them;
    the backward's too, unless TRACED_MASKED_BACKWARD is off);
    the backward's crossover for masks sends short rows to the portable
    kernels; eager calls hand the block mask's tables to the launchers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashfuse import kernels
    from flashfuse.kernels import backward  # before TRITON_INTERPRET is unset (see above)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(hopper, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(hopper, "gluon_available", lambda: True)
    band = dict(dropout_p=0.0, scale=0.125, window_left=None, window_right=None, bottom_right=False)
    # D = 128: its masked crossover lies above the unmasked one (at D = 64
    # they are one, so no row is refused for the mask alone).
    long, short = hopper.BWD_MASK_MIN_KEYS[128], hopper.BWD_MASK_MIN_KEYS[128] // 2
    assert short >= hopper.BWD_MIN_KEYS[128]
    with FakeTensorMode(allow_non_fake_inputs=True):
        for N, takes in ((long, True), (short, False)):
            q = torch.empty(1, 4, N, 128, dtype=torch.bfloat16, device="cuda")
            mask = torch.empty(1, 1, 1, N, dtype=torch.bool, device="cuda")
            kt = torch.empty(1, 1, N // 16, 5, dtype=torch.int32, device="cuda")
            qt = torch.empty(1, 1, N // 32, 4, dtype=torch.int32, device="cuda")
            assert kernels._route(q, q, q, mask, band)[0] == "hopper-op"
            out, lse = kernels.attention_forward(q, q, q, mask, None, **band, key_table=kt)
            assert out.shape == q.shape and lse.shape == (1, 4, N)
            bwd = dict(band, mask_grad=False, key_table=kt, query_table=qt)
            route, _, why = kernels._backward_route(q, q, q, q, mask, bwd)
            assert route == ("hopper-op" if takes else "portable"), why
            if takes:  # the opaque op's schema takes the mask and both tables
                dq, dk, dv, _ = kernels.attention_backward(q, q, q, q, mask, None, out, lse, **bwd)
                assert dq.shape == dk.shape == dv.shape == q.shape
            else:
                assert f"reads masks from {long}" in why
            # Turned off, a traced masked backward keeps the portable kernels.
            monkeypatch.setattr(hopper, "TRACED_MASKED_BACKWARD", False)
            route, _, why = kernels._backward_route(q, q, q, q, mask, bwd)
            assert route == "portable" and "traced graph" in why, why
            monkeypatch.setattr(hopper, "TRACED_MASKED_BACKWARD", True)
            fmask = torch.empty(1, 1, N, N, dtype=torch.bfloat16, device="cuda")
            assert kernels._route(q, q, q, fmask, band)[0] == "hopper-op"
    got = []
    monkeypatch.setattr(kernels, "_route", lambda *a: kernels.Route("hopper", "problem", None))
    monkeypatch.setattr(hopper, "hopper_forward", lambda p, q, k, v, key_table=None: got.append(key_table) or (1, 2))
    cq = torch.randn(1, 2, 8, 64)
    assert kernels.attention_forward(cq, cq, cq, cq[..., :1, :], None, **band, key_table="the table") == (1, 2)
    assert got == ["the table"]


def test_hopper_backward_op_fake_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 300, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(2, 2, 500, 128, dtype=torch.bfloat16)
        go = torch.empty(2, 8, 300, 128, dtype=torch.bfloat16)
        lse = torch.empty(2, 8, 300)
        dq, dk, dv = torch.ops.flashfuse._hopper_backward(go, q, k, k, go, lse, 0.1, None, 0, True, None)
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.shape == k.shape


def test_backward_kernel_names_nothing_off_cuda():
    q = torch.randn(1, 2, 64, 64)
    assert flashfuse.ops.backward_kernel(q, q, q) is None


@contextlib.contextmanager
def _deterministic():
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def test_backward_path_rule(monkeypatch):
    """The default schedule unless deterministic algorithms are on (then
    the two kernels); FLASHFUSE_HOPPER_DQ names one, and a bad name raises."""
    monkeypatch.delenv("FLASHFUSE_HOPPER_DQ", raising=False)
    assert hopper.backward_path() == hopper.BWD_FUSED_DQ in hopper.BWD_DQ_CHOICES
    for how in hopper.BWD_DQ_CHOICES:
        monkeypatch.setenv("FLASHFUSE_HOPPER_DQ", how)
        assert hopper.backward_path() == how
        with _deterministic():
            assert hopper.backward_path() == "separate"
    monkeypatch.setenv("FLASHFUSE_HOPPER_DQ", "fast")
    with pytest.raises(ValueError, match="FLASHFUSE_HOPPER_DQ"):
        hopper.backward_path()


class _Launch:
    """A kernel's ``kernel[grid](*args, **meta)``, recorded, not run;
    ``effect(args)`` stands in for what the kernel writes."""

    def __init__(self, calls, name, effect=None):
        self.calls, self.name, self.effect = calls, name, effect

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.calls.append((self.name, grid, meta))
            if self.effect is not None:
                self.effect(args)
        return launch


@pytest.mark.parametrize("how", ["atomic", "tma"])
def test_fused_backward_launches(monkeypatch, how):
    """On CPU tensors, with the Gluon launches recorded: the fused kernel
    (the dK/dV kernel's grid, the dQ mode and its staging tiles) then the
    convert kernel, run in the interpreter (dq = scale * the float32 sum,
    in q's layout); under deterministic algorithms the two kernels and no
    float32 buffer."""
    from flashfuse.kernels import hopper_gluon

    monkeypatch.setenv("FLASHFUSE_HOPPER_DQ", how)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    calls = []

    def fused_effect(args):
        dk, dv, dq_acc = args[4], args[5], args[6]
        assert dq_acc.dtype == torch.float32 and dq_acc.shape == (1, 4, 300, 64) and (dq_acc == 0).all()
        dq_acc.copy_(torch.arange(dq_acc.numel(), dtype=torch.float32).reshape(dq_acc.shape) / 1024)
        dk.zero_()
        dv.zero_()

    monkeypatch.setattr(hopper_gluon, "_hopper_attn_bwd_fused", _Launch(calls, "fused", fused_effect))
    monkeypatch.setattr(hopper_gluon, "_hopper_attn_bwd_dkdv", _Launch(calls, "dkdv"))
    monkeypatch.setattr(hopper_gluon, "_hopper_attn_bwd_dq", _Launch(calls, "dq"))
    q = torch.randn(1, 300, 4, 64, dtype=torch.bfloat16).transpose(1, 2)  # (B, N, H, D) as projections leave it
    k = torch.randn(1, 2, 500, 64, dtype=torch.bfloat16)
    go = torch.randn(1, 4, 300, 64, dtype=torch.bfloat16)
    lse = torch.randn(1, 4, 300)
    p = _bwd_problem(q, k, k, window_right=0)
    dq, dk, dv = hopper.hopper_backward(p, go, q, k, k, lse, lse)
    assert [c[0] for c in calls] == ["fused"]
    name, grid, meta = calls[0]
    assert grid == (8, ) and meta["DQ_TMA"] is (how == "tma") and meta["HEAD_DIM"] == 64  # 4 key tiles x 2 heads
    tile = hopper.BWD_FUSED_TILES[64]  # causal 300 x 500: short rows
    assert hopper.fused_tile(p) == tile
    assert meta["DQ_BUFFERS"] == (tile.dq_buffers if how == "tma" else 1)
    assert meta["STAGES"] == tile.stages and meta["BLOCK_M"] == tile.block_m
    assert meta["COALESCED_MASK"] is (hopper.BWD_MASK_LOADS[64] == "coalesced")
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    want = torch.arange(4 * 300 * 64, dtype=torch.float32).reshape(1, 4, 300, 64) / 1024 * p.scale
    # one bfloat16 step: the interpreter may round differently from the GPU's nearest-even
    torch.testing.assert_close(dq.float(), want.bfloat16().float(), atol=0, rtol=2 ** -7)
    calls.clear()
    with _deterministic():
        hopper.hopper_backward(p, go, q, k, k, lse, lse)
    assert [c[0] for c in calls] == ["dkdv", "dq"]
    assert calls[0][1] == (4, 2, 1) and calls[1][1] == (3, 4, 1)



@pytest.mark.parametrize("kind", ["none", "bool", "float"])
def test_fused_row_inputs(monkeypatch, kind):
    """The fused backward's per-row inputs from lse and delta, in the
    interpreter, against values computed here: shift lse * log2(e), +inf
    for a row that saw no key (lse +inf, or -inf as some producers write
    it), -FLT_MAX for a float mask's marked rows, whose cap is 1 / l (1
    elsewhere); delta as given; rows past N padded (shift +inf, delta 0);
    dQ's float32 accumulator, poisoned, zeroed."""
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    B, H, N, D = 2, 3, 77, 64
    q = torch.randn(B, H, N, D, dtype=torch.bfloat16)
    mask = {"none": None, "bool": torch.rand(B, 1, N, N) > 0.3,
            "float": torch.randn(B, 1, N, N, dtype=torch.bfloat16)}[kind]
    p = _bwd_problem(q, q, q, mask)
    lse = torch.randn(B, H, N) * 20
    lse[0, 0, 3], lse[1, 2, 10] = float("inf"), float("-inf")
    keys = torch.tensor([1.0, 5.0, 300.0])
    if kind == "float":
        lse[0, 1, 20:23] = -3.4028234663852886e38 + keys * 2.0 ** 104  # the marker (common.LSE_MARK_UNIT)
    delta = torch.randn(B, H, 2 * N)[:, :, ::2]  # any strides
    acc = torch.full((B, H, N, D), float("nan"))
    rows = hopper.fused_row_inputs(p, lse, delta, acc)
    R = rows.shift.shape[-1]
    assert R % hopper.BWD_ROW_PAD == 0 and R >= N and R - N < hopper.BWD_ROW_PAD
    assert all(t.stride() == rows.shift.stride() and t.shape == (B, H, R) for t in rows)
    assert (acc == 0).all()
    want = lse.double() * 1.4426950408889634
    want[0, 0, 3] = want[1, 2, 10] = float("inf")
    if kind == "float":
        want[0, 1, 20:23] = -3.4028234663852886e38
        cap = torch.ones(B, H, N)
        cap[0, 1, 20:23] = 1 / keys
        torch.testing.assert_close(rows.cap[..., :N], cap, rtol=1e-6, atol=0)
    torch.testing.assert_close(rows.shift[..., :N].double(), want, rtol=1e-6, atol=0)
    assert torch.equal(rows.delta[..., :N], delta)
    assert (rows.shift[..., N:] == float("inf")).all() and (rows.delta[..., N:] == 0).all()

def _reference_grads(q, k, v, dout, kw, lse_weight=None):
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    out = ref.reference_attention(*leaves, scale=0.125, **kw)
    loss = (out * dout.cpu().double()).sum()
    if lse_weight is not None:
        lse = ref.reference_lse(*leaves[:2], scale=0.125, **kw)
        fin = torch.isfinite(lse)
        loss = loss + (torch.where(fin, lse, 0.0) * lse_weight.cpu().double()).sum()
    loss.backward()
    return [t.grad for t in leaves]


def _hopper_grads(q, k, v, dout, kw, grad_lse=None, path=None, persistent=None):
    """The forward on whichever kernel the op takes, then the Hopper
    backward kernels called directly (short rows included): ``path``
    "separate" (the two deterministic kernels), "atomic" or "tma" (the fused
    kernel's dQ modes, on the grid ``persistent`` names, the plan's unless
    given), or None (``hopper_backward``'s own choice)."""
    from flashfuse.kernels import attention_forward, backward

    band = dict(dropout_p=0.0, scale=0.125, **_kernel_band(kw))
    out, lse = attention_forward(q, k, v, None, None, **band)
    p = _bwd_problem(q, k, v, **kw)
    delta, _ = backward.row_delta(p, out, dout, lse, grad_lse)
    if path is None:
        return hopper.hopper_backward(p, dout, q, k, v, lse, delta)
    if path == "separate":
        return hopper.hopper_backward_separate(p, dout, q, k, v, lse, delta)
    return hopper.hopper_backward_fused(p, dout, q, k, v, lse, delta, how=path, persistent=persistent)


# The backward schedules the reference test runs: (path, grid). The fused
# kernel with dQ by atomics on one program per key tile, by the copy
# engine's reduce on one program per tile and on three programs (each takes
# many key tiles of different heads and bands, in rounds of alternating
# order).
BWD_SCHEDULES = {"separate": ("separate", "tiles"), "atomic": ("atomic", "tiles"), "tma": ("tma", "tiles"),
                 "tma_three_programs": ("tma", "three_programs")}


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(BWD_SCHEDULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("B,Hq,Hkv,N,M", [(2, 4, 4, 1000, 1000), (1, 8, 2, 129, 4097), (1, 2, 2, 1, 300),
                                          (1, 4, 1, 300, 1), (2, 2, 1, 2048, 640), (1, 3, 1, 77, 200)])
def test_backward_against_reference(monkeypatch, schedule, dtype, D, band, B, Hq, Hkv, N, M):
    """Every schedule: the two deterministic kernels, and the fused kernel
    with dQ added by atomics or by the copy engine's reduce, on one program
    per key tile or a persistent grid."""
    _require_hopper()
    path, grid = BWD_SCHEDULES[schedule]
    persistent = _grid(monkeypatch, grid)
    gen = torch.Generator(device="cuda").manual_seed(D * 999983 + N * 17 + M + 5)
    q, k, v = _inputs(B, Hq, Hkv, N, M, D, dtype, "nan_padded", gen)
    dout = in_nan_padding(torch.randn(B, Hq, N, D, generator=gen, device="cuda").to(dtype))
    kw = BANDS[band]
    poison_empty(monkeypatch)
    dq, dk, dv = _hopper_grads(q, k, v, dout, kw, path=path, persistent=persistent)
    want = _reference_grads(q, k, v, dout, kw)
    for got, exp in zip((dq, dk, dv), want):
        assert not got.isnan().any()
        if exp.norm() == 0:
            # Keys no query sees, queries that see no key, and rows with one
            # visible key (p = 1, so dS = dP - delta is zero but for the
            # rounding of two fp32 sums in different orders): zero, or
            # rounding-sized where the kernel sums.
            assert got.float().abs().max().item() < 1e-3
        else:
            assert _rel(got.cpu(), exp) < 2 * REL_TOL[dtype]


def _layout_case(monkeypatch, layout, D, seed):
    """A causal grouped-heads backward in a layout models hand the op
    (q, k, v, dout, band), allocations poisoned from here on."""
    _require_hopper()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = _inputs(2, 8, 2, 3000, 3000, D, torch.bfloat16, layout, gen)
    dout = torch.randn(2, 3000, 8, D, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
    poison_empty(monkeypatch)
    return q, k, v, dout, dict(window_right=0)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "bnhd"])
def test_backward_layouts_and_repeatability(monkeypatch, layout, D):
    """Under ``torch.use_deterministic_algorithms(True)`` the backward takes
    the two kernels: the same bits on repeated runs (no atomics), in the
    layouts models hand the op, against float64."""
    q, k, v, dout, kw = _layout_case(monkeypatch, layout, D, seed=13)
    fused = []
    monkeypatch.setattr(hopper, "hopper_backward_fused", lambda *a, **k: fused.append(1))
    with _deterministic():
        runs = [_hopper_grads(q, k, v, dout, kw) for _ in range(3)]
    assert not fused
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, runs[0]))
    for got, exp in zip(runs[0], _reference_grads(q, k, v, dout, kw)):
        assert _rel(got.cpu(), exp) < 2 * REL_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("how", ["atomic", "tma"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "bnhd"])
def test_fused_backward_layouts(monkeypatch, layout, D, how, grid):
    """The fused kernel in the layouts models hand the op, on each grid:
    gradients laid out as the two kernels lay them out; dK and dV bitwise
    theirs (the same sums in the same order), dQ equal up to the order of
    its float32 adds."""
    q, k, v, dout, kw = _layout_case(monkeypatch, layout, D, seed=19)
    got = _hopper_grads(q, k, v, dout, kw, path=how, persistent=_grid(monkeypatch, grid))
    sep = _hopper_grads(q, k, v, dout, kw, path="separate")
    for a, b in zip(got, sep):
        assert a.stride() == b.stride() and not a.isnan().any()
    assert torch.equal(got[1], sep[1]) and torch.equal(got[2], sep[2])
    for g, exp in zip(got, _reference_grads(q, k, v, dout, kw)):
        assert _rel(g.cpu(), exp) < 2 * REL_TOL[torch.bfloat16]


# Both query sides the fused backward has at D = 64: 64-row q/dO blocks
# (masked calls and short rows) and 128-row ones (unmasked long rows), with
# their slots and staging tiles.
FUSED_TILES_D64 = {"q64": hopper.FusedTile(64, 3, 2), "q128": hopper.FusedTile(128, 2, 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(FUSED_TILES_D64))
@pytest.mark.parametrize("grid", ["tiles", "three_programs"])
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("B,Hq,Hkv,N,M", [(1, 8, 2, 129, 4097), (2, 2, 1, 2048, 640), (1, 3, 1, 77, 200),
                                          (1, 4, 1, 300, 1)])
def test_fused_tiles_against_reference(monkeypatch, tile, grid, band, B, Hq, Hkv, N, M):
    """Each D = 64 query side of the fused kernel (dQ by the copy engine's
    reduce) without a mask, against float64 at odd sizes with NaN in the
    inputs' padding and poisoned outputs; dK and dV bitwise the
    deterministic kernels' (64-row blocks: the same products in the same
    order, the 128-row blocks' k-steps in the same sequence)."""
    _require_hopper()
    monkeypatch.setitem(hopper.BWD_FUSED_TILES, 64, FUSED_TILES_D64[tile])
    monkeypatch.setitem(hopper.BWD_LONG_ROW_TILES, 64, FUSED_TILES_D64[tile])
    persistent = _grid(monkeypatch, grid)
    gen = torch.Generator(device="cuda").manual_seed(N * 31 + M + len(band))
    q, k, v = _inputs(B, Hq, Hkv, N, M, 64, torch.bfloat16, "nan_padded", gen)
    dout = in_nan_padding(torch.randn(B, Hq, N, 64, generator=gen, device="cuda").to(torch.bfloat16))
    kw = BANDS[band]
    poison_empty(monkeypatch)
    got = _hopper_grads(q, k, v, dout, kw, path="tma", persistent=persistent)
    sep = _hopper_grads(q, k, v, dout, kw, path="separate")
    for g, exp in zip(got, _reference_grads(q, k, v, dout, kw)):
        assert not g.isnan().any()
        if exp.norm() == 0:
            assert g.float().abs().max().item() < 1e-3
        else:
            assert _rel(g.cpu(), exp) < 2 * REL_TOL[torch.bfloat16]
    assert torch.equal(got[1], sep[1]) and torch.equal(got[2], sep[2])


def test_fused_tile_rule(monkeypatch):
    """128-row q/dO blocks at D = 64 for unmasked calls whose rows see at
    least BWD_LONG_ROW_KEYS keys on average; 64-row blocks for shorter rows,
    for calls that read a mask, and at D = 128; the launch and the grid
    plan take the chosen side."""
    long_tile, short_tile = hopper.BWD_LONG_ROW_TILES[64], hopper.BWD_FUSED_TILES[64]
    assert long_tile.block_m == 128 and short_tile.block_m == 64 and 128 not in hopper.BWD_LONG_ROW_TILES
    x = torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16)
    assert hopper.fused_tile(_bwd_problem(x, x, x)) == long_tile  # 1024 keys a row
    assert hopper.fused_tile(_bwd_problem(x, x, x, window_right=0)) == short_tile  # 512 on average
    x2k = torch.randn(1, 2, 2048, 64, dtype=torch.bfloat16)
    causal_2k = _bwd_problem(x2k, x2k, x2k, window_right=0)
    assert hopper.fused_tile(causal_2k) == long_tile
    assert hopper.fused_tile(_bwd_problem(x2k, x2k, x2k, torch.ones(2048, 2048, dtype=torch.bool))) == short_tile
    x128 = torch.randn(1, 2, 4096, 128, dtype=torch.bfloat16)
    assert hopper.fused_tile(_bwd_problem(x128, x128, x128)) == hopper.BWD_FUSED_TILES[128]
    go, lse = torch.randn_like(x2k), torch.randn(1, 2, 2048)
    rows = hopper.fused_row_buffers(causal_2k, x2k.device)
    acc = torch.empty(1, 2, 2048, 64)
    meta = hopper.fused_kernel_args(causal_2k, go, x2k, x2k, x2k, rows, acc, x2k, x2k, "tma")[1]
    assert (meta["BLOCK_M"], meta["STAGES"], meta["DQ_BUFFERS"]) == tuple(long_tile)
    planned = []
    monkeypatch.setattr(hopper, "_backward_grid_plan", lambda *a: planned.append(a[-1]) or (1, False))
    hopper._backward_plan(causal_2k)
    hopper._backward_plan(_bwd_problem(x, x, x, window_right=0))
    assert planned == [long_tile.block_m, short_tile.block_m]  # the plan counts the launch's blocks


def test_fused_tiles_fit_shared_memory():
    """Every query side in the tile tables fits a Hopper block's 227 KiB of
    shared memory at its head dim, counted as the kernel allocates it: q and
    dO slots, the K and V tile, dSᵀ of both consumers twice, the dQ staging
    tiles, and the per-row inputs (shift, delta and cap, two buffers per
    consumer), plus the barriers."""
    for tables in (hopper.BWD_FUSED_TILES, hopper.BWD_LONG_ROW_TILES):
        for D, t in tables.items():
            ring = 2 * t.stages * t.block_m * D * 2
            kv = 2 * hopper.BWD_BLOCK_N * D * 2
            ds = 4 * (hopper.BWD_BLOCK_N // 2) * t.block_m * 2
            dq = 2 * t.dq_buffers * t.block_m * (D // 2) * 4
            stats = 4 * 4 * t.block_m * 4
            assert ring + kv + ds + dq + stats + 1024 <= 227 * 1024, (D, t)


@pytest.mark.gpu
def test_backward_with_an_lse_gradient():
    """``attention_with_lse``: the gradient of lse folds into delta."""
    _require_hopper()
    gen = torch.Generator(device="cuda").manual_seed(17)
    q, k, v = _inputs(1, 4, 2, 1500, 1500, 128, torch.bfloat16, "contiguous", gen)
    dout = torch.randn(q.shape, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(1, 4, 1500, generator=gen, device="cuda")
    kw = dict(window_right=0)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    assert flashfuse.ops.backward_kernel(*leaves, scale=0.125, is_causal=True, enable_gqa=True) == "hopper"
    out, lse = flashfuse.attention_with_lse(*leaves, scale=0.125, is_causal=True, enable_gqa=True)
    ((out.float() * dout.float()).sum() + (lse * w).sum()).backward()
    for got, exp in zip(leaves, _reference_grads(q, k, v, dout, kw, lse_weight=w)):
        assert _rel(got.grad.cpu(), exp) < 2e-2


# ---------------------------------------------------------------------------
# The forward's exponentials on the FMA units (CPU: the PTX text evaluated)
# ---------------------------------------------------------------------------

def _run_ptx(asm: str, inputs):
    """Evaluate ``hopper_gluon._exp2_asm``'s PTX on float32 ``inputs`` (one
    pack, numpy): each instruction it uses with its float32 / uint32
    semantics (``fma`` through float64, whose product is exact, then one
    rounding to float32 after the add: at most one ulp from a fused one).
    ``ex2.approx`` as the exact 2^x rounded to float32, denormals flushed."""
    import numpy as np

    regs = {f"${len(inputs) + i}": np.float32(x).view(np.uint32) for i, x in enumerate(inputs)}

    def val(tok):
        if tok.startswith("0f"):
            return np.uint32(int(tok[2:], 16))
        if tok[0].isdigit():
            return np.uint32(int(tok))
        return regs[tok]

    f32 = lambda bits: np.uint32(bits).view(np.float32)  # noqa: E731
    bits = lambda x: np.float32(x).view(np.uint32)  # noqa: E731
    with np.errstate(all="ignore"):
        for line in asm.splitlines():
            line = line.strip().rstrip(";")
            if not line or line in "{}" or line.startswith(".reg"):
                continue
            op, rest = line.split(None, 1)
            dst, *src = [t.strip() for t in rest.split(",")]
            a = [val(t) for t in src]
            if op == "ex2.approx.ftz.f32":
                y = np.float32(2.0 ** np.float64(f32(a[0])))
                regs[dst] = bits(0.0 if abs(y) < np.finfo(np.float32).tiny else y)
            elif op == "max.NaN.f32":
                x, y = f32(a[0]), f32(a[1])
                regs[dst] = bits(np.nan if np.isnan(x) or np.isnan(y) else max(x, y))
            elif op == "add.rn.f32":
                regs[dst] = bits(f32(a[0]) + f32(a[1]))
            elif op == "sub.rn.f32":
                regs[dst] = bits(f32(a[0]) - f32(a[1]))
            elif op == "mul.rn.f32":
                regs[dst] = bits(f32(a[0]) * f32(a[1]))
            elif op == "fma.rn.f32":
                regs[dst] = bits(np.float32(np.float64(f32(a[0])) * np.float64(f32(a[1])) + np.float64(f32(a[2]))))
            elif op == "mad.lo.u32":
                regs[dst] = np.uint32((int(a[0]) * int(a[1]) + int(a[2])) % 2 ** 32)
            else:
                raise AssertionError(f"the evaluator does not know {op!r}")
    return [f32(regs[f"${i}"]) for i in range(len(inputs))]


@pytest.mark.parametrize("poly", [1, 2, 3])
def test_fma_exponentials_match_exp2(poly):
    """2^x for the softmax's arguments (x <= 0, -inf, NaN) from the PTX the
    forward runs: the FMA lanes within 1.1e-4 of 2^x (relative), exact at
    integers (2^0 = 1: a row's maximum), 0 below 2^-127 and for -inf, NaN
    kept; the special-function lanes as ``ex2``."""
    import math

    import numpy as np

    from flashfuse.kernels import hopper_gluon

    asm = hopper_gluon._exp2_asm(poly)
    rng = np.random.default_rng(poly)
    xs = np.concatenate([
        -rng.exponential(4.0, 4000), -rng.uniform(0, 130, 4000), -np.arange(0, 127, dtype=np.float64),
        [0.0, -0.0, -0.5, -0.49999997, -1.5, -126.4, -126.6, -127.0, -127.5, -150.0, -1e30, -math.inf, math.nan,
         1e-7, 3e-8],
    ]).astype(np.float32)
    xs = np.concatenate([xs, np.zeros((-len(xs)) % 8, np.float32)])
    got = np.array([y for i in range(0, len(xs), 8) for y in _run_ptx(asm, xs[i:i + 8])], np.float32)
    want = 2.0 ** xs.astype(np.float64)
    lane = np.arange(len(xs)) % 8
    on_fma = lane >= 8 - poly
    assert on_fma.sum() > 1000
    nan = np.isnan(xs)
    assert np.isnan(got[nan]).all()
    normal = ~nan & (xs >= -126)
    rel = np.abs(got[normal] / want[normal] - 1)
    assert rel[on_fma[normal]].max() < 1.1e-4
    assert rel[~on_fma[normal]].max() < 1e-6
    whole = ~nan & (xs == np.round(xs)) & (xs >= -126)
    assert (got[whole] == want[whole]).all()  # 2^j exactly, 2^0 = 1 included
    assert (got[~nan & (xs <= -127.5)] == 0).all()  # -inf (masked keys) included
    assert (got[~nan & (xs < -126)] < 2.0 ** -125.5).all()


def test_forward_softmax_settings_reach_the_kernel(monkeypatch):
    """``hopper.FWD_SOFTMAX`` at the call's head dim is what the forward
    kernel is compiled with."""
    q = torch.randn(1, 2, 300, 64, dtype=torch.bfloat16)
    p = _problem(q, q, q)
    monkeypatch.setattr(hopper, "FWD_SOFTMAX", {64: dict(row_max_folds=2, exp_poly=3),
                                                128: dict(row_max_folds=0, exp_poly=0)})
    meta = hopper.kernel_args(p, q, q, q, torch.empty_like(q), torch.empty(1, 2, 300), persistent=False)[1]
    assert (meta["ROW_MAX_FOLDS"], meta["EXP_POLY"]) == (2, 3)
