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
from flashfuse.kernels.decode import DecodeCall, choose_splits, decode_forward, decode_refusal, decode_suits

from tests.kernels.padding import in_nan_padding, poison_empty

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    poison_empty(monkeypatch)


@pytest.fixture(params=["fused", "kernel"])
def combine(request, monkeypatch):
    """The partials merged by the split kernel's last split, or by the
    combine kernel (as in traced graphs and under CUDA graph capture).
    "fused" merges every tile in the split kernel, however many rows it has."""
    monkeypatch.setattr(decode, "FUSE_COMBINE", request.param == "fused")
    monkeypatch.setattr(decode, "FUSED_MAX_MERGES", decode.MAX_ROWS * decode.MAX_SPLITS)
    return request.param


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
def test_split_counts_and_groups(splits, group, n, combine):
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
def test_bands_and_rows_that_see_nothing(band, combine):
    torch.manual_seed(1)
    # N > M: under bottom-right causal alignment the first rows see no key.
    q = torch.randn(1, 4, 7, 16, device=DEVICE)
    k = torch.randn(1, 2, 5, 16, device=DEVICE)
    v = torch.randn(1, 2, 5, 16, device=DEVICE)
    out, lse = decode_forward(q, k, v, scale=0.5, num_splits=2, **band)
    _check(q, k, v, out, lse, **band)


def _counter_buffers():
    return [buf for (_, _, what), buf in decode._WORKSPACES.items() if what == "counters"]


class _CountLaunches:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def small_row_tiles(monkeypatch):
    """Row tiles of at most 16 rows (few rows make several tiles, cheaply
    under the interpreter); plans made with them are dropped afterwards."""
    decode.forget_plans()
    monkeypatch.setattr(decode, "MAX_ROWS", 16)
    yield
    decode.forget_plans()


@pytest.mark.parametrize("group,n,tiles", [(4, 3, 1), (8, 4, 2)])
def test_fused_combine_launches_one_kernel_and_leaves_its_counters_at_zero(monkeypatch, small_row_tiles, group, n,
                                                                           tiles):
    """The split kernel merges the partials itself: no combine launch (up to
    FUSED_MAX_SPLITS splits, FUSED_MAX_MERGES rows times splits per tile and
    FUSED_MAX_BYTES of cache), the same numbers
    as the combine kernel's, each row tile's arrival counter back at zero,
    so that the next call (of another shape too) counts from zero; several
    row tiles per key/value head."""
    torch.manual_seed(group + n)
    Hkv, M = 2, 70
    q = torch.randn(2, Hkv * group, n, 32, device=DEVICE)
    k = torch.randn(2, Hkv, M, 32, device=DEVICE)
    v = torch.randn(2, Hkv, M, 16, device=DEVICE)
    band = dict(window_left=40, window_right=0, bottom_right=True)
    assert decode.row_tile(group, n) * tiles == max(16, group * n)
    rows = min(group * n, decode.row_tile(group, n))  # what the last split of a tile merges
    monkeypatch.setattr(decode, "FUSED_MAX_MERGES", rows * 5)
    monkeypatch.setattr(decode, "FUSE_COMBINE", False)
    want, want_lse = decode_forward(q, k, v, scale=0.5, num_splits=3, **band)
    monkeypatch.setattr(decode, "FUSE_COMBINE", True)
    monkeypatch.setattr(decode, "FUSED_MAX_SPLITS", 4)
    combine = _CountLaunches(decode._decode_combine)
    monkeypatch.setattr(decode, "_decode_combine", combine)
    for splits in (3, 5, 2):  # with 3 queries, 5 splits leave the last without a key (the window)
        before = combine.launches
        out, lse = decode_forward(q, k, v, scale=0.5, num_splits=splits, **band)
        _check(q, k, v, out, lse, **band)
        assert all(not c.any() for c in _counter_buffers())
        # More splits than FUSED_MAX_SPLITS: the combine kernel merges them.
        assert combine.launches - before == (1 if splits > 4 else 0)
        if splits == 3:
            assert torch.equal(out, want) and torch.equal(lse, want_lse)  # the same merge, per row
    # A cache past FUSED_MAX_BYTES: the combine kernel, the same numbers.
    monkeypatch.setattr(decode, "FUSED_MAX_BYTES", 2 * Hkv * (32 + 16) * 4 * M - 1)  # B * Hkv * (D + Dv) * 4 B * M
    decode._CALLS.clear()
    before = combine.launches
    out, lse = decode_forward(q, k, v, scale=0.5, num_splits=3, **band)
    assert combine.launches - before == 1
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # More rows times splits per tile than FUSED_MAX_MERGES: the combine kernel, the same numbers.
    monkeypatch.setattr(decode, "FUSED_MAX_BYTES", 1 << 40)
    monkeypatch.setattr(decode, "FUSED_MAX_MERGES", rows * 3 - 1)
    decode.forget_plans()
    before = combine.launches
    out, lse = decode_forward(q, k, v, scale=0.5, num_splits=3, **band)
    assert combine.launches - before == 1
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    monkeypatch.setattr(decode, "FUSED_MAX_MERGES", rows * 3)
    decode.forget_plans()
    before = combine.launches
    decode_forward(q, k, v, scale=0.5, num_splits=3, **band)
    assert combine.launches - before == 0


@pytest.mark.parametrize("masked", [False, True])
def test_workspaces_hold_nothing_a_call_reads(combine, masked):
    """Partials, mask bounds and a dropped lse come from kept workspaces:
    with every workspace filled with NaN (and the bounds with garbage)
    before a call, the call is still exact, so it reads only what it
    wrote; ``need_lse=False`` gives the same output and no lse."""
    gen = torch.Generator().manual_seed(11)
    B, Hkv, G, M = 2, 2, 4, 45
    q = torch.randn(B, Hkv * G, 1, 32, generator=gen).to(DEVICE)
    k = torch.randn(B, Hkv, M, 32, generator=gen).to(DEVICE)
    v = torch.randn(B, Hkv, M, 16, generator=gen).to(DEVICE)
    mask = _mask("prefix", B, Hkv * G, 1, M, gen) if masked else None
    band = dict(window_right=0, bottom_right=True)
    decode_forward(q, k, v, scale=0.5, num_splits=3, attn_mask=mask, need_lse=False, **band)
    assert {w for _, _, w in decode._WORKSPACES} >= ({"part", "lse", "bounds"} if masked else {"part", "lse"})
    for (_, _, what), buf in decode._WORKSPACES.items():
        if what != "counters":
            buf.fill_(float("nan") if buf.is_floating_point() else -7)
    out, none = decode_forward(q, k, v, scale=0.5, num_splits=3, attn_mask=mask, need_lse=False, **band)
    assert none is None
    want, want_lse = decode_forward(q, k, v, scale=0.5, num_splits=3, attn_mask=mask, **band)
    assert torch.equal(out, want)
    if masked:
        _check_masked(q, k, v, mask, want, want_lse, **band)
    else:
        _check(q, k, v, want, want_lse, **band)


def test_counter_buffers_per_stream_and_grown(monkeypatch):
    """Counters are kept per (device, stream) and replaced by a larger
    zeroed buffer when a call has more row tiles than the buffer holds; the
    workspaces likewise, per (device, stream, what)."""
    monkeypatch.setattr(decode, "_WORKSPACES", {})
    cpu = torch.device("cpu")

    def counters(stream, n):
        return decode._workspace(cpu, stream, "counters", n, torch.int32, zeroed=True)

    a = counters(1, 10)
    assert a.numel() >= 10 and not a.any() and a.dtype == torch.int32
    assert counters(1, 10) is a
    assert counters(2, 10) is not a
    big = counters(1, a.numel() + 1)
    assert big.numel() > a.numel() and not big.any()
    w = decode._workspace(cpu, 1, "part", 10, torch.float32)
    assert decode._workspace(cpu, 1, "part", 10, torch.float32) is w
    assert decode._workspace(cpu, 2, "part", 10, torch.float32) is not w
    assert decode._workspace(cpu, 1, "lse", 10, torch.float32) is not w
    assert decode._workspace(cpu, 1, "part", w.numel() + 1, torch.float32).numel() > w.numel()


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
    # One wave of the SMs' program slots, no split below MIN_SPLIT_KEYS keys.
    assert choose_splits(1, 8, 1, 4096, 132, per_sm=2) == 4096 // decode.MIN_SPLIT_KEYS
    assert choose_splits(1, 8, 1, 1 << 17, 132, per_sm=2) == 2 * 132 // 8  # 33: 264 programs, 2 per SM
    assert choose_splits(8, 8, 1, 1 << 17, 132, per_sm=2) == 2 * 132 // 64  # 4, not 5: no partial wave
    assert choose_splits(8, 8, 1, 1 << 17, 132, per_sm=4) == 4 * 132 // 64
    assert choose_splits(64, 8, 1, 1 << 17, 132, per_sm=2) == 1  # the batch fills the GPU
    assert choose_splits(64, 8, 1, 100, 132) == 1


def test_programs_per_sm():
    # The default config at D = 128 in 16 bits: three stages of 64 keys of
    # K and V, 96 kB, two per SM of an H200; 32-bit tiles take twice that.
    assert decode.programs_per_sm(64, 4, 3, 128, 128, 2, 227 * 1024) == 2
    assert decode.programs_per_sm(32, 4, 3, 128, 128, 2, 227 * 1024) == 4
    assert decode.programs_per_sm(64, 4, 3, 128, 128, 4, 227 * 1024) == 1
    assert decode.programs_per_sm(16, 8, 1, 16, 16, 2, 227 * 1024) == 8  # warps bound it


def test_split_count_env_knob(monkeypatch):
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "5")
    assert choose_splits(1, 1, 1, 10, 4) == 5


def test_dispatch_rule(monkeypatch):
    q = torch.empty(1, 32, 1, 128)
    k = torch.empty(1, 8, 4096, 128)
    assert decode_suits(DecodeCall(q, k, None, 0.0, None, 0, True, None))
    assert not decode_suits(DecodeCall(q, k, None, 0.0, None, 0, False, None))  # top-left causal
    assert not decode_suits(DecodeCall(q, k, torch.ones(1), 0.0, None, None, True, None))  # float masks: see below
    assert not decode_suits(DecodeCall(q, k, None, 0.1, None, None, True, None))
    assert not decode_suits(DecodeCall(q, k[:, :, :64], None, 0.0, None, 0, True, None))  # few keys
    assert not decode_suits(DecodeCall(torch.empty(1, 32, 64, 128), k, None, 0.0, None, 0, True, None))
    monkeypatch.setenv("FLASHFUSE_DECODE", "0")
    assert not decode_suits(DecodeCall(q, k, None, 0.0, None, 0, True, None))


def test_refusal_reasons(monkeypatch):
    """Every reason to leave a call to the forward kernel is decode_refusal's,
    soft-capping and sinks included."""
    q = torch.empty(1, 32, 1, 128)
    k = torch.empty(1, 8, 4096, 128)
    assert decode_refusal(DecodeCall(q, k, window_right=0)) is None
    assert "soft-capping" in decode_refusal(DecodeCall(q, k, window_right=0, softcap=30.0))
    assert "sinks" in decode_refusal(DecodeCall(q, k, window_right=0, sinks=torch.zeros(32)))
    assert "top-left" in decode_refusal(DecodeCall(q, k, window_right=0, bottom_right=False))
    assert "fewer than" in decode_refusal(DecodeCall(q, k[:, :, :64]))
    monkeypatch.setenv("FLASHFUSE_DECODE", "1")  # sizes no longer count, the kernels' limits still do
    assert decode_refusal(DecodeCall(q, k[:, :, :64])) is None
    assert "sinks" in decode_refusal(DecodeCall(q, k, sinks=torch.zeros(32)))


def _plan_call(q, k, v, **kw):
    before = decode.PLAN_MISSES[0]
    out, lse = decode_forward(q, k, v, scale=0.5, window_right=0, bottom_right=True, **kw)
    return out, lse, decode.PLAN_MISSES[0] - before


def test_repeated_call_takes_its_plan(monkeypatch):
    """A second identical call takes the cached plan and gives the same
    bits; a new dtype, new strides or a new split knob build a new one. A
    longer cache (a dynamic cache's next step) keeps the plan."""
    decode.forget_plans()
    torch.manual_seed(6)
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    k = torch.randn(1, 2, 40, 16, device=DEVICE)
    v = torch.randn(1, 2, 40, 16, device=DEVICE)
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "2")
    out1, lse1, miss1 = _plan_call(q, k, v)
    out2, lse2, miss2 = _plan_call(q, k, v)
    assert (miss1, miss2) == (1, 0)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    decode.forget_plans()  # a miss again: the same bits as a hit
    out3, lse3, miss3 = _plan_call(q, k, v)
    assert miss3 == 1 and torch.equal(out1, out3) and torch.equal(lse1, lse3)
    assert _plan_call(q.half(), k.half(), v.half())[2] == 1  # dtype
    qt = in_nan_padding(q)  # same values, other strides
    out4, lse4, miss4 = _plan_call(qt, k, v)
    assert miss4 == 1 and torch.equal(out1, out4)
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "3")  # the knob
    out5, _, miss5 = _plan_call(q, k, v)
    assert miss5 == 1
    torch.testing.assert_close(out5, out1)
    k2, v2 = torch.cat([k, k[:, :, :8]], 2), torch.cat([v, v[:, :, :8]], 2)
    out6, lse6, miss6 = _plan_call(q, k2, v2)
    assert miss6 == 0
    _check(q, k2, v2, out6, lse6, window_right=0, bottom_right=True)


def _cache(buf, layout, M, Hkv, D):
    """A cache of M keys as a dynamic cache hands it over: a fresh contiguous
    tensor per length (views of one buffer), (B, Hkv, M, D) or (B, M, Hkv, D)."""
    n = Hkv * M * D
    return buf[:n].view(1, Hkv, M, D) if layout == "bhsd" else buf[:n].view(1, M, Hkv, D)


def _assert_as_built(q, k, v, layout, **kw):
    """The call ``decode_forward`` just kept for these arguments is the one
    ``_make_call`` builds from the plan key: same plan, launches, integer
    arguments, windows and fused merge."""
    call = list(decode._CALLS.values())[-1]
    want = _REAL_MAKE_CALL(q, k, v, kw.get("cache_seqlens"), None, None, kw.get("window_left"),
                           kw.get("window_right"), True, layout, kw.get("num_splits"), True,
                           flashfuse.config.decode_knobs())
    assert call.plan is want.plan and call.L is want.L
    assert (call.ints, call.windows, call.fuse, call.bounds_ints) == (want.ints, want.windows, want.fuse,
                                                                      want.bounds_ints)
    return call


_REAL_MAKE_CALL = decode._make_call


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_growing_cache_reuses_its_plan_without_the_plan_key(monkeypatch, layout):
    """A dynamic cache (one key more per call, a fresh contiguous tensor each
    time, so new strides): a length whose strides specialise as a kept
    plan's takes that plan (``_GROWN``) without ``_make_call``, and its call
    is the one ``_make_call`` would build, split count included as it moves
    with the length; a length whose strides specialise otherwise (head dim
    24: ``M * 24`` is a multiple of 16 for even M only) does not take it.
    Bitwise what a cold call (every plan dropped) gives."""
    decode.forget_plans()
    monkeypatch.setattr(decode, "_INTERPRET_SMS", 16)  # the split count moves with the length
    monkeypatch.setattr(decode, "MIN_SPLIT_KEYS", 8)
    built = []
    monkeypatch.setattr(decode, "_make_call", lambda *a: built.append(a[3]) or _REAL_MAKE_CALL(*a))
    torch.manual_seed(8)
    Hkv, D = 1, 24
    q = torch.randn(1, 4, 1, D, device=DEVICE)
    buf = torch.randn(Hkv * 64 * D, device=DEVICE)
    band = dict(window_right=0)
    splits, outs = set(), {}
    for M in (30, 32, 34, 40, 48, 31, 33, 35, 36):
        k = _cache(buf, layout, M, Hkv, D)
        before = len(built)
        outs[M] = decode_forward(q, k, k, scale=0.5, bottom_right=True, layout=layout, **band)
        call = _assert_as_built(q, k, k, layout, **band)
        splits.add(call.L.S)
        # Built only for the first even and odd lengths, and at each change of parity.
        assert len(built) - before == (M in (30, 31, 36)), M
    assert len(splits) > 1
    decode.forget_plans()
    for M, (out, lse) in outs.items():
        k = _cache(buf, layout, M, Hkv, D)
        want, want_lse = decode_forward(q, k, k, scale=0.5, bottom_right=True, layout=layout, **band)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), M


@pytest.mark.parametrize("change", ["dtype", "splits", "strides", "window", "seqlens"])
def test_growing_cache_takes_no_stale_plan(monkeypatch, change):
    """After a few lengths of a dynamic cache, a call that changes something
    else between two lengths (dtype, the split setting, strides that
    specialise otherwise, the window, per-row lengths) gets the call built
    for it, not the kept plan's."""
    decode.forget_plans()
    torch.manual_seed(9)
    Hkv, D = 2, 16
    q = torch.randn(1, 4, 1, D, device=DEVICE)
    buf = torch.randn(Hkv * 80 * D, device=DEVICE)
    kw = dict(window_right=0)
    for M in (30, 31, 32):
        k = _cache(buf, "bhsd", M, Hkv, D)
        decode_forward(q, k, k, scale=0.5, bottom_right=True, **kw)
    k = _cache(buf, "bhsd", 33, Hkv, D)
    qq = q
    if change == "dtype":
        qq, k = q.double(), k.double()
    elif change == "splits":
        monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "3")
    elif change == "strides":
        k = torch.randn(1, Hkv, 33, D + 1, device=DEVICE)[..., :D]  # row stride D + 1: not a multiple of 16
    elif change == "window":
        kw["window_left"] = 4
    else:
        kw["cache_seqlens"] = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    out, lse = decode_forward(qq, k, k, scale=0.5, bottom_right=True, **kw)
    call = _assert_as_built(qq, k, k, "bhsd", **kw)
    if change == "splits":
        assert call.L.S == 3
    decode.forget_plans()
    want, want_lse = decode_forward(qq, k, k, scale=0.5, bottom_right=True, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_decode_knobs_follow_the_environment(monkeypatch):
    """The decode plans' settings, read in one call, are the three settings
    read apart, at every call."""
    from flashfuse import config

    for splits, tune in (("", "0"), ("4", "1"), ("7", "0")):
        monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", splits)
        monkeypatch.setenv("FLASHFUSE_AUTOTUNE", tune)
        assert config.decode_knobs() == (config.decode_splits(), config.autotune(), config.interpreter_on())
        assert config.decode_knobs()[:2] == ((int(splits) if splits else None), tune != "0")


@pytest.mark.parametrize("forced", ["1", "2", "9"])
def test_split_knob_forces_the_count(monkeypatch, forced):
    """FLASHFUSE_DECODE_SPLITS decides the split count the kernels run
    with (one split writes the output directly; 9 splits of 40 keys leave
    some with none)."""
    decode.forget_plans()
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", forced)
    torch.manual_seed(7)
    q = torch.randn(1, 4, 2, 16, device=DEVICE)
    k = torch.randn(1, 2, 40, 16, device=DEVICE)
    v = torch.randn(1, 2, 40, 16, device=DEVICE)
    out, lse = decode_forward(q, k, v, scale=0.5, window_right=0, bottom_right=True)
    (call,) = decode._CALLS.values()
    assert call.L.S == int(forced) and call.L.direct == (forced == "1")
    _check(q, k, v, out, lse, window_right=0, bottom_right=True)


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
def test_gpu_fused_combine_against_the_combine_kernel(monkeypatch):
    """Many back-to-back calls (no synchronisation between them), split
    counts 2-128, one to several row tiles: the last split of each tile
    merges partials that other programs wrote during the same launch. A
    missed ordering (a partial read before it was written, a counter not
    set back) would show as a large error or NaN (poisoned outputs)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    cases = [(1, 32, 8, 1, 4096), (2, 32, 8, 3, 9000), (4, 8, 8, 1, 2048), (1, 64, 4, 16, 20000)]
    runs = []
    for B, Hq, Hkv, N, M in cases:
        q = torch.randn(B, Hq, N, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(B, Hkv, M, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(B, Hkv, M, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        for splits in (2, 7, 33, 64, 128):  # 128: more than FUSED_MAX_SPLITS, the combine kernel
            runs.append((q, k, v, splits))
    monkeypatch.setattr(decode, "FUSE_COMBINE", False)
    want = [decode_forward(q, k, v, scale=0.1, num_splits=s, window_right=0, bottom_right=True) for q, k, v, s in runs]
    monkeypatch.setattr(decode, "FUSE_COMBINE", True)
    monkeypatch.setattr(decode, "FUSED_MAX_BYTES", 1 << 40)  # every case fused, however long its cache
    monkeypatch.setattr(decode, "FUSED_MAX_MERGES", decode.MAX_ROWS * decode.MAX_SPLITS)  # and however many rows
    decode.forget_plans()
    for _ in range(25):
        got = [decode_forward(q, k, v, scale=0.1, num_splits=s, window_right=0, bottom_right=True)
               for q, k, v, s in runs]
        for (o, lse), (wo, wlse) in zip(got, want):
            torch.testing.assert_close(o, wo, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(lse, wlse, atol=1e-5, rtol=1e-5)
    assert all(not c.any() for c in _counter_buffers())


@pytest.mark.gpu
@pytest.mark.parametrize("B,N,M", [(1, 1, 4096), pytest.param(8, 1, 32768, marks=pytest.mark.gpu_alone),
                                   pytest.param(2, 16, 65536, marks=pytest.mark.gpu_alone), (3, 4, 1000)])
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


# ---------------------------------------------------------------------------
# Bool masks (static caches, padded batches)
# ---------------------------------------------------------------------------

def _mask(kind, B, Hq, N, M, gen):
    """Bool masks as callers hand them over, each with fully hidden rows."""
    if kind == "prefix":  # a static cache: row b filled up to lens[b] (0: none)
        lens = torch.tensor([M - 7, 0, 13][:B])
        return (torch.arange(M) < lens.view(B, 1, 1, 1)).to(DEVICE)
    if kind == "padded":  # left padding and an unfilled tail, per query
        j = torch.arange(M)
        m = (j >= 5) & (j < M - 9)
        m = m.view(1, 1, 1, M).repeat(B, 1, N, 1)
        m[-1, :, 0] = False
        return m.to(DEVICE)
    # "strided": (B, Hq, N, M) random, every other key of a larger buffer,
    # heads and queries swapped in memory.
    buf = torch.rand(B, N, Hq, 2 * M, generator=gen) < 0.4
    m = buf[..., ::2].transpose(1, 2)
    m[0, 1] = False
    assert m.stride(-1) == 2 and not m.is_contiguous()
    return m.to(DEVICE)


def _check_masked(q, k, v, mask, out, lse, tol=2e-6, **band):
    want = ref.reference_attention(q, k, v, mask, scale=0.5, **band)
    want_lse = ref.reference_lse(q, k, mask, scale=0.5, **band)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert (lse[torch.isinf(lse)] > 0).all()
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["prefix", "padded", "strided"])
@pytest.mark.parametrize("group,n,splits", [(1, 1, 1), (4, 2, 2), (8, 1, 5)])
def test_bool_masks(kind, group, n, splits):
    gen = torch.Generator().manual_seed(group * 7 + splits)
    Hkv, M, B = 2 if group < 8 else 1, 45, 3 if kind == "prefix" else 2
    q = torch.randn(B, Hkv * group, n, 32, generator=gen).to(DEVICE)
    k = torch.randn(B, Hkv, M, 32, generator=gen).to(DEVICE)
    v = torch.randn(B, Hkv, M, 16, generator=gen).to(DEVICE)
    mask = _mask(kind, B, Hkv * group, n, M, gen)
    out, lse = decode_forward(q, k, v, scale=0.5, num_splits=splits, attn_mask=mask)
    _check_masked(q, k, v, mask, out, lse)


def test_bool_mask_with_causal_band_and_nan_padding():
    """The mask and a bottom-right window together; keys and values the
    mask hides hold NaN past the cache's end, never read."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 3, 16, generator=gen).to(DEVICE)
    k = in_nan_padding(torch.randn(2, 2, 50, 16, generator=gen).to(DEVICE))
    v = in_nan_padding(torch.randn(2, 2, 50, 16, generator=gen).to(DEVICE))
    mask = (torch.rand(2, 1, 3, 50, generator=gen) < 0.7).to(DEVICE)
    band = dict(window_left=20, window_right=0, bottom_right=True)
    out, lse = decode_forward(q, k, v, scale=0.5, num_splits=3, attn_mask=mask, **band)
    _check_masked(q, k, v, mask, out, lse, **band)


def test_masked_keys_are_not_read():
    """NaN in the keys and values of every hidden slot (a static cache's
    tail, a hole): they must neither be read into a score nor shift the
    splits' shares off the visible span."""
    gen = torch.Generator().manual_seed(6)
    B, M = 2, 64
    q = torch.randn(B, 4, 1, 16, generator=gen).to(DEVICE)
    k = torch.randn(B, 1, M, 16, generator=gen).to(DEVICE)
    v = torch.randn(B, 1, M, 16, generator=gen).to(DEVICE)
    mask = torch.zeros(B, 1, 1, M, dtype=torch.bool, device=DEVICE)
    mask[0, ..., :40] = True
    mask[0, ..., 20:25] = False
    mask[1, ..., 33:35] = True
    kn, vn = k.masked_fill(~mask.transpose(-1, -2), float("nan")), v.masked_fill(~mask.transpose(-1, -2), float("nan"))
    for splits in (1, 4):
        out, lse = decode_forward(q, kn, vn, scale=0.5, num_splits=splits, attn_mask=mask)
        _check_masked(q, k, v, mask, out, lse)


def test_mask_bounds_kernel():
    """Per batch row, the first and one past the last key that some mask
    row shows, over all chunks; a row showing nothing gives an empty span."""
    gen = torch.Generator().manual_seed(7)
    B, Hq, N, M = 3, 4, 2, 61
    m = torch.rand(B, 1, N, M, generator=gen) < 0.05
    m[1] = False
    m[2, 0, 1, 60] = True
    mask = decode.bool_mask_as_bytes(m.to(DEVICE).expand(B, Hq, N, M))
    chunks = decode._INTERPRET_BOUNDS_CHUNKS
    bounds = torch.empty((B, chunks, 2), dtype=torch.int32, device=DEVICE)
    decode._mask_bounds[(chunks, B)](mask, bounds, *mask.stride(), M, N, N,
                                     BLOCK_K=decode._INTERPRET_BOUNDS_BLOCK_K, CHUNKS=chunks)
    for b in range(B):
        seen = m[b].any(0).any(0).nonzero().flatten()
        lo, hi = int(bounds[b, :, 0].min()), int(bounds[b, :, 1].max())
        if seen.numel():
            assert (lo, hi) == (int(seen.min()), int(seen.max()) + 1)
        else:
            assert hi == 0 and lo > M


def test_dispatch_rule_with_masks(monkeypatch):
    q = torch.empty(1, 32, 1, 128)
    k = torch.empty(1, 8, 4096, 128)
    bool_mask = torch.ones(1, 1, 1, 4096, dtype=torch.bool)
    assert decode_suits(DecodeCall(q, k, bool_mask, 0.0, None, None, True, None))
    # Without a band the alignment changes nothing: top-left is taken too.
    assert decode_suits(DecodeCall(q, k, bool_mask, 0.0, None, None, False, None))
    assert not decode_suits(DecodeCall(q, k, bool_mask, 0.0, None, 0, False, None))  # top-left causal
    assert not decode_suits(DecodeCall(q, k, bool_mask, 0.0, None, None, True, -1e4))  # a fill: the forward kernel
    # A float mask: the forward kernel.
    assert not decode_suits(DecodeCall(q, k, bool_mask.float(), 0.0, None, None, True, None))
    assert not decode_suits(DecodeCall(q, k, bool_mask, 0.1, None, None, True, None))


def test_op_with_bool_mask_takes_decode_path_and_its_gradients(monkeypatch):
    """A static cache's call (bool mask, no band, as the Hugging Face hook
    makes it) through ``flashfuse.attention``: the decode forward, then the
    backward kernels from its out and lse."""
    monkeypatch.setattr(decode, "MIN_KEYS", 16)
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "3")
    calls = []
    real = decode.decode_forward
    monkeypatch.setattr(decode, "decode_forward", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 1, 16, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(2, 2, 37, 16, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(2, 2, 37, 16, generator=gen).to(DEVICE).requires_grad_()
    mask = (torch.arange(37) < torch.tensor([30, 0]).view(2, 1, 1, 1)).to(DEVICE)
    out = flashfuse.attention(q, k, v, mask, alignment="bottom_right", enable_gqa=True, scale=0.5)
    assert len(calls) == 1 and calls[0]["attn_mask"] is mask
    g = torch.randn(out.shape, generator=gen).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v), g)
    want_out = ref.reference_attention(q, k, v, mask, scale=0.5)
    want = torch.autograd.grad(want_out, (q, k, v), g.double())
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=2e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("B,M,filled", [(1, 4096, 3072), pytest.param(8, 32768, 20000, marks=pytest.mark.gpu_alone),
                                        (2, 1000, 0)])
def test_gpu_static_cache_mask(B, M, filled):
    """A static cache's bool mask (B, 1, 1, M), first ``filled`` slots (row 0
    of the batch sees one slot fewer), through the op as the Hugging Face
    hook calls it, against SDPA with the same mask."""
    torch.manual_seed(9)
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, 8, M, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, 8, M, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B, 1, 1, 1), filled, device="cuda")
    lens[0] = max(filled - 1, 0)
    mask = torch.arange(M, device="cuda") < lens
    k[..., filled:, :] = float("nan")  # unfilled slots are never read
    v[..., filled:, :] = float("nan")
    out = flashfuse.attention(q, k, v, mask, enable_gqa=True, alignment="bottom_right")
    if filled == 0:
        assert (out == 0).all()
        return
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().nan_to_num(), v.float().nan_to_num(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_split_candidates_override_and_restore():
    """The sweep hook replaces both candidate lists inside its block and
    restores them (and forgets the launcher's choices) when it ends, also
    after an error."""
    import triton

    tuned, tuned_mask = decode._split_configs(False), decode._split_configs(True)
    only = [triton.Config({"BLOCK_N": 32}, num_warps=2, num_stages=1)]
    with decode.split_candidates(only):
        assert decode._split_configs(False) == only and decode._split_configs(True) == only
    assert decode._split_configs(False) is tuned and decode._split_configs(True) is tuned_mask
    with pytest.raises(RuntimeError, match="inside"):
        with decode.split_candidates(only):
            raise RuntimeError("inside")
    assert decode._split_configs(False) is tuned


# The start of a subprocess script (argv: bench, the repository root): CUDA's
# launch path on CPU tensors (``bench/host_path_cpu.py``), every compiled
# binary a stand-in whose launcher has Triton 3.6's form (recording its C
# calls; ``binaries`` in compile order), the launch hooks set by ``hooks[0]``.
_ON_THE_CUDA_PATH = r'''
import os, sys
os.environ.update(FLASHFUSE_AUTOTUNE="0", TRITON_INTERPRET="0", FLASHFUSE_DECODE="1")
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import torch
import host_path_cpu
import flashfuse
from flashfuse.kernels import decode, launch
from tests.kernels.test_launch import CudaLauncher

host_path_cpu.force_cuda_path_on_cpu()  # CUDA's launch path on CPU tensors


class Binary:
    function, packed_metadata = 7, (4, 1, 0)

    def __init__(self):
        self.run = CudaLauncher()

    def launch_metadata(self, grid, stream, *args):
        return None


binaries = []
launch.ConfigLauncher._launch = lambda self, cfg, grid, args, kwargs: binaries.append(Binary()) or binaries[-1]
hooks = [(None, None)]
decode._launch_hooks = launch._launch_hooks = lambda: hooks[0]
'''


_POINTERS_ON_THE_CUDA_PATH = _ON_THE_CUDA_PATH + r'''
q = torch.randn(2, 8, 1, 64)
buf = torch.randn(2, 2 * 2 * 900 * 64)
masks = {"none": None, "bool": torch.rand(2, 1, 1, 900) > 0.3}
as_addresses = 0
for name, mask in masks.items():
    for M in (700, 701, 702, 900, 900):
        k, v = (buf[i, :2 * 2 * M * 64].view(2, 2, M, 64) for i in (0, 1))
        m = None if mask is None else mask[..., :M]
        for hook in ((None, None), (object(), None)):
            hooks[0] = hook
            for b in binaries:
                b.run.c_calls.clear(); b.run.wrapper_calls = 0
            torch.ops.flashfuse.attention(q, k, v, m, 0.0, m is None, None, True, alignment="bottom_right")
            calls = [(b, c) for b in binaries for c in b.run.c_calls]
            if hook[0] is None:
                assert all(b.run.wrapper_calls == 0 for b in binaries), "the C launch, not the wrapper"
                c_args = {id(b): c for b, c in calls}
                as_addresses += sum(not any(isinstance(a, torch.Tensor) for a in c) for _, c in calls)
                continue
            assert all(id(b) in c_args for b, _ in calls) and len(calls) == len(c_args)
            # Buffers that outlive a call (the inputs, the kept workspaces)
            # are at the same address in both calls; each call's output and
            # lse are fresh.
            kept = {t.data_ptr() for t in (q, k, v, *decode._WORKSPACES.values())}
            if m is not None:
                kept.add(m.data_ptr())
            for b, c in calls:
                want = c_args[id(b)]
                assert b.run.wrapper_calls and len(c) == len(want) and c[:9] == want[:9], name
                assert c[10:13] == (None, hook[0], None) and want[10:13] == (None, None, None)
                checked = 0
                for got, sent in zip(c[13:], want[13:]):
                    if isinstance(got, torch.Tensor):
                        address = sent.data_ptr() if isinstance(sent, torch.Tensor) else sent
                        assert type(address) is int and (got.data_ptr() not in kept or got.data_ptr() == address), name
                        checked += got.data_ptr() in kept
                    else:
                        assert got == sent and type(got) is type(sent), name
                assert checked >= 1, name
print("ok", as_addresses)
'''


def test_c_launches_take_every_tensor_as_its_address():
    """On CUDA's launch path (CPU tensors, launches stubbed:
    ``bench/host_path_cpu.py``, in a subprocess), with kept binaries whose
    launcher is the wrapper ``launch.run_binary`` bypasses: without a launch
    hook every launch takes the C launch, the decode calls' kept launches
    with their tensors as addresses; with a hook the wrapper gets the
    tensors. Everything else each kernel gets is the same, and every
    address of a buffer that outlives the call is that buffer's, with and
    without a mask."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _POINTERS_ON_THE_CUDA_PATH, os.path.join(root, "bench"), root],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == "ok" and int(done.stdout.split()[1]) >= 2, done.stdout


_DIRECT_ON_THE_CUDA_PATH = _ON_THE_CUDA_PATH + r'''
if sys.argv[3] == "installed":  # this Triton's own launcher class (3.6's form, or 3.9's packed one)
    from triton.backends.nvidia import driver as nv
    from tests.kernels.test_launch import _installed_launcher

    assert launch._c_launch_form(nv.CudaLauncher) is not None  # read before the counting wrapper below
    wrapper = nv.CudaLauncher.__call__

    def counted(self, *args):
        self.wrapper_calls += 1
        return wrapper(self, *args)

    nv.CudaLauncher.__call__ = counted

    def make_run(binary):
        binary.run = _installed_launcher()
        binary.run.wrapper_calls = 0

    Binary.__init__ = make_run
streams = [launch._triton_device_stream(0)]
decode._device_stream = lambda index: streams[0]
kw = dict(is_causal=True, alignment="bottom_right", enable_gqa=True)
OUT = 8  # the output's address among the kernel's arguments: the 9th tensor


def split(c):
    """A C call as (grid, stream and head; the kernel's arguments, a tensor
    as its address): 3.9's packed form passes the arguments as one tuple."""
    head, args = (c[:-1], c[-1]) if isinstance(c[-1], tuple) else (c[:13], c[13:])
    return head, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


runs = [0]
real_run = decode._run
decode._run = lambda *a, **k: runs.__setitem__(0, runs[0] + 1) or real_run(*a, **k)


def call(q, buf, M, run=False):
    """The C launches of one lane call on M keys (a tensor as its address:
    a launch's first, through the launcher, takes tensors), and whether it
    was direct; ``run``: with the step's direct launch dropped first."""
    B, Hq, _, D = q.shape
    k, v = (buf[i, :B * 2 * M * D].view(B, 2, M, D) for i in (0, 1))
    for b in binaries:
        b.run.c_calls.clear(); b.run.wrapper_calls = 0
    step = next(iter(decode._LANE_STEPS.values()), None)
    if run and step is not None:
        step.direct = None
    before = runs[0]
    out = flashfuse.attention(q, k, v, **kw)
    assert not any(b.run.wrapper_calls for b in binaries) or hooks[0] != (None, None)
    return [split(c) for b in binaries for c in b.run.c_calls], runs[0] == before, out


q = torch.randn(2, 8, 1, 64)
buf = torch.randn(2, 2 * 2 * 4000 * 64)
for M in (599, 600):  # the op's call, which makes the lane, then the lane's, which makes its step
    flashfuse.attention(q, *(buf[i, :2 * 2 * M * 64].view(2, 2, M, 64) for i in (0, 1)), **kw)
direct = 0
for M in [*range(601, 700, 7), *range(700, 4000, 211)]:  # growing: split counts and buckets move
    call(q, buf, M)  # a new length (a new split count or bucket compiles: no launch seen)
    for again in range(2):  # the same length again, directly, then through _run
        got, was_direct, out = call(q, buf, M)
        want, was_run, _ = call(q, buf, M, run=True)
        direct += was_direct
        assert was_direct and not was_run and len(got) == len(want) == 1, (M, len(got), len(want))
        # Bit for bit the launch _run makes, but for the fresh output's address.
        (head, args), (want_head, want_args) = got[0], want[0]
        assert head == want_head and args[:OUT] == want_args[:OUT] and args[OUT + 1:] == want_args[OUT + 1:], M
        assert type(args[OUT]) is int and out.shape == (2, 8, 1, 64), M

# Where _run would launch otherwise, the direct launch steps back.
def fallback(name):
    call(q, buf, 3999)
    got, was_direct, _ = call(q, buf, 3999)
    assert was_direct, name
    return got

base = fallback("base")
hooks[0] = (object(), None)
_, was_direct, _ = call(q, buf, 3999)
assert not was_direct and any(b.run.wrapper_calls for b in binaries), "a launch hook: Triton's wrapper"
hooks[0] = (None, None)
fallback("after the hook")
streams[0] = streams[0] + 1
got, was_direct, _ = call(q, buf, 3999)
assert not was_direct and got[0][0][3] == streams[0], "another stream: its own workspaces"
got = fallback("on the new stream")
assert got[0][0][3] == streams[0] and got[0][1][7] != base[0][1][7], "the new stream's partials"
for setting in ("FUSE_COMBINE", "WORKSPACES"):
    setattr(decode, setting, False)
    call(q, buf, 3999)  # unfused: the split and combine kernels compile
    got, was_direct, _ = call(q, buf, 3999)
    assert not was_direct and got, setting
    setattr(decode, setting, True)
    fallback("after " + setting)
capturing = torch.cuda.is_current_stream_capturing
torch.cuda.is_current_stream_capturing = lambda: True
call(q, buf, 3999)
got, was_direct, _ = call(q, buf, 3999)
assert not was_direct and got, "under capture"
torch.cuda.is_current_stream_capturing = capturing
fallback("after capture")
# A workspace replaced by a larger one (a bigger batch's partials): the
# direct launch holding the old one steps back once, then holds the new one.
big = torch.randn(16, 8, 1, 64)
call(big, torch.randn(2, 16 * 2 * 4000 * 64), 3999)
_, was_direct, _ = call(q, buf, 3999)
assert not was_direct, "a workspace replaced"
got = fallback("with the new workspace")
part = decode._WORKSPACES[(q.device, streams[0], "part")]
assert got[0][1][7] == part.data_ptr()
print("ok", direct)
'''


@pytest.mark.parametrize("launcher", ["stand-in", "installed"])
def test_direct_lane_launch_is_the_launch_run_makes(launcher):
    """A lane step's direct launch (``decode._launch_direct``) on CUDA's
    launch path (CPU tensors, in a subprocess; the launches stubbed with a
    stand-in of Triton 3.6's launcher, or with this Triton's own launcher
    class, 3.9's packed form on the CPU's Triton, its C launch recording
    what it gets): on a growing cache (split counts and buckets
    moving) and a repeated length, its C launch gets, argument for
    argument, what ``_run``'s gets but the fresh output's address; with a
    launch hook, on another stream, with the fused merge or the workspaces
    off, under graph capture, and once after a workspace was replaced, the
    call takes ``_run``, and the direct launch comes back after."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if launcher == "installed":
        from triton.backends.nvidia import driver

        from flashfuse.kernels import launch

        if launch._c_launch_form(driver.CudaLauncher) is None:
            pytest.skip("this Triton's launcher is not a form run_binary bypasses")
    done = subprocess.run([sys.executable, "-c", _DIRECT_ON_THE_CUDA_PATH, os.path.join(root, "bench"), root,
                           launcher], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == "ok" and int(done.stdout.split()[1]) >= 20, done.stdout
