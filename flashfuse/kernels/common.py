"""Triton helpers shared by the forward and backward kernels.

Both passes must agree bit for bit on which (query, key) pairs are visible and
which probabilities dropout keeps, so those two rules live here and nowhere
else. ``flashfuse.reference`` re-implements the same rules in PyTorch. The
host side of launching (configs, binaries) is in ``launch``.
"""

import triton
import triton.language as tl


# Mask kinds: the MASK_KIND constexpr of every attention and table kernel.
# The launchers use the plain ints (they go into launcher keys and the tuning
# cache's entries as numbers); kernel bodies compare with the constexpr twins,
# since Triton reads only constexpr globals inside a kernel.
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
MASK_NONE_C, MASK_BOOL_C, MASK_FLOAT_C = tl.constexpr(MASK_NONE), tl.constexpr(MASK_BOOL), tl.constexpr(MASK_FLOAT)


def mask_kind(mask) -> int:
    """The kind of an attention mask (None, bool or bytes, floating)."""
    import torch

    if mask is None:
        return MASK_NONE
    return MASK_BOOL if mask.dtype in (torch.bool, torch.uint8) else MASK_FLOAT


@triton.jit
def _visible(
    offs_m,
    offs_n,
    N,
    M,
    DIAG_OFFSET,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) bool tile: query i may look at key j.

    Out-of-range rows and columns are invisible. With a window, key j is
    visible to query i when
    ``i + DIAG_OFFSET - WINDOW_LEFT <= j <= i + DIAG_OFFSET + WINDOW_RIGHT``
    (a causal mask is ``WINDOW_RIGHT = 0`` with no left bound).
    """
    i = offs_m[:, None]
    j = offs_n[None, :]
    vis = (i < N) & (j < M)
    if HAS_WINDOW_RIGHT:
        vis = vis & (j <= i + DIAG_OFFSET + WINDOW_RIGHT)
    if HAS_WINDOW_LEFT:
        vis = vis & (j >= i + DIAG_OFFSET - WINDOW_LEFT)
    return vis


@triton.jit
def _mask_block_start(start, BLOCK: tl.constexpr):
    """``start``, a multiple of BLOCK, written so that the compiler sees it.
    A loop bound computed at run time hides it, and then a mask tile's
    address has no known alignment: its load cannot vectorise, the software
    pipeliner leaves it in registers in its own layout, and the softmax is
    computed twice, once in that layout and once in the product's (about
    twice the registers; bench/NOTES.md run 20)."""
    return (start // BLOCK) * BLOCK


@triton.jit
def _mask_tile_bounds(query_ok, key_ok, KEY_BOUNDS: tl.constexpr):
    """The bounds of a mask tile's load, from its rows' and keys' tests
    (already shaped for the tile): the query rows always, the keys only
    where a block can pass M (KEY_BOUNDS). A per-key bound stops the load
    from vectorising, as an unknown alignment does (``_mask_block_start``)."""
    if KEY_BOUNDS:
        ok = query_ok & key_ok
    else:
        ok = query_ok
    return ok


@triton.jit
def _block_crosses_edge(
    m0,
    n0,
    N,
    M,
    DIAG_OFFSET,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Whether the (BLOCK_M, BLOCK_N) block at rows m0, keys n0 may hold a
    pair that ``_visible`` rejects (past the tensor's end or outside the
    band), so that the element-wise test is needed there and only there."""
    edge = (m0 + BLOCK_M > N) | (n0 + BLOCK_N > M)
    if HAS_WINDOW_RIGHT:
        edge = edge | (n0 + BLOCK_N - 1 > m0 + DIAG_OFFSET + WINDOW_RIGHT)
    if HAS_WINDOW_LEFT:
        edge = edge | (n0 < m0 + BLOCK_M - 1 + DIAG_OFFSET - WINDOW_LEFT)
    return edge


@triton.jit
def _mask_key_span(key_table, offs_m, N, lo_blk, hi_blk, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks of the rows ``offs_m`` from the key table of
    ``mask_ranges`` (``key_table`` points at this (batch, head)'s entries of
    five int32): ``[lo_blk, hi_blk)`` narrowed to the blocks where some row
    has a score the mask lets take part, and within them ``[free_lo,
    free_hi)``, the blocks every row sees through a neutral mask value (no
    mask read needed). All bounds are multiples of BLOCK_N, with
    ``lo <= free_lo <= free_hi <= hi``. (The dK/dV kernel reads the query
    table the same way, its loads written out in place.)"""
    e = key_table + (offs_m // GROUP) * 5
    real = offs_m < N
    r_lo = tl.min(tl.load(e, mask=real, other=2147483647), 0)
    r_hi = tl.max(tl.load(e + 1, mask=real, other=0), 0)
    f_lo = tl.max(tl.load(e + 2, mask=real, other=0), 0)
    f_hi = tl.min(tl.load(e + 3, mask=real, other=2147483647), 0)
    return _narrow_span(lo_blk, hi_blk, r_lo, r_hi, f_lo, f_hi, BLOCK_N)


@triton.jit
def _narrow_span(lo, hi, r_lo, r_hi, f_lo, f_hi, BLOCK: tl.constexpr):
    """Blocks ``[lo, hi)`` (lo a multiple of BLOCK) narrowed to the reduced
    table entry: ``[r_lo, r_hi)`` where something takes part, and within it
    ``[f_lo, f_hi)`` where the mask is neutral. Returns ``(lo, hi, free_lo,
    free_hi)`` with ``lo <= free_lo <= free_hi <= hi``; lo and the free
    bounds are multiples of BLOCK or equal to hi, so a loop from lo in steps
    of BLOCK visits the same blocks with hi rounded up or not. Takes loaded
    values, not the table's pointer: see the dK/dV kernel's read."""
    new_lo = tl.maximum(lo + 0 * r_lo, (r_lo // BLOCK) * BLOCK)  # + 0 * r_lo: lo may be a Python int
    new_hi = tl.maximum(tl.minimum(hi + 0 * r_hi, tl.cdiv(r_hi, BLOCK) * BLOCK), new_lo)  # empty: lo == hi
    free_lo = tl.minimum(tl.maximum(tl.cdiv(f_lo, BLOCK) * BLOCK, new_lo), new_hi)
    free_hi = tl.maximum(tl.minimum((tl.maximum(f_hi, 0) // BLOCK) * BLOCK, new_hi), free_lo)
    return new_lo, new_hi, free_lo, free_hi


# Rows that a finite mask value hides entirely average the values of their
# keys; their lse is stored as a marker holding the number of keys, l
# (``reference.lse_marker``: -FLT_MAX + l * 2**104), because m + log(l)
# rounds to m in float32 when m is huge. The forward marks a float-masked
# row whose largest base-2 score is at or below AVERAGE_AT_BASE2 (other
# scores of the row are then at least 64 below it: exp2 gives exactly 0 or
# 1), and with FILL == 2 a bool-masked row whose largest score is the fill.
AVERAGE_AT_BASE2 = tl.constexpr(-774541002.0)  # -2**29 * log2(e): reference._AVERAGE_AT in base 2
FLT_MAX = tl.constexpr(3.4028234663852886e38)
LSE_MARK_UNIT = tl.constexpr(2.028240960365167e31)  # 2**104
LSE_MARK_MAX_KEYS = tl.constexpr(8388607.0)  # 2**23 - 1: markers stay below -1e38


@triton.jit
def _lse_marked(lse, l_i, uniform):
    """The forward's stored lse: the marker for ``uniform`` rows (``l_i``
    keys, each with probability 1 / l_i), ``lse`` for the others."""
    return tl.where(uniform, -FLT_MAX + tl.minimum(l_i, LSE_MARK_MAX_KEYS) * LSE_MARK_UNIT, lse)


@triton.jit
def _lse_cap(lse):
    """Per row, from the stored lse: 1 / l for a marked row, 1 for others.
    Computed once per row (the backward's preprocess kernel): in the dK/dV
    loop, which reads lse per query block, its special-function ops cost
    several hundred instructions per iteration."""
    marked = lse <= -1.0e38
    return tl.where(marked, 1.0 / tl.where(marked, (lse + FLT_MAX) * (1.0 / LSE_MARK_UNIT), 1.0), 1.0)


@triton.jit
def _lse_shift(lse, fill, MASK_KIND: tl.constexpr, FILL: tl.constexpr):
    """Per row, from the stored natural-log ``lse``: ``shift`` such that,
    with ``cap`` from ``_lse_cap``, a recomputed probability is

    * float mask (MASK_FLOAT): ``min(exp2((s - shift) * log2(e)), cap)``,
      ``s`` the natural-log score. A marked row gets shift -FLT_MAX, so
      every finite score gives at least 1, capped at 1 / l; other rows get
      cap 1, above any of their probabilities.
    * bool mask with a marking fill (FILL == 2): ``exp2(s - shift) * cap``,
      ``s`` in base 2 with hidden pairs at ``fill`` (base 2): a marked row is
      shifted by its largest score, the fill, and scaled by 1 / l.
    * otherwise: ``exp2(s - shift)``, cap unused.
    """
    marked = lse <= -1.0e38
    if MASK_KIND == MASK_FLOAT_C:
        shift = tl.where(lse == float("-inf"), float("inf"), lse)
        shift = tl.where(marked, -FLT_MAX, shift)
    elif FILL == 2:
        shift = tl.where(marked, fill, _lse_base2(lse))
    else:
        shift = _lse_base2(lse)
    return shift


@triton.jit
def _lse_base2(lse):
    """Natural-log lse to base 2. A row with no visible key has lse = +inf
    (or -inf from some producers): +inf, so its probabilities are exactly 0.
    A marked row (see ``_lse_shift``) overflows in base 2: kept finite, so
    that a kernel that reads no mask (a block where the mask is neutral,
    which such a row never sees inside the band) gets 0 rather than NaN."""
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    return tl.maximum(lse, -3.0e38)


# Dropout draws 16 random bits per element: one Philox4x32-10 call (128
# bits) serves eight keys of one query. Fewer bits would make the drop rate a
# coarse multiple of 2**-DROPOUT_BITS; more would cost more Philox calls, which
# dominate the kernels' non-matrix work at small head dims.
DROPOUT_BITS = 16


def dropout_threshold(dropout_p: float) -> int:
    """Integer threshold ``round(p * 2**16)``: a 16-bit draw r keeps when
    ``r >= threshold``, so the keep rate is 1 - p to within 2**-17."""
    return int(round(float(dropout_p) * (1 << DROPOUT_BITS)))


@triton.jit
def _keep_halves(r, threshold):
    """Keep decisions (low half >= threshold, high half >= threshold) of the
    two 16-bit draws in each uint32 word of ``r``."""
    return (r & 0xFFFF).to(tl.int32) >= threshold, (r >> 16).to(tl.int32) >= threshold


@triton.jit
def _dropout_keep(seed, offs_m, offs_n, bh, threshold):
    """(BLOCK_M, BLOCK_N) bool tile: dropout keeps probability (i, j).

    Key j of query i uses Philox4x32-10 with counter
    ``(4 * (j >> 5) + ((j >> 1) & 3), i, bh, 0)``, takes the 16-bit half
    ``j & 1`` (0: low) of word ``(j >> 3) & 3`` and keeps when that draw is
    ``>= threshold`` (``dropout_threshold``). The eight keys of one call,
    ``32a + 8w + 2q + h`` for words w and halves h, are the ones a thread holds
    together in the tensor cores' accumulator layout (pairs of keys, eight
    apart), so the block form below draws them without moving data between
    threads. The stream depends only on the seed and the element's
    coordinates, so the backward regenerates the forward's mask exactly,
    whatever the tiling.
    """
    return _dropout_keep_at(seed, offs_m[:, None], offs_n[None, :], bh, threshold)


@triton.jit
def _dropout_keep_at(seed, i, j, bh, threshold):
    """Dropout's keep rule for broadcastable 2-D index tiles ``i`` (queries)
    and ``j`` (keys), e.g. ``i = offs_m[None, :]``, ``j = offs_n[:, None]``
    for a transposed (BLOCK_N, BLOCK_M) tile. Same stream as ``_dropout_keep``,
    which is this with ``i = offs_m[:, None]``, ``j = offs_n[None, :]``. One
    Philox call per element: for tests, odd layouts and narrow blocks, not hot
    loops.
    """
    c0 = (4 * (j >> 5) + ((j >> 1) & 3)).to(tl.uint32) + (i * 0).to(tl.uint32)
    c1 = i.to(tl.uint32) + (j * 0).to(tl.uint32)
    c2 = (c0 * 0) + bh.to(tl.uint32)
    c3 = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    word = (j >> 3) & 3
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    lo, hi = _keep_halves(r, threshold)
    return tl.where((j & 1) == 0, lo, hi)


@triton.jit
def _dropout_keep_block(seed, offs_m, start_n, bh, threshold, BLOCK_N: tl.constexpr):
    """``_dropout_keep(seed, offs_m, start_n + arange(BLOCK_N), bh, threshold)``
    at an eighth of the Philox work: one call per eight keys. ``start_n`` must
    be a multiple of BLOCK_N; blocks narrower than 32 keys take the
    per-element rule."""
    if BLOCK_N >= 32:
        A: tl.constexpr = BLOCK_N // 32
        i = offs_m[:, None, None]
        a = (start_n >> 5) + tl.arange(0, A)[None, :, None]
        q = tl.arange(0, 4)[None, None, :]
        c0 = (a * 4 + q).to(tl.uint32) + (i * 0).to(tl.uint32)  # (BLOCK_M, A, 4)
        c1 = i.to(tl.uint32) + (c0 * 0)
        c2 = (c0 * 0) + bh.to(tl.uint32)
        c3 = c0 * 0
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
        lo0, hi0 = _keep_halves(r0, threshold)
        lo1, hi1 = _keep_halves(r1, threshold)
        lo2, hi2 = _keep_halves(r2, threshold)
        lo3, hi3 = _keep_halves(r3, threshold)
        w0 = tl.join(lo0, hi0)  # (BLOCK_M, A, 4, 2): [m, a, q, h]
        w1 = tl.join(lo1, hi1)
        w2 = tl.join(lo2, hi2)
        w3 = tl.join(lo3, hi3)
        # [m, a, q, h, s, u] is word w = 2s + u; key 32a + 8w + 2q + h once
        # the word bits move in front of q. The permute and reshape only
        # rename register and lane indices: no data moves.
        keep = tl.join(tl.join(w0, w2), tl.join(w1, w3))
        keep = tl.permute(keep, (0, 1, 4, 5, 2, 3))
        keep = tl.reshape(keep, (offs_m.shape[0], BLOCK_N))
    else:
        keep = _dropout_keep(seed, offs_m, start_n + tl.arange(0, BLOCK_N), bh, threshold)
    return keep



# Soft-capping (``cap * tanh(s / cap)``) needs tanh in fp32. Written with
# exp2 rather than a libdevice call, whose availability and accuracy differ
# between Triton versions. For |x| >= 1/8, tanh|x| = (1 - e) / (1 + e) with
# e = exp(-2|x|) in (0, 0.78]: 1 - e loses at most ~2 bits. Below, the odd
# Taylor series to x**9 (error < 2e-12, far under fp32's spacing).
@triton.jit
def _tanh_parts(x):
    """``(tanh(x), 1 - tanh(x)**2)`` in fp32; the second as ``4e / (1 + e)**2``
    with ``e = exp(-2|x|)``, so it keeps its relative accuracy where tanh is
    close to 1 (``1 - tanh**2`` would cancel there)."""
    ax = tl.abs(x)
    e = tl.exp2(ax * -2.8853900817779268)  # exp(-2|x|), 2 * log2(e)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    t = tl.where(ax < 0.125, small, big)
    t = tl.where(x < 0.0, -t, t)
    one_plus = 1.0 + e
    return t, (4.0 * e) / (one_plus * one_plus)


@triton.jit
def _tanh(x):
    """tanh(x) in fp32, see ``_tanh_parts``."""
    t, _ = _tanh_parts(x)
    return t
