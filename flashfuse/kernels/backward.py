"""Triton backward kernels for flash attention, and their launcher.

FlashAttention-2 style. Three kernels:

* ``_bwd_preprocess``: ``delta = rowsum(dO * O)`` in float32, (B, Hq, N).
* ``_bwd_dkdv``: one program per (key block, kv head, batch). It loops over
  the query heads of its GQA group and over the query blocks whose causal /
  window band meets the key block, recomputes the probabilities from ``lse``
  and accumulates dK and dV in float32. It also produces the gradient of a
  learned float mask when asked, since it sees every query row of its keys.
* ``_bwd_dq``: one program per (query block, q head, batch), looping over the
  visible key blocks and accumulating dQ.

Two schedules (see ``_one_pass_enabled``):

* two passes (deterministic, no atomics): ``_bwd_dkdv`` then ``_bwd_dq``,
  which recomputes P and dP: 7 block matmuls per (query block, key block).
* one pass: ``_bwd_dkdv`` with ``DQ_ATOMIC`` also forms ``scale * dS K`` for
  each tile and adds it into a float32 (B, Hq, N, D) buffer with atomics;
  ``_bwd_dq`` is not launched. 5 block matmuls per tile, but dQ's rounding
  then depends on the order in which the atomic adds land.

Conventions (shapes, mask, visibility, dropout, lse) are those of the forward,
see ARCHITECTURE.md. With ``s = scale * q.k + mask`` and ``P = exp(s - lse)``:
``dP = dO V^T`` (times keep / (1 - p) under dropout), ``dS = P * (dP - delta)``,
``dQ = scale * dS K``, ``dK = scale * dS^T Q``, ``dV = (P * keep / (1 - p))^T dO``
and ``d(mask) = dS``. With a soft-cap, ``s = cap * tanh(scale * q.k / cap) + mask``
and dQ, dK take ``dS * (1 - tanh**2)`` instead of dS (the mask still takes dS).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from .. import config
from .common import (
    MASK_BOOL_C,
    MASK_FLOAT,
    MASK_FLOAT_C,
    MASK_NONE,
    MASK_NONE_C,
    _block_crosses_edge,
    _dropout_keep,
    _dropout_keep_block,
    _lse_base2,
    _lse_cap,
    _lse_shift,
    _mask_block_start,
    _mask_key_span,
    _mask_tile_bounds,
    _narrow_span,
    _tanh_parts,
    _visible,
)
from .launch import (
    ConfigLauncher, _autotune_enabled, _bucket, cdiv, config_tuple, BACKWARD_BUCKET_CAP, DESCRIPTOR_MIN_STAGES,
    ensure_scratch_allocator, device_shared_mem,
)
from .mask_ranges import COL_GROUP as _COL_GROUP
from .mask_ranges import ROW_GROUP as _ROW_GROUP
from .mask_ranges import mask_tables, table_strides
from .problem import AttentionProblem

__all__ = ["attention_backward", "row_delta"]

# Cap on the float32 dS buffer for a mask that broadcasts over the batch
# (module-level so tests can shrink it); a non-broadcast batch needs no cap,
# the buffer is then at most the mask's own size expanded over the heads.
_DMASK_BUFFER_BYTES = 1 << 30

# Skip the blocks a mask hides entirely, as the forward does (see
# forward.SKIP_HIDDEN_BLOCKS), from the same per-call table of ranges.
SKIP_HIDDEN_BLOCKS = True

# Schedule when FLASHFUSE_BWD is unset: one pass (dQ by atomics inside the
# dK/dV kernel) or two passes; see _one_pass_enabled. Two passes measured
# faster on an H200 (bench/results/backward_schedules.txt, bench/NOTES.md
# run 5): the atomics cost more than the matmuls they save.
_ONE_PASS_DEFAULT = False
# With dropout at small head dims, drawing the dropout mask a second time
# costs more than the atomics: one pass measured 13 % faster at GPT-2's shape
# (D = 64), two passes 8 % faster at D = 128 (bench/results/kernel_times.csv,
# bench/NOTES.md run 6). Head dims up to this take one pass with dropout.
_ONE_PASS_DROPOUT_MAX_D = 64


# --------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------


@triton.jit
def _fp32_scalars(qk_scale, scale, inv_keep, mask_fill):
    """The float arguments as fp32: Inductor passes Python floats as fp64,
    which would turn the tiles' arithmetic into fp64."""
    return (tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32), tl.cast(inv_keep, tl.float32),
            tl.cast(mask_fill, tl.float32))


@triton.jit(do_not_specialize=["N"])
def _bwd_preprocess(
    O, DO, DELTA, LSE, CAP,
    stride_o_b, stride_o_h, stride_o_q, stride_o_d,
    stride_do_b, stride_do_h, stride_do_q, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_q,
    N, D_V,
    MARKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] (float32), and
    with MARKS cap[b, h, i] = ``common._lse_cap`` of lse[b, h, i] (float32,
    delta's layout)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    H = tl.num_programs(1)
    m0 = pid_m.to(tl.int64) * BLOCK_M
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_DV)
    ok = ((m0 + rm) < N)[:, None] & (rd < D_V)[None, :]
    o = tl.load(O + (b * stride_o_b + h * stride_o_h + m0 * stride_o_q) + rm[:, None] * stride_o_q
            + rd[None, :] * stride_o_d,
                mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + (b * stride_do_b + h * stride_do_h + m0 * stride_do_q) + rm[:, None] * stride_do_q
            + rd[None, :] * stride_do_d,
                 mask=ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(DELTA + (b * H + h) * N + m0 + rm, delta, mask=(m0 + rm) < N)
    if MARKS:
        lse = tl.load(LSE + b * stride_lse_b + h * stride_lse_h + (m0 + rm) * stride_lse_q, mask=(m0 + rm) < N,
                      other=float("inf"))
        tl.store(CAP + (b * H + h) * N + m0 + rm, _lse_cap(lse), mask=(m0 + rm) < N)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, col_acc, k, v,
    q_rows, do_rows, lse_ptr, delta_ptr, cap_ptr, mask_base, g_base, dq_rows,
    lo, hi, lo2, hi2, n0, n0l, offs_n, n_ok, rn, rm, rd, rdv,
    stride_q_q, stride_q_d, stride_do_q, stride_do_d, stride_lse_q, stride_mask_q, stride_mask_k, stride_dmask_q,
    stride_dmask_k, stride_dqacc_q, stride_dqacc_d,
    N, M, D_QK, D_V, qk_scale, scale, inv_keep, threshold, seed, bh, diag_off, window_left, window_right, mask_fill,
    softcap_scale, softcap,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, MASK_KIND: tl.constexpr, FILL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    MASK_GRAD: tl.constexpr, DMASK_ROWSUM: tl.constexpr, DMASK_COLSUM: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, FULL_KEY_BLOCKS: tl.constexpr,
):
    """Fold the query blocks ``[lo, hi)`` then ``[lo2, hi2)`` (lo, lo2
    multiples of BLOCK_M) of one query head into dK, dV (and dmask, dQ) of
    the key block ``n0``. One loop over both ranges: a loop of its own would
    keep its own pipeline state live and the kernel spilled.

    MASK_KIND MASK_NONE with a mask present: blocks where its values are all neutral
    (``mask_ranges``); the mask is not read, its gradient still written.
    Probabilities follow ``common._lse_shift``: a float mask's scores are
    formed in natural-log units (its values of -3.4e38 would overflow in
    base 2), and FILL (bool masks) gives hidden pairs the fill's score and no
    gradient to q and k.
    """
    dtype = q_rows.dtype.element_ty
    n1 = tl.cdiv(hi - lo, BLOCK_M)
    for t in range(0, n1 + tl.cdiv(hi2 - lo2, BLOCK_M)):
        start_m = tl.where(t < n1, lo + t * BLOCK_M, lo2 + (t - n1) * BLOCK_M)
        sml = tl.cast(start_m, tl.int64)
        offs_m = start_m + rm
        m_ok = offs_m < N
        q = tl.load((q_rows + sml * stride_q_q)[:, None] + rd[None, :] * stride_q_d,
                    mask=m_ok[:, None] & (rd < D_QK)[None, :], other=0.0)
        do = tl.load((do_rows + sml * stride_do_q)[:, None] + rdv[None, :] * stride_do_d,
                     mask=m_ok[:, None] & (rdv < D_V)[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        shift = _lse_shift(tl.load(lse_ptr + offs_m.to(tl.int64) * stride_lse_q, mask=m_ok, other=float("inf")),
                           mask_fill, MASK_KIND, FILL)
        delta = tl.load(delta_ptr + offs_m, mask=m_ok, other=0.0)
        mask_ok = _mask_tile_bounds(m_ok[None, :], n_ok[:, None], not FULL_KEY_BLOCKS)
        if MASK_KIND == MASK_FLOAT_C or (MASK_KIND == MASK_BOOL_C and FILL == 2):
            cap = tl.load(cap_ptr + offs_m, mask=m_ok, other=1.0)

        # sT[j, i] in log2 units (natural ones with a float mask)
        if SOFTCAP:  # recomputed: tanh and its derivative (see common._tanh_parts)
            thT, sech2T = _tanh_parts(tl.dot(k, tl.trans(q), input_precision=PREC) * softcap_scale)
            if MASK_KIND == MASK_FLOAT_C:
                sT = thT * softcap
            else:
                sT = thT * qk_scale
        elif MASK_KIND == MASK_FLOAT_C:
            sT = tl.dot(k, tl.trans(q), input_precision=PREC) * scale
        else:
            sT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
        if HAS_DROPOUT:  # drawn while the product is in flight (independent of it)
            if dtype == tl.float32:
                # Per element for float32: with the block draw, Triton 3.6's
                # compiled kernel gave a wrong dK (not dV) for float32 with a
                # finite fill (tf32x3 dots; bench/NOTES.md run 14).
                keepT = tl.trans(_dropout_keep(seed, offs_m, offs_n, bh, threshold))
            else:
                keepT = tl.trans(_dropout_keep_block(seed, offs_m, n0, bh, threshold, BLOCK_N))
        if MASK_KIND == MASK_FLOAT_C:
            mT = tl.load(mask_base + sml * stride_mask_q + rn[:, None] * stride_mask_k + rm[None, :] * stride_mask_q,
                         mask=mask_ok, other=0.0)
            sT = sT + mT.to(tl.float32)
            pT = tl.minimum(tl.exp2((sT - shift[None, :]) * 1.4426950408889634), cap[None, :])
        elif MASK_KIND == MASK_BOOL_C:
            if FILL != 0:
                bT = tl.load(mask_base + sml * stride_mask_q + rn[:, None] * stride_mask_k
                        + rm[None, :] * stride_mask_q,
                             mask=mask_ok, other=0)
                pT = tl.exp2(tl.where(bT != 0, sT, mask_fill) - shift[None, :])
                if FILL == 2:
                    pT = pT * cap[None, :]
            else:
                pT = tl.exp2(sT - shift[None, :])
                bT = tl.load(mask_base + sml * stride_mask_q + rn[:, None] * stride_mask_k
                        + rm[None, :] * stride_mask_q,
                             mask=mask_ok, other=0)
                pT = tl.where(bT != 0, pT, 0.0)
        else:
            pT = tl.exp2(sT - shift[None, :])
        # Element-wise visibility only on blocks that cross an edge of the
        # band or of the tensor. The transposed tile is _visible with the
        # roles of queries and keys swapped (offset negated, windows
        # exchanged), which is the same integer test.
        if _block_crosses_edge(start_m, n0, N, M, diag_off, window_left, window_right, HAS_WL, HAS_WR, BLOCK_M,
                               BLOCK_N):
            visT = _visible(offs_n, offs_m, M, N, -diag_off, window_right, window_left, HAS_WR, HAS_WL)
            pT = tl.where(visT, pT, 0.0)

        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        if HAS_DROPOUT:
            pdT = tl.where(keepT, pT, 0.0)  # 1 / (1 - p) applied to dV once, at the end
            dpT = tl.where(keepT, dpT * inv_keep, 0.0)
        else:
            pdT = pT
        dv += tl.dot(pdT.to(dtype).to(q.dtype), do, input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        if MASK_KIND == MASK_BOOL_C and FILL != 0:  # filled scores are constants
            dsT = tl.where(bT != 0, dsT, 0.0)
        if SOFTCAP:  # to the uncapped scores; the mask's gradient stays dsT
            dsT_op = (dsT * sech2T).to(dtype).to(q.dtype)
        else:
            dsT_op = dsT.to(dtype).to(q.dtype)
        dk += tl.dot(dsT_op, q, input_precision=PREC)
        if DQ_ATOMIC:
            # dQ rows of this query block += scale * dS K, from the same
            # rounded dS the two-pass _bwd_dq feeds its dot. The tile is
            # (query, d) with d contiguous in memory, so the adds coalesce;
            # only their sum matters, hence relaxed (no fences).
            dq_part = tl.dot(tl.trans(dsT_op), k, input_precision=PREC) * scale
            tl.atomic_add((dq_rows + sml * stride_dqacc_q)[:, None] + rd[None, :] * stride_dqacc_d, dq_part,
                          mask=m_ok[:, None] & (rd < D_QK)[None, :], sem="relaxed")

        if MASK_GRAD:
            if DMASK_ROWSUM:
                col_acc += tl.sum(dsT, axis=1)
            elif DMASK_COLSUM:
                tl.store(g_base + offs_m.to(tl.int64) * stride_dmask_q + n0l * stride_dmask_k,
                         tl.sum(dsT, axis=0), mask=m_ok)
            else:
                tl.store(g_base + sml * stride_dmask_q + n0l * stride_dmask_k
                         + rn[:, None] * stride_dmask_k + rm[None, :] * stride_dmask_q,
                         dsT, mask=n_ok[:, None] & m_ok[None, :])
    return dk, dv, col_acc


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right", "B_OFF"])
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, CAP, MASK, RANGES, SEED, DK, DV, DMASK, DQacc,
    stride_q_b, stride_q_h, stride_q_q, stride_q_d,
    stride_k_b, stride_k_h, stride_k_k, stride_k_d,
    stride_v_b, stride_v_h, stride_v_k, stride_v_d,
    stride_do_b, stride_do_h, stride_do_q, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_q,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
    stride_tab_b, stride_tab_h,
    stride_dk_b, stride_dk_h, stride_dk_k, stride_dk_d,
    stride_dv_b, stride_dv_h, stride_dv_k, stride_dv_d,
    stride_dmask_b, stride_dmask_h, stride_dmask_q, stride_dmask_k,
    stride_dqacc_b, stride_dqacc_h, stride_dqacc_q, stride_dqacc_d,
    H, G, N, M, D_QK, D_V,
    qk_scale, scale, inv_keep, threshold,
    diag_off, window_left, window_right, B_OFF, mask_fill, softcap_scale, softcap,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK_KIND: tl.constexpr, FILL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SKIP_HIDDEN: tl.constexpr, RANGE_GROUP: tl.constexpr,
    MASK_GRAD: tl.constexpr, DMASK_ROWSUM: tl.constexpr, DMASK_COLSUM: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, FULL_KEY_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK, dV (and dmask) for one key block of one (batch, kv head).

    Works on transposed (BLOCK_N, BLOCK_M) score tiles so that both dots that
    reduce over query rows (dV += P^T dO, dK += dS^T Q) take their register
    operand untransposed. dmask is written into a float32 buffer indexed
    (b, h, i, j), with i collapsed to 0 when the mask broadcasts over queries
    (DMASK_ROWSUM: summed here over all query rows) and the block's columns
    summed into column n0 when it broadcasts over keys (DMASK_COLSUM).

    DQ_ATOMIC (one-pass backward): also add each tile's ``scale * dS K``,
    (BLOCK_M, BLOCK_D) float32, into ``DQacc``, a zero-initialised float32
    (B, Hq, N, D) buffer with strides ``stride_dqacc_*``, at the rows of query head
    ``h`` (not ``hk``). Every key block of a (batch, head) adds into the same
    rows, hence atomics; skipped blocks add nothing.
    """
    qk_scale, scale, inv_keep, mask_fill = _fp32_scalars(qk_scale, scale, inv_keep, mask_fill)
    softcap_scale, softcap = tl.cast(softcap_scale, tl.float32), tl.cast(softcap, tl.float32)
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n0 = pid_n * BLOCK_N
    rn = tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    offs_n = n0 + rn
    n_ok = offs_n < M

    # K and V tiles stay in registers for the whole program.
    n0l = n0.to(tl.int64)
    k_base = K + b * stride_k_b + hk.to(tl.int64) * stride_k_h + n0l * stride_k_k
    v_base = V + b * stride_v_b + hk.to(tl.int64) * stride_v_h + n0l * stride_v_k
    k = tl.load(k_base + rn[:, None] * stride_k_k + rd[None, :] * stride_k_d,
                mask=n_ok[:, None] & (rd < D_QK)[None, :], other=0.0)
    v = tl.load(v_base + rn[:, None] * stride_v_k + rdv[None, :] * stride_v_d,
                mask=n_ok[:, None] & (rdv < D_V)[None, :], other=0.0)
    # UPCAST (interpreter with bfloat16 only): the interpreter mis-computes
    # bfloat16 dots, so operands go to float32 after loading; P and dS are
    # still rounded to bfloat16 (.to(dtype)) first, so the products match
    # the compiled kernel's. Without UPCAST the extra casts are no-ops.
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)

    # Query rows that can see some key of [n0, n0 + BLOCK_N):
    # j <= i + off + window_right  <=>  i >= j - off - window_right;
    # j >= i + off - window_left   <=>  i <= j - off + window_left.
    lo = 0
    hi = N
    if HAS_WR:
        lo = tl.maximum(n0 - diag_off - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_WL:
        hi = tl.minimum(n0 + BLOCK_N - diag_off + window_left, N)

    for g in range(0, G):
        h = hk * G + g
        hl = h.to(tl.int64)
        # Row pointers and column offsets only: the 2-D pointer tiles are
        # formed inside the loop. Loop-invariant 2-D pointer tiles would hold
        # two registers per element across the loop and make it spill.
        q_rows = Q + b * stride_q_b + hl * stride_q_h + rm * stride_q_q
        do_rows = DO + b * stride_do_b + hl * stride_do_h + rm * stride_do_q
        lse_ptr = LSE + b * stride_lse_b + hl * stride_lse_h
        delta_ptr = DELTA + (b * H + hl) * N
        cap_ptr = CAP + (b * H + hl) * N  # delta's layout (read for float masks and marking fills)
        mask_base = MASK
        if MASK_KIND != MASK_NONE_C:
            mask_base = MASK + b * stride_mask_b + hl * stride_mask_h + n0l * stride_mask_k
        g_base = DMASK
        if MASK_GRAD:
            g_base = DMASK + b * stride_dmask_b + hl * stride_dmask_h
        col_acc = tl.zeros([BLOCK_N], dtype=tl.float32)  # DMASK_ROWSUM's column sums
        dq_rows = DQacc
        if DQ_ATOMIC:
            dq_rows = DQacc + b * stride_dqacc_b + hl * stride_dqacc_h + rm * stride_dqacc_q
        bh = (b + B_OFF) * H + hl  # global batch index: the dropout stream's key
        q_lo = lo
        q_hi = hi
        free_lo = hi
        free_hi = hi
        if SKIP_HIDDEN:
            # The query rows where some of these keys take part, and within
            # them the blocks where the mask is neutral for all of them, from
            # the query table of mask_ranges (entries of four int32). Loaded
            # here, not in a called helper: torch's analysis of which tensors
            # a kernel writes treats every argument of a call whose result
            # reaches a store address as written, and these bounds reach
            # dQ's atomics; the loaded values may go through a call.
            e = RANGES + b * stride_tab_b + hl * stride_tab_h + (offs_n // RANGE_GROUP) * 4
            r_lo = tl.min(tl.load(e, mask=n_ok, other=2147483647), 0)
            r_hi = tl.max(tl.load(e + 1, mask=n_ok, other=0), 0)
            f_lo = tl.max(tl.load(e + 2, mask=n_ok, other=0), 0)
            f_hi = tl.min(tl.load(e + 3, mask=n_ok, other=2147483647), 0)
            q_lo, q_hi, free_lo, free_hi = _narrow_span(lo, hi, r_lo, r_hi, f_lo, f_hi, BLOCK_M)
        # The blocks that read the mask (before and after the neutral
        # rows), then those that need not.
        dk, dv, col_acc = _bwd_dkdv_inner(
            dk, dv, col_acc, k, v, q_rows, do_rows, lse_ptr, delta_ptr, cap_ptr, mask_base, g_base, dq_rows,
            q_lo, free_lo, free_hi, q_hi, n0, n0l, offs_n, n_ok, rn, rm, rd, rdv,
            stride_q_q, stride_q_d, stride_do_q, stride_do_d, stride_lse_q, stride_mask_q, stride_mask_k,
            stride_dmask_q, stride_dmask_k, stride_dqacc_q, stride_dqacc_d,
            N, M, D_QK, D_V, qk_scale, scale, inv_keep, threshold, seed, bh, diag_off, window_left, window_right,
            mask_fill,
            softcap_scale, softcap,
            HAS_WL, HAS_WR, MASK_KIND, FILL, HAS_DROPOUT, MASK_GRAD, DMASK_ROWSUM, DMASK_COLSUM, DQ_ATOMIC,
            PREC, UPCAST, BLOCK_M, BLOCK_N, SOFTCAP, FULL_KEY_BLOCKS)
        if SKIP_HIDDEN:
            dk, dv, col_acc = _bwd_dkdv_inner(
                dk, dv, col_acc, k, v, q_rows, do_rows, lse_ptr, delta_ptr, cap_ptr, mask_base, g_base, dq_rows,
                free_lo, free_hi, free_hi, free_hi, n0, n0l, offs_n, n_ok, rn, rm, rd, rdv,
                stride_q_q, stride_q_d, stride_do_q, stride_do_d, stride_lse_q, stride_mask_q, stride_mask_k,
                stride_dmask_q, stride_dmask_k, stride_dqacc_q, stride_dqacc_d,
                N, M, D_QK, D_V, qk_scale, scale, inv_keep, threshold, seed, bh, diag_off, window_left,
                window_right, mask_fill,
                softcap_scale, softcap,
                HAS_WL, HAS_WR, MASK_NONE_C, 0, HAS_DROPOUT, MASK_GRAD, DMASK_ROWSUM, DMASK_COLSUM, DQ_ATOMIC,
                PREC, UPCAST, BLOCK_M, BLOCK_N, SOFTCAP, FULL_KEY_BLOCKS)
        if MASK_GRAD:
            if DMASK_ROWSUM:
                if DMASK_COLSUM:
                    tl.store(g_base + n0l * stride_dmask_k, tl.sum(col_acc, axis=0))
                else:
                    tl.store(g_base + offs_n.to(tl.int64) * stride_dmask_k, col_acc, mask=n_ok)

    dk_ptrs = (DK + b * stride_dk_b + hk.to(tl.int64) * stride_dk_h + n0l * stride_dk_k
            + rn[:, None] * stride_dk_k + rd[None, :] * stride_dk_d)
    dv_ptrs = (DV + b * stride_dv_b + hk.to(tl.int64) * stride_dv_h + n0l * stride_dv_k
            + rn[:, None] * stride_dv_k + rdv[None, :] * stride_dv_d)
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=n_ok[:, None] & (rd < D_QK)[None, :])
    if HAS_DROPOUT:
        dv = dv * inv_keep
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & (rdv < D_V)[None, :])


@triton.jit
def _bwd_dq_inner(
    dq, q, do, shift, cap, delta, kT_cols, vT_cols, mask_rows,
    lo, hi, lo2, hi2, m0, offs_m, m_ok, rn, rd, rdv,
    stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_mask_k,
    N, M, D_QK, D_V, qk_scale, scale, inv_keep, threshold, seed, bh, diag_off, window_left, window_right, mask_fill,
    softcap_scale, softcap,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, MASK_KIND: tl.constexpr, FILL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DESC: tl.constexpr, SOFTCAP: tl.constexpr, FULL_KEY_BLOCKS: tl.constexpr,
):
    """Fold the key blocks ``[lo, hi)`` then ``[lo2, hi2)`` (lo, lo2
    multiples of BLOCK_N) into the dQ tile of the query block ``m0``, in one
    loop (see ``_bwd_dkdv_inner``). MASK_KIND MASK_NONE with a mask present: blocks
    where its values are all neutral (``mask_ranges``), computed without it.
    DESC: ``kT_cols`` and ``vT_cols`` are tensor descriptors of the head's K
    and V, else column pointers. ``shift`` and ``cap``: the rows' terms of
    ``common._lse_shift`` for this call's MASK_KIND and FILL."""
    if DESC:
        dtype = kT_cols.dtype
    else:
        dtype = kT_cols.dtype.element_ty
    n1 = tl.cdiv(hi - lo, BLOCK_N)
    for t in range(0, n1 + tl.cdiv(hi2 - lo2, BLOCK_N)):
        start_n = tl.where(t < n1, lo + t * BLOCK_N, lo2 + (t - n1) * BLOCK_N)
        snl = tl.cast(start_n, tl.int64)
        offs_n = start_n + rn
        n_ok = offs_n < M
        mask_cols = tl.cast(_mask_block_start(start_n, BLOCK_N), tl.int64) * stride_mask_k
        mask_ok = _mask_tile_bounds(m_ok[:, None], n_ok[None, :], not FULL_KEY_BLOCKS)
        if DESC:  # keys past M and columns past the head dim arrive as zeros
            kT = tl.trans(kT_cols.load([start_n, 0]))
            vT = tl.trans(vT_cols.load([start_n, 0]))
        else:
            kT = tl.load((kT_cols + snl * stride_k_k)[None, :] + rd[:, None] * stride_k_d,
                         mask=n_ok[None, :] & (rd < D_QK)[:, None], other=0.0)
            vT = tl.load((vT_cols + snl * stride_v_k)[None, :] + rdv[:, None] * stride_v_d,
                         mask=n_ok[None, :] & (rdv < D_V)[:, None], other=0.0)
        if UPCAST:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        if SOFTCAP:  # as in _bwd_dkdv_inner
            th, sech2 = _tanh_parts(tl.dot(q, kT, input_precision=PREC) * softcap_scale)
            if MASK_KIND == MASK_FLOAT_C:
                s = th * softcap
            else:
                s = th * qk_scale
        elif MASK_KIND == MASK_FLOAT_C:  # natural-log units with a float mask (see _bwd_dkdv_inner)
            s = tl.dot(q, kT, input_precision=PREC) * scale
        else:
            s = tl.dot(q, kT, input_precision=PREC) * qk_scale
        if HAS_DROPOUT:  # drawn while the product is in flight (independent of it)
            keep = _dropout_keep_block(seed, offs_m, start_n, bh, threshold, BLOCK_N)
        if MASK_KIND == MASK_FLOAT_C:
            mt = tl.load((mask_rows + mask_cols)[:, None] + rn[None, :] * stride_mask_k, mask=mask_ok, other=0.0)
            s = s + mt.to(tl.float32)
            p = tl.minimum(tl.exp2((s - shift[:, None]) * 1.4426950408889634), cap[:, None])
        elif MASK_KIND == MASK_BOOL_C:
            if FILL != 0:
                bt = tl.load((mask_rows + mask_cols)[:, None] + rn[None, :] * stride_mask_k, mask=mask_ok, other=0)
                p = tl.exp2(tl.where(bt != 0, s, mask_fill) - shift[:, None])
                if FILL == 2:
                    p = p * cap[:, None]
            else:
                p = tl.exp2(s - shift[:, None])
                bt = tl.load((mask_rows + mask_cols)[:, None] + rn[None, :] * stride_mask_k, mask=mask_ok, other=0)
                p = tl.where(bt != 0, p, 0.0)
        else:
            p = tl.exp2(s - shift[:, None])
        if _block_crosses_edge(m0, start_n, N, M, diag_off, window_left, window_right, HAS_WL, HAS_WR, BLOCK_M,
                               BLOCK_N):
            vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right, HAS_WL, HAS_WR)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        if HAS_DROPOUT:
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        if MASK_KIND == MASK_BOOL_C and FILL != 0:  # filled scores are constants
            ds = tl.where(bt != 0, ds, 0.0)
        if SOFTCAP:
            ds = ds * sech2
        dq += tl.dot(ds.to(dtype).to(q.dtype), tl.trans(kT), input_precision=PREC)

    return dq


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, CAP, MASK, RANGES, SEED, DQ,
    stride_q_b, stride_q_h, stride_q_q, stride_q_d,
    stride_k_b, stride_k_h, stride_k_k, stride_k_d,
    stride_v_b, stride_v_h, stride_v_k, stride_v_d,
    stride_do_b, stride_do_h, stride_do_q, stride_do_d,
    stride_lse_b, stride_lse_h, stride_lse_q,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
    stride_tab_b, stride_tab_h,
    stride_dq_b, stride_dq_h, stride_dq_q, stride_dq_d,
    H, G, N, M, D_QK, D_V,
    qk_scale, scale, inv_keep, threshold,
    diag_off, window_left, window_right, mask_fill, softcap_scale, softcap,
    HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK_KIND: tl.constexpr, FILL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SKIP_HIDDEN: tl.constexpr, RANGE_GROUP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, DESC: tl.constexpr, SOFTCAP: tl.constexpr,
    FULL_KEY_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ for one query block of one (batch, q head)."""
    qk_scale, scale, inv_keep, mask_fill = _fp32_scalars(qk_scale, scale, inv_keep, mask_fill)
    softcap_scale, softcap = tl.cast(softcap_scale, tl.float32), tl.cast(softcap, tl.float32)
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hl = h.to(tl.int64)
    hk = (h // G).to(tl.int64)
    m0 = pid_m * BLOCK_M
    m0l = m0.to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    offs_m = m0 + rm
    m_ok = offs_m < N

    q = tl.load(Q + b * stride_q_b + hl * stride_q_h + m0l * stride_q_q + rm[:, None] * stride_q_q
            + rd[None, :] * stride_q_d,
                mask=m_ok[:, None] & (rd < D_QK)[None, :], other=0.0)
    do = tl.load(DO + b * stride_do_b + hl * stride_do_h + m0l * stride_do_q + rm[:, None] * stride_do_q
            + rdv[None, :] * stride_do_d,
                 mask=m_ok[:, None] & (rdv < D_V)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + b * stride_lse_b + hl * stride_lse_h + offs_m.to(tl.int64) * stride_lse_q, mask=m_ok,
                  other=float("inf"))
    shift = _lse_shift(lse, mask_fill, MASK_KIND, FILL)
    lse = _lse_base2(lse)  # for the blocks computed without the mask
    delta = tl.load(DELTA + (b * H + hl) * N + offs_m, mask=m_ok, other=0.0)
    cap = delta  # read only for float masks and marking fills
    if MASK_KIND == MASK_FLOAT_C or (MASK_KIND == MASK_BOOL_C and FILL == 2):
        cap = tl.load(CAP + (b * H + hl) * N + offs_m, mask=m_ok, other=1.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(SEED)
    bh = b * H + hl

    # Keys visible to some query of [m0, m0 + BLOCK_M).
    lo = 0
    hi = M
    if HAS_WL:
        lo = tl.maximum(m0 + diag_off - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_WR:
        hi = tl.minimum(m0 + BLOCK_M + diag_off + window_right, M)

    # K^T and V^T tiles (BLOCK_D, BLOCK_N) read through transposed pointers.
    # Column pointers and row offsets only; the 2-D pointer tiles are formed
    # inside the loop (see _bwd_dkdv).
    if DESC:  # the copy engine reads the streamed tiles (see launch.descriptor_loads)
        kT_cols = tl.make_tensor_descriptor(K + b * stride_k_b
                + hk * stride_k_h, shape=[M, D_QK], strides=[stride_k_k, 1],
                                            block_shape=[BLOCK_N, BLOCK_D])
        vT_cols = tl.make_tensor_descriptor(V + b * stride_v_b
                + hk * stride_v_h, shape=[M, D_V], strides=[stride_v_k, 1],
                                            block_shape=[BLOCK_N, BLOCK_DV])
    else:
        kT_cols = K + b * stride_k_b + hk * stride_k_h + rn * stride_k_k
        vT_cols = V + b * stride_v_b + hk * stride_v_h + rn * stride_v_k
    mask_rows = MASK
    if MASK_KIND != MASK_NONE_C:
        mask_rows = MASK + b * stride_mask_b + hl * stride_mask_h + m0l * stride_mask_q + rm * stride_mask_q
    free_lo = hi
    free_hi = hi
    if SKIP_HIDDEN:  # key blocks the mask hides from every row of the tile, and those it leaves neutral
        lo, hi, free_lo, free_hi = _mask_key_span(RANGES + b * stride_tab_b + hl * stride_tab_h, offs_m, N, lo, hi,
                                                  RANGE_GROUP, BLOCK_N)
    # The blocks that read the mask (before and after the neutral keys),
    # then those that need not.
    dq = _bwd_dq_inner(
        dq, q, do, shift, cap, delta, kT_cols, vT_cols, mask_rows, lo, free_lo, free_hi, hi, m0, offs_m, m_ok,
        rn, rd, rdv, stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_mask_k, N, M, D_QK, D_V, qk_scale,
        scale, inv_keep, threshold, seed,
        bh, diag_off, window_left, window_right, mask_fill, softcap_scale, softcap, HAS_WL, HAS_WR, MASK_KIND,
        FILL, HAS_DROPOUT,
        PREC, UPCAST, BLOCK_M, BLOCK_N, DESC, SOFTCAP, FULL_KEY_BLOCKS)
    if SKIP_HIDDEN:
        dq = _bwd_dq_inner(
            dq, q, do, lse, cap, delta, kT_cols, vT_cols, mask_rows, free_lo, free_hi, free_hi, free_hi, m0,
            offs_m, m_ok, rn, rd, rdv, stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_mask_k, N, M, D_QK,
            D_V, qk_scale, scale, inv_keep,
            threshold, seed, bh, diag_off, window_left, window_right, mask_fill, softcap_scale, softcap, HAS_WL,
            HAS_WR, MASK_NONE_C, 0,
            HAS_DROPOUT, PREC, UPCAST, BLOCK_M, BLOCK_N, DESC, SOFTCAP, FULL_KEY_BLOCKS)

    tl.store(DQ + b * stride_dq_b + hl * stride_dq_h + m0l * stride_dq_q + rm[:, None] * stride_dq_q + rd[None,
    :] * stride_dq_d,
             (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & (rd < D_QK)[None, :])


# --------------------------------------------------------------------------
# tuning
# --------------------------------------------------------------------------


# The prune reads the device's shared memory through this name (tests replace it).
_max_shared_mem = device_shared_mem


def _cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


# Candidate tiles (BLOCK_M, BLOCK_N, warps, stages) per head-dim class, chosen
# from ptxas register/spill reports for sm_90 (fp16): the dK/dV program keeps
# a key block of K, V and two float32 accumulators resident and streams query
# blocks (wide BLOCK_N, narrow BLOCK_M); dQ is the mirror image.
_DKDV_TILES = {
    # (64, 64, 4, 3) measured best or second on an H200 (Triton 3.6) for D = 64
    # at GPT-2's shape with and without dropout and at 4k causal
    # (bench/results/kernel_times.csv), also in the one-pass kernel
    64: [(64, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3), (16, 64, 4, 3), (32, 64, 4, 3),
         (32, 128, 8, 3), (16, 128, 8, 3), (64, 128, 8, 3), (32, 64, 8, 3)],
    # (64, 128, 8, 2) measured best on an H200 (Triton 3.6) for D = 128, bf16
    128: [(64, 128, 8, 2), (16, 128, 8, 3), (16, 64, 8, 2), (32, 64, 8, 3), (32, 128, 8, 3),
          (16, 32, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3)],
    # The single-stage tile is the smallest, so fp32 keeps it as its fallback
    # (large fp32 tiles need more shared memory than the estimate counts).
    256: [(32, 64, 8, 2), (16, 64, 8, 2), (32, 64, 8, 3), (16, 32, 4, 2), (16, 32, 4, 1)],
}
# With a mask tensor at head dims up to 64, the dK/dV kernel (one pass or
# two) starts from 32-query blocks: the autotuner's pick on an H200 (Triton
# 3.6) at GPT-2's and BERT's shapes, with and without dropout, in all four
# (bench/NOTES.md run 20); the mask tile's registers favour the short block.
_MASKED_SMALL_HEAD_DKDV_FIRST = (32, 64, 4, 3)

_DQ_TILES = {
    # (64, 64, 4, 3) measured best on an H200 (Triton 3.6) for D = 64 in the
    # same three cases
    64: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (128, 32, 4, 3),
         (128, 64, 4, 3), (128, 16, 8, 3)],
    # (128, 64, 8, 3) measured best on an H200 (Triton 3.6) for D = 128, bf16
    128: [(128, 64, 8, 3), (128, 16, 8, 3), (64, 32, 8, 3), (64, 32, 8, 2), (64, 16, 4, 3),
          (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
    256: [(64, 16, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (128, 16, 8, 3), (32, 32, 4, 1)],
}


def _all_configs(tiles):
    seen = dict.fromkeys(t for ts in tiles.values() for t in ts)
    return [_cfg(*t) for t in seen]


def _prune(kind: str):
    """early_config_prune: keep the candidate tiles of the head-dim class
    that fit in shared memory (fewer for fp32, whose IEEE dots compile slowly
    and run on CUDA cores). ``kind``: "dkdv", "dkdv_dq" (the dK/dV kernel
    with DQ_ATOMIC, same tiles) or "dq"."""
    tiles = _DQ_TILES if kind == "dq" else _DKDV_TILES

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        bd, bdv = args["BLOCK_D"], args["BLOCK_DV"]
        q = args["Q"]
        elt = q.element_size()
        wanted = tiles[64 if max(bd, bdv) <= 64 else 128 if max(bd, bdv) <= 128 else 256]
        if kind != "dq" and args.get("MASK_KIND", MASK_NONE) != MASK_NONE and max(bd, bdv) <= 64:
            wanted = sorted(wanted, key=lambda t: t != _MASKED_SMALL_HEAD_DKDV_FIRST)  # stable
        if args.get("HAS_DROPOUT"):
            # Key blocks under 32 draw dropout one Philox call per element.
            wanted = [t for t in wanted if t[1] >= 32] or wanted
        if kind == "dq" and args.get("DESC"):
            wanted = [t for t in wanted if t[3] >= DESCRIPTOR_MIN_STAGES]
        if elt == 4:
            # Two candidates, and the smallest tile as a fallback: fp32 tiles
            # need more shared memory than the estimate below counts.
            wanted = list(dict.fromkeys(wanted[:2] + [min(wanted, key=lambda t: t[0] * t[1] * t[3])]))
        smem_cap = _max_shared_mem(q.device)
        by_tile = {config_tuple(c): c for c in configs}
        kept = []
        for t in wanted:  # in the class's own best-first order
            c = by_tile.get(t)
            if c is None:
                continue
            bm, bn = t[0], t[1]
            resident, streamed = (bm, bn) if kind == "dq" else (bn, bm)
            smem = elt * (bd + bdv) * (resident + c.num_stages * streamed) + 4 * bm * bn
            if kind == "dkdv_dq":
                smem += elt * bm * bn  # dS staged transposed for the dS K dot
            if smem <= smem_cap:
                kept.append(c)
        if not kept and wanted:  # smallest tile of the class as the fallback
            small = min(wanted, key=lambda t: t[0] * t[1])
            kept = [by_tile[small]] if small in by_tile else []
        return kept

    return prune


_DKDV_CONFIGS = _all_configs(_DKDV_TILES)
_DQ_CONFIGS = _all_configs(_DQ_TILES)

# Under the interpreter: one small fixed tile, for CI speed.
_INTERPRET_META = {"BLOCK_M": 16, "BLOCK_N": 32}  # BLOCK_N >= 32: the block dropout draw

# The main kernels by name, as written (interpreter) and behind launchers
# that choose a config once per key (timed when autotuning, else the first
# that fits) and then launch the compiled binary directly.
# "dkdv_dq" is _bwd_dkdv launched with DQ_ATOMIC=True (one pass). Choosing
# its config runs it several times, each run adding into the dQ accumulator,
# so DQacc is zeroed before each of those runs and before the real launch.
_KERNELS = {"dkdv": _bwd_dkdv, "dkdv_dq": _bwd_dkdv, "dq": _bwd_dq}
_LAUNCHERS = {"dkdv": ConfigLauncher(_bwd_dkdv), "dkdv_dq": ConfigLauncher(_bwd_dkdv, reset_to_zero=["DQacc"]),
              "dq": ConfigLauncher(_bwd_dq)}
_CONFIGS = {"dkdv": _DKDV_CONFIGS, "dkdv_dq": _DKDV_CONFIGS, "dq": _DQ_CONFIGS}
_preprocess_launcher = ConfigLauncher(_bwd_preprocess)


def _preprocess_config(block_dv: int):
    """The preprocess kernel's one config: rows per program so that a tile
    holds about 8k elements."""
    return triton.Config({"BLOCK_M": max(16, min(128, 8192 // block_dv))}, num_warps=4, num_stages=1)


# --------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------


def _one_pass_enabled(has_dropout: bool, head_dim: int) -> bool:
    """Whether this backward call computes dQ in the dK/dV kernel (one pass,
    atomic float32 adds) instead of a second kernel (two passes).

    ``FLASHFUSE_BWD=one_pass`` or ``two_pass`` forces a schedule; unset (or
    empty) means one pass with dropout at head dims up to
    ``_ONE_PASS_DROPOUT_MAX_D``, else ``_ONE_PASS_DEFAULT``. Read at every
    call, so it can change between calls. Always two passes while
    ``torch.use_deterministic_algorithms(True)`` is on, whatever the variable
    says: the order in which the atomic adds land varies from run to run, and
    float32 addition is not associative, so one-pass dQ may differ in its
    last bits between identical calls. dK, dV and dmask are deterministic in
    both schedules.
    """
    if torch.are_deterministic_algorithms_enabled():
        return False
    mode = config.backward_schedule()
    if mode == "one_pass":
        return True
    if mode == "two_pass":
        return False
    if mode == "":
        if has_dropout and head_dim <= _ONE_PASS_DROPOUT_MAX_D:
            return True
        return _ONE_PASS_DEFAULT
    raise ValueError(f"FLASHFUSE_BWD must be 'one_pass' or 'two_pass', got {mode!r}")


def _dmask_layout(mask: torch.Tensor, B: int, Hq: int, N: int, M: int):
    """Buffer shape for dS over the mask and the reduction flags.

    Returns (buffer_shape, rowsum, colsum): rowsum when the mask broadcasts
    over queries (the kernel sums over rows), colsum when it broadcasts over
    keys (the kernel sums each key block's columns into its first column).
    """
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    rowsum = shape[2] == 1 and N > 1
    colsum = shape[3] == 1 and M > 1
    return (B, Hq, 1 if rowsum else N, M), rowsum, colsum


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    dropout_p: float,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    bottom_right: bool,
    mask_grad: bool,
    mask_fill: float | None = None,
    grad_lse: torch.Tensor | None = None,
    key_table: torch.Tensor | None = None,
    query_table: torch.Tensor | None = None,
    softcap: float | None = None,
    problem: AttentionProblem | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of flash attention with respect to q, k, v and a float mask.

    Args:
        grad_out: (B, Hq, N, Dv) gradient of the output, any strides.
        q: (B, Hq, N, D) queries; fp16, bf16 or fp32; any strides.
        k: (B, Hkv, M, D) keys, Hq % Hkv == 0 (query head h uses h // (Hq // Hkv)).
        v: (B, Hkv, M, Dv) values.
        attn_mask: None, bool (True takes part) or floating (added to the
            scaled scores), broadcastable to (B, Hq, N, M).
        seed: int64 0-d tensor on q's device, the forward's dropout seed
            (unused, may be None, when dropout_p == 0).
        out: (B, Hq, N, Dv) forward output.
        lse: (B, Hq, N) float32 natural-log log-sum-exp from the forward;
            +inf for rows with no visible key.
        dropout_p: dropout probability used in the forward.
        scale: multiplier of q.k.
        window_left, window_right: visibility band (None = unbounded);
            causal is window_right = 0.
        bottom_right: align the band's diagonal to the bottom-right corner
            (offset M - N) instead of the top-left.
        mask_grad: also return the gradient of the float ``attn_mask``.
        mask_fill: as in the forward (bool masks): the score of the pairs
            the mask hides, which pass no gradient to q and k; None: -inf.
        grad_lse: None, or the (B, Hq, N) gradient of ``lse`` (a caller
            that returns lse as a result): d lse / d s = P, so it enters as
            ``delta - grad_lse``.
        key_table, query_table: the mask's tables from a block mask (built
            for this mask, band and fill; saved by the forward); None: built
            here.
        softcap: as in the forward (``softcap * tanh(s / softcap)``); the
            scores are recomputed through the tanh. (Sinks need nothing
            here: the forward's lse includes them; ``ops.sink_gradient``
            gives their gradient.)
        problem: the call's ``AttentionProblem`` (built with ``backward=True``)
            when the caller (the dispatch) has built it; None: built here.

    Returns:
        (dq, dk, dv, dmask): ``empty_like`` of q, k, v; dmask is None unless
        ``mask_grad``, else the mask's own shape and dtype, summed over the
        dimensions where the mask broadcasts.

    dQ comes from one pass (atomics) or two (a second kernel) as
    ``_one_pass_enabled`` decides: ``FLASHFUSE_BWD``, and always two passes,
    bitwise reproducible, under ``torch.use_deterministic_algorithms(True)``.
    """
    if mask_grad and attn_mask is not None and not attn_mask.is_floating_point():
        raise ValueError(f"mask_grad needs a floating attn_mask, got {attn_mask.dtype}")
    p = problem or AttentionProblem.build(q, k, v, attn_mask, dropout_p=dropout_p, scale=scale,
                                          window_left=window_left, window_right=window_right,
                                          bottom_right=bottom_right, mask_fill=mask_fill, softcap=softcap,
                                          backward=True)
    B, Hq, Hkv, N, M, D, Dv = p.B, p.Hq, p.Hkv, p.N, p.M, p.D, p.Dv
    G = Hq // Hkv
    device = q.device
    has_dropout = p.dropout
    one_pass = _one_pass_enabled(has_dropout, max(D, Dv))
    if one_pass:
        # float32 dQ accumulator in dq's layout, zeroed since the kernel only
        # adds into it (and blocks outside the band add nothing); for float32
        # inputs it is dq itself.
        dq_acc = torch.zeros_like(q, dtype=torch.float32)
        dq = None  # dq_acc cast to q's dtype once the kernel is done
        dq_acc_strides = dq_acc.stride()
    else:
        dq = torch.empty_like(q)
        dq_acc, dq_acc_strides = q, (0, 0, 0, 0)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)

    BLOCK_D, BLOCK_DV = p.block_d, p.block_dv
    mask_kind, mask_strides = p.mask_kind, p.mask_strides
    mask_arg = p.mask if p.mask is not None else q  # q: never read

    do_grad = bool(mask_grad) and attn_mask is not None and mask_kind == MASK_FLOAT
    chunk = B
    if do_grad:
        gshape, rowsum, colsum = _dmask_layout(attn_mask, B, Hq, N, M)
        if attn_mask.dim() < 4 or attn_mask.shape[0] == 1:
            per_batch = 4 * math.prod(gshape[1:])
            chunk = max(1, min(B, _DMASK_BUFFER_BYTES // per_batch))
            gshape = (chunk,) + tuple(gshape[1:])
        # zeros: blocks outside the band are skipped and never written
        gbuf = torch.zeros(gshape, device=device, dtype=torch.float32)
        g_strides = gbuf.stride()
    else:
        rowsum = colsum = False
        gbuf, g_strides = q, (0, 0, 0, 0)

    seed_arg = seed if has_dropout else q  # q: never read
    fill, fill_arg = p.fill, p.fill_arg
    skip_hidden = SKIP_HIDDEN_BLOCKS and p.tables_apply()
    if skip_hidden:
        # The key table serves dQ, and the query table's pass for float masks
        # and fills (rows that average); one pass with a plain bool mask needs
        # only the latter.
        need_keys = key_table is not None or not one_pass or mask_kind == MASK_FLOAT or fill != 0
        key_ranges, query_ranges = mask_tables(mask_arg, N, M, p.band(), fills=fill != 0, key_table=key_table,
                                               query_table=query_table, keys=need_keys, unread=lse)
        if key_ranges is None:
            key_ranges = lse  # never read
        kr_strides = table_strides(key_ranges) if need_keys else (0, 0)
        qr_strides = table_strides(query_ranges)
    else:
        key_ranges = query_ranges = lse  # never read
        kr_strides = qr_strides = (0, 0)

    # With a soft-cap the base-2 scores are tanh(...) * cap * log2(e) (see
    # the forward); dQ and dK still end with the true scale.
    common_scalars = (Hq, G, N, M, D, Dv, p.qk_scale, p.scale, p.keep_scale, p.threshold,
                      p.diag_off, p.window_left, p.window_right)
    softcap_args = (p.softcap_scale, softcap) if softcap is not None else (0.0, 1.0)
    lse_strides = lse.stride()
    interp = p.interpret
    flags = dict(HAS_WL=p.has_window_left, HAS_WR=p.has_window_right, MASK_KIND=mask_kind, FILL=fill,
                 HAS_DROPOUT=has_dropout, PREC=p.precision, SKIP_HIDDEN=skip_hidden, SOFTCAP=softcap is not None,
                 UPCAST=interp and q.dtype == torch.bfloat16, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
                 FULL_KEY_BLOCKS=p.full_key_blocks)
    # dQ's K/V loads (the problem's descriptor rule for the backward; dK/dV,
    # whose best tiles need a two-stage pipeline, never takes descriptors).
    dq_desc = p.kv_descriptors
    if not interp:
        tune = _autotune_enabled()
        # Everything the candidate lists and the compiled kernels depend on.
        key = (q.dtype, device, tuple(sorted(flags.items())), do_grad, rowsum, colsum, one_pass,
               _bucket(N, BACKWARD_BUCKET_CAP), _bucket(M, BACKWARD_BUCKET_CAP), dq_desc)
        named = {"Q": q, **flags, "DESC": dq_desc}
        if dq_desc:
            ensure_scratch_allocator()

    def launch(kind, grid, *args, **kwargs):
        """Launch the "dkdv", "dkdv_dq" or "dq" kernel the way this call runs kernels."""
        if interp:
            _KERNELS[kind][grid](*args, **kwargs, **_INTERPRET_META)
        else:
            _LAUNCHERS[kind](key, lambda: _prune(kind)(_CONFIGS[kind], named), grid, *args, tune=tune, **kwargs)

    # Launch on q's device (the current CUDA device may be another one).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        # 1 / l per row for rows lse marks as averaging l keys (1 elsewhere).
        marks = mask_kind == MASK_FLOAT or fill == 2
        delta, cap = row_delta(p, out, grad_out, lse, grad_lse, marks=marks)

        # When the mask broadcasts over the batch, the dS buffer is filled a
        # batch chunk at a time and summed in a fixed order, which bounds its
        # memory without atomics. Otherwise one launch takes whole tensors: in
        # a traced graph a kernel must write whole tensors, not views, and a
        # loop over a symbolic batch size would specialise the graph to it.
        chunked = do_grad and chunk < B
        if chunked:
            dmask_sum = torch.zeros((1,) + tuple(gbuf.shape[1:]), device=device, dtype=torch.float32)
        for b0 in range(0, B, chunk) if chunked else (0,):
            b1 = min(B, b0 + chunk)

            def rows(t, b0=b0, b1=b1):
                return t[b0:b1] if chunked else t

            launch(
                "dkdv_dq" if one_pass else "dkdv", lambda m: (cdiv(M, m["BLOCK_N"]), Hkv, b1 - b0),
                rows(q), rows(k), rows(v), rows(grad_out), rows(lse), rows(delta), rows(cap),
                rows(mask_arg) if attn_mask is not None else q,
                rows(query_ranges) if qr_strides[0] else query_ranges,
                seed_arg, rows(dk), rows(dv), gbuf[: b1 - b0] if chunked else gbuf,
                rows(dq_acc) if one_pass else dq_acc,
                *p.q_strides, *p.k_strides, *p.v_strides, *grad_out.stride(), *lse_strides, *mask_strides,
                *qr_strides,
                *dk.stride(), *dv.stride(), *g_strides, *dq_acc_strides,
                *common_scalars, b0, fill_arg, *softcap_args,
                MASK_GRAD=do_grad, DMASK_ROWSUM=rowsum, DMASK_COLSUM=colsum, DQ_ATOMIC=one_pass,
                RANGE_GROUP=_COL_GROUP, **flags,
            )
            if chunked:
                dmask_sum += gbuf[: b1 - b0].sum(dim=0, keepdim=True)
                if b1 < B:
                    gbuf.zero_()
        if chunked:
            gbuf = dmask_sum
        if one_pass:
            dq = dq_acc.to(q.dtype)  # same layout: one elementwise cast (none for float32)
        else:
            launch(
                "dq", lambda m: (cdiv(N, m["BLOCK_M"]), Hq, B),
                q, k, v, grad_out, lse, delta, cap, mask_arg, key_ranges, seed_arg, dq,
                *p.q_strides, *p.k_strides, *p.v_strides, *grad_out.stride(), *lse_strides, *mask_strides,
                *kr_strides,
                *dq.stride(),
                *common_scalars, fill_arg, *softcap_args,
                RANGE_GROUP=_ROW_GROUP, DESC=dq_desc, **flags,
            )

    dmask = _reduce_dmask(gbuf, attn_mask) if do_grad else None
    return dq, dk, dv, dmask


def row_delta(p: AttentionProblem, out, grad_out, lse, grad_lse=None, *, marks: bool = False) -> tuple:
    """``(delta, cap)``: delta = rowsum(dO * O) in float32, (B, Hq, N)
    contiguous, less ``grad_lse`` where lse has a gradient (dS = P * (dP -
    delta) + P * grad_lse); with ``marks``, cap = 1 / l for the rows lse
    marks as averaging l keys (1 elsewhere), else cap is delta itself (never
    read). Runs on the current device (the launchers set it)."""
    B, Hq, N = p.B, p.Hq, p.N
    delta = torch.empty((B, Hq, N), device=out.device, dtype=torch.float32)
    cap = torch.empty((B, Hq, N), device=out.device, dtype=torch.float32) if marks else delta
    pre_args = (out, grad_out, delta, lse, cap, *out.stride(), *grad_out.stride(), *lse.stride(), N, p.Dv)
    if p.interpret:
        _bwd_preprocess[(cdiv(N, 16), Hq, B)](*pre_args, MARKS=marks, BLOCK_M=16, BLOCK_DV=p.block_dv)
    else:
        _preprocess_launcher(
            (out.device, p.block_dv, marks), lambda: [_preprocess_config(p.block_dv)],
            lambda m: (cdiv(N, m["BLOCK_M"]), Hq, B), *pre_args, MARKS=marks, BLOCK_DV=p.block_dv,
        )
    if grad_lse is not None:
        delta = (delta - grad_lse.to(torch.float32)).contiguous()
    return delta, cap


def _reduce_dmask(gbuf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum the (B, Hq, N or 1, M) float32 dS buffer over the mask's broadcast
    dimensions and return it in the mask's own shape and dtype."""
    shape4 = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    dims = [d for d in range(4) if shape4[d] == 1 and gbuf.shape[d] != 1]
    g = gbuf.sum(dim=dims, keepdim=True) if dims else gbuf
    return g.reshape(mask.shape).to(mask.dtype)
