"""Triton helpers shared by the forward and backward kernels.

Both passes must agree bit for bit on which (query, key) pairs are visible and
which probabilities dropout keeps, so those two rules live here and nowhere
else. ``flashfuse.reference`` re-implements the same rules in PyTorch. The
host side of launching (configs, binaries) is in ``launch``.
"""

import triton
import triton.language as tl


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


# Dropout draws 16 random bits per element: one Philox4x32-10 call (128
# bits) serves eight consecutive keys. Fewer bits would make the drop rate a
# coarse multiple of 2**-DROPOUT_BITS; more would cost more Philox calls, which
# dominate the kernels' non-matrix work at small head dims.
DROPOUT_BITS = 16


def dropout_threshold(dropout_p: float) -> int:
    """Integer threshold ``round(p * 2**16)``: a 16-bit draw r keeps when
    ``r >= threshold``, so the keep rate is 1 - p to within 2**-17."""
    return int(round(float(dropout_p) * (1 << DROPOUT_BITS)))


@triton.jit
def _dropout_keep(seed, offs_m, offs_n, bh, threshold):
    """(BLOCK_M, BLOCK_N) bool tile: dropout keeps probability (i, j).

    One Philox4x32-10 call with counter ``(j >> 3, i, bh, 0)`` yields four
    32-bit words; key j takes half ``j & 1`` (0: low 16 bits) of word
    ``(j >> 1) & 3`` and keeps when that 16-bit draw is ``>= threshold``
    (``dropout_threshold``). The stream depends only on the seed and the
    element's coordinates, so the backward regenerates the forward's mask
    exactly, whatever the tiling.
    """
    return _dropout_keep_at(seed, offs_m[:, None], offs_n[None, :], bh, threshold)


@triton.jit
def _dropout_keep_at(seed, i, j, bh, threshold):
    """Dropout's keep rule for broadcastable 2-D index tiles ``i`` (queries)
    and ``j`` (keys), e.g. ``i = offs_m[None, :]``, ``j = offs_n[:, None]``
    for a transposed (BLOCK_N, BLOCK_M) tile. Same stream as ``_dropout_keep``,
    which is this with ``i = offs_m[:, None]``, ``j = offs_n[None, :]``. One
    Philox call per element: for tests and odd layouts, not hot loops.
    """
    c0 = (j >> 3).to(tl.uint32) + (i * 0).to(tl.uint32)
    c1 = i.to(tl.uint32) + (j * 0).to(tl.uint32)
    c2 = (c0 * 0) + bh.to(tl.uint32)
    c3 = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    word = (j >> 1) & 3
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    r = tl.where((j & 1) == 0, r & 0xFFFF, r >> 16)
    return r.to(tl.int32) >= threshold


@triton.jit
def _dropout_keep_block(seed, offs_m, start_n, bh, threshold, BLOCK_N: tl.constexpr):
    """``_dropout_keep(seed, offs_m, start_n + arange(BLOCK_N), bh, threshold)``
    at an eighth of the Philox work: one call per eight keys, its sixteen
    16-bit halves interleaved back into key order. ``start_n`` must be a
    multiple of 8 (block starts are multiples of BLOCK_N >= 16)."""
    GROUPS: tl.constexpr = BLOCK_N // 8
    i = offs_m[:, None]
    g = (start_n >> 3) + tl.arange(0, GROUPS)[None, :]
    c0 = g.to(tl.uint32) + (i * 0).to(tl.uint32)
    c1 = i.to(tl.uint32) + (g * 0).to(tl.uint32)
    c2 = (c0 * 0) + bh.to(tl.uint32)
    c3 = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    # Compare before interleaving: booleans are cheaper to move than words.
    k0l, k0h = (r0 & 0xFFFF).to(tl.int32) >= threshold, (r0 >> 16).to(tl.int32) >= threshold
    k1l, k1h = (r1 & 0xFFFF).to(tl.int32) >= threshold, (r1 >> 16).to(tl.int32) >= threshold
    k2l, k2h = (r2 & 0xFFFF).to(tl.int32) >= threshold, (r2 >> 16).to(tl.int32) >= threshold
    k3l, k3h = (r3 & 0xFFFF).to(tl.int32) >= threshold, (r3 >> 16).to(tl.int32) >= threshold
    # join(join(w0, w2), join(w1, w3))[m, g, y, x] is word 2y + x; joining the
    # low and high halves last puts the half innermost, so [m, g, y, x, h] is
    # key 8g + 2(2y + x) + h after the reshape: key order restored.
    lo = tl.join(tl.join(k0l, k2l), tl.join(k1l, k3l))
    hi = tl.join(tl.join(k0h, k2h), tl.join(k1h, k3h))
    return tl.reshape(tl.join(lo, hi), (offs_m.shape[0], BLOCK_N))
