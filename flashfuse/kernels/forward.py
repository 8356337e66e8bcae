"""Triton flash-attention forward kernel and its launcher.

One program computes a BLOCK_M tile of queries of one (batch, query head). It
streams the keys and values of that head's key/value head in BLOCK_N blocks
and keeps an online softmax (running max ``m_i``, running sum ``l_i``, fp32
accumulator ``acc``) so no (N, M) tensor is ever stored. Scores are kept in
base-2 units: ``scale * log2(e)`` is folded into one multiply and ``exp2``
replaces ``exp``; ``lse`` is converted back to natural-log units at the end.

The key range of a query block is split in three phases: key blocks that
straddle the start of the visible band, key blocks that every (real) query of
the block sees entirely, and key blocks that straddle its end or the sequence
end. Only the first and last pay for the element-wise visibility and bounds
masks; blocks outside the band are never visited. With a mask, the middle
phase is split again at the blocks where the mask's values are all neutral
for the tile's rows (``mask_ranges``): those run as if there were no mask.

See ARCHITECTURE.md for the conventions (shapes, masks, visibility, dropout,
lse, output layout).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import AVERAGE_AT_BASE2, _dropout_keep_block, _lse_marked, _mask_block_start, _mask_key_span
from .common import _mask_tile_bounds, _tanh, _visible
from .common import MASK_BOOL_C, MASK_FLOAT_C, MASK_NONE, MASK_NONE_C
from .common import dropout_threshold as _keep_threshold
from .launch import (
    ConfigLauncher, _autotune_enabled, _bucket, cdiv, config_tuple, DESCRIPTOR_MIN_STAGES, FORWARD_BUCKET_CAP,
    ensure_scratch_allocator,
)
from .mask_ranges import ROW_GROUP as _RANGE_GROUP
from .mask_ranges import mask_tables, table_strides
from .problem import AttentionProblem

__all__ = ["attention_forward", "dropout_keep_mask_triton"]

_LOG2E = math.log2(math.e)


@triton.jit
def _load_tile(ptrs, mask0, mask1, CHECK0: tl.constexpr, CHECK1: tl.constexpr):
    """Load a 2-d tile, masking only the dimensions that can be out of range.

    ``mask0`` / ``mask1`` are the bounds masks of the two dimensions (shaped to
    broadcast against ``ptrs``); out-of-range elements read as 0. Skipping the
    masks that are known to be all-true keeps the loads unpredicated.
    """
    if CHECK0:
        if CHECK1:
            x = tl.load(ptrs, mask=mask0 & mask1, other=0.0)
        else:
            x = tl.load(ptrs, mask=mask0, other=0.0)
    else:
        if CHECK1:
            x = tl.load(ptrs, mask=mask1, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation.

    UPCAST multiplies in fp32: Triton's interpreter mis-computes tl.dot on
    bfloat16 operands, so the launcher sets it there (values already rounded
    to bfloat16 stay exact in fp32, so results match the compiled kernel).
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def _dot_acc(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``, accumulated in place by the MMA (see ``_dot``)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    k_base, v_base, mask_base,
    lo, hi,
    offs_m, offs_n_base, offs_d, offs_dv, row_ok,
    N, M,
    stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_mask_q, stride_mask_k,
    qk_scale, diag_off, window_left, window_right,
    seed, bh, dropout_threshold, mask_fill, softcap_scale,
    BOUNDARY: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, FILL: tl.constexpr, DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALE_NONNEG: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KV_DESC: tl.constexpr, SOFTCAP: tl.constexpr, FULL_KEY_BLOCKS: tl.constexpr,
):
    """Fold key blocks ``[lo, hi)`` (lo a multiple of BLOCK_N) into the online softmax.

    acc (BLOCK_M, BLOCK_DV) fp32, l_i / m_i (BLOCK_M,) fp32 in base-2 units,
    q (BLOCK_M, BLOCK_D). ``k_base`` / ``v_base`` point at key 0 of the
    key/value head, ``mask_base`` at (row offs_m, key 0) of the mask tile rows.
    BOUNDARY blocks may cross the visible band or the end of the keys: they
    apply ``_visible`` and bounds-check their loads; other blocks are known to
    be fully visible to every real query of the tile. FILL (bool masks):
    the pairs the mask hides score ``mask_fill`` (base 2) instead of -inf.
    SOFTCAP: the product goes through ``tanh(qk * softcap_scale)`` first;
    ``qk_scale`` is then ``cap * log2(e)``, so the code below is unchanged.
    """
    # Loop-invariant pointer tiles; only the scalar base advances, so the
    # per-element offsets stay small (int32) even for multi-million keys.
    if not KV_DESC:
        k_ptrs = (k_base + lo.to(tl.int64) * stride_k_k + offs_n_base[:, None] * stride_k_k
                + offs_d[None, :] * stride_k_d)
        v_ptrs = (v_base + lo.to(tl.int64) * stride_v_k + offs_n_base[:, None] * stride_v_k
                + offs_dv[None, :] * stride_v_d)
    if MASK_KIND != MASK_NONE_C:
        # The mask's 2-D pointer tile is formed in each iteration from the row
        # pointers: carried across the loop (like K's and V's) it held two
        # more registers per element and the masked loops spilled.
        mask_cols = offs_n_base[None, :] * stride_mask_k
    # Rows that can hold -inf everywhere (masked blocks, -inf in a float mask)
    # need a finite shift for exp2, else -inf - -inf = NaN.
    SAFE: tl.constexpr = BOUNDARY or (MASK_KIND != MASK_NONE_C)
    # max(qk) * scale is the max of the scaled scores only for scale >= 0.
    FMA_MAX: tl.constexpr = (not SAFE) and SCALE_NONNEG
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        col_ok = offs_n < M
        if KV_DESC:
            # Tensor-memory-accelerator copy; rows past M and columns past
            # the head dim arrive as zeros, so no bounds masks.
            k = k_base.load([start_n, 0])
        else:
            k = _load_tile(k_ptrs, col_ok[:, None], d_ok, BOUNDARY, BLOCK_D != HEAD_DIM)
        qk = _dot(q, tl.trans(k), INPUT_PRECISION, DOT_UPCAST)
        if SOFTCAP:
            qk = _tanh(qk * softcap_scale)
        if DROPOUT:
            # Drawn while the score product is in flight: the draws do not
            # depend on it, so integer and tensor-core work can overlap.
            dkeep = _dropout_keep_block(seed, offs_m, start_n, bh, dropout_threshold, BLOCK_N)
        if MASK_KIND != MASK_NONE_C:
            mask_ptrs = (mask_base + tl.cast(_mask_block_start(start_n, BLOCK_N), tl.int64) * stride_mask_k
                         + mask_cols)
            mvals = tl.load(mask_ptrs, mask=_mask_tile_bounds(row_ok[:, None], col_ok[None, :],
                                                              BOUNDARY and not FULL_KEY_BLOCKS), other=0)
        if MASK_KIND == MASK_FLOAT_C:
            mvals = mvals.to(tl.float32)
            # Natural -> base-2 units. Values below -1e38 (finfo(fp32).min,
            # as HF builds masks) would overflow to -inf when multiplied by
            # log2(e); keep them as they are so a row masked that way still
            # averages its values like the float64 reference, while -inf
            # stays -inf. (The clamp only keeps the unused branch finite.)
            mvals = tl.where(mvals > -1.0e38, tl.maximum(mvals, -1.0e38) * 1.4426950408889634, mvals)
            qk = qk * qk_scale + mvals
            if BOUNDARY:
                vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                               HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
                qk = tl.where(vis, qk, float("-inf"))
        elif MASK_KIND == MASK_BOOL_C:
            keep = mvals != 0
            if FILL != 0:
                # masked_fill: hidden pairs score the fill; outside the band
                # nothing takes part, as with is_causal.
                qk = tl.where(keep, qk * qk_scale, mask_fill)
                if BOUNDARY:
                    vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                                   HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
                    qk = tl.where(vis, qk, float("-inf"))
            else:
                if BOUNDARY:
                    keep = keep & _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                                           HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
                qk = tl.where(keep, qk * qk_scale, float("-inf"))
        elif BOUNDARY:
            vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                           HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
            qk = tl.where(vis, qk * qk_scale, float("-inf"))
        if not FMA_MAX:
            if not SAFE:
                qk = qk * qk_scale
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            m_shift = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.exp2(qk - m_shift[:, None])
        else:
            # Interior block without a mask: every score is finite, and
            # scaling inside the exponent's argument is one FMA.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_shift = m_ij
            p = tl.exp2(qk * qk_scale - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        # The normaliser uses the undropped probabilities.
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dkeep, p, 0.0)
        if KV_DESC:
            v = v_base.load([start_n, 0])
        else:
            v = _load_tile(v_ptrs, col_ok[:, None], dv_ok, BOUNDARY, BLOCK_DV != HEAD_DIM_V)
        acc = acc * alpha[:, None]
        acc = _dot_acc(p.to(v.dtype), v, acc, INPUT_PRECISION, DOT_UPCAST)
        m_i = m_ij
        if not KV_DESC:
            k_ptrs += BLOCK_N * stride_k_k
            v_ptrs += BLOCK_N * stride_v_k
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _attn_fwd(
    Q, K, V, Mask, KeyTable, Seed, Out, Lse,
    stride_q_b, stride_q_h, stride_q_q, stride_q_d,
    stride_k_b, stride_k_h, stride_k_k, stride_k_d,
    stride_v_b, stride_v_h, stride_v_k, stride_v_d,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
    stride_tab_b, stride_tab_h,
    stride_o_b, stride_o_h, stride_o_q, stride_o_d,
    Hq, Hkv, N, M,
    qk_scale, diag_off, window_left, window_right,
    dropout_threshold, dropout_scale, mask_fill, Sinks, softcap_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, FILL: tl.constexpr, DROPOUT: tl.constexpr,
    SKIP_HIDDEN: tl.constexpr, SCALE_NONNEG: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, RANGE_GROUP: tl.constexpr,
    KV_DESC: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, FULL_KEY_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_M), Hq, B): one query tile of one (batch, head).

    Q (B, Hq, N, D), K (B, Hkv, M, D), V (B, Hkv, M, Dv), Mask (B, Hq, N, M)
    through its (possibly 0) strides, Seed an int64 scalar, Out (B, Hq, N, Dv)
    through its strides, Lse (B, Hq, N) contiguous fp32. ``qk_scale`` is
    ``scale * log2(e)``; ``diag_off`` the visibility diagonal offset.
    FILL: 0, or with a bool mask the score of the pairs it hides,
    ``mask_fill`` in base 2 (1), and then whether a row whose largest score
    is the fill is marked in lse as averaging its keys (2).
    SOFTCAP: scores are ``cap * tanh(scale * q.k / cap)``, with
    ``softcap_scale = scale / cap`` and ``qk_scale = cap * log2(e)``.
    SINKS: ``Sinks`` (Hq,) holds a logit per head that joins the row's
    denominator without a value, folded in after the loop.
    """
    # Inductor passes Python floats as fp64; the arithmetic must stay fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    dropout_scale = tl.cast(dropout_scale, tl.float32)
    mask_fill = tl.cast(mask_fill, tl.float32)
    softcap_scale = tl.cast(softcap_scale, tl.float32)
    # Last query tiles first: under causal masking they have the most keys,
    # so starting them early balances the tail of the launch.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // (Hq // Hkv)
    b64 = b.to(tl.int64)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N
    offs_m64 = offs_m.to(tl.int64)  # row * row-stride can pass 2**31

    q_ptrs = (Q + b64 * stride_q_b + h.to(tl.int64) * stride_q_h + offs_m64[:, None] * stride_q_q
            + offs_d[None, :] * stride_q_d)
    q = _load_tile(q_ptrs, row_ok[:, None], offs_d[None, :] < HEAD_DIM, True, BLOCK_D != HEAD_DIM)
    k_base = K + b64 * stride_k_b + kvh.to(tl.int64) * stride_k_h
    v_base = V + b64 * stride_v_b + kvh.to(tl.int64) * stride_v_h
    if KV_DESC:
        # The host checked: unit last strides, 16-byte aligned bases and row
        # strides (what the copy engine requires).
        k_base = tl.make_tensor_descriptor(k_base, shape=[M, HEAD_DIM], strides=[stride_k_k, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_base = tl.make_tensor_descriptor(v_base, shape=[M, HEAD_DIM_V], strides=[stride_v_k, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    if MASK_KIND != MASK_NONE_C:
        mask_base = Mask + b64 * stride_mask_b + h.to(tl.int64) * stride_mask_h
        mask_base = mask_base + offs_m64[:, None] * stride_mask_q
    else:
        mask_base = Mask
    if DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    bh = b * Hq + h

    # Key range of the tile: the union of its real rows' visible ranges ...
    row_last = tl.minimum(start_m + BLOCK_M, N) - 1
    zero = start_m * 0  # int32 scalar tensor, so the bounds below are tensors
    lo = zero
    hi = zero + M
    # ... and the keys every real row sees (no element-wise mask needed).
    full_lo = zero
    full_hi = zero + M
    if HAS_WINDOW_LEFT:
        lo = tl.maximum(start_m + diag_off - window_left, 0)
        full_lo = tl.maximum(row_last + diag_off - window_left, 0)
    if HAS_WINDOW_RIGHT:
        hi = tl.minimum(row_last + diag_off + window_right + 1, M)
        full_hi = tl.minimum(start_m + diag_off + window_right + 1, M)
    lo_blk = (lo // BLOCK_N) * BLOCK_N
    # Empty band (e.g. bottom-right alignment with N > M): no iteration.
    hi_blk = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N) * BLOCK_N, lo_blk)
    if SKIP_HIDDEN:
        # Skip the key blocks the mask hides from every row of the tile; find
        # those it leaves neutral for all of them.
        lo_blk, hi_blk, free_lo, free_hi = _mask_key_span(
            KeyTable + b64 * stride_tab_b + h.to(tl.int64) * stride_tab_h, offs_m, N, lo_blk, hi_blk,
            RANGE_GROUP, BLOCK_N)
    full_lo_blk = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    full_hi_blk = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(full_lo_blk, lo_blk), hi_blk)
    mid_hi = tl.maximum(tl.minimum(full_hi_blk, hi_blk), mid_lo)
    if SKIP_HIDDEN:  # the phase-2 blocks computed without the mask
        free_lo = tl.minimum(tl.maximum(free_lo, mid_lo), mid_hi)
        free_hi = tl.maximum(tl.minimum(free_hi, mid_hi), free_lo)
    else:
        free_lo = mid_hi
        free_hi = mid_hi

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Five loops in key order: blocks that straddle the band's start (bounds
    # and band checked per element); blocks every real row sees, which with
    # a mask split at the part where its values are all neutral (run as if
    # there were no mask), before it, in it and after it; blocks that
    # straddle the band's end or the last key (phases 0 and 4 check each
    # element). Without tables the middle is one loop.
    for phase in tl.static_range(5):
        if phase == 0:
            phase_lo, phase_hi = lo_blk, mid_lo
        elif phase == 1:
            phase_lo, phase_hi = mid_lo, free_lo
        elif phase == 2:
            phase_lo, phase_hi = free_lo, free_hi
        elif phase == 3:
            phase_lo, phase_hi = free_hi, mid_hi
        else:
            phase_lo, phase_hi = mid_hi, hi_blk
        if SKIP_HIDDEN or (phase != 2 and phase != 3):
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, q, k_base, v_base, mask_base, phase_lo, phase_hi,
                offs_m, offs_n_base, offs_d, offs_dv, row_ok, N, M,
                stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_mask_q, stride_mask_k,
                qk_scale, diag_off, window_left, window_right, seed, bh, dropout_threshold, mask_fill,
                softcap_scale, phase == 0 or phase == 4, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT,
                MASK_NONE_C if phase == 2 else MASK_KIND, 0 if phase == 2 else FILL, DROPOUT,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, SCALE_NONNEG, INPUT_PRECISION, DOT_UPCAST,
                KV_DESC, SOFTCAP, FULL_KEY_BLOCKS)

    # Rows that saw no key (l_i == 0): output 0, lse +inf.
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if DROPOUT:
        inv_l = inv_l * dropout_scale
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    lse_keys = lse  # the true lse of the keys, before any marker (for SINKS)
    # Rows that a finite value hides entirely: the marker holding l (see
    # common._lse_marked); m_i + log2(l) would have rounded to m_i.
    if MASK_KIND == MASK_FLOAT_C:
        lse = _lse_marked(lse, l_i, (m_i <= AVERAGE_AT_BASE2) & (~empty))
    elif FILL == 2:
        lse = _lse_marked(lse, l_i, (m_i == mask_fill) & (~empty))
    if SINKS:
        # lse' = logaddexp(lse, sink) and out *= exp(lse - lse'): the sink
        # joins the denominator only. From the keys' true lse; where the
        # sink changes nothing the stored lse (a marker, maybe) is kept.
        sink = tl.load(Sinks + h).to(tl.float32)
        keys = tl.where(empty, float("-inf"), lse_keys)
        top = tl.maximum(keys, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        e_keys = tl.exp(keys - top)
        den = e_keys + tl.exp(sink - top)  # 0 only when both are -inf
        lse_s = top + tl.log(den)
        out = out * tl.where(den > 0.0, e_keys / tl.where(den > 0.0, den, 1.0), 0.0)[:, None]
        lse = tl.where(lse_s == keys, lse, tl.where(lse_s == float("-inf"), float("inf"), lse_s))

    o_ptrs = (Out + b64 * stride_o_b + h.to(tl.int64) * stride_o_h + offs_m64[:, None] * stride_o_q
            + offs_dv[None, :] * stride_o_d)
    if BLOCK_DV != HEAD_DIM_V:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse_ptrs = Lse + (b64 * Hq + h) * N + offs_m64
    tl.store(lse_ptrs, lse, mask=row_ok)


# ---------------------------------------------------------------------------
# Tuning
# ---------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages), chosen for H100/H200 class GPUs;
# _prune_configs drops those that cannot fit a given head dim / dtype.
_CUDA_CONFIGS = [
    (128, 64, 8, 3),  # measured best on an H200 (Triton 3.6) for D = 128, bf16
    (128, 64, 4, 3),
    (128, 128, 8, 2),
    (128, 64, 8, 2),  # large head dims
    (64, 64, 4, 3),
    (64, 32, 4, 2),  # fp32 with large head dims
    (128, 128, 8, 3),
    (128, 64, 4, 4),
    (64, 64, 4, 4),
]

# Dropout or a mask tensor at head dims up to 64: 64-row tiles with 4 warps
# first. With dropout measured on an H200 (Triton 3.6) 11 % faster than
# (128, 64, 8, 3) at GPT-2's shape (bench/results/kernel_times.csv); with a
# mask the autotuner's pick at GPT-2's and BERT's shapes, with and without
# dropout, in 3 of 4 (bench/NOTES.md run 20). Otherwise the 128-row tiles stay
# first: the 64-row ones measured 5-9 % slower on the D = 64 rows of the
# attention sweep (bench/NOTES.md run 6), though 7 % faster at GPT-2's shape.
_SMALL_HEAD_FIRST = (64, 64, 4, 3)


# With tensor-descriptor loads (head dims 65-128): 64-row tiles, one warp
# group, measured 3-8 % faster on an H200 (Triton 3.6) at D = 128 than the
# best pointer-load tile, (128, 64, 8, 3) (bench/NOTES.md run 11).
_DESCRIPTOR_FIRST = (64, 64, 4, 3)

_SMEM_BUDGET = 200 * 1024  # bytes; H100/H200 allow 227 KiB per block, leave room
_REG_BUDGET = 200  # fp32 accumulator + score values per thread before spilling


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs whose tiles fit shared memory and registers."""
    args = {**named_args, **kwargs}
    bd, bdv = args["BLOCK_D"], args["BLOCK_DV"]
    elt = args["Q"].element_size()
    # The pipeliner stages mask tiles in shared memory next to K and V.
    mask_elt = args["Mask"].element_size() if args["MASK_KIND"] != MASK_NONE else 0
    if args.get("KV_DESC"):
        configs = [c for c in configs if c.num_stages >= DESCRIPTOR_MIN_STAGES]
    kept = []
    for cfg in configs:
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        smem = elt * bm * bd + cfg.num_stages * bn * (elt * (bd + bdv) + mask_elt * bm)
        regs = (bm * bdv + bm * bn) // (cfg.num_warps * 32)
        if smem <= _SMEM_BUDGET and regs <= _REG_BUDGET:
            kept.append(cfg)
    if not kept:  # always leave something to run: the smallest tiles
        kept = [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))]
    if (args["DROPOUT"] or args["MASK_KIND"] != MASK_NONE) and max(bd, bdv) <= 64:
        kept.sort(key=lambda c: config_tuple(c) != _SMALL_HEAD_FIRST)  # stable: the rest keep their order
    if args.get("KV_DESC"):
        kept.sort(key=lambda c: config_tuple(c) != _DESCRIPTOR_FIRST)
    if elt == 4:
        # fp32 tiles need more shared memory than this estimate counts (an H200
        # run refused 128x64x2 stages); smallest first, so that the untuned
        # path (FLASHFUSE_AUTOTUNE=0) takes one that compiles.
        kept.sort(key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)
        if max(bd, bdv) > 128:
            # Past D = 128 even (64, 32, 4, 2) needs 262144 bytes of shared
            # memory on an H200 (bench/results/compile_matrix.csv, first run):
            # smaller tiles, tried only when nothing above fits.
            kept += [c for c in _FP32_LAST_RESORT if c not in kept]
    return kept


_FP32_LAST_RESORT = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                     for bm, bn, w, s in ((32, 32, 4, 2), (32, 32, 4, 1))]


_FWD_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bm, bn, w, s in _CUDA_CONFIGS]

# Chooses the config once per (dtype, head dims, flags, size bucket): the
# fastest when autotuning, else the first that fits; then launches directly.
_attn_fwd_launcher = ConfigLauncher(_attn_fwd)

# Skip the key blocks a mask hides from a whole query tile, found by one pass
# over the mask per call (mask_ranges): padding, block-sparse masks, and
# causal masks that arrive as tensors.
SKIP_HIDDEN_BLOCKS = True


# Under the interpreter: one small tile so CPU tests stay fast.
_INTERPRET_BLOCK_M = 16
_INTERPRET_BLOCK_N = 32  # >= 32: the block dropout draw


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    *,
    dropout_p: float,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    bottom_right: bool,
    mask_fill: float | None = None,
    key_table: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    problem: AttentionProblem | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward on the portable Triton kernel.

    Args:
        q: queries (B, Hq, N, D), fp16 / bf16 / fp32, any strides.
        k: keys (B, Hkv, M, D), same dtype and device, ``Hq % Hkv == 0``.
        v: values (B, Hkv, M, Dv).
        attn_mask: None, or a bool (True takes part) or floating (added to the
            scaled scores) tensor broadcastable to (B, Hq, N, M); read through
            its expanded strides, never materialised.
        seed: int64 tensor of shape () on q's device; read only if
            ``dropout_p > 0``.
        dropout_p: dropout probability in [0, 1).
        scale: multiplier of q·k.
        window_left: left visibility bound (None: unbounded).
        window_right: right visibility bound (None: unbounded; 0: causal).
        bottom_right: diagonal offset ``M - N`` instead of 0.
        mask_fill: with a bool mask, the score of the pairs it hides (as
            ``masked_fill``); None: they take no part.
        key_table: the mask's key table from a block mask (built for this
            mask, band and fill); None: built here.
        softcap: scores become ``softcap * tanh(scale * q.k / softcap)``
            before the mask; None: no capping.
        sinks: None, or (Hq,) per-head logits that join each row's softmax
            denominator without a value (the lse includes them).
        problem: the call's ``AttentionProblem`` when the caller (the
            kernels' dispatch, ``kernels._route``) built it already.

    Returns:
        ``(out, lse)``: out (B, Hq, N, Dv) in q's dtype, laid out as
        ``empty(B, N, Hq, Dv).transpose(1, 2)``; lse float32 (B, Hq, N)
        contiguous, natural log, +inf for rows with no visible key,
        ``reference.lse_marker`` for rows that average their keys.
    """
    p = problem or AttentionProblem.build(
        q, k, v, attn_mask, dropout_p=dropout_p, scale=scale, window_left=window_left, window_right=window_right,
        bottom_right=bottom_right, mask_fill=mask_fill, softcap=softcap)
    B, Hq, N, M = p.B, p.Hq, p.N, p.M
    # (B, N, Hq, Dv) in memory; a tensor of its own, not a view (see launch._traced).
    out = torch.empty_strided((B, Hq, N, p.Dv), (N * Hq * p.Dv, p.Dv, Hq * p.Dv, 1), dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    mask = p.mask if p.mask is not None else q  # q: never read
    seed_arg = seed if p.dropout else q  # q: never read

    skip_hidden = SKIP_HIDDEN_BLOCKS and p.tables_apply()
    if skip_hidden:  # a block mask's table, else built here (the forward reads no query table)
        key_table, _ = mask_tables(mask, N, M, p.band(), fills=p.fill != 0, key_table=key_table, queries=False)
        range_strides = table_strides(key_table)
    else:
        key_table, range_strides = lse, (0, 0)  # never read
    args = (
        q, k, v, mask, key_table, seed_arg, out, lse,
        *p.q_strides, *p.k_strides, *p.v_strides, *p.mask_strides, *range_strides, *out.stride(),
        Hq, p.Hkv, N, M,
        # With a soft-cap the kernel takes tanh(scale / cap * q.k) first and
        # then multiplies by cap in base 2, where it multiplied by the scale.
        p.qk_scale, p.diag_off, p.window_left, p.window_right,
        p.threshold, p.keep_scale, p.fill_arg,
        sinks if sinks is not None else lse,  # never read without sinks
        p.softcap_scale,
    )
    meta = dict(
        HEAD_DIM=p.D, HEAD_DIM_V=p.Dv, BLOCK_D=p.block_d, BLOCK_DV=p.block_dv,
        HAS_WINDOW_LEFT=p.has_window_left, HAS_WINDOW_RIGHT=p.has_window_right,
        MASK_KIND=p.mask_kind, FILL=p.fill, DROPOUT=p.dropout, INPUT_PRECISION=p.precision,
        SKIP_HIDDEN=skip_hidden,
        SCALE_NONNEG=scale >= 0 or softcap is not None, RANGE_GROUP=_RANGE_GROUP, KV_DESC=p.kv_descriptors,
        SOFTCAP=softcap is not None, SINKS=sinks is not None,
        FULL_KEY_BLOCKS=p.full_key_blocks,
    )
    if p.interpret:
        grid = (cdiv(N, _INTERPRET_BLOCK_M), Hq, B)
        _attn_fwd[grid](*args, **meta, DOT_UPCAST=q.dtype == torch.bfloat16,
                        BLOCK_M=_INTERPRET_BLOCK_M, BLOCK_N=_INTERPRET_BLOCK_N)
    else:
        if p.kv_descriptors:
            ensure_scratch_allocator()
        with torch.cuda.device(q.device):
            # A bool mask is keyed as the bytes eager calls pass, so that a
            # traced launch (which passes the bool tensor) finds their choice.
            mask_dtype = torch.uint8 if mask.dtype == torch.bool else mask.dtype
            key = (q.dtype, mask_dtype, q.device, _bucket(N, FORWARD_BUCKET_CAP), _bucket(M, FORWARD_BUCKET_CAP),
                   tuple(meta.items()))
            _attn_fwd_launcher(
                key, lambda: _prune_configs(_FWD_CONFIGS, {"Q": q, "Mask": mask}, **meta),
                lambda m: (cdiv(N, m["BLOCK_M"]), Hq, B),
                *args, tune=_autotune_enabled(), **meta, DOT_UPCAST=False,
            )
    return out, lse


# ---------------------------------------------------------------------------
# Dropout mask, materialised (for tests)
# ---------------------------------------------------------------------------


@triton.jit
def _dropout_mask_kernel(Seed, Out, H, N, M, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (B*H, cdiv(N, BLOCK_M), cdiv(M, BLOCK_N)); Out (B*H, N, M) uint8."""
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    seed = tl.load(Seed)
    # The block form the attention kernels use, so tests pin it bit for bit.
    keep = _dropout_keep_block(seed, offs_m, tl.program_id(2) * BLOCK_N, bh, threshold, BLOCK_N)
    ptrs = Out + bh.to(tl.int64) * N * M + offs_m.to(tl.int64)[:, None] * M + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < N) & (offs_n[None, :] < M))


def dropout_keep_mask_triton(seed: torch.Tensor, B: int, H: int, N: int, M: int, dropout_p: float,
                             block_n: int = 64) -> torch.Tensor:
    """Materialise the kernels' dropout rule, drawn the way the attention
    kernels draw it (``common._dropout_keep_block``).

    Args:
        seed: int64 tensor of shape () on the target device.
        B, H: batch size and number of query heads.
        N, M: number of queries and keys.
        dropout_p: dropout probability in [0, 1].
        block_n: keys per block, a power of two >= 16 (below 32 the kernels
            fall back to one Philox call per element).

    Returns:
        bool tensor (B, H, N, M) on seed's device; True keeps the probability.
    """
    out = torch.empty(B, H, N, M, dtype=torch.uint8, device=seed.device)
    threshold = _keep_threshold(dropout_p)
    block_m = 16
    grid = (B * H, cdiv(N, block_m), cdiv(M, block_n))
    _dropout_mask_kernel[grid](seed, out, H, N, M, threshold, BLOCK_M=block_m, BLOCK_N=block_n)
    return out.view(torch.bool)
