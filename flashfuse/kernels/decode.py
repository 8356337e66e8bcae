"""Split-KV decoding kernels ("flash-decoding") and their launcher.

Decoding asks few queries (one per new token) of a long key/value cache. The
forward kernel's grid, one program per (query tile, query head, batch), then
has B * Hq programs for the whole GPU and reads every key/value head once per
query head. Here instead:

* one program takes all the query heads that share a key/value head (a GQA
  group of G heads) and all N new queries as the rows of one tile
  (row ``r`` is query ``r // G`` of head ``kvh * G + r % G``; padded to at
  least 16 rows for the tensor-core dot), so K and V are read once per
  key/value head; longer groups are cut into several row tiles;
* the keys of a row tile are split over ``S`` programs (``_decode_split``),
  each keeping its own online softmax and writing a float32 partial output
  (normalised) and its base-2 log-sum-exp, ``-inf`` when it saw no key;
* ``_decode_combine`` merges the S partials of each row exactly:
  ``lse = log2 sum_s 2**lse_s`` and ``out = sum_s 2**(lse_s - lse) out_s``.
  Splits that saw no key weigh 0; a row that saw no key at all gets output 0
  and lse ``+inf``, as the forward kernel gives it. With S = 1 the split
  kernel writes the final output itself.

Keys come from three layouts, all read through strides: the op's own
(B, Hkv, M, D) tensors, a contiguous cache (B, S_cache, Hkv, D) with a
per-row length, and a paged cache (num_pages, page_size, Hkv, D) with a block
table (B, max_pages) (see ``flashfuse.attention_with_kvcache``). Every key
index a program forms is below its row's length, which is clamped to the
cache's capacity, and every page index read from the table is clamped into
``[0, num_pages)``: bad table or length values give wrong numbers, never an
out-of-bounds read (the host checks them first where it can).

Visibility is the forward's rule with the row's own length ``L``: key j is
visible to query i when ``i + off - window_left <= j <= i + off +
window_right`` with ``off = L - N`` (bottom-right) or 0 (top-left).
A bool mask (broadcastable to (B, Hq, N, M), any strides, as a Hugging
Face static cache or padded batch hands it over) narrows that further: a
pair takes part when the band and the mask both let it. Before the split
kernel, ``_mask_bounds`` finds on the device, per batch row, the first and
last key any mask row shows, so the splits share only that span (a static
cache's unfilled tail costs no split time), and within it a key that no row
of a tile sees is never loaded. Float masks and ``mask_fill`` stay on the
forward kernel (rows a finite value hides entirely need its lse marker).
``out`` and ``lse`` have the forward kernel's layout and meaning, so the
existing backward kernels differentiate a decode forward unchanged.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import config
from .forward import _LOG2E, _clamp_window, _dot
from .launch import (
    ConfigLauncher, _autotune_enabled, _bucket, _dot_precision, _interpreting, bool_mask_as_bytes, cdiv, hint,
    next_pow2, static_int,
)

__all__ = ["decode_forward", "decode_suits", "choose_splits"]



@triton.jit(do_not_specialize=["M", "ROWS", "N_ROWS"])
def _mask_bounds(
    Mask, Bounds,
    stride_mb, stride_mh, stride_mn, stride_mm,
    M, ROWS, N_ROWS,
    BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
):
    """Grid (CHUNKS, B): where bool mask row b lets anything take part
    within chunk c of its keys (``CHUNKS`` chunks of whole BLOCK_K blocks,
    the last ones empty when M is small), over the mask's own ``ROWS``
    (head, query) rows (``N_ROWS`` queries per head; a broadcast dimension
    counts once). Writes ``Bounds[b, c] = (first, last + 1)`` of the visible
    keys, ``(2**31 - 1, 0)`` when there is none. The chunking is fixed by M
    alone, so that every key is covered whatever M is at run time."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    chunk = tl.cdiv(tl.cdiv(M, CHUNKS), BLOCK_K) * BLOCK_K
    c_lo = c * chunk
    c_hi = tl.minimum(c_lo + chunk, M)
    first = tl.full([BLOCK_K], 2147483647, dtype=tl.int32)
    last = tl.zeros([BLOCK_K], dtype=tl.int32)
    for r in range(0, ROWS):
        row = Mask + b * stride_mb + (r // N_ROWS).to(tl.int64) * stride_mh + (r % N_ROWS).to(tl.int64) * stride_mn
        for start in range(c_lo, c_hi, BLOCK_K):
            j = start + offs
            seen = tl.load(row + j.to(tl.int64) * stride_mm, mask=j < c_hi, other=0).to(tl.int32) != 0
            first = tl.minimum(first, tl.where(seen, j, 2147483647))
            last = tl.maximum(last, tl.where(seen, j + 1, 0))
    out = Bounds + (b * CHUNKS + c) * 2
    tl.store(out, tl.min(first, 0))
    tl.store(out + 1, tl.max(last, 0))


@triton.jit(do_not_specialize=["N", "G", "M_CAP", "NUM_PAGES", "S", "window_left", "window_right"])
def _decode_split(
    Q, K, V, SeqLens, Table, Mask, Bounds, OPart, LPart, Out, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_tb, stride_tp,
    stride_mb, stride_mh, stride_mn, stride_mm,
    stride_ob, stride_oh, stride_om, stride_od,
    Hq, N, G, M_CAP, NUM_PAGES, S,
    qk_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr, CHUNKS: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    DIRECT: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (S, Hkv * row tiles, B): split ``pid0`` of one row tile.

    K / V are addressed as ``base + page * stride_kb + slot * stride_kn +
    kvh * stride_kh``: without PAGED, page is the batch row and slot the key
    index; with PAGED, page is ``Table[b, j // PAGE_SIZE]`` and slot
    ``j % PAGE_SIZE``. ``M_CAP`` is the keys a row can hold (the cache
    length, or max_pages * PAGE_SIZE). DIRECT (S == 1): write Out (q's dtype)
    and Lse (natural log) directly; else OPart (B, Hq, N, S, BLOCK_DV) and
    LPart (B, Hq, N, S) float32, base 2. HAS_MASK: a bool mask (bytes,
    nonzero takes part) at ``Mask + b * stride_mb + h * stride_mh + i *
    stride_mn + j * stride_mm`` also decides visibility, and the keys are
    first narrowed to the row's ``Bounds`` (``_mask_bounds``, CHUNKS
    entries), so that the splits share only the keys the mask shows.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)
    s = tl.program_id(0)
    pid1 = tl.program_id(1)
    b = tl.program_id(2)
    rows_total = G * N
    n_tiles = tl.cdiv(rows_total, BLOCK_R)
    kvh = pid1 // n_tiles
    r0 = (pid1 % n_tiles) * BLOCK_R
    b64 = b.to(tl.int64)

    offs_r = r0 + tl.arange(0, BLOCK_R)
    row_ok = offs_r < rows_total
    qi = offs_r // G  # query index of each row
    h = kvh * G + offs_r % G  # query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_nb = tl.arange(0, BLOCK_N)

    if HAS_SEQLENS:
        L = tl.load(SeqLens + b)
        # Clamped to the capacity: no key index can pass the cache.
        L = tl.minimum(tl.maximum(L, 0), M_CAP)
    else:
        L = M_CAP + b * 0
    if BOTTOM_RIGHT:
        off = L - N
    else:
        off = L * 0
    # Key range of the tile: the union of its real rows' visible ranges.
    i_lo = r0 // G
    i_hi = (tl.minimum(r0 + BLOCK_R, rows_total) - 1) // G
    lo = L * 0
    hi = L
    if HAS_WINDOW_LEFT:
        lo = tl.maximum(i_lo + off - window_left, 0)
    if HAS_WINDOW_RIGHT:
        hi = tl.minimum(i_hi + off + window_right + 1, L)
    if HAS_MASK:
        # The mask's visible span of this batch row (a static cache's unfilled
        # tail, left padding): splits share it alone, none runs past it.
        bnd = Bounds + (b64 * CHUNKS + tl.arange(0, CHUNKS)) * 2
        lo = tl.maximum(lo, tl.min(tl.load(bnd), 0))
        hi = tl.minimum(hi, tl.max(tl.load(bnd + 1), 0))
        # A row showing nothing has first = 2**31 - 1: back into [0, L], so
        # that the empty span's keys stay in range.
        lo = tl.minimum(lo, L)
    hi = tl.maximum(hi, lo)
    # This split's share, whole key blocks from the tile's first block.
    lo_blk = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(hi - lo_blk, S), BLOCK_N) * BLOCK_N
    start = lo_blk + s * chunk
    end = tl.minimum(start + chunk, hi)

    q_ptrs = (Q + b64 * stride_qb + h.to(tl.int64)[:, None] * stride_qh + qi.to(tl.int64)[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < HEAD_DIM_V

    if HAS_MASK:
        m_rows = Mask + b64 * stride_mb + h.to(tl.int64) * stride_mh + qi.to(tl.int64) * stride_mn

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_nb
        col_ok = offs_n < end
        if PAGED:
            slot_idx = offs_n // PAGE_SIZE
            page = tl.load(Table + b64 * stride_tb + slot_idx.to(tl.int64) * stride_tp, mask=col_ok, other=0)
            # A page number out of range reads page 0 or the last one, never past the pool.
            page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
        else:
            page = b64 + offs_n.to(tl.int64) * 0
            slot = offs_n.to(tl.int64)
        k_rows = k_head + page * stride_kb + slot * stride_kn
        v_rows = v_head + page * stride_vb + slot * stride_vn
        vis = col_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW_RIGHT:
            vis = vis & (offs_n[None, :] <= qi[:, None] + off + window_right)
        if HAS_WINDOW_LEFT:
            vis = vis & (offs_n[None, :] >= qi[:, None] + off - window_left)
        kv_ok = col_ok
        if HAS_MASK:
            keep = tl.load(m_rows[:, None] + offs_n.to(tl.int64)[None, :] * stride_mm, mask=vis, other=0)
            vis = vis & (keep.to(tl.int32) != 0)
            # Keys no row of the tile sees are not read (a predicated-off
            # load moves no memory): holes and ends a cache leaves unfilled.
            kv_ok = tl.max(vis.to(tl.int32), 0) != 0
        k = tl.load(k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_ok[:, None] & d_ok, other=0.0)
        qk = _dot(q, tl.trans(k), INPUT_PRECISION, DOT_UPCAST) * qk_scale
        qk = tl.where(vis, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        m_shift = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.exp2(qk - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows[:, None] + offs_dv[None, :] * stride_vd, mask=kv_ok[:, None] & dv_ok, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, INPUT_PRECISION, DOT_UPCAST)
        m_i = m_ij

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    out = acc * inv_l[:, None]
    lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    row_base = (b64 * Hq + h.to(tl.int64)) * N + qi.to(tl.int64)  # (b, h, i) in (B, Hq, N)
    if DIRECT:
        lse = tl.where(empty, float("inf"), lse2 * 0.6931471805599453)
        o_ptrs = (Out + b64 * stride_ob + h.to(tl.int64)[:, None] * stride_oh + qi.to(tl.int64)[:, None] * stride_om
                  + offs_dv[None, :] * stride_od)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        tl.store(Lse + row_base, lse, mask=row_ok)
    else:
        part = row_base * S + s
        tl.store(OPart + part[:, None] * BLOCK_DV + offs_dv[None, :], out, mask=row_ok[:, None])
        tl.store(LPart + part, tl.where(empty, float("-inf"), lse2), mask=row_ok)


@triton.jit(do_not_specialize=["N", "S"])
def _decode_combine(
    OPart, LPart, Out, Lse,
    stride_ob, stride_oh, stride_om, stride_od,
    Hq, N, S,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (B * Hq * N,): merge the S partials of one row (flattened
    (b, h, i)) exactly."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < S
    lse_s = tl.load(LPart + row * S + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    none = m == float("-inf")
    w = tl.exp2(lse_s - tl.where(none, 0.0, m))  # 0 for splits that saw no key
    o_s = tl.load(OPart + (row * S + offs_s)[:, None] * BLOCK_DV + offs_dv[None, :], mask=s_ok[:, None], other=0.0)
    # where, not a product: an unwritten partial must not leak through a 0 weight.
    o = tl.sum(tl.where(w[:, None] > 0.0, o_s * w[:, None], 0.0), 0)
    wsum = tl.sum(w, 0)
    o = o / tl.where(none, 1.0, wsum)
    lse = tl.where(none, float("inf"), (m + tl.log2(tl.where(none, 1.0, wsum))) * 0.6931471805599453)
    per_batch = Hq * N
    bb = row // per_batch
    hh = (row % per_batch) // N
    ii = row % N
    o_ptrs = Out + bb * stride_ob + hh * stride_oh + ii * stride_om + offs_dv * stride_od
    tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    tl.store(Lse + row, lse)


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------

# (BLOCK_N, num_warps, num_stages), first = untuned default; few, so tuning a
# new shape class compiles few variants.
_CUDA_CONFIGS = [(64, 4, 3), (128, 4, 2), (64, 8, 3), (32, 4, 3)]
_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in _CUDA_CONFIGS]
_split_launcher = ConfigLauncher(_decode_split)
_combine_launcher = ConfigLauncher(_decode_combine)
_bounds_launcher = ConfigLauncher(_mask_bounds)

# Mask bounds: keys per block and chunks per batch row (a power of two, all
# read by every split program; 64 chunks keep each program's share of a long
# cache at a few kB).
_BOUNDS_BLOCK_K, _BOUNDS_CHUNKS = 1024, 64
_INTERPRET_BOUNDS_BLOCK_K, _INTERPRET_BOUNDS_CHUNKS = 16, 4

# Under the interpreter: small blocks so that tests cross several, and a
# stand-in SM count.
_INTERPRET_BLOCK_N = 16
_INTERPRET_SMS = 4

# Splits: enough programs for this many per SM, each at least this many keys
# (a multiple of every BLOCK_N), at most this many splits.
WAVES = 4
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 128

# The decode path is taken for up to this many queries per head ...
MAX_QUERIES = 16
# ... and this many rows (queries x group heads) per tile ...
MAX_ROWS = 128
# ... with at least this many keys (below, the forward kernel's grid is full enough).
MIN_KEYS = 512


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of t's device (a stand-in under the interpreter)."""
    if _interpreting(t):
        return _INTERPRET_SMS
    return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())


def row_tile(G: int, N: int) -> int:
    """Rows per tile: the G * N rows of a key/value head, padded to a power
    of two >= 16, at most MAX_ROWS (more rows take several tiles)."""
    return min(MAX_ROWS, max(16, next_pow2(G * N)))


def choose_splits(B: int, Hkv: int, row_tiles: int, keys: int, sms: int) -> int:
    """How many programs share a row tile's keys: enough for ``WAVES``
    programs per SM over the whole grid, none with fewer than
    ``MIN_SPLIT_KEYS`` keys. ``FLASHFUSE_DECODE_SPLITS`` forces a count."""
    forced = config.decode_splits()
    if forced is not None:
        return forced
    base = max(1, B * Hkv * row_tiles)
    want = cdiv(WAVES * sms, base)
    return max(1, min(want, cdiv(max(keys, 1), MIN_SPLIT_KEYS), MAX_SPLITS))


def decode_suits(q, k, attn_mask, dropout_p, window_left, window_right, bottom_right, mask_fill) -> bool:
    """Whether ``_attention_forward``'s arguments take the split-KV path:
    few queries, many keys, no mask tensor or a bool one whose hidden pairs
    take no part (no ``mask_fill``), no dropout, and a band aligned
    bottom-right, or none (without a band the alignment means nothing: a
    static cache's mask arrives so). ``FLASHFUSE_DECODE=0`` turns the path
    off, ``=1`` takes it whenever the arguments allow, whatever the sizes."""
    mode = config.decode()
    if mode == "0":
        return False
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return False  # a float mask's all-hidden rows need the forward's lse marker
    if dropout_p > 0.0 or mask_fill is not None:
        return False
    if (window_left is not None or window_right is not None) and not bottom_right:
        return False
    N, M = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    if mode == "1":
        return True
    return N <= MAX_QUERIES and G * N <= MAX_ROWS and M >= MIN_KEYS


def decode_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    bottom_right: bool = True,
    layout: str = "bhsd",
    num_splits: int | None = None,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention of few queries over a key/value cache.

    Args:
        q: (B, Hq, N, D) queries, any strides; fp16 / bf16 / fp32.
        k, v: keys and values in one of three layouts (any strides):
            ``layout="bhsd"``: (B, Hkv, M, D), the op's own;
            ``layout="bshd"``: (B, M, Hkv, D), a contiguous cache;
            paged (``block_table`` given): (num_pages, page_size, Hkv, D).
        scale: multiplier of q.k.
        cache_seqlens: None (every row sees all its keys) or int32 (B,):
            row b sees its first ``cache_seqlens[b]`` keys (clamped to the
            capacity here; the caller checks the values).
        block_table: None or int32 (B, max_pages): row b's key j lives in
            page ``block_table[b, j // page_size]`` at slot ``j % page_size``.
        window_left, window_right, bottom_right: the visibility band, as in
            the forward kernel, with M the row's own length.
        num_splits: force the split count (None: ``choose_splits``).
        attn_mask: None or a bool mask broadcastable to (B, Hq, N, M) with M
            the keys a row can hold, any strides: True takes part (with the
            band); a row that sees no key gets 0 and lse +inf. The splits
            share only the keys between the first and last that some row of
            the batch row sees (found on the device, ``_mask_bounds``).

    Returns:
        ``(out, lse)`` as the forward kernel returns them: out (B, Hq, N, Dv)
        in q's dtype laid out as ``empty(B, N, Hq, Dv).transpose(1, 2)``,
        lse float32 (B, Hq, N) natural log, +inf for rows that see no key.
    """
    B, Hq, N, D = q.shape
    D = static_int(D)
    Dv = static_int(v.shape[-1])
    if block_table is not None:
        num_pages, page_size, Hkv = k.shape[0], static_int(k.shape[1]), k.shape[2]
        m_cap = block_table.shape[1] * page_size
        kst = (k.stride(0), k.stride(1), k.stride(2), k.stride(3))
        vst = (v.stride(0), v.stride(1), v.stride(2), v.stride(3))
        table, tst = block_table, (block_table.stride(0), block_table.stride(1))
    else:
        num_pages, page_size = 1, 1
        if layout == "bhsd":
            Hkv, m_cap = k.shape[1], k.shape[2]
            kst = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
            vst = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
        else:
            Hkv, m_cap = k.shape[2], k.shape[1]
            kst = (k.stride(0), k.stride(1), k.stride(2), k.stride(3))
            vst = (v.stride(0), v.stride(1), v.stride(2), v.stride(3))
        table, tst = q, (0, 0)  # never read
    G = Hq // Hkv
    # Sizes may be symbolic (a traced graph): the tile and the split count
    # are choices, made from example values; the grid stays symbolic.
    block_r = row_tile(hint(G), hint(N))
    tiles = cdiv(G * N, block_r)
    S = num_splits if num_splits is not None else choose_splits(hint(B), hint(Hkv), hint(tiles), hint(m_cap),
                                                                sm_count(q))
    S = max(1, int(S))
    direct = S == 1
    block_d, block_dv = max(16, next_pow2(D)), max(16, next_pow2(Dv))

    out = torch.empty_strided((B, Hq, N, Dv), (N * Hq * Dv, Dv, Hq * Dv, 1), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
    if direct:
        opart = lpart = lse  # never read
    else:
        opart = torch.empty((B, Hq, N, S, block_dv), dtype=torch.float32, device=q.device)
        lpart = torch.empty((B, Hq, N, S), dtype=torch.float32, device=q.device)
    seqlens = cache_seqlens if cache_seqlens is not None else q  # never read without HAS_SEQLENS
    interp = _interpreting(q)
    chunks = _INTERPRET_BOUNDS_CHUNKS if interp else _BOUNDS_CHUNKS
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(f"decode_forward: attn_mask must be bool, got {attn_mask.dtype}")
        mask = bool_mask_as_bytes(attn_mask.expand(B, Hq, N, m_cap))
        mst = mask.stride()
        bounds = torch.empty((B, chunks, 2), dtype=torch.int32, device=q.device)
        # The mask's own rows: a broadcast dimension (stride 0) is read once.
        m_heads = Hq if mst[1] != 0 else 1
        m_queries = N if mst[2] != 0 else 1
        bounds_args = (mask, bounds, *mst, m_cap, m_heads * m_queries, m_queries)
        bounds_meta = dict(BLOCK_K=_INTERPRET_BOUNDS_BLOCK_K if interp else _BOUNDS_BLOCK_K, CHUNKS=chunks)
    else:
        mask, mst, bounds = q, (0, 0, 0, 0), lse  # never read
    limit = N + m_cap
    args = (
        q, k, v, seqlens, table, mask, bounds, opart, lpart, out, lse,
        *q.stride(), *kst, *vst, *tst, *mst, *out.stride(),
        Hq, N, G, m_cap, num_pages, S,
        float(scale) * _LOG2E, _clamp_window(window_left, limit), _clamp_window(window_right, limit),
    )
    meta = dict(
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_SEQLENS=cache_seqlens is not None, PAGED=block_table is not None, PAGE_SIZE=page_size,
        BOTTOM_RIGHT=bool(bottom_right), HAS_WINDOW_LEFT=window_left is not None,
        HAS_WINDOW_RIGHT=window_right is not None, DIRECT=direct, INPUT_PRECISION=_dot_precision(q),
        BLOCK_R=block_r, HAS_MASK=attn_mask is not None, CHUNKS=chunks,
    )
    grid = (S, Hkv * tiles, B)
    comb_args = (opart, lpart, out, lse, *out.stride(), Hq, N, S)
    comb_meta = dict(HEAD_DIM_V=Dv, BLOCK_DV=block_dv, BLOCK_S=max(2, next_pow2(S)))
    comb_grid = (B * Hq * N,)
    if interp:
        if attn_mask is not None:
            _mask_bounds[(chunks, B)](*bounds_args, **bounds_meta)
        _decode_split[grid](*args, **meta, DOT_UPCAST=q.dtype == torch.bfloat16, BLOCK_N=_INTERPRET_BLOCK_N)
        if not direct:
            _decode_combine[comb_grid](*comb_args, **comb_meta)
        return out, lse
    key = (q.dtype, q.device, _bucket(cdiv(m_cap, S), 1 << 16), tuple(meta.items()))
    with torch.cuda.device(q.device):
        if attn_mask is not None:
            _bounds_launcher((q.device, tuple(bounds_meta.items())),
                             lambda: [triton.Config({}, num_warps=4, num_stages=1)],
                             lambda m: (chunks, B), *bounds_args, **bounds_meta)
        _split_launcher(key, lambda: _CONFIGS, lambda m: grid, *args, tune=_autotune_enabled(), **meta,
                        DOT_UPCAST=False)
        if not direct:
            _combine_launcher((q.device, tuple(comb_meta.items())),
                              lambda: [triton.Config({}, num_warps=4, num_stages=1)],
                              lambda m: comb_grid, *comb_args, **comb_meta)
    return out, lse
