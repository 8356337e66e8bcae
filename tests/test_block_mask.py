"""Block masks (flashfuse.block_mask, flashfuse::block_mask): tables built
once per mask, against the brute-force rule, and attention reading them
giving the same bits as attention building its own (kernels in Triton's
interpreter on CPU)."""

from __future__ import annotations

import gc
import math
import sys
import weakref

import pytest
import torch

import flashfuse
from flashfuse.block_mask import BlockMask, MaskBand, find_band

from tests.kernels.masks import hiding_mask
from tests.kernels.test_mask_ranges import _expected

BANDS = {
    "none": {},
    "causal": {"is_causal": True},
    "causal-bottom-right": {"is_causal": True, "alignment": "bottom_right"},
    "window": {"window_left": 9, "window_right": 3},
    "window-bottom-right": {"window_left": 5, "window_right": 0, "alignment": "bottom_right"},
}


def _ref_band(band):
    """The band as ``_expected`` (reference.visibility_mask) takes it."""
    right = 0 if band.get("is_causal") else band.get("window_right")
    return {"window_left": band.get("window_left"), "window_right": right,
            "bottom_right": band.get("alignment") == "bottom_right"}


def _block_structured(shape, gen, kind, blk=8, values="zeros"):
    """A mask of ``kind`` hiding random blk x blk blocks (and a few single
    pairs) of a (B, H, rows, M) shape."""
    B, H, rows, M = shape
    blocks = torch.rand(B, H, -(-rows // blk), -(-M // blk), generator=gen) < 0.4
    hidden = blocks.repeat_interleave(blk, 2)[:, :, :rows].repeat_interleave(blk, 3)[..., :M]
    hidden = hidden | (torch.rand(hidden.shape, generator=gen) < 0.05)
    return hiding_mask(hidden, kind, gen, values)


@pytest.mark.parametrize("band", list(BANDS), ids=list(BANDS))
@pytest.mark.parametrize("shape, kind", [((2, 1, 37, 70), "bool"), ((1, 3, 37, 70), "float32-min"),
                                         ((2, 1, 1, 70), "bfloat16-min"), ((37, 70), "float16-min"),
                                         ((2, 2, 37, 70), "float32-inf")],
                         ids=["batch-bool", "heads-f32", "padding-bf16", "2d-f16", "full-inf"])
def test_block_mask_matches_brute_force(shape, kind, band):
    N, M = 37, 70
    gen = torch.Generator().manual_seed(hash((shape, kind)) % 2**31)
    mask = _block_structured((1,) * (4 - len(shape)) + shape, gen, kind).reshape(shape)
    bm = flashfuse.block_mask(mask, N, M, **BANDS[band])
    full = mask.reshape((1,) * (4 - len(shape)) + shape)
    full = full.expand(full.shape[0], full.shape[1], N, M)
    want_keys, want_queries = _expected(full, N, M, _ref_band(BANDS[band]))
    # The mask's own batch and heads, 1 where it broadcasts.
    assert bm.key_table.shape == want_keys.shape and bm.query_table.shape == want_queries.shape
    assert torch.equal(bm.key_table, want_keys)
    assert torch.equal(bm.query_table, want_queries)


def test_block_mask_with_a_fill_matches_brute_force():
    N, M = 37, 40
    gen = torch.Generator().manual_seed(3)
    mask = _block_structured((2, 1, N, M), gen, "bool")
    mask[:, :, 7] = False  # a row it hides entirely: averages with a fill
    bm = flashfuse.block_mask(mask, mask_fill=-1e30, is_causal=True)
    want_keys, want_queries = _expected(mask, N, M, _ref_band({"is_causal": True}), fills=True)
    assert torch.equal(bm.key_table, want_keys) and torch.equal(bm.query_table, want_queries)
    # A fill too high to skip filled pairs: the kernels read no tables.
    assert flashfuse.block_mask(mask, mask_fill=0.0).key_table.numel() == 0


def test_stride_zero_dimensions_get_the_shape_of_the_mask():
    # An expanded (stride-0) batch is computed once but the table follows
    # the mask's sizes, which is what the fake implementation promises.
    gen = torch.Generator().manual_seed(0)
    mask = _block_structured((1, 1, 20, 40), gen, "bool").expand(3, 1, 20, 40)
    bm = flashfuse.block_mask(mask)
    assert bm.key_table.shape == (3, 1, 2, 5) and bm.query_table.shape == (3, 1, 2, 4)
    want_keys, want_queries = _expected(mask.contiguous(), 20, 40, _ref_band({}))
    assert torch.equal(bm.key_table, want_keys) and torch.equal(bm.query_table, want_queries)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fk, fq = torch.ops.flashfuse.block_mask(torch.empty(3, 1, 20, 40, dtype=torch.bool), 20, 40)
    assert fk.shape == bm.key_table.shape and fq.shape == bm.query_table.shape


def _qkv(B, H, N, M, D, gen, dtype=torch.float32):
    mk = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    return mk(B, H, N, D), mk(B, H, M, D), mk(B, H, M, D)


def _run(q, k, v, mask, dropout_p=0.0, **kw):
    torch.manual_seed(5)  # the same dropout draw for both calls
    out = flashfuse.attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **kw)
    own = mask.mask if isinstance(mask, BlockMask) else mask
    inputs = [t for t in (q, k, v, own) if t is not None and t.requires_grad]
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, inputs, go)
    return out, grads


@pytest.mark.parametrize("case", ["float-bias-causal", "bool-window-dropout", "bool-fill", "padding-bottom-right"])
def test_shared_block_mask_gives_the_same_bits(case, monkeypatch):
    # Forward and every gradient (the float mask's included), with the
    # tables from a block mask and with the op building its own.
    gen = torch.Generator().manual_seed(11)
    B, H, N, M, D = 2, 2, 20, 36, 16
    q, k, v = _qkv(B, H, N, M, D, gen)
    kw, dropout_p = {}, 0.0
    if case == "float-bias-causal":
        mask = _block_structured((B, 1, N, M), gen, "float32-min", values="bias").requires_grad_()
        kw = {"is_causal": True}
    elif case == "bool-window-dropout":
        mask = _block_structured((1, H, N, M), gen, "bool")
        kw, dropout_p = {"window_left": 7, "window_right": 4}, 0.25
    elif case == "bool-fill":
        mask = _block_structured((B, 1, N, M), gen, "bool")
        kw = {"mask_fill": torch.finfo(torch.float32).min}
    else:
        mask = _block_structured((B, 1, 1, M), gen, "bfloat16-min").float()
        kw = {"is_causal": True, "alignment": "bottom_right"}
    want_out, want_grads = _run(q, k, v, mask, dropout_p, **kw)
    bm = flashfuse.block_mask(mask, N, M, **kw)

    def built_again(*args, **kwargs):
        raise AssertionError("the kernels built tables the block mask holds")

    # The tables come from the block mask: the launchers must not build them.
    import flashfuse.kernels.mask_ranges as mask_ranges

    # The one builder of the launchers (mask_ranges.mask_tables) calls these.
    for name in ("mask_key_table", "mask_query_table"):
        monkeypatch.setattr(mask_ranges, name, built_again)
    got_out, got_grads = _run(q, k, v, bm, dropout_p)
    assert torch.equal(got_out, want_out)
    assert len(got_grads) == len(want_grads)
    for got, want in zip(got_grads, want_grads):
        assert torch.equal(got, want)


def test_one_block_mask_serves_several_layers_and_the_backward():
    gen = torch.Generator().manual_seed(2)
    B, H, N, D = 1, 1, 20, 16
    mask = _block_structured((B, 1, N, N), gen, "float32-min")
    bm = flashfuse.block_mask(mask, is_causal=True)
    x0, k, v = _qkv(B, H, N, N, D, gen)

    def layers(m, **kw):
        x = x0
        for _ in range(3):
            x = flashfuse.attention(x, k, v, attn_mask=m, **kw)
        return x, torch.autograd.grad(x.sum(), (x0, k, v))

    want_out, want_grads = layers(mask, is_causal=True)
    got_out, got_grads = layers(bm)
    assert torch.equal(got_out, want_out) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


def test_block_mask_under_compile_matches_eager():
    # The op and its fake trace: a compiled function building one block
    # mask for two layers gives eager's bits (aot_eager keeps the ops).
    gen = torch.Generator().manual_seed(4)
    B, H, N, D = 1, 1, 16, 16
    mask = _block_structured((B, 1, N, N), gen, "bool")
    q, k, v = _qkv(B, H, N, N, D, gen)

    def fn(q, k, v, mask):
        bm = flashfuse.block_mask(mask, is_causal=True)
        return flashfuse.attention(flashfuse.attention(q, k, v, attn_mask=bm), k, v, attn_mask=bm)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    want = fn(q, k, v, mask)
    assert torch.equal(got, want)
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g_got, g_want))
    torch._dynamo.reset()


def test_bad_tables_and_contradicting_bands_raise():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(1, 2, 20, 40, 16, gen)
    mask = _block_structured((1, 1, 20, 40), gen, "bool")
    bm = flashfuse.block_mask(mask, is_causal=True)
    with pytest.raises(ValueError, match="contradicts the block mask"):
        flashfuse.attention(q, k, v, attn_mask=bm, window_left=3)
    other = flashfuse.block_mask(torch.ones(1, 1, 40, 40, dtype=torch.bool), find_band=False)
    with pytest.raises(ValueError, match="built for q_len=40"):
        flashfuse.attention(q, k, v, attn_mask=other)
    with pytest.raises(ValueError, match="does not fit"):
        torch.ops.flashfuse.attention(q, k, v, mask, mask_key_table=other.key_table)
    with pytest.raises(ValueError, match="without the attn_mask"):
        torch.ops.flashfuse.attention(q, k, v, None, mask_key_table=bm.key_table)
    with pytest.raises(ValueError, match="does not broadcast"):
        flashfuse.block_mask(mask, 21, 40)
    assert isinstance(bm, BlockMask) and bm.window_right == 0 and bm.q_len == 20 and bm.kv_len == 40


# --------------------------------------------------------------------------
# The Hugging Face hook: one block mask per mask object and forward
# --------------------------------------------------------------------------


class _Layer(torch.nn.Module):
    is_causal = True


@pytest.fixture
def table_builds(monkeypatch):
    ffhf = pytest.importorskip("flashfuse.hf")
    import flashfuse.block_mask  # noqa: F401

    calls = []
    real = torch.ops.flashfuse.block_mask

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ffhf, "_block_mask_op", spy)
    monkeypatch.setattr(ffhf, "_TABLE_CACHE", [])
    return ffhf, calls


def test_hf_hook_builds_the_tables_once_per_mask(table_builds):
    ffhf, calls = table_builds
    gen = torch.Generator().manual_seed(6)
    B, H, N, D = 2, 2, 20, 16
    mask = _block_structured((B, 1, N, N), gen, "bool")
    x, k, v = _qkv(B, H, N, N, D, gen)
    layer = _Layer().train(False)
    outs = []
    for _ in range(3):  # three layers, one mask object
        outs.append(ffhf.flashfuse_attention_forward(layer, x, k, v, mask)[0])
    assert len(calls) == 1
    want = flashfuse.attention(x, k, v, attn_mask=mask).transpose(1, 2)
    assert all(torch.equal(o, want) for o in outs)


def test_hf_hook_frees_a_masks_tables_when_the_mask_dies(table_builds):
    """Nothing the hook keeps outlives the mask: a kept table would hold
    memory through the rest of a generate() and move where the next static
    cache lands (and the CUDA graphs recorded against its addresses)."""
    ffhf, calls = table_builds
    gen = torch.Generator().manual_seed(8)
    B, H, N, D = 1, 2, 20, 16
    x, k, v = _qkv(B, H, N, N, D, gen)
    layer = _Layer().train(False)
    mask = _block_structured((B, 1, N, N), gen, "bool")
    ffhf.flashfuse_attention_forward(layer, x, k, v, mask)
    kept = weakref.ref(ffhf._TABLE_CACHE[0][2][0])
    assert len(calls) == 1 and kept() is not None
    del mask, calls[:]
    gc.collect()
    assert ffhf._TABLE_CACHE == [] and kept() is None  # no masked call since


def test_hf_hook_never_reuses_tables_of_a_changed_or_other_mask(table_builds):
    ffhf, calls = table_builds
    gen = torch.Generator().manual_seed(7)
    B, H, N, D = 1, 2, 20, 16
    x, k, v = _qkv(B, H, N, N, D, gen)
    layer = _Layer().train(False)
    mask = torch.ones(B, 1, N, N, dtype=torch.bool)
    ffhf.flashfuse_attention_forward(layer, x, k, v, mask)
    mask[..., 16:] = False  # written in place: the old tables would skip nothing
    got = ffhf.flashfuse_attention_forward(layer, x, k, v, mask)[0]
    assert len(calls) == 2
    assert torch.equal(got, flashfuse.attention(x, k, v, attn_mask=mask).transpose(1, 2))
    # A new mask object (perhaps at the old one's address) is never taken
    # for the old one.
    del mask
    gc.collect()
    other = _block_structured((B, 1, N, N), gen, "bool")
    got = ffhf.flashfuse_attention_forward(layer, x, k, v, other)[0]
    assert len(calls) == 3 and calls[-1] is other
    assert torch.equal(got, flashfuse.attention(x, k, v, attn_mask=other).transpose(1, 2))
    assert not math.isnan(got.sum().item())


@pytest.mark.gpu
def test_shared_block_mask_gives_the_same_bits_on_the_gpu(monkeypatch):
    # Two passes: one-pass dQ adds with atomics, whose order (and so dQ's
    # last bits) varies between any two calls.
    monkeypatch.setenv("FLASHFUSE_BWD", "two_pass")
    gen = torch.Generator().manual_seed(0)
    B, H, N, D = 2, 4, 1000, 64
    q, k, v = (t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in _qkv(B, H, N, N, D, gen))
    later = torch.ones(N, N, dtype=torch.bool).triu(1)
    mask = torch.zeros(B, 1, N, N).masked_fill(later, torch.finfo(torch.bfloat16).min).to(torch.bfloat16).cuda()
    for dropout_p in (0.0, 0.1):
        want_out, want_grads = _run(q, k, v, mask, dropout_p)
        got_out, got_grads = _run(q, k, v, flashfuse.block_mask(mask, find_band=False), dropout_p)
        assert torch.equal(got_out, want_out) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


# --------------------------------------------------------------------------
# Masks that are bands: found once, run as the band without the mask
# --------------------------------------------------------------------------

def _effective(mask, N, M, band, fill=None):
    """Bool (Bm, Hm, N, M): the pairs that take part with this mask inside
    this band (the kernels' rule: bool True; float above the hiding
    threshold), by brute force."""
    full = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    full = full.expand(full.shape[0], full.shape[1], N, M)
    if full.dtype == torch.bool:
        part = full
    else:
        part = full.float() > (-65504.0 if mask.dtype == torch.float16 else -1.0e38)
    vis = flashfuse.reference.visibility_mask(N, M, window_left=band.get("window_left"),
                                              window_right=band.get("window_right"),
                                              bottom_right=band.get("alignment") == "bottom_right")
    return part if vis is None else part & vis


def _band_args(b):
    return {"window_left": b.window_left, "window_right": b.window_right, "alignment": b.alignment}


def _as_kind(visible, kind):
    """``visible`` written as models write masks of ``kind``."""
    if kind == "bool":
        return visible
    dtype, hidden = {"float32-min": (torch.float32, torch.finfo(torch.float32).min),
                     "bfloat16-min": (torch.bfloat16, torch.finfo(torch.bfloat16).min),
                     "float16-min": (torch.float16, -65504.0), "float32-inf": (torch.float32, -math.inf)}[kind]
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, hidden)


BAND_MASKS = {  # name: (N, M, the visible pairs as a band of j - i, the block mask's own band)
    "causal": (37, 37, {"window_right": 0}, {}),
    "causal-short-queries": (21, 50, {"window_right": 0}, {}),
    "bottom-right-causal": (21, 50, {"window_right": 0, "alignment": "bottom_right"}, {}),
    "bottom-right-more-queries": (50, 21, {"window_right": 0, "alignment": "bottom_right"}, {}),
    "sliding-window": (45, 45, {"window_left": 6, "window_right": 0}, {}),
    "two-sided-window": (40, 33, {"window_left": 3, "window_right": 5}, {}),
    "nothing-hidden": (19, 70, {}, {}),
    "window-inside-causal": (40, 40, {"window_left": 9}, {"is_causal": True}),
    "causal-given-bottom-right": (30, 47, {"window_right": 0}, {"is_causal": True, "alignment": "bottom_right"}),
}


@pytest.fixture(params=["kernel", "torch"])
def band_path(request, monkeypatch):
    """find_band through its kernel (Triton's interpreter on CPU) and
    through its torch operations (where no kernel can run)."""
    if request.param == "torch":
        monkeypatch.setattr(sys.modules["flashfuse.block_mask"], "_kernels_available", lambda mask: False)
    return request.param


@pytest.mark.parametrize("kind", ["bool", "float32-min", "bfloat16-min", "float16-min", "float32-inf"])
@pytest.mark.parametrize("name", list(BAND_MASKS))
def test_find_band_recognises_bands_written_as_tensors(name, kind, band_path):
    N, M, pattern, own = BAND_MASKS[name]
    visible = flashfuse.reference.visibility_mask(N, M, window_left=pattern.get("window_left"),
                                                  window_right=pattern.get("window_right"),
                                                  bottom_right=pattern.get("alignment") == "bottom_right")
    visible = torch.ones(N, M, dtype=torch.bool) if visible is None else visible
    mask = _as_kind(visible, kind).expand(2, 1, N, M).contiguous()  # a batch of equal masks, as HF builds them
    bm = flashfuse.block_mask(mask, N, M, **own)
    own_band = {"window_left": own.get("window_left"), "window_right": 0 if own.get("is_causal") else None,
                "alignment": own.get("alignment", "top_left")}
    empty_rows = not _effective(mask, N, M, own_band).any(-1).all()
    finite_hidden = kind not in ("bool", "float32-inf")
    if empty_rows and finite_hidden:
        # A row it hides entirely with finite values averages them: no band does that.
        assert bm.band is None and bm.key_table.numel() > 0
        return
    assert bm.band is not None, "a band written as a tensor was not found"
    assert bm.key_table.numel() == 0 and bm.query_table.numel() == 0  # no tables built
    for w in (bm.band.window_left, bm.band.window_right):
        assert w is None or w >= 0
    got = _effective(torch.ones(1, 1, 1, 1, dtype=torch.bool), N, M, _band_args(bm.band))
    assert torch.equal(got[0, 0], _effective(mask, N, M, own_band)[0, 0])


def _not_bands():
    N, M = 30, 30
    causal = torch.ones(N, M, dtype=torch.bool).tril()
    one_pair = causal.clone()
    one_pair[17, 3] = False
    per_batch = causal.expand(2, N, M).clone()
    per_batch[1, 5, 0] = False  # the second batch hides one pair the first shows
    padded = causal.expand(2, 1, N, M).clone()
    padded[1, ..., 25:] = False
    bias = _as_kind(causal, "float32-min")
    bias[20, 4] = 0.25  # a visible value that changes the score
    nan = _as_kind(causal, "float32-min")
    nan[9, 2] = math.nan
    holes = causal & ~torch.eye(N, dtype=torch.bool).roll(-3, 1)  # a diagonal of holes inside the band
    return {"one-pair": one_pair, "per-batch": per_batch.unsqueeze(1), "padding": padded, "bias": bias,
            "nan": nan, "holes": holes, "random": torch.rand(N, M, generator=torch.Generator().manual_seed(0)) > 0.5}


@pytest.mark.parametrize("name", list(_not_bands()))
def test_find_band_refuses_masks_that_are_not_bands(name, band_path):
    mask = _not_bands()[name]
    assert find_band(mask, 30, 30) is None
    bm = flashfuse.block_mask(mask, 30, 30)
    assert bm.band is None and bm.key_table.numel() > 0


def test_find_band_with_fills_and_rows_it_hides(band_path):
    N, M = 20, 12
    br = flashfuse.reference.visibility_mask(N, M, window_right=0, bottom_right=True)  # rows 0-7 see nothing
    assert find_band(br, N, M) == MaskBand(None, 0, "bottom_right")
    # With a finite fill those rows average their filled keys: not a band.
    assert find_band(br, N, M, mask_fill=-1e30) is None
    square = torch.ones(N, N, dtype=torch.bool).tril()
    assert find_band(square, N, N, mask_fill=-1e30) is not None  # every row keeps a key: fills weigh 0
    assert find_band(square, N, N, mask_fill=-100.0) is None  # a fill that takes part
    assert flashfuse.block_mask(square, mask_fill=0.0).band is None


def test_find_band_reads_large_masks_in_chunks_and_skips_larger_ones(monkeypatch):
    # The torch operations' path (no kernels: CPU without the interpreter).
    bmod = sys.modules["flashfuse.block_mask"]  # flashfuse.block_mask is the function
    monkeypatch.setattr(bmod, "_kernels_available", lambda mask: False)
    N = 64
    mask = _as_kind(flashfuse.reference.visibility_mask(N, N, window_left=5, window_right=0), "bfloat16-min")
    monkeypatch.setattr(bmod, "_BAND_CHUNK", 3 * N)  # three rows per chunk
    assert bmod.find_band(mask, N, N) == bmod.MaskBand(5, 0, "top_left")
    mask[40, 30] = 0.0  # one visible pair outside the window, in a later chunk
    assert bmod.find_band(mask, N, N) is None
    mask[40, 30] = -math.inf
    monkeypatch.setattr(bmod, "BAND_CHECK_MAX_ELEMENTS", N * N - 1)
    assert bmod.find_band(mask, N, N) is None and flashfuse.block_mask(mask).band is None


def test_find_band_is_skipped_for_masks_that_want_a_gradient_and_on_request():
    causal = _as_kind(torch.ones(16, 16, dtype=torch.bool).tril(), "float32-min")
    assert find_band(causal.requires_grad_(), 16, 16) is None
    assert flashfuse.block_mask(causal.detach(), find_band=False).band is None
    with torch._subclasses.fake_tensor.FakeTensorMode():  # no data to read
        assert find_band(torch.ones(16, 16, dtype=torch.bool).tril(), 16, 16) is None


@pytest.mark.parametrize("case", ["bf16-causal-dropout", "bool-window-gqa", "bottom-right-lse", "nothing-hidden"])
def test_a_band_block_mask_runs_the_band(case, monkeypatch):
    # The calls take the band without the mask: the kernels build and read
    # no tables, and forward and gradients are the band's own bits and
    # match the float64 reference with the mask.
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hkv, D = 2, 4, 2, 16
    N, M, pattern, own, kind, dropout_p = {
        "bf16-causal-dropout": (33, 33, {"window_right": 0}, {}, "bfloat16-min", 0.2),
        "bool-window-gqa": (40, 40, {"window_left": 7, "window_right": 0}, {}, "bool", 0.0),
        "bottom-right-lse": (20, 45, {"window_right": 0, "alignment": "bottom_right"}, {}, "float32-inf", 0.0),
        "nothing-hidden": (24, 37, {}, {"is_causal": True}, "float32-min", 0.0),
    }[case]
    vis = flashfuse.reference.visibility_mask(N, M, window_left=pattern.get("window_left"),
                                              window_right=pattern.get("window_right"),
                                              bottom_right=pattern.get("alignment") == "bottom_right")
    mask = _as_kind(torch.ones(N, M, dtype=torch.bool) if vis is None else vis, kind)[None, None]
    mask = mask.expand(B, 1, N, M).contiguous()
    bm = flashfuse.block_mask(mask, N, M, **own)
    assert bm.band is not None
    q = torch.randn(B, Hq, N, D, generator=gen).requires_grad_()
    k, v = (torch.randn(B, Hkv, M, D, generator=gen).requires_grad_() for _ in range(2))

    import flashfuse.kernels.mask_ranges as mask_ranges

    def built(*args, **kwargs):
        raise AssertionError("a band block mask built mask tables")

    for name in ("mask_key_table", "mask_query_table"):
        monkeypatch.setattr(mask_ranges, name, built)

    def run(**kw):
        torch.manual_seed(5)
        if case == "bottom-right-lse":
            out, lse = flashfuse.attention_with_lse(q, k, v, enable_gqa=True, **kw)
            out = out + lse.unsqueeze(-1)  # both results reach the gradients
        else:
            out = flashfuse.attention(q, k, v, dropout_p=dropout_p, enable_gqa=True, **kw)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return (out, *torch.autograd.grad(out, (q, k, v), go))

    got = run(attn_mask=bm)
    want = run(**_band_args(bm.band))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if dropout_p == 0.0 and case != "bottom-right-lse":
        # The float64 reference with the mask itself (and the block mask's own band).
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        rep = Hq // Hkv
        ref = flashfuse.reference.reference_attention(
            leaves[0], leaves[1].repeat_interleave(rep, 1), leaves[2].repeat_interleave(rep, 1),
            attn_mask=mask if kind == "bool" else mask.double(), window_right=0 if own.get("is_causal") else None)
        go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).double()
        ref_grads = torch.autograd.grad(ref, leaves, go)
        for a, b in zip(got, (ref, *ref_grads)):
            assert (a.double() - b).abs().max().item() < 1e-4


@pytest.mark.gpu
def test_a_band_block_mask_runs_the_band_kernels_on_the_gpu():
    # Hugging Face's causal mask (B, 1, N, N) in bf16: found on the device,
    # then the is_causal kernels' own bits, forward and backward, with and
    # without dropout.
    gen = torch.Generator().manual_seed(0)
    B, H, N, D = 2, 4, 1000, 64
    q, k, v = (t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in _qkv(B, H, N, N, D, gen))
    later = torch.ones(N, N, dtype=torch.bool).triu(1)
    mask = torch.zeros(B, 1, N, N).masked_fill(later, torch.finfo(torch.bfloat16).min).to(torch.bfloat16).cuda()
    bm = flashfuse.block_mask(mask)
    assert bm.band is not None and bm.band.window_right == 0 and bm.band.window_left is None
    for dropout_p in (0.0, 0.1):
        want_out, want_grads = _run(q, k, v, mask, dropout_p)
        got_out, got_grads = _run(q, k, v, bm, dropout_p)
        band_out, band_grads = _run(q, k, v, None, dropout_p, is_causal=True)
        assert torch.equal(got_out, band_out) and all(torch.equal(a, b) for a, b in zip(got_grads, band_grads))
        torch.testing.assert_close(got_out, want_out, atol=2e-2, rtol=0)


def test_find_band_falls_back_to_torch_when_its_kernel_fails(monkeypatch):
    bmod = sys.modules["flashfuse.block_mask"]

    def broken(*args):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(bmod, "_kernels_available", lambda mask: True)
    monkeypatch.setattr(bmod, "_band_rows_kernel", broken)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    with pytest.warns(RuntimeWarning, match="no kernel today"):
        assert find_band(causal, 24, 24) == MaskBand(None, 0, "top_left")
