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
  kernel writes the final output itself; on short caches in eager calls the
  last split of each row tile to finish merges the tile's partials itself
  (one launch per call, not two: see ``FUSE_COMBINE``).

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

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import config
from .forward import _LOG2E, _dot
from .launch import (
    _DRY_RUN, ConfigLauncher, _autotune_enabled, _bucket, _device_stream, _dot_precision, _fingerprint,
    _interpreting, _launch_hooks, bool_mask_as_bytes, cdiv, clamp_window, device_shared_mem, hint, next_pow2, run_binary,
    static_int,
)
from .launch import multiprocessors as _sm_count

__all__ = ["decode_forward", "decode_suits", "decode_refusal", "DecodeCall", "choose_splits"]

# Tensor types whose calls may keep a launch plan (real tensors).
_PLAIN = (torch.Tensor, torch.nn.Parameter)



@triton.jit(do_not_specialize=["M", "ROWS", "N_ROWS"])
def _mask_bounds(
    Mask, Bounds,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
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
        row = (Mask + b * stride_mask_b + (r // N_ROWS).to(tl.int64) * stride_mask_h
               + (r % N_ROWS).to(tl.int64) * stride_mask_q)
        for start in range(c_lo, c_hi, BLOCK_K):
            j = start + offs
            seen = tl.load(row + j.to(tl.int64) * stride_mask_k, mask=j < c_hi, other=0).to(tl.int32) != 0
            first = tl.minimum(first, tl.where(seen, j, 2147483647))
            last = tl.maximum(last, tl.where(seen, j + 1, 0))
    out = Bounds + (b * CHUNKS + c) * 2
    tl.store(out, tl.min(first, 0))
    tl.store(out + 1, tl.max(last, 0))


@triton.jit
def _parts(Part, rows, S, BLOCK_DV: tl.constexpr):
    """OPart and LPart within Part, for ``rows`` (B * Hq * N) rows: the
    partial outputs first (so LPart starts 16-byte aligned), then the lse."""
    return Part, Part + rows.to(tl.int64) * S * BLOCK_DV


@triton.jit(do_not_specialize=["N", "G", "M_CAP", "NUM_PAGES", "S", "window_left", "window_right"])
def _decode_split(
    Q, K, V, SeqLens, Table, Mask, Bounds, Part, Out, Lse, Count,
    stride_q_b, stride_q_h, stride_q_q, stride_q_d,
    stride_k_b, stride_k_k, stride_k_h, stride_k_d,
    stride_v_b, stride_v_k, stride_v_h, stride_v_d,
    stride_table_b, stride_table_p,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
    stride_o_b, stride_o_h, stride_o_q, stride_o_d,
    Hq, N, G, M_CAP, NUM_PAGES, S,
    qk_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr, CHUNKS: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    DIRECT: tl.constexpr, FUSED: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (S, Hkv * row tiles, B): split ``pid0`` of one row tile.

    K / V are addressed as ``base + page * stride_k_b + slot * stride_k_k +
    kvh * stride_k_h``: without PAGED, page is the batch row and slot the key
    index; with PAGED, page is ``Table[b, j // PAGE_SIZE]`` and slot
    ``j % PAGE_SIZE``. ``M_CAP`` is the keys a row can hold (the cache
    length, or max_pages * PAGE_SIZE). DIRECT (S == 1): write Out (q's dtype)
    and Lse (natural log) directly; else the float32 buffer Part, which holds
    OPart (B, Hq, N, S, BLOCK_DV) then LPart (B, Hq, N, S), base 2 (one
    allocation per call, see ``_parts``). HAS_MASK: a bool mask (bytes,
    nonzero takes part) at ``Mask + b * stride_mask_b + h * stride_mask_h + i *
    stride_mask_q + j * stride_mask_k`` also decides visibility, and the keys are
    first narrowed to the row's ``Bounds`` (``_mask_bounds``, CHUNKS
    entries), so that the splits share only the keys the mask shows.
    FUSED (S > 1): the last split of a row tile to finish merges the tile's
    partials itself, row by row as ``_decode_combine`` does (``_merge_row``,
    BLOCK_S >= S), counted in ``Count`` (one int32 per row tile, zero before
    the launch and set back to zero by that last split), so no combine
    kernel follows.
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

    q_ptrs = (Q + b64 * stride_q_b + h.to(tl.int64)[:, None] * stride_q_h + qi.to(tl.int64)[:, None] * stride_q_q
              + offs_d[None, :] * stride_q_d)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_head = K + kvh.to(tl.int64) * stride_k_h
    v_head = V + kvh.to(tl.int64) * stride_v_h
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < HEAD_DIM_V

    if HAS_MASK:
        m_rows = Mask + b64 * stride_mask_b + h.to(tl.int64) * stride_mask_h + qi.to(tl.int64) * stride_mask_q

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_nb
        col_ok = offs_n < end
        if PAGED:
            slot_idx = offs_n // PAGE_SIZE
            page = tl.load(Table + b64 * stride_table_b + slot_idx.to(tl.int64) * stride_table_p, mask=col_ok, other=0)
            # A page number out of range reads page 0 or the last one, never past the pool.
            page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
        else:
            page = b64 + offs_n.to(tl.int64) * 0
            slot = offs_n.to(tl.int64)
        k_rows = k_head + page * stride_k_b + slot * stride_k_k
        v_rows = v_head + page * stride_v_b + slot * stride_v_k
        vis = col_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW_RIGHT:
            vis = vis & (offs_n[None, :] <= qi[:, None] + off + window_right)
        if HAS_WINDOW_LEFT:
            vis = vis & (offs_n[None, :] >= qi[:, None] + off - window_left)
        kv_ok = col_ok
        if HAS_MASK:
            keep = tl.load(m_rows[:, None] + offs_n.to(tl.int64)[None, :] * stride_mask_k, mask=vis, other=0)
            vis = vis & (keep.to(tl.int32) != 0)
            # Keys no row of the tile sees are not read (a predicated-off
            # load moves no memory): holes and ends a cache leaves unfilled.
            # (Loading them regardless, so that the loads do not wait on the
            # mask tile, was measured slower: bench/NOTES.md run 16.)
            kv_ok = tl.max(vis.to(tl.int32), 0) != 0
        k = tl.load(k_rows[:, None] + offs_d[None, :] * stride_k_d, mask=kv_ok[:, None] & d_ok, other=0.0)
        qk = _dot(q, tl.trans(k), INPUT_PRECISION, DOT_UPCAST) * qk_scale
        qk = tl.where(vis, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        m_shift = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.exp2(qk - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows[:, None] + offs_dv[None, :] * stride_v_d, mask=kv_ok[:, None] & dv_ok, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, INPUT_PRECISION, DOT_UPCAST)
        m_i = m_ij

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    out = acc * inv_l[:, None]
    lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    row_base = (b64 * Hq + h.to(tl.int64)) * N + qi.to(tl.int64)  # (b, h, i) in (B, Hq, N)
    if DIRECT:
        lse = tl.where(empty, float("inf"), lse2 * 0.6931471805599453)
        o_ptrs = (Out + b64 * stride_o_b + h.to(tl.int64)[:, None] * stride_o_h + qi.to(tl.int64)[:, None] * stride_o_q
                  + offs_dv[None, :] * stride_o_d)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        tl.store(Lse + row_base, lse, mask=row_ok)
    else:
        part = row_base * S + s
        OPart, LPart = _parts(Part, tl.num_programs(2) * Hq * N, S, BLOCK_DV)
        tl.store(OPart + part[:, None] * BLOCK_DV + offs_dv[None, :], out, mask=row_ok[:, None])
        tl.store(LPart + part, tl.where(empty, float("-inf"), lse2), mask=row_ok)
        if FUSED:
            # Every thread's partial stores come before the arrival (the
            # barrier), and the arrival releases them to the split that
            # counts last, which acquires them all before it reads them.
            tl.debug_barrier()
            counter = Count + b64 * tl.num_programs(1) + pid1
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == S - 1:
                tl.store(counter, 0)  # zero again for the next launch
                offs_s = tl.arange(0, BLOCK_S)
                # One row at a time: all of a row's partials in one load,
                # as the combine kernel's programs read them in parallel.
                for r in range(r0, tl.minimum(r0 + BLOCK_R, rows_total)):
                    h_r = kvh * G + r % G
                    i_r = r // G
                    _merge_row(OPart, LPart, Out, Lse, (b64 * Hq + h_r) * N + i_r, b64, h_r, i_r, S, offs_s, offs_dv,
                               stride_o_b, stride_o_h, stride_o_q, stride_o_d, HEAD_DIM_V, BLOCK_DV)


@triton.jit
def _merge_row(OPart, LPart, Out, Lse, row, b, h, i, S, offs_s, offs_dv,
               stride_o_b, stride_o_h, stride_o_q, stride_o_d, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The exact merge of the S partials of row ``row`` (flattened (b, h, i);
    Part as ``_decode_split`` writes it, ``offs_s`` covering S) into its
    output and natural-log lse: ``lse = log2 sum_s 2**lse_s``, ``out =
    sum_s 2**(lse_s - lse) out_s``; splits that saw no key weigh 0, a row
    that saw none gets 0 and lse +inf. The loads bypass L1 (``.cg``): in
    the fused combine, other programs wrote the partials during the same
    launch."""
    s_ok = offs_s < S
    lse_s = tl.load(LPart + row * S + offs_s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse_s, 0)
    none = m == float("-inf")
    w = tl.exp2(lse_s - tl.where(none, 0.0, m))  # 0 for splits that saw no key
    o_s = tl.load(OPart + (row * S + offs_s)[:, None] * BLOCK_DV + offs_dv[None, :], mask=s_ok[:, None], other=0.0,
                  cache_modifier=".cg")
    # where, not a product: an unwritten partial must not leak through a 0 weight.
    o = tl.sum(tl.where(w[:, None] > 0.0, o_s * w[:, None], 0.0), 0)
    wsum = tl.sum(w, 0)
    o = o / tl.where(none, 1.0, wsum)
    lse = tl.where(none, float("inf"), (m + tl.log2(tl.where(none, 1.0, wsum))) * 0.6931471805599453)
    o_ptrs = (Out + b * stride_o_b + h.to(tl.int64) * stride_o_h + i.to(tl.int64) * stride_o_q
              + offs_dv * stride_o_d)
    tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    tl.store(Lse + row, lse)


@triton.jit(do_not_specialize=["N", "S"])
def _decode_combine(
    Part, Out, Lse,
    stride_o_b, stride_o_h, stride_o_q, stride_o_d,
    Hq, N, S,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (B * Hq * N,): merge the S partials of one row (flattened
    (b, h, i)) exactly; Part as ``_decode_split`` writes it."""
    row = tl.program_id(0).to(tl.int64)
    OPart, LPart = _parts(Part, tl.num_programs(0), S, BLOCK_DV)
    per_batch = Hq * N
    _merge_row(OPart, LPart, Out, Lse, row, row // per_batch, (row % per_batch) // N, row % N, S,
               tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_DV), stride_o_b, stride_o_h, stride_o_q, stride_o_d,
               HEAD_DIM_V, BLOCK_DV)


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------

# (BLOCK_N, num_warps, num_stages), first = untuned default; few, so tuning a
# new shape class compiles few variants. With a bool mask the first is the
# narrower tile, which measured fastest there (bench/NOTES.md run 16).
_CUDA_CONFIGS = [(64, 4, 3), (128, 4, 2), (64, 8, 3), (32, 4, 3)]
_CUDA_MASK_CONFIGS = [(32, 4, 3), (64, 4, 3), (128, 4, 2), (32, 4, 4)]
_CONFIGS, _MASK_CONFIGS = ([triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in table]
                           for table in (_CUDA_CONFIGS, _CUDA_MASK_CONFIGS))
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

# The split count (``choose_splits``). The grid is (splits, Hkv * row
# tiles, B): without splits a decode call has B * Hkv programs, a few per SM
# of an H200 (132 SMs) at batch 1, and reading the cache is then limited by
# how many loads those few programs keep in flight. Splitting every row
# tile's keys over S programs fills the GPU. How far: the sweep of every
# config and split count (``bench/decode_configs.py``, bench/NOTES.md run 16)
# found the time set by wave quantisation: a grid that fills every SM's
# program slots exactly once streams at copy speed, while one that spills a
# partial second wave lost 7-15 %. So S is the largest count whose grid fits
# one wave at the default config's occupancy (``programs_per_sm``: the
# programs whose pipelined K/V tiles fit one SM's shared memory). Each split
# also costs a partial output and its share of the combine, and a split with
# few keys spends its time on set-up rather than streaming: no split is given
# fewer than MIN_SPLIT_KEYS keys (a multiple of every BLOCK_N, so every split
# streams whole key blocks), and at most MAX_SPLITS (the combine reads all of
# a row's partials in one tile). FLASHFUSE_DECODE_SPLITS (or ``num_splits``)
# forces the count.
# With a bool mask the best counts measured were about two waves, not one
# (``MASK_WAVES``).
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 128
MASK_WAVES = 2
_WARPS_PER_SM = 64

# The decode path is taken for up to this many queries per head ...
MAX_QUERIES = 16
# ... and this many rows (queries x group heads) per tile ...
MAX_ROWS = 128
# ... with at least this many keys (below, the forward kernel's grid is full enough).
MIN_KEYS = 512


def sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of t's device (a stand-in under the interpreter)."""
    if _interpreting(t):
        return _INTERPRET_SMS
    return _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _default_per_sm(q: torch.Tensor, block_d: int, block_dv: int, has_mask: bool = False) -> int:
    """Programs per SM the split count is chosen for: ``programs_per_sm`` of
    the untuned config on q's device, ``MASK_WAVES`` times that with a mask
    (1 under the interpreter, whose stand-in SMs run one program each). The
    device's shared memory per block stands for the SM's (on Hopper 227 of
    228 kB)."""
    if _interpreting(q):
        return 1
    block_n, warps, stages = (_CUDA_MASK_CONFIGS if has_mask else _CUDA_CONFIGS)[0]
    waves = MASK_WAVES if has_mask else 1
    return waves * programs_per_sm(block_n, warps, stages, block_d, block_dv, q.element_size(),
                                   device_shared_mem(q.device))


def row_tile(G: int, N: int) -> int:
    """Rows per tile: the G * N rows of a key/value head, padded to a power
    of two >= 16, at most MAX_ROWS (more rows take several tiles)."""
    return min(MAX_ROWS, max(16, next_pow2(G * N)))


def programs_per_sm(block_n: int, num_warps: int, num_stages: int, block_d: int, block_dv: int, elem: int,
                    smem: int) -> int:
    """Split programs one SM holds at once with this config: its
    ``num_stages`` pipelined K and V tiles (BLOCK_N x (BLOCK_D + BLOCK_DV)
    elements each stage) in ``smem`` bytes, at most 64 warps."""
    per_program = num_stages * block_n * (block_d + block_dv) * elem
    return max(1, min(smem // max(1, per_program), _WARPS_PER_SM // num_warps))


def _wanted_splits(B: int, Hkv: int, row_tiles: int, sms: int, per_sm: int = 1) -> int:
    """Splits whose grid fills one wave of ``per_sm`` programs on each of
    ``sms`` SMs, before the keys' limit (1 when B * Hkv * row tiles alone
    fill it)."""
    return max(1, (per_sm * sms) // max(1, B * Hkv * row_tiles))


def _splits_for_keys(want: int, keys: int) -> int:
    return max(1, min(want, cdiv(max(keys, 1), MIN_SPLIT_KEYS), MAX_SPLITS))


def choose_splits(B: int, Hkv: int, row_tiles: int, keys: int, sms: int, per_sm: int = 1) -> int:
    """How many programs share a row tile's keys (see the comment at
    ``MIN_SPLIT_KEYS``): as many as one wave of ``per_sm`` programs on each
    of ``sms`` SMs holds over the whole grid, none with fewer than
    ``MIN_SPLIT_KEYS`` keys, at most ``MAX_SPLITS``.
    ``FLASHFUSE_DECODE_SPLITS`` forces a count."""
    forced = config.decode_splits()
    if forced is not None:
        return forced
    return _splits_for_keys(_wanted_splits(B, Hkv, row_tiles, sms, per_sm), keys)


class DecodeCall(NamedTuple):
    """A forward call as ``_attention_forward`` gets it, as far as the
    choice of the split-KV path goes (``decode_refusal``)."""

    q: torch.Tensor
    k: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    window_left: int | None = None
    window_right: int | None = None
    bottom_right: bool = True
    mask_fill: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


def decode_refusal(call: DecodeCall) -> str | None:
    """Why ``call`` does not take the split-KV path, or None when it does:
    few queries, many keys, no mask tensor or a bool one whose hidden pairs
    take no part (no ``mask_fill``), no dropout, no soft-capping or sinks,
    and a band aligned bottom-right, or none (without a band the alignment
    means nothing: a static cache's mask arrives so). ``FLASHFUSE_DECODE=0``
    turns the path off, ``=1`` takes it whenever the arguments allow,
    whatever the sizes."""
    mode = config.decode()
    if mode == "0":
        return "FLASHFUSE_DECODE=0"
    why = argument_refusal(call)
    if why is not None or mode == "1":
        return why
    N, M = call.q.shape[2], call.k.shape[2]
    return size_refusal(N, call.q.shape[1] // call.k.shape[1], M)


def argument_refusal(call: DecodeCall) -> str | None:
    """The part of ``decode_refusal`` that no size and no setting decides:
    why the decode kernels cannot compute ``call`` at all."""
    if call.softcap is not None or call.sinks is not None:
        return "soft-capping and sinks: the decode kernels have neither"
    if call.attn_mask is not None and call.attn_mask.dtype != torch.bool:
        return "a float mask: rows it hides entirely need the forward kernel's lse marker"
    if call.dropout_p > 0.0:
        return "dropout"
    if call.mask_fill is not None:
        return "a mask_fill: the pairs a bool mask hides take part"
    if (call.window_left is not None or call.window_right is not None) and not call.bottom_right:
        return "a band aligned top-left"
    return None


def size_refusal(N: int, G: int, M: int) -> str | None:
    """The part of ``decode_refusal`` that the sizes decide (unless
    ``FLASHFUSE_DECODE=1``): N queries per head, G query heads per key/value
    head, M keys."""
    if N > MAX_QUERIES:
        return f"{N} queries per head, more than {MAX_QUERIES}"
    if G * N > MAX_ROWS:
        return f"{G * N} rows (queries x grouped heads) per key/value head, more than {MAX_ROWS}"
    if M < MIN_KEYS:
        return f"{M} keys, fewer than {MIN_KEYS}: the forward kernel's grid is full enough"
    return None


def decode_suits(call: DecodeCall) -> bool:
    """Whether ``call`` takes the split-KV path (``decode_refusal``)."""
    return decode_refusal(call) is None


# ---------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------
#
# A decode call's host work is mostly fixed by its signature: the split count,
# tiles, grids, meta-parameters, the chosen configs and compiled binaries.
# ``decode_forward`` keeps it in a plan per signature (``_plan_key``), and
# each exact call signature (every size and stride, ``_Call``) in a second
# dict, so that a repeated call builds one key, finds its call, allocates its
# outputs and launches the binaries directly. The cache length changes at every step of
# a dynamic cache, so it is no part of the key: the key holds the sizes
# and strides that do not move with it exactly, and for the strides that
# do, only what Triton specialises on (``launch._fingerprint``); the length
# itself decides the split count per call, and a plan keeps one entry per
# (split count, tuning bucket) (``_Launches``). Knobs read through
# ``config`` (split count, autotuning, the interpreter) are part of the key.
# A dynamic cache misses the exact dict at every new length; without a mask
# or a block table such a call skips the plan key too (``_GROWN``). The eager
# fast path's decode lane keeps its calls in the same dict under a shorter
# key (``lane_forward``), so that dropping the calls drops them too.

_PLANS: dict = {}  # signature (``_plan_key``) -> _Plan
# exact call signature (``decode_forward``), or a lane's shorter key (``lane_forward``) -> _Call, to skip even
# the plan key
_CALLS: dict = {}
_MAX_PLANS = 512  # signatures kept, each; past this a cache starts afresh
PLAN_MISSES = [0]  # plans built (tests count them)


def _keep(cache: dict, key, value) -> None:
    """``cache[key] = value``, the cache started afresh when it holds
    ``_MAX_PLANS`` entries."""
    if len(cache) >= _MAX_PLANS:
        cache.clear()
    cache[key] = value


def forget_plans() -> None:
    """Drop every launch plan (the next call of each signature builds one)."""
    _PLANS.clear()
    _CALLS.clear()
    _GROWN.clear()
    _LANE_GROWN.clear()
    _LANE_STEPS.clear()


for _launcher in (_split_launcher, _combine_launcher, _bounds_launcher):
    _launcher.forget_hooks.append(forget_plans)


class _Plan:
    """What a signature fixes (see above): sizes, scalar arguments and
    meta-parameters; ``launches`` per (splits, bucket)."""

    __slots__ = ("B", "Hq", "N", "Hkv", "G", "Dv", "block_r", "tiles", "want", "forced", "interp", "tune",
                 "meta", "chunks", "bounds_meta", "m_rows", "m_queries", "block_dv", "launches", "device_index",
                 "cache_bytes_per_key", "sizes")


class _Launches:
    """The launches of one plan at one split count: grids, meta, launcher
    keys and, once known, the binaries (``ConfigLauncher.binary``)."""

    __slots__ = ("S", "direct", "fusable", "grid", "comb_grid", "part_numel", "counters", "meta", "launch_meta",
                 "fused_meta", "comb_meta", "key", "comb_key", "bounds_key", "binaries", "c_launch")


def _mask_strides(mask: torch.Tensor) -> tuple:
    """The strides of ``mask`` broadcast to 4-D (what ``expand`` gives,
    without making the view): 0 for a dimension it lacks or has once."""
    pad = 4 - mask.dim()
    return (0,) * pad + tuple(0 if n == 1 else st for n, st in zip(mask.shape, mask.stride()))


def _plan_key(q, k, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right, layout,
              num_splits, heads, page_size, m_cap, k_ints, knobs):
    """The signature of a decode call (see "Launch plans"). ``k_ints``: the
    strides of k, v, the table and the mask, which may move with the cache
    length: only their specialisation enters. ``knobs``: the settings (split
    count, autotuning, interpreter) as ``decode_forward`` read them."""
    return (
        q.shape, q.stride(), q.dtype, k.dtype, v.dtype, q.device, layout, block_table is None, heads, page_size,
        k.shape[-1], v.shape[-1], _fingerprint(k_ints), q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
        None if cache_seqlens is None else (cache_seqlens.dtype, cache_seqlens.data_ptr() & 15),
        None if block_table is None else (block_table.dtype, block_table.data_ptr() & 15),
        None if attn_mask is None else (attn_mask.shape[:-1], attn_mask.shape[-1] == m_cap,
                                        attn_mask.shape[-1] == 1, attn_mask.data_ptr() & 15),
        window_left is None, window_right is None, bool(bottom_right), num_splits, knobs, _dot_precision(q),
    )


def _check_mask_shape(mask: torch.Tensor, target: tuple) -> None:
    """The kernels read a mask through broadcast strides: its shape must
    broadcast to ``target`` (B, Hq, N, M) (as ``expand`` would demand)."""
    shape = tuple(mask.shape)
    if len(shape) > 4 or any(n != 1 and n != t for n, t in zip(reversed(shape), reversed(target))):
        raise ValueError(f"decode_forward: attn_mask of shape {shape} does not broadcast to {tuple(target)}")


def _make_plan(q, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right, Hkv,
               page_size, m_cap):
    p = _Plan()
    B, Hq, N, D = q.shape
    D = static_int(D)
    Dv = static_int(v.shape[-1])
    page_size = static_int(page_size)
    G = Hq // Hkv
    p.B, p.Hq, p.N, p.Hkv, p.G, p.Dv = B, Hq, N, Hkv, G, Dv
    # The split kernel's integer arguments after the strides and before the
    # length: out's strides, Hq, N, G.
    p.sizes = (N * Hq * Dv, Dv, Hq * Dv, 1, Hq, N, G)
    p.cache_bytes_per_key = hint(B) * hint(Hkv) * (D + Dv) * q.element_size()
    # Sizes may be symbolic (a traced graph): the tile and the split count
    # are choices, made from example values; the grid stays symbolic.
    p.block_r = row_tile(hint(G), hint(N))
    p.tiles = cdiv(G * N, p.block_r)
    p.forced = config.decode_splits()
    p.interp = _interpreting(q)
    p.block_dv = max(16, next_pow2(Dv))
    block_d = max(16, next_pow2(D))
    per_sm = _default_per_sm(q, block_d, p.block_dv, attn_mask is not None)
    p.want = _wanted_splits(hint(B), hint(Hkv), hint(p.tiles), sm_count(q), per_sm)
    p.tune = _autotune_enabled()
    p.chunks = _INTERPRET_BOUNDS_CHUNKS if p.interp else _BOUNDS_CHUNKS
    p.meta = dict(
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=block_d, BLOCK_DV=p.block_dv,
        HAS_SEQLENS=cache_seqlens is not None, PAGED=block_table is not None, PAGE_SIZE=page_size,
        BOTTOM_RIGHT=bool(bottom_right), HAS_WINDOW_LEFT=window_left is not None,
        HAS_WINDOW_RIGHT=window_right is not None, INPUT_PRECISION=_dot_precision(q),
        BLOCK_R=p.block_r, HAS_MASK=attn_mask is not None, CHUNKS=p.chunks,
    )
    if attn_mask is not None:
        _check_mask_shape(attn_mask, (B, Hq, N, m_cap))
        mst = _mask_strides(attn_mask)
        # The mask's own rows: a broadcast dimension (stride 0) is read once.
        p.m_queries = N if mst[2] != 0 else 1
        p.m_rows = (Hq if mst[1] != 0 else 1) * p.m_queries
        p.bounds_meta = dict(BLOCK_K=_INTERPRET_BOUNDS_BLOCK_K if p.interp else _BOUNDS_BLOCK_K, CHUNKS=p.chunks)
    p.launches = {}
    p.device_index = q.device.index
    return p


def _make_launches(p: _Plan, S: int, bucket: int, q) -> _Launches:
    L = _Launches()
    L.S, L.direct = S, S == 1
    merged_rows = min(p.block_r, hint(p.G) * hint(p.N))  # what a fused merge takes one after the other
    L.fusable = 1 < S <= FUSED_MAX_SPLITS and merged_rows * S <= FUSED_MAX_MERGES
    B, Hq, N = p.B, p.Hq, p.N
    L.grid = (S, p.Hkv * p.tiles, B)
    L.comb_grid = (B * Hq * N, 1, 1)
    L.part_numel = 0 if L.direct else B * Hq * N * S * (p.block_dv + 1)
    L.counters = B * p.Hkv * p.tiles  # one per row tile (the fused combine's)
    L.meta = dict(p.meta, DIRECT=L.direct, FUSED=False)
    # What the split kernel is launched with: under the interpreter its block
    # too; on CUDA the configs give it.
    # BLOCK_S is unused without FUSED: one binary for every S.
    L.launch_meta = (dict(L.meta, DOT_UPCAST=q.dtype == torch.bfloat16, BLOCK_N=_INTERPRET_BLOCK_N, BLOCK_S=1)
                     if p.interp else dict(L.meta, DOT_UPCAST=False, BLOCK_S=1))
    # The same split kernel merging the partials itself (``_run`` says when).
    block_s = max(2, next_pow2(S))
    L.fused_meta = dict(L.launch_meta, FUSED=True, BLOCK_S=block_s)
    L.comb_meta = dict(HEAD_DIM_V=p.Dv, BLOCK_DV=p.block_dv, BLOCK_S=block_s)
    L.key = (q.dtype, q.device, bucket, tuple(L.meta.items()))
    L.comb_key = (q.device, tuple(L.comb_meta.items()))
    L.bounds_key = (q.device, tuple(p.bounds_meta.items())) if p.meta["HAS_MASK"] else None
    L.binaries = [None] * 4  # indexed by _SPLIT, _COMBINE, _BOUNDS, _FUSED_SPLIT
    L.c_launch = False  # whether a binary kept has a C launch (``_launch``)
    return L


def _one_config():
    return [triton.Config({}, num_warps=4, num_stages=1)]


# The split kernel's candidates when a sweep forces them (split_candidates);
# None: the tuned lists above.
_FORCED_CONFIGS = None


def _split_configs(has_mask: bool = False):
    if _FORCED_CONFIGS is not None:
        return _FORCED_CONFIGS
    return _MASK_CONFIGS if has_mask else _CONFIGS


@contextlib.contextmanager
def split_candidates(configs):
    """Within the block, the split kernel chooses among ``configs`` (a list
    of ``triton.Config``) alone, masked or not; the launcher forgets the
    configs it chose before on entry and on exit. For config sweeps
    (``bench/decode_configs.py``)."""
    global _FORCED_CONFIGS
    previous = _FORCED_CONFIGS
    _FORCED_CONFIGS = list(configs)
    _split_launcher.forget()
    try:
        yield
    finally:
        _FORCED_CONFIGS = previous
        _split_launcher.forget()


# The kernels of a call, as ``_Launches.binaries`` and ``_launch`` index them.
_SPLIT, _COMBINE, _BOUNDS, _FUSED_SPLIT = range(4)


def _launch(i: int, L: _Launches, launcher, key, grid, args, meta, tune, stream, cache: bool,
            pointers: tuple | None = None) -> None:
    """Launch kernel ``i`` of ``L``: its binary directly once known, else
    through its launcher (which chooses the config and compiles), then ask
    the launcher for the binary. ``pointers``: ``args`` with every tensor
    as its address, for the binary's C launch when no launch hook is set
    (``_allocate_and_launch``)."""
    kept = L.binaries[i]
    if kept is not None:
        # (``pointers`` exist only without launch hooks, and go only to a C launch)
        run_binary(kept, grid, pointers if pointers is not None and kept.c_launch is not None else args, stream)
        return
    cands = (lambda: _split_configs(meta["HAS_MASK"])) if launcher is _split_launcher else _one_config
    launcher(key, cands, lambda m: grid, *args, tune=tune, **meta)
    if cache:
        kept = L.binaries[i] = launcher.binary(key, args, meta, tune)
        if kept is not None and kept.c_launch is not None:
            L.c_launch = True


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
    need_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        need_lse: False when the caller drops the lse (an eager call then
            writes it into a kept workspace instead of a new tensor).

    Returns:
        ``(out, lse)`` as the forward kernel returns them: out (B, Hq, N, Dv)
        in q's dtype laid out as ``empty(B, N, Hq, Dv).transpose(1, 2)``,
        lse float32 (B, Hq, N) natural log, +inf for rows that see no key
        (None with ``need_lse=False``).

    A repeated signature takes its launch plan (see "Launch plans" above).
    """
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError(f"decode_forward: attn_mask must be bool, got {attn_mask.dtype}")
    # Calls are kept for real tensors only: a traced or dry-run call (fake or
    # symbolic) builds its own and launches through the launchers.
    cache = (type(q) in _PLAIN and type(k) in _PLAIN and type(v) in _PLAIN
             and (cache_seqlens is None or type(cache_seqlens) in _PLAIN)
             and (block_table is None or type(block_table) in _PLAIN)
             and (attn_mask is None or type(attn_mask) in _PLAIN) and not _DRY_RUN.get())
    if cache:
        call = _cached_call(q, k, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right,
                            layout, num_splits, config.decode_knobs())
    else:
        call = _make_call(q, k, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right,
                          layout, num_splits, False)
    return _run(call, q, k, v, cache_seqlens, block_table, attn_mask, scale, cache, need_lse)


def _cached_call(q, k, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right, layout,
                 num_splits, knobs):
    """The kept call of ``decode_forward``'s arguments on real tensors
    (``knobs``: the settings the plans depend on, see "Launch plans"),
    built when new."""
    ks, vs = k.shape, v.shape
    # Everything of the exact key but k's and v's shapes and strides
    # (``_GROWN``'s key starts from it).
    rest = (
        q.shape, q.stride(), q.dtype, k.dtype, v.dtype, q.device,
        layout, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
        None if cache_seqlens is None else (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
                                            cache_seqlens.data_ptr() & 15),
        None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                          block_table.data_ptr() & 15),
        None if attn_mask is None else (attn_mask.shape, attn_mask.stride(), attn_mask.data_ptr() & 15),
        window_left, window_right, bottom_right, num_splits, knobs, _dot_precision(q),
    )
    key = (ks, k.stride(), vs, v.stride(), rest)
    call = _CALLS.get(key)
    if call is None:
        if attn_mask is None and block_table is None:
            call = _grown_call(q, k, v, rest, cache_seqlens, window_left, window_right, bottom_right, layout,
                               num_splits, knobs)
        else:
            call = _make_call(q, k, v, cache_seqlens, block_table, attn_mask, window_left, window_right,
                              bottom_right, layout, num_splits, True, knobs)
        _keep(_CALLS, key, call)
    return call


def lane_forward(token, q, k, v, attn_mask, scale, window_left, window_right, bottom_right,
                 knobs: tuple | None = None, transpose_out: bool = False) -> torch.Tensor:
    """``decode_forward(q, k, v, scale=scale, window_left=window_left,
    window_right=window_right, bottom_right=bottom_right,
    attn_mask=attn_mask, need_lse=False)[0]``, for the eager fast path's
    decode lane (``flashfuse.fastpath``): a lane stands for one signature
    whose calls all passed the op's checks, which fixes the tensors' types
    (real), dtypes, device, q's shape, every size of k and v but the key
    length, and the band and scale (its arguments here). So its calls are
    kept under ``(token, what the signature leaves free)`` in ``_CALLS``
    (``token``: an object of the lane's own, compared by identity),
    each the call ``decode_forward``'s own key finds (``_cached_call``):
    a repeated call builds the shorter key and skips the call's checks.
    Without a mask, the lane's last plan is its ``_LaneStep`` (below).
    ``knobs``: ``config.decode_knobs()`` when the caller has read them.
    ``transpose_out``: return the output as (B, N, Hq, Dv), contiguous:
    ``out.transpose(1, 2)`` (the output lies in memory in that order), made
    without the view."""
    if _DRY_RUN.get():
        out = decode_forward(q, k, v, scale=scale, window_left=window_left, window_right=window_right,
                             bottom_right=bottom_right, attn_mask=attn_mask, need_lse=False)[0]
        return out.transpose(1, 2) if transpose_out else out
    if knobs is None:
        knobs = config.decode_knobs()
    ks = k.shape
    m = ks[2]
    if attn_mask is None:
        out = lane_step_forward(token, q, k, v, m, knobs, scale, window_left, window_right, transpose_out)
        if out is not None:
            return out
    q_strides, k_strides, vs, v_strides = q.stride(), k.stride(), v.shape, v.stride()
    aligned = (q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)
    precision = "ieee" if q.dtype is not torch.float32 else _dot_precision(q)
    if attn_mask is None:
        # k's and v's strides in the kernel's order (``_bhsd_order``, inline).
        kv = (k_strides[0], k_strides[2], k_strides[1], k_strides[3],
              v_strides[0], v_strides[2], v_strides[1], v_strides[3])
        fixed = (q_strides, ks[:2] + ks[3:], vs[:2] + vs[3:], aligned, knobs, precision)
        step = _LANE_STEPS.get(token)
        # A length other than the lane's last one is a dynamic cache's next
        # token: no exact key of it is kept, so its lane's grown plan is
        # tried first (a fixed cache repeats its length, its exact key).
        grown_first = step is not None and step.m != m
    else:
        kv = fixed = None
        grown_first = False
    key = (token, q_strides, ks, k_strides, vs, v_strides, *aligned,
           None if attn_mask is None else (attn_mask.shape, attn_mask.stride(), attn_mask.data_ptr() & 15),
           knobs, precision)
    call = None if grown_first else _CALLS.get(key)
    grown = None
    if call is None and attn_mask is None:  # a dynamic cache's next length: its lane's kept plan
        grown = (token, *fixed, _fingerprint(kv))
        plan = _LANE_GROWN.get(grown)
        if plan is not None:  # not kept: this length will not recur
            call = _finish_grown(plan, q, q_strides, m, kv, window_left, window_right, None)
    if call is None:
        call = _cached_call(q, k, v, None, None, attn_mask, window_left, window_right, bottom_right, "bhsd", None,
                            knobs)
        _keep(_CALLS, key, call)
        if grown is not None:
            _keep(_LANE_GROWN, grown, call.plan)
    step = None
    if grown is not None:
        step = _LaneStep(fixed, kv, grown[-1], call, m)
        _keep(_LANE_STEPS, token, step)
    out = _run(call, q, k, v, None, None, attn_mask, scale, True, False, transpose_out)[0]
    if step is not None:
        step.arm_direct(q)
    return out


# A lane's dynamic cache: one key longer at every call, so ``lane_forward``'s
# key (k's and v's sizes and strides) is new each time, and building the call
# through ``_cached_call`` (its exact key, then ``_GROWN``) cost the hook about
# 12 us more per call than a fixed cache (bench/host_path_cpu.py). The lane
# fixes everything ``_GROWN``'s key holds but q's strides, the alignments,
# the knobs and the dot precision (``lane_forward``'s docstring), so
# ``_LANE_GROWN`` keeps the plan per lane, those, k's and v's sizes but the
# length, and the specialisation fingerprint of k's and v's strides (two
# entries for a cache whose strides alternate, as M * 24 does); a call that
# finds one takes that plan's call directly (``_finish_grown``), and is not
# kept: its length will not recur.
_LANE_GROWN: dict = {}


class _LaneStep:
    """A lane's last call without a mask, for its next one: what
    ``_LANE_GROWN``'s key holds but the lane (``fixed``: q's strides, k's and
    v's sizes but the length, alignments, knobs, dot precision), k's and v's
    strides in the kernel's order (``kv``) and their fingerprint (``fp``),
    the plan, the launches (``L``: split count and bucket) and length
    (``m``) of the last call, and that call when it was made (``call``, None
    after a direct launch). A call with the same ``fixed`` and the same
    strides, or strides of the same fingerprint, has the same plan
    (``_LANE_GROWN`` would find it); ``_step_forward`` then asks ``_bucket``
    and the plan's launches only when its split count or its keys per
    split's bucket moved, and launches directly (``direct``, a
    ``_DirectLaunch``) where it can, else builds its call. A call with the
    last one's strides and length is that call (``_Call`` objects are never
    changed once built).

    Inside ``generate()`` the hook's call costs a multiple of the same call
    in a loop (the model's layers evict the path from the CPU's caches), so
    what counts there is how much code a call runs: this skips
    ``_finish_call``'s seven helpers (bench/NOTES.md run 37), and the direct
    launch ``_run``'s allocations and lookups (run 39)."""

    __slots__ = ("fixed", "kv", "fp", "call", "m", "windows", "lo", "hi", "plan", "L", "direct")

    def __init__(self, fixed, kv, fp, call, m):
        self.fixed, self.kv, self.fp, self.call, self.m = fixed, kv, fp, call, m
        self.windows, self.plan, self.L, self.direct = call.windows, call.plan, call.L, None
        # The keys per split that ``L`` serves (none known yet).
        self.lo, self.hi = 1, 0

    def last_call(self) -> "_Call":
        """The call the step's last call was, built when ``_run`` needs it
        (a direct launch makes none): what ``_cached_call`` keeps for its
        arguments."""
        if self.call is None:
            plan, L, m = self.plan, self.L, self.m
            c = self.call = _Call()
            c.plan, c.L = plan, L
            c.ints = (*self.fixed[0], *self.kv, 0, 0, 0, 0, 0, 0, *plan.sizes, m, 1, L.S)  # q's strides first
            c.windows = self.windows
            c.bounds_ints = None
            c.fuse = L.fusable and plan.cache_bytes_per_key * m <= FUSED_MAX_BYTES
        return self.call

    def arm_direct(self, q) -> None:
        """After a call launched through ``_run``: the direct launch of the
        step's launches for its next call, where they have a C launch."""
        if self.L.c_launch:
            self.direct = _DirectLaunch.of(self.plan, self.L, q)


# lane token -> its _LaneStep (``lane_forward``)
_LANE_STEPS: dict = {}


def lane_step_forward(token, q, k, v, m: int, knobs: tuple, scale, window_left, window_right,
                      transpose_out: bool) -> torch.Tensor | None:
    """``lane_forward(token, q, k, v, None, scale, window_left,
    window_right, True, knobs, transpose_out)`` (``m``: k's length) where
    the lane's kept step serves the call (``_LaneStep``), else None with
    nothing launched: the fast path's lane sites (``fastpath.LaneSite``),
    whose calls have the lane's signature, so that its sizes need no
    check: what the step holds besides the sizes (q's strides, the
    alignments, knobs and dot precision) is compared, and k's and v's
    strides, or their fingerprint. ``lane_forward`` tries it first too."""
    if _DRY_RUN.get():
        return None
    step = _LANE_STEPS.get(token)
    if step is None:
        return None
    fixed = step.fixed
    q_strides = q.stride()
    addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr())  # read once: a direct launch takes them
    if (q_strides != fixed[0] or (addresses[0] & 15, addresses[1] & 15, addresses[2] & 15) != fixed[3]
            or knobs != fixed[4] or ("ieee" if q.dtype is not torch.float32 else _dot_precision(q)) != fixed[5]):
        return None
    k_strides, v_strides = k.stride(), v.stride()
    # k's and v's strides in the kernel's order (``_bhsd_order``, inline).
    kv = (k_strides[0], k_strides[2], k_strides[1], k_strides[3],
          v_strides[0], v_strides[2], v_strides[1], v_strides[3])
    if kv != step.kv and step.fp != _fingerprint(kv):
        return None
    return _step_forward(step, q, k, v, m, kv, scale, window_left, window_right, transpose_out, addresses)


def _step_forward(step: _LaneStep, q, k, v, m: int, kv: tuple, scale, window_left, window_right,
                  transpose_out: bool, addresses: tuple) -> torch.Tensor:
    """``lane_forward``'s result for a call that ``step`` serves (see
    ``_LaneStep``): ``_finish_grown`` of the step's plan, inline, then its
    direct launch (``_launch_direct``) or ``_run``. ``addresses``: q's, k's
    and v's."""
    plan, L = step.plan, step.L
    if m != step.m or kv != step.kv:
        if plan.forced is not None:
            S = plan.forced
        else:
            S = max(1, min(plan.want, -(-max(m, 1) // MIN_SPLIT_KEYS), MAX_SPLITS))  # _splits_for_keys
        per = -(-m // S)  # the keys a split reads: what the launches' bucket is of
        if S != L.S or not step.lo <= per <= step.hi:
            if plan.interp:
                bucket, step.lo, step.hi = 0, 0, _NO_END
            else:
                # _bucket: the next power of two, capped; the same for every
                # count of keys in (bucket / 2, bucket], or past the cap's half.
                bucket = _bucket(per, _BUCKET_CAP)
                step.lo, step.hi = bucket // 2 + 1, (bucket if bucket < _BUCKET_CAP else _NO_END)
            L = plan.launches.get((S, bucket))
            if L is None:
                L = plan.launches[(S, bucket)] = _make_launches(plan, S, bucket, q)
            step.L = L
        step.kv, step.m, step.call = kv, m, None
        limit = plan.N + m
        # clamp_window, inline (0: no bound)
        step.windows = (0 if window_left is None else max(-limit, min(int(window_left), limit)),
                        0 if window_right is None else max(-limit, min(int(window_right), limit)))
    d = step.direct
    if d is not None and d.L is L:
        out = _launch_direct(d, step, m, kv, scale, transpose_out, addresses)
        if out is not None:
            return out
    out = _run(step.last_call(), q, k, v, None, None, None, scale, True, False, transpose_out)[0]
    step.arm_direct(q)  # the next call's, where this one could have been direct
    return out


class _DirectLaunch:
    """A lane step's one launch made without ``_run`` (``_launch_direct``):
    for launches ``L`` of an eager call on real tensors whose one kernel
    (the split kernel, merging its partials itself where ``L`` splits the
    keys) has a C launch (``launch.KeptBinary``), on the stream it was made
    for, with the workspaces ``_run`` took there (held here, checked by
    ``_WORKSPACE_EPOCH``). What stays fixed for such calls is kept: the
    grid and the C launch's head and tail, the buffers' addresses, the
    integer arguments before the length (rebuilt when k's or v's strides
    move), the output's shape, dtype and device. Only calls that ``_run``
    would launch the same way take it; any other falls back to ``_run``."""

    __slots__ = ("L", "index", "stream", "epoch", "c_launch", "head", "tail", "packed", "buffers", "lse", "part",
                 "count", "max_m", "kv", "ints", "out_shape", "out_strides", "op_shape", "op_strides", "dtype",
                 "device")

    @staticmethod
    def of(plan: _Plan, L: _Launches, q) -> "_DirectLaunch | None":
        """The direct launch of ``L``, after ``_run`` launched it as one (its
        binary and workspaces made), or None where ``_run`` would not."""
        if plan.interp or not WORKSPACES or (L.part_numel > SCRATCH_MAX_FLOATS):
            return None
        if L.direct:
            kept = L.binaries[_SPLIT]
        elif L.fusable and FUSE_COMBINE:
            kept = L.binaries[_FUSED_SPLIT]
        else:
            return None
        if kept is None or kept.c_launch is None or (_CUDA_CAPTURING or torch.cuda.is_current_stream_capturing)():
            return None
        current = _CUDA_DEVICE() if _CUDA_DEVICE is not None else torch.cuda.current_device()
        if plan.device_index is not None and plan.device_index != current:
            return None
        stream, dev = _device_stream(current), q.device
        lse = _WORKSPACES.get((dev, stream, "lse"))
        part = lse if L.direct else _WORKSPACES.get((dev, stream, "part"))
        count = lse if L.direct else _WORKSPACES.get((dev, stream, "counters"))
        if (lse is None or part is None or count is None or lse.numel() < plan.B * plan.Hq * plan.N
                or part.numel() < L.part_numel or (not L.direct and count.numel() < L.counters)):
            return None
        d = _DirectLaunch()
        d.L, d.index, d.stream, d.epoch = L, plan.device_index, stream, _WORKSPACE_EPOCH[0]
        d.c_launch, d.head, d.tail, d.packed = kept.c_launch, (*L.grid, stream, *kept.c_head), kept.tail, kept.c_packed
        d.buffers = (lse, part, count)  # alive while this launch may write them
        d.lse, d.part, d.count = lse.data_ptr(), part.data_ptr(), count.data_ptr()
        d.max_m = _NO_END if L.direct else FUSED_MAX_BYTES // plan.cache_bytes_per_key
        d.kv = d.ints = None
        st = plan.sizes[:4]  # out's strides as (B, Hq, N, Dv)
        d.out_shape, d.out_strides = (plan.B, plan.N, plan.Hq, plan.Dv), (st[0], st[2], st[1], st[3])
        d.op_shape, d.op_strides = (plan.B, plan.Hq, plan.N, plan.Dv), st
        d.dtype, d.device = q.dtype, dev
        return d


def _launch_direct(d: _DirectLaunch, step: _LaneStep, m: int, kv: tuple, scale, transpose_out: bool,
                   addresses: tuple) -> torch.Tensor | None:
    """The output of ``step``'s call launched through ``d``, or None (nothing
    launched) where ``_run`` would launch otherwise: under graph capture, on
    another device or stream, with launch hooks, settings changed
    (``FUSE_COMBINE``, ``WORKSPACES``), a workspace replaced, or a cache too
    large for the fused merge. Its arguments are ``_allocate_and_launch``'s
    C launch's, to the address."""
    if (not WORKSPACES or (not FUSE_COMBINE and not d.L.direct) or m > d.max_m or d.epoch != _WORKSPACE_EPOCH[0]
            or (_CUDA_CAPTURING or torch.cuda.is_current_stream_capturing)()):
        return None
    current = _CUDA_DEVICE() if _CUDA_DEVICE is not None else torch.cuda.current_device()
    if (d.index is not None and d.index != current) or _device_stream(current) != d.stream \
            or _launch_hooks() != (None, None):
        return None
    if kv != d.kv:
        d.kv, d.ints = kv, (*step.fixed[0], *kv, 0, 0, 0, 0, 0, 0, *step.plan.sizes)  # q's strides first
    windows = step.windows
    # (empty_strided: a shorter way through torch's argument parsing than
    # empty's, 1.1 against 1.7 us on a CPU)
    if transpose_out:  # (B, N, Hq, Dv), contiguous: the memory order of the op's output
        out = torch.empty_strided(d.out_shape, d.out_strides, dtype=d.dtype, device=d.device)
    else:  # (B, Hq, N, Dv) over the same memory
        out = torch.empty_strided(d.op_shape, d.op_strides, dtype=d.dtype, device=d.device)
    q, lse = addresses[0], d.lse
    # (q, k, v, seqlens, table, mask, bounds, part, out, lse, counters) as
    # _allocate_and_launch passes them: q stands in for the absent tensors,
    # the lse for the bounds (and for the partials and counters unsplit).
    if d.packed:  # (``launch.KeptBinary.c_packed``: the arguments in one tuple)
        d.c_launch(*d.head, (*addresses, q, q, q, lse, d.part, out.data_ptr(), lse, d.count, *d.ints, m, 1, d.L.S,
                             float(scale) * _LOG2E, *windows, *d.tail))
    else:
        d.c_launch(*d.head, *addresses, q, q, q, lse, d.part, out.data_ptr(), lse, d.count, *d.ints, m, 1, d.L.S,
                   float(scale) * _LOG2E, *windows, *d.tail)
    return out


_BUCKET_CAP = 1 << 16  # the cap on the launches' bucket of keys per split (_finish_call)
_NO_END = 1 << 62


def _grown_strides(k, v, layout: str) -> tuple:
    """A cache without a block table: k's length, k's and v's strides in the
    kernel's order, and their specialisation fingerprint."""
    _, m, kst, vst, _ = _kernel_strides(k, v, None, layout)
    kv = (*kst, *vst)
    return m, kv, _fingerprint(kv)


def _finish_grown(plan, q, q_strides, m, kv, window_left, window_right, num_splits) -> "_Call":
    """The call of a kept ``plan`` for a cache without mask or block table
    of ``m`` keys (``kv``: k's and v's strides in the kernel's order)."""
    return _finish_call(plan, q, (*q_strides, *kv, 0, 0, 0, 0, 0, 0), m, m, 1, window_left, window_right,
                        num_splits, True)


class _Call:
    """One exact call signature: its plan, its launches and every integer
    argument (strides, sizes, split count, clamped window)."""

    __slots__ = ("plan", "L", "ints", "windows", "bounds_ints", "fuse")


def _bhsd_order(strides) -> tuple:
    """A (B, Hkv, M, D) cache's strides in the kernel's (batch row, slot,
    head, dim) order."""
    return strides[0], strides[2], strides[1], strides[3]


def _kernel_strides(k, v, block_table, layout):
    """Hkv, the capacity, k's and v's strides in the kernel's (page or batch
    row, slot, head, dim) order, and the table's strides."""
    ks, vs = k.stride(), v.stride()
    if block_table is not None:
        return k.shape[2], block_table.shape[1] * k.shape[1], ks, vs, block_table.stride()
    if layout == "bhsd":
        return k.shape[1], k.shape[2], _bhsd_order(ks), _bhsd_order(vs), (0, 0)
    return k.shape[2], k.shape[1], ks, vs, (0, 0)


def _make_call(q, k, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right, layout,
               num_splits, cache: bool, knobs: tuple = ()) -> _Call:
    # The strides that may move with the cache length, in the kernel's
    # (page or batch row, slot, head, dim) order, and the capacity.
    Hkv, m_cap, kst, vst, tst = _kernel_strides(k, v, block_table, layout)
    num_pages, page_size = (k.shape[0], k.shape[1]) if block_table is not None else (1, 1)
    mst = _mask_strides(attn_mask) if attn_mask is not None else (0, 0, 0, 0)
    plan = None
    if cache:
        key = _plan_key(q, k, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right,
                        layout, num_splits, Hkv, page_size, m_cap, (*kst, *vst, *tst, *mst), knobs)
        plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(q, v, cache_seqlens, block_table, attn_mask, window_left, window_right, bottom_right, Hkv,
                          page_size, m_cap)
        if cache:
            PLAN_MISSES[0] += 1
            _keep(_PLANS, key, plan)
    elif attn_mask is not None:
        _check_mask_shape(attn_mask, (plan.B, plan.Hq, plan.N, m_cap))
    c = _finish_call(plan, q, (*q.stride(), *kst, *vst, *tst, *mst), m_cap, hint(m_cap), num_pages, window_left,
                     window_right, num_splits, cache)
    c.bounds_ints = (*mst, m_cap, plan.m_rows, plan.m_queries) if attn_mask is not None else None
    return c


def _finish_call(plan: _Plan, q, head: tuple, m_cap, m_hint: int, num_pages, window_left, window_right, num_splits,
                 cache: bool) -> _Call:
    """The call of ``plan`` with ``m_cap`` keys a row can hold (``m_hint``
    its example value when symbolic): its split count, launches and integer
    arguments (``head``: the strides of q, k, v, the table and the mask, in
    the kernel's order); no mask bounds."""
    if num_splits is not None:
        S = max(1, int(num_splits))
    elif plan.forced is not None:
        S = plan.forced
    else:
        S = _splits_for_keys(plan.want, m_hint)
    bucket = 0 if plan.interp else _bucket(cdiv(m_hint, S), _BUCKET_CAP)
    L = plan.launches.get((S, bucket))
    if L is None:
        L = _make_launches(plan, S, bucket, q)
        if cache:
            plan.launches[(S, bucket)] = L
    c = _Call()
    c.plan, c.L = plan, L
    c.ints = (*head, *plan.sizes, m_cap, num_pages, S)
    limit = plan.N + m_cap
    c.windows = (clamp_window(window_left, limit), clamp_window(window_right, limit))
    c.bounds_ints = None
    c.fuse = L.fusable and plan.cache_bytes_per_key * m_hint <= FUSED_MAX_BYTES
    return c


# A dynamic cache is one key longer at every token: a new exact call
# signature (sizes and strides) each time, whose plan only the strides'
# specialisation and the sizes other than the length decide. For calls
# without a mask or a block table, ``_GROWN`` maps the exact key less k's
# and v's sizes and strides, plus those sizes but the length, to the plan
# and the specialisation fingerprint of k's and v's strides it was built
# for: a call with the same fingerprint takes that plan without building
# the plan key (``_grown_call``). Everything else the plan key holds is in
# the exact key (``decode_forward``) or fixed by the absent mask and table;
# v's length is read by nothing.
_GROWN: dict = {}


def _grown_call(q, k, v, rest, cache_seqlens, window_left, window_right, bottom_right, layout, num_splits,
                knobs) -> _Call:
    """The call of a signature without mask or block table (``rest``: its
    exact key less k's and v's sizes and strides, ``rest[1]`` q's strides):
    from ``_GROWN``'s plan when one matches, else through ``_make_call``,
    whose plan is then recorded."""
    m, kv, fp = _grown_strides(k, v, layout)
    length = 2 if layout == "bhsd" else 1  # k's and v's length dimension: (B, Hkv, M, D) or (B, M, Hkv, D)
    ks, vs = k.shape, v.shape
    gkey = (ks[:length] + ks[length + 1:], vs[:length] + vs[length + 1:], rest)
    entry = _GROWN.get(gkey)
    if entry is not None and entry[1] == fp:
        return _finish_grown(entry[0], q, rest[1], m, kv, window_left, window_right, num_splits)
    call = _make_call(q, k, v, cache_seqlens, None, None, window_left, window_right, bottom_right, layout,
                      num_splits, True, knobs)
    _keep(_GROWN, gkey, (call.plan, fp))
    return call


# The split kernel merges a call's partials itself (``_decode_split``'s
# FUSED: one launch per call instead of two) where that pays: eager calls on
# real tensors outside CUDA graph capture (in traced graphs and under capture
# a combine kernel follows, since a counter buffer made there would belong to
# the graph's memory), on caches of at most FUSED_MAX_BYTES of keys and
# values, with at most FUSED_MAX_SPLITS splits and FUSED_MAX_MERGES rows
# times splits per tile. The fused merge saves the
# host a launch (7.5-13 us per call on the H200's host, two runs) but costs
# device time:
# one program merges its tile's rows one after the other, where the combine
# kernel has a program per row (4k keys 18.6 against 14.9 us, 32k keys 57.5
# against 49.3: bench/NOTES.md run 22). Below FUSED_MAX_BYTES an eager
# call's device time stays under its host time, so the extra device time is
# hidden and the saved launch is not. At 64 MiB (16k keys at batch 1 in
# bench/decode_merge.py, run 41) the fused merge cost 41.8 against 33.0 us of
# device time on an H100 and 33.7 against 25.5 on an H200; in a loop of calls
# it tied on the H100 (46.8 against 45.5 us) and won on the H200's faster
# host (39.8 against 53.1). 32 MiB keeps the device time; the H200's loop
# at 8-16k keys is the price (bench/NOTES.md run 41). At 16 MiB the fused
# merge won on both (loop 39.9 against 57.5 us, H100). Tests and benchmarks
# set FUSE_COMBINE False to compare.
FUSE_COMBINE = True
FUSED_MAX_BYTES = 32 << 20
# With 128 splits (BLOCK_S = 128) the fused split kernel needs 199 registers
# a thread (Triton 3.6, sm_90a), too many for three programs an SM; with 64, 154.
FUSED_MAX_SPLITS = 64
# The merging program takes its tile's rows one after the other, each a round
# trip for its S partials: about 1.1 + 0.035 * S us a row on an H100 (run 41,
# bench/decode_merge.py; 16 and 49 splits). With many rows (several queries
# times the grouped heads) that chain outlasts the launch it saves, so past
# FUSED_MAX_MERGES rows times splits per tile the combine kernel (a program
# per row) merges. At 4k keys (16 splits) a loop of eager calls was faster
# fused up to 16 rows (37.7 against 47.8 us a call on an H100, 32.6 against
# 36.7 on an H200) and slower at 32 (69.4 against 47.5); at 8k keys (32
# splits, H200) 8 rows fused were faster (38.8 against 54.1), 16 slower
# (58.9 against 53.5).
FUSED_MAX_MERGES = 256

# Buffers kept per (device, stream, what) (``_workspace``): launches on one
# stream never overlap, on two they may. Two kinds:
# * "counters", the fused combine's arrival counters: zero between
#   launches, since each row tile's last split sets its counter back;
# * the buffers that live only within an eager call (the partials "part",
#   the mask "bounds", and the "lse" when the caller drops it), kept instead
#   of allocated at every call: a call's kernels are done with them before
#   the next call's on the same stream start. Partials larger than
#   SCRATCH_MAX_FLOATS (64 MiB) are allocated per call, so that no workspace
#   keeps that much memory. Benchmarks set WORKSPACES False to compare.
_WORKSPACES: dict = {}
_WORKSPACE_EPOCH = [0]  # buffers made so far (``_workspace``)
SCRATCH_MAX_FLOATS = 1 << 24
WORKSPACES = True


def _workspace(dev: torch.device, stream, what: str, n: int, dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
    """A kept buffer of at least ``n`` elements for launches on ``stream``:
    zeros when first made with ``zeroed``, else contents undefined."""
    key = (dev, stream, what)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < n:
        # A buffer dropped here may still be in use by a launch queued on
        # the stream; the allocator reuses its memory only after that launch.
        buf = (torch.zeros if zeroed else torch.empty)(max(n, 4096), dtype=dtype, device=dev)
        _WORKSPACES[key] = buf
        _WORKSPACE_EPOCH[0] += 1  # a direct launch holding the one replaced steps back (_DirectLaunch)
    return buf


def _run(c: _Call, q, k, v, cache_seqlens, block_table, attn_mask, scale, cache: bool, need_lse: bool = True,
         transpose_out: bool = False):
    """Allocate the outputs of call ``c`` and launch its kernels; the output
    as (B, N, Hq, Dv) with ``transpose_out`` (``lane_forward``)."""
    plan = c.plan
    if plan.interp:
        # eager as below: no graph capture under the interpreter.
        return _allocate_and_launch(c, q, k, v, cache_seqlens, block_table, attn_mask, scale, cache, need_lse,
                                    cache, None, transpose_out)
    # An eager call on real tensors outside graph capture may merge its
    # partials in the split kernel and take its scratch from its stream's
    # workspace (see FUSE_COMBINE and _workspace).
    eager = cache and not (_CUDA_CAPTURING or torch.cuda.is_current_stream_capturing)()
    index = plan.device_index
    current = _CUDA_DEVICE() if _CUDA_DEVICE is not None else torch.cuda.current_device()
    if index is None or index == current:  # a device without an index is the current one
        # The current device read once: the stream Triton's own launch would
        # take (``launch._current_stream``), without reading it again.
        return _allocate_and_launch(c, q, k, v, cache_seqlens, block_table, attn_mask, scale, cache, need_lse,
                                    eager, _device_stream(current), transpose_out)
    with torch.cuda.device(q.device):
        return _allocate_and_launch(c, q, k, v, cache_seqlens, block_table, attn_mask, scale, cache, need_lse,
                                    eager, _device_stream(index), transpose_out)


# The C functions behind ``torch.cuda.is_current_stream_capturing()`` and
# ``torch.cuda.current_device()`` (which first makes sure CUDA is
# initialised: it is, a call's tensors are on it), called directly where
# this torch has them (a CPU build has dummies): a Python frame or two less
# per decode call (the stream: ``launch._device_stream``).
_CUDA_BUILT = torch.backends.cuda.is_built()
_CUDA_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) if _CUDA_BUILT else None
_CUDA_DEVICE = getattr(torch._C, "_cuda_getDevice", None) if _CUDA_BUILT else None


def _allocate_and_launch(c: _Call, q, k, v, cache_seqlens, block_table, attn_mask, scale, cache: bool,
                         need_lse: bool, eager: bool, stream, transpose_out: bool = False):
    """``_run`` on the current device; ``stream`` None under the interpreter."""
    plan, L = c.plan, c.L
    B, Hq, N, Dv = plan.B, plan.Hq, plan.N, plan.Dv
    dev = q.device
    kept = eager and WORKSPACES
    # Fresh allocations are 16-byte aligned (PyTorch's allocators align far
    # more), as the binaries kept for these arguments assume; so are the
    # workspaces, fresh allocations that are kept.
    if transpose_out:  # the same memory, allocated in its own order: no view made
        out = torch.empty((B, N, Hq, Dv), dtype=q.dtype, device=dev)
    else:
        out = torch.empty_strided((B, Hq, N, Dv), plan.sizes[:4], dtype=q.dtype, device=dev)  # out's strides
    if need_lse or not kept:
        lse = torch.empty((B, Hq, N), dtype=torch.float32, device=dev)
    else:  # written, never read
        # (Each kept buffer's lookup is ``_workspace``'s first lines, inline:
        # this runs per layer per token, bench/NOTES.md run 37.)
        lse = _WORKSPACES.get((dev, stream, "lse"))
        if lse is None or lse.numel() < B * Hq * N:
            lse = _workspace(dev, stream, "lse", B * Hq * N, torch.float32)
    # Partial outputs and lse in one buffer (``_parts``); none when direct.
    if L.direct:
        part = lse
    elif kept and L.part_numel <= SCRATCH_MAX_FLOATS:
        part = _WORKSPACES.get((dev, stream, "part"))
        if part is None or part.numel() < L.part_numel:
            part = _workspace(dev, stream, "part", L.part_numel, torch.float32)
    else:
        part = torch.empty((L.part_numel,), dtype=torch.float32, device=dev)
    seqlens = cache_seqlens if cache_seqlens is not None else q  # never read without HAS_SEQLENS
    table = block_table if block_table is not None else q  # never read without PAGED
    if attn_mask is not None:
        # The kernels read the mask through broadcast strides, unexpanded.
        mask = bool_mask_as_bytes(attn_mask)
        n_bounds = B * plan.chunks * 2
        bounds = (_workspace(dev, stream, "bounds", n_bounds, torch.int32) if kept
                  else torch.empty((n_bounds,), dtype=torch.int32, device=dev))
        bounds_args = (mask, bounds, *c.bounds_ints)
    else:
        mask, bounds = q, lse  # never read
    fused = c.fuse and eager and FUSE_COMBINE
    # lse stands in for the counters unfused: never read there.
    if fused:
        count = _WORKSPACES.get((dev, stream, "counters"))
        if count is None or count.numel() < L.counters:
            count = _workspace(dev, stream, "counters", L.counters, torch.int32, zeroed=True)
    else:
        count = lse
    tensors = (q, k, v, seqlens, table, mask, bounds, part, out, lse, count)
    scalars = (*c.ints, float(scale) * _LOG2E, *c.windows)
    # The split kernel's arguments are (*tensors, *scalars), built where a
    # launch takes them as tensors (the C launches take addresses).
    # The combine kernel's arguments, when it runs.
    comb_args = None if L.direct or fused else (part, out, lse, *plan.sizes[:-1], L.S)
    if plan.interp:
        if attn_mask is not None:
            _mask_bounds[(plan.chunks, B)](*bounds_args, **plan.bounds_meta)
        _decode_split[L.grid](*tensors, *scalars, **(L.fused_meta if fused else L.launch_meta))
        if not L.direct and not fused:
            _decode_combine[L.comb_grid](*comb_args, **L.comb_meta)
    else:
        # Kept binaries with a C launch (``launch.KeptBinary``) take the
        # tensors as addresses: Triton's launcher would otherwise call each
        # one's data_ptr() and ask the driver about the address, per launch.
        # Only without launch hooks, which may read the tensors.
        pointers = comb_pointers = bounds_pointers = None
        if L.c_launch and _launch_hooks() == (None, None):
            p = tuple(map(_DATA_PTR, tensors))
            pointers = (*p, *scalars)
            comb_pointers = None if comb_args is None else (p[7], p[8], p[9], *comb_args[3:])
            bounds_pointers = None if attn_mask is None else (p[5], p[6], *bounds_args[2:])
        if attn_mask is not None:
            _launch(_BOUNDS, L, _bounds_launcher, L.bounds_key, (plan.chunks, B, 1), bounds_args, plan.bounds_meta,
                    False, stream, cache, bounds_pointers)
        if fused:
            kept = L.binaries[_FUSED_SPLIT]
            if pointers is not None and kept is not None and kept.c_launch is not None and not kept.c_packed:
                # ``_launch``'s C launch, inline: the decode lane's one launch
                g = L.grid
                kept.c_launch(g[0], g[1], g[2], stream, *kept.c_head, *pointers, *kept.tail)
            else:
                _launch(_FUSED_SPLIT, L, _split_launcher, L.key, L.grid, (*tensors, *scalars), L.fused_meta, plan.tune,
                        stream, cache, pointers)
        else:
            _launch(_SPLIT, L, _split_launcher, L.key, L.grid, (*tensors, *scalars), L.launch_meta, plan.tune, stream,
                    cache, pointers)
            if not L.direct:
                _launch(_COMBINE, L, _combine_launcher, L.comb_key, L.comb_grid, comb_args, L.comb_meta, False, stream,
                        cache, comb_pointers)
    return out, (lse if need_lse else None)


_DATA_PTR = torch.Tensor.data_ptr
