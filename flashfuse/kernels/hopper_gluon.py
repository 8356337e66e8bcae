"""The Hopper kernels in Gluon, forward and backward (see ``hopper.py`` for the schedules,
the scope and the launcher). Imported only when a Hopper launch needs it:
Gluon kernels do not run in Triton's interpreter.

Written for Gluon as shipped with Triton 3.6.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)


@gluon.jit
def _mask_scores(s, start_n, m0, key_end, diag_off, window_left, window_right,
                 HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """-inf where key j is past ``key_end`` or outside query i's band (common._visible)."""
    i = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    j = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    i2 = gl.expand_dims(i, 1)
    j2 = gl.expand_dims(j, 0)
    vis = j2 < key_end
    if HAS_WINDOW_RIGHT:
        vis = vis & (j2 <= i2 + diag_off + window_right)
    if HAS_WINDOW_LEFT:
        vis = vis & (j2 >= i2 + diag_off - window_left)
    return gl.where(vis, s, float("-inf"))


@gluon.jit
def _mask_if_crossing(s, start_n, m0, key_end, full_end, right_edge, left_edge, diag_off, window_left,
                      window_right, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """The block's scores, masked only if the block crosses the key end
    (``full_end``: the last start whose block ends inside the keys) or an
    edge of the band (``right_edge`` / ``left_edge``: the block starts
    between which every row sees all of it)."""
    need = start_n > full_end
    if HAS_WINDOW_RIGHT:
        need = need | (start_n > right_edge)
    if HAS_WINDOW_LEFT:
        need = need | (start_n < left_edge)
    if need:
        s = _mask_scores(s, start_n, m0, key_end, diag_off, window_left, window_right,
                         HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_M, BLOCK_N, layout)
    return s


@gluon.jit
def _ws_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
               v_empty, m0, lo, n_blocks, WITH_DO: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The copy-engine warp of the forward and the dQ kernel: q's two halves
    (and dO's, ``WITH_DO``) once, then K and V blocks into their slots as
    the two consumers release them."""
    if WITH_DO:
        mbarrier.expect(q_bar, 4 * HALF_M * HEAD_DIM * 2)
    else:
        mbarrier.expect(q_bar, 2 * HALF_M * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [m0 + HALF_M, 0], q_bar, q_smem.index(1))
    if WITH_DO:
        tma.async_copy_global_to_shared(do_desc, [m0, 0], q_bar, do_smem.index(0))
        tma.async_copy_global_to_shared(do_desc, [m0 + HALF_M, 0], q_bar, do_smem.index(1))
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * 2
    for i in range(n_blocks):
        slot = i % STAGES
        phase = ((i // STAGES) & 1) ^ 1  # a fresh barrier's previous phase counts as done
        start_n = lo + i * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(k_desc, [start_n, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(v_desc, [start_n, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_consumer(o_desc, Lse, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                 lse_base, N, m0, lo, n_blocks, key_end, qk_scale, diag_off, window_left, window_right,
                 HALF: gl.constexpr, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
                 HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """One warp group: 64 query rows, the whole online softmax for them."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    r0 = m0 + HALF * HALF_M
    last_row = gl.minimum(r0 + HALF_M, N) - 1
    q_half = q_smem.index(HALF)
    full_end = key_end - BLOCK_N
    right_edge = r0 + diag_off + window_right - BLOCK_N + 1
    left_edge = last_row + diag_off - window_left
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_half, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False)
    mbarrier.arrive(k_empty.index(0))
    s = _mask_if_crossing(s, lo, r0, key_end, full_end, right_edge, left_edge, diag_off, window_left,
                          window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, s_layout)
    m_i = gl.max(s, axis=1) * qk_scale
    m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    l_i = gl.sum(p, axis=1)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        start_n = lo + j * BLOCK_N
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot))
        s = _mask_if_crossing(s, start_n, r0, key_end, full_end, right_edge, left_edge, diag_off, window_left,
                              window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, s_layout)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)

    last = n_blocks - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc)
    mbarrier.arrive(v_empty.index(last % STAGES))

    l_o = gl.convert_layout(l_i, row_o)
    m_o = gl.convert_layout(m_i, row_o)
    empty = l_o == 0.0
    inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_o))
    out = acc * gl.expand_dims(inv_l, 1)
    lse = gl.where(empty, float("inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) * 0.6931471805599453)
    rows = r0 + gl.arange(0, HALF_M, layout=row_o)
    gl.store(Lse + lse_base + rows, lse, mask=rows < N)
    # This warp group's q half is free once its last q·kᵀ has finished.
    q_half.store(out.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [r0, 0], q_half)
    tma.store_wait(0)


@gluon.jit
def _head_matrix(base, b64, head, stride_b, stride_h, stride_row, rows, BLOCK_ROWS: gl.constexpr,
                 HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """A descriptor over one (batch, head)'s (rows, HEAD_DIM) matrix: the copy
    engine clips at ``rows`` and reads zeros past it, whatever the strides
    between heads."""
    return tma.make_tensor_descriptor(base + b64 * stride_b + head.to(gl.int64) * stride_h,
                                      shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                      block_shape=[BLOCK_ROWS, HEAD_DIM], layout=layout)


@gluon.jit
def _key_range(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT: gl.constexpr,
               HAS_WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """``[lo, hi)``: the keys the query rows ``m0 .. m0 + BLOCK_M - 1`` may
    see under the band, ``lo`` rounded down to a key block (the forward and
    the dQ kernel stream the same blocks); ``hi <= lo`` when none."""
    last_row = gl.minimum(m0 + BLOCK_M, N) - 1
    lo = 0
    hi = M
    if HAS_WINDOW_RIGHT:
        hi = gl.minimum(hi, gl.maximum(last_row + diag_off + window_right + 1, 0))
    if HAS_WINDOW_LEFT:
        lo = gl.maximum(m0 + diag_off - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@gluon.jit
def _stream_barriers(STAGES: gl.constexpr):
    """The barriers of every Hopper kernel: one for the tile loaded once
    (q, or q and dO; K and V in the dK/dV kernel), then ready/empty per slot
    of the two operands that stream (K and V; q and dO); an empty barrier
    counts both consumers' releases."""
    tile_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(tile_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=2)
        mbarrier.init(b_empty.index(i), count=2)
    fence_async_shared()
    return tile_bar, a_ready, a_empty, b_ready, b_empty


@gluon.jit
def _hopper_attn_fwd_ws(
    Q, K, V, Out, Lse,
    stride_q_b, stride_q_h, stride_q_n,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_o_b, stride_o_h, stride_o_n,
    Hq, Hkv, N, M,
    qk_scale, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF_M: gl.constexpr = BLOCK_M // 2
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    hk = h // (Hq // Hkv)
    m0 = pid_m * BLOCK_M
    b64 = b.to(gl.int64)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = _head_matrix(Q, b64, h, stride_q_b, stride_q_h, stride_q_n, N, HALF_M, HEAD_DIM, q_layout)
    k_desc = _head_matrix(K, b64, hk, stride_k_b, stride_k_h, stride_k_n, M, BLOCK_N, HEAD_DIM, kv_layout)
    v_desc = _head_matrix(V, b64, hk, stride_v_b, stride_v_h, stride_v_n, M, BLOCK_N, HEAD_DIM, kv_layout)
    o_desc = _head_matrix(Out, b64, h, stride_o_b, stride_o_h, stride_o_n, N, HALF_M, HEAD_DIM, q_layout)

    lo, hi = _key_range(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_M,
                        BLOCK_N)
    n_blocks = gl.cdiv(hi - lo, BLOCK_N)
    none_visible = n_blocks <= 0
    key_end = gl.where(none_visible, 0, M)
    lo = gl.where(none_visible, 0, lo)
    n_blocks = gl.maximum(n_blocks, 1)

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar, k_ready, k_empty, v_ready, v_empty = _stream_barriers(STAGES)

    lse_base = (b64 * Hq + h) * N
    gl.warp_specialize([
        (_ws_consumer, (o_desc, Lse, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                        lse_base, N, m0, lo, n_blocks, key_end, qk_scale, diag_off, window_left, window_right,
                        0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
        (_ws_consumer, (o_desc, Lse, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                        lse_base, N, m0, lo, n_blocks, key_end, qk_scale, diag_off, window_left, window_right,
                        1, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
        (_ws_loader, (q_desc, q_desc, k_desc, v_desc, q_smem, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
                      v_ready, v_empty, m0, lo, n_blocks, False, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
    ], [4, 1], [240, 24])


# The backward kernels (taken by the op's backward where
# hopper.backward_refusal says so): dK/dV per 128-key tile, its two consumer warp
# groups 64 keys each, looping over the group's query heads and the query
# blocks of the band; dQ per 128-query tile, as the forward streams K and V.
# Both deterministic (no atomics), the lse and delta the portable backward
# reads.
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _dkdv_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                 do_ready, do_empty, h0, n0, lo_m, n_m, n_iters, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    half_bytes: gl.constexpr = HALF_N * HEAD_DIM * 2
    mbarrier.expect(kv_bar, 4 * half_bytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(k_desc, [n0 + HALF_N, 0], kv_bar, k_smem.index(1))
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [n0 + HALF_N, 0], kv_bar, v_smem.index(1))
    blk_bytes: gl.constexpr = BLOCK_M * HEAD_DIM * 2
    for i in range(n_iters):
        slot = i % STAGES
        phase = ((i // STAGES) & 1) ^ 1
        head = h0 + i // n_m
        m0 = lo_m + (i % n_m) * BLOCK_M
        mbarrier.wait(q_empty.index(slot), phase)
        mbarrier.expect(q_ready.index(slot), blk_bytes)
        tma.async_copy_global_to_shared(q_desc, [head, m0, 0], q_ready.index(slot),
                                        q_smem.index(slot).reshape([1, BLOCK_M, HEAD_DIM]))
        mbarrier.wait(do_empty.index(slot), phase)
        mbarrier.expect(do_ready.index(slot), blk_bytes)
        tma.async_copy_global_to_shared(do_desc, [head, m0, 0], do_ready.index(slot),
                                        do_smem.index(slot).reshape([1, BLOCK_M, HEAD_DIM]))


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                   do_ready, do_empty, stat_b, stride_stat_h, N, h0, n0, lo_m, n_m, n_iters, qk_scale, scale,
                   diag_off, window_left, window_right, HALF: gl.constexpr, HAS_WINDOW_LEFT: gl.constexpr,
                   HAS_WINDOW_RIGHT: gl.constexpr, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col: gl.constexpr = gl.SliceLayout(0, st_layout)
    row: gl.constexpr = gl.SliceLayout(1, st_layout)
    j0 = n0 + HALF * HALF_N
    k_half = k_smem.index(HALF)
    v_half = v_smem.index(HALF)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
    zero_st = gl.zeros([HALF_N, BLOCK_M], gl.float32, st_layout)
    kj = gl.expand_dims(j0 + gl.arange(0, HALF_N, layout=row), 1)
    # Query blocks whose rows all see every key of this half (no mask needed):
    # m0 >= right_from (causal edge) and m0 <= left_to (left window edge).
    right_from = j0 + HALF_N - 1 - diag_off - window_right
    left_to = j0 - diag_off + window_left - BLOCK_M + 1
    mbarrier.wait(kv_bar, 0)
    for i in range(n_iters):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        head = h0 + i // n_m
        m0 = lo_m + (i % n_m) * BLOCK_M
        qi = m0 + gl.arange(0, BLOCK_M, layout=col)
        stat = stat_b + head.to(gl.int64) * stride_stat_h + qi
        lse2 = gl.load(Lse + stat, mask=qi < N, other=float("inf")) * LOG2E
        delta = gl.load(Delta + stat, mask=qi < N, other=0.0)
        mbarrier.wait(q_ready.index(slot), phase)
        st_tok = warpgroup_mma(k_half, q_smem.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dpt_tok = warpgroup_mma(v_half, do_smem.index(slot).permute((1, 0)), zero_st, use_acc=False,
                                is_async=True)
        st = warpgroup_mma_wait(1, deps=(st_tok, ))
        need = False
        if HAS_WINDOW_RIGHT:
            need = need | (m0 < right_from)
        if HAS_WINDOW_LEFT:
            need = need | (m0 > left_to)
        if need:
            i2 = gl.expand_dims(qi, 0)
            vis = (kj >= 0) & (i2 >= 0)
            if HAS_WINDOW_RIGHT:
                vis = vis & (kj <= i2 + diag_off + window_right)
            if HAS_WINDOW_LEFT:
                vis = vis & (kj >= i2 + diag_off - window_left)
            st = gl.where(vis, st, float("-inf"))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        pt_op = gl.convert_layout(pt.to(dtype), a_layout)
        dst_op = gl.convert_layout(dst.to(dtype), a_layout)
        dv_tok = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
        dk_tok = warpgroup_mma(dst_op, q_smem.index(slot), dk, is_async=True)
        dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, pt_op, dst_op))
        mbarrier.arrive(q_empty.index(slot))
        mbarrier.arrive(do_empty.index(slot))
    k_half.store((dk * scale).to(dtype))
    v_half.store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [j0, 0], k_half)
    tma.async_copy_shared_to_global(dv_desc, [j0, 0], v_half)
    tma.store_wait(0)


@gluon.jit
def _hopper_attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, Lse, Delta,
    stride_q_b, stride_q_h, stride_q_n,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_do_b, stride_do_h, stride_do_n,
    stride_dk_b, stride_dk_h, stride_dk_n,
    stride_dv_b, stride_dv_h, stride_dv_n,
    stride_stat_b, stride_stat_h,
    Hq, Hkv, N, M,
    qk_scale, scale, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF_N: gl.constexpr = BLOCK_N // 2
    pid_n = gl.program_id(0)
    hk = gl.program_id(1)
    b = gl.program_id(2)
    G = Hq // Hkv
    n0 = pid_n * BLOCK_N
    b64 = b.to(gl.int64)
    qo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    qo3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, HEAD_DIM], dtype)
    q_desc = tma.make_tensor_descriptor(Q + b64 * stride_q_b, shape=[Hq, N, HEAD_DIM],
                                        strides=[stride_q_h, stride_q_n, 1], block_shape=[1, BLOCK_M, HEAD_DIM],
                                        layout=qo3_layout)
    do_desc = tma.make_tensor_descriptor(DO + b64 * stride_do_b, shape=[Hq, N, HEAD_DIM],
                                         strides=[stride_do_h, stride_do_n, 1], block_shape=[1, BLOCK_M, HEAD_DIM],
                                         layout=qo3_layout)
    k_desc = _head_matrix(K, b64, hk, stride_k_b, stride_k_h, stride_k_n, M, HALF_N, HEAD_DIM, kv_layout)
    v_desc = _head_matrix(V, b64, hk, stride_v_b, stride_v_h, stride_v_n, M, HALF_N, HEAD_DIM, kv_layout)
    dk_desc = _head_matrix(DK, b64, hk, stride_dk_b, stride_dk_h, stride_dk_n, M, HALF_N, HEAD_DIM, kv_layout)
    dv_desc = _head_matrix(DV, b64, hk, stride_dv_b, stride_dv_h, stride_dv_n, M, HALF_N, HEAD_DIM, kv_layout)

    lo_m = 0
    hi_m = N
    if HAS_WINDOW_RIGHT:
        lo_m = gl.maximum(n0 - diag_off - window_right, 0)
        lo_m = (lo_m // BLOCK_M) * BLOCK_M
    if HAS_WINDOW_LEFT:
        hi_m = gl.minimum(hi_m, n0 + BLOCK_N - diag_off + window_left)
    n_m = gl.cdiv(gl.maximum(hi_m - lo_m, 0), BLOCK_M)
    n_iters = G * n_m
    n_m = gl.maximum(n_m, 1)  # a divisor; no iteration runs when n_iters is 0

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qo_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qo_layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, HEAD_DIM], kv_layout)
    kv_bar, q_ready, q_empty, do_ready, do_empty = _stream_barriers(STAGES)
    h0 = hk * G
    stat_b = b64 * stride_stat_b
    gl.warp_specialize([
        (_dkdv_consumer, (dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                          do_ready, do_empty, stat_b, stride_stat_h, N, h0, n0, lo_m, n_m, n_iters, qk_scale, scale,
                          diag_off, window_left, window_right, 0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_N, BLOCK_M,
                          HEAD_DIM, STAGES)),
        (_dkdv_consumer, (dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                          do_ready, do_empty, stat_b, stride_stat_h, N, h0, n0, lo_m, n_m, n_iters, qk_scale, scale,
                          diag_off, window_left, window_right, 1, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_N, BLOCK_M,
                          HEAD_DIM, STAGES)),
        (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty,
                        do_ready, do_empty, h0, n0, lo_m, n_m, n_iters, HALF_N, BLOCK_M, HEAD_DIM, STAGES)),
    ], [4, 1], [240, 24])


@gluon.jit
def _dq_consumer(dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, k_empty, v_ready, v_empty,
                 stat_base, N, M, m0, lo, n_blocks, qk_scale, scale, diag_off, window_left, window_right,
                 HALF: gl.constexpr, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
                 HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row: gl.constexpr = gl.SliceLayout(1, s_layout)
    r0 = m0 + HALF * HALF_M
    last_row = gl.minimum(r0 + HALF_M, N) - 1
    q_half = q_smem.index(HALF)
    do_half = do_smem.index(HALF)
    full_end = M - BLOCK_N
    right_edge = r0 + diag_off + window_right - BLOCK_N + 1
    left_edge = last_row + diag_off - window_left
    rows = r0 + gl.arange(0, HALF_M, layout=row)
    lse2 = gl.load(Lse + stat_base + rows, mask=rows < N, other=float("inf")) * LOG2E
    delta = gl.load(Delta + stat_base + rows, mask=rows < N, other=0.0)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([HALF_M, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(qdo_bar, 0)
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        start_n = lo + j * BLOCK_N
        mbarrier.wait(k_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp_tok = warpgroup_mma(do_half, v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        s = _mask_if_crossing(s, start_n, r0, M, full_end, right_edge, left_edge, diag_off, window_left,
                              window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, s_layout)
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        mbarrier.arrive(v_empty.index(slot))
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)
        dq_tok = warpgroup_mma(ds_op, k_smem.index(slot), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(k_empty.index(slot))
    q_half.store((dq * scale).to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dq_desc, [r0, 0], q_half)
    tma.store_wait(0)


@gluon.jit
def _hopper_attn_bwd_dq(
    Q, K, V, DO, DQ, Lse, Delta,
    stride_q_b, stride_q_h, stride_q_n,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_do_b, stride_do_h, stride_do_n,
    stride_dq_b, stride_dq_h, stride_dq_n,
    stride_stat_b, stride_stat_h,
    Hq, Hkv, N, M,
    qk_scale, scale, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF_M: gl.constexpr = BLOCK_M // 2
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    hk = h // (Hq // Hkv)
    m0 = pid_m * BLOCK_M
    b64 = b.to(gl.int64)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = _head_matrix(Q, b64, h, stride_q_b, stride_q_h, stride_q_n, N, HALF_M, HEAD_DIM, q_layout)
    do_desc = _head_matrix(DO, b64, h, stride_do_b, stride_do_h, stride_do_n, N, HALF_M, HEAD_DIM, q_layout)
    dq_desc = _head_matrix(DQ, b64, h, stride_dq_b, stride_dq_h, stride_dq_n, N, HALF_M, HEAD_DIM, q_layout)
    k_desc = _head_matrix(K, b64, hk, stride_k_b, stride_k_h, stride_k_n, M, BLOCK_N, HEAD_DIM, kv_layout)
    v_desc = _head_matrix(V, b64, hk, stride_v_b, stride_v_h, stride_v_n, M, BLOCK_N, HEAD_DIM, kv_layout)
    lo, hi = _key_range(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_M,
                        BLOCK_N)
    n_blocks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    qdo_bar, k_ready, k_empty, v_ready, v_empty = _stream_barriers(STAGES)
    stat_base = b64 * stride_stat_b + h.to(gl.int64) * stride_stat_h
    gl.warp_specialize([
        (_dq_consumer, (dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, k_empty, v_ready,
                        v_empty, stat_base, N, M, m0, lo, n_blocks, qk_scale, scale, diag_off, window_left,
                        window_right, 0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
        (_dq_consumer, (dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, k_empty, v_ready,
                        v_empty, stat_base, N, M, m0, lo, n_blocks, qk_scale, scale, diag_off, window_left,
                        window_right, 1, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
        (_ws_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, k_empty,
                      v_ready, v_empty, m0, lo, n_blocks, True, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
    ], [4, 1], [240, 24])
