"""The Hopper kernels in Gluon, forward and backward (see ``hopper.py`` for the schedules,
the scope and the launcher). Imported only when a Hopper launch needs it:
Gluon kernels do not run in Triton's interpreter.

Written for Gluon as shipped with Triton 3.6.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gluon_builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from . import common, mask_ranges

LOG2E = gl.constexpr(1.4426950408889634)


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


@gluon.constexpr_function
def _exp2_asm(poly: int, pack: int = 8) -> str:
    """PTX for 2^x of ``pack`` float32 scores at most 0 (or -inf, or NaN),
    the last ``poly`` of them on the FMA units instead of the special-function
    unit (``ex2.approx``), which gives an eighth as many results per cycle
    as there are FMA lanes (at D = 64 a block's exponentials ask it for as
    many cycles as the block's products take the tensor cores).
    2^x = 2^j * 2^f with j = x rounded to the nearest integer (adding
    1.5 * 2^23 leaves j in the sum's low bits), f = x - j in [-0.5, 0.5],
    2^f by a cubic with constant term 1 (so 2^0 = 1 exactly, as a row's
    maximum needs; otherwise minimax, relative error below 1.1e-4: 19 times
    finer than bf16's rounding, 4.8 times finer than fp16's), 2^j by writing
    j + 127 into a float's exponent bits. x is clamped at -127 first, where 2^j
    comes out as 0.0: -inf gives exactly 0, as ``ex2`` does; ``max.NaN``
    keeps a NaN a NaN. Outputs are $0 .. $pack-1, inputs $pack .. 2 pack-1."""
    lines = ["{", ".reg .b32 x, t, r, f, p, e;"]
    for i in range(pack):
        out, arg = f"${i}", f"${pack + i}"
        if i < pack - poly:
            lines.append(f"ex2.approx.ftz.f32 {out}, {arg};")
            continue
        lines += [
            f"max.NaN.f32 x, {arg}, 0fC2FE0000;",   # -127
            "add.rn.f32 t, x, 0f4B400000;",          # 1.5 * 2^23: j in t's low bits
            "sub.rn.f32 r, t, 0f4B400000;",          # j
            "sub.rn.f32 f, x, r;",
            "fma.rn.f32 p, f, 0f3D6150CF, 0f3E78060A;",
            "fma.rn.f32 p, p, f, 0f3F317AFD;",
            "fma.rn.f32 p, p, f, 0f3F800000;",
            "mad.lo.u32 e, t, 8388608, 1065353216;",  # (j + 127) << 23: 2^j
            f"mul.rn.f32 {out}, p, e;",
        ]
    lines.append("}")
    return "\n".join(lines)


EXP2_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))


@gluon.jit
def _exp2(x, POLY: gl.constexpr):
    """2^x of float32 scores at most 0 (the softmax's), ``POLY`` of each
    eight on the FMA units (``_exp2_asm``), the rest by ``ex2.approx``."""
    if POLY == 0:
        return gl.exp2(x)
    else:
        gl.static_assert((POLY > 0) & (POLY <= 8), "POLY: 0 to 8 of each eight exponentials")
        return gl.inline_asm_elementwise(_exp2_asm(POLY), EXP2_CONSTRAINTS, [x], gl.float32, True, 8)


@gluon.jit
def _row_max(s, FOLDS: gl.constexpr, layout: gl.constexpr):
    """Each row's maximum of ``s`` (rows x columns, in ``layout``), in
    ``layout``'s row slice. A plain ``gl.max`` reduces a thread's columns
    in one dependent chain (31 ``FMNMX`` for a 64 x 128 wgmma accumulator),
    which the exponentials wait for. Folding the two halves of the columns
    onto each other ``FOLDS`` times first (the halves lie in the same
    thread's registers, so each fold is independent ``FMNMX`` only) cuts the
    chain to about ``FOLDS`` plus columns / 2^(FOLDS + 2)."""
    x = s
    for _ in gl.static_range(FOLDS):
        a, b = gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))
        x = gl.maximum(a, b)
    return gl.convert_layout(gl.max(x, axis=1), gl.SliceLayout(1, layout), assert_trivial=True)


@gluon.jit
def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
               v_empty, m0, lo, n_blocks, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               STAGES: gl.constexpr):
    """The copy-engine warp of the dQ kernel: q's and dO's two halves once,
    then K and V blocks into their slots as the two consumers release them."""
    mbarrier.expect(q_bar, 4 * HALF_M * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [m0 + HALF_M, 0], q_bar, q_smem.index(1))
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
def _head_matrix(base, b64, head, stride_b, stride_h, stride_row, rows, BLOCK_ROWS: gl.constexpr,
                 HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """A descriptor over one (batch, head)'s (rows, HEAD_DIM) matrix: the copy
    engine clips at ``rows`` and reads zeros past it, whatever the strides
    between heads."""
    return tma.make_tensor_descriptor(base + b64 * stride_b + head.to(gl.int64) * stride_h,
                                      shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                      block_shape=[BLOCK_ROWS, HEAD_DIM], layout=layout)


@gluon.jit
def _stacked_heads(base, b64, stride_b, stride_h, stride_row, heads, rows, BLOCK_ROWS: gl.constexpr,
                   WIDTH: gl.constexpr, BLOCK_WIDTH: gl.constexpr, layout: gl.constexpr):
    """A descriptor over one batch's (heads, rows, WIDTH) block, copied
    [1, BLOCK_ROWS, BLOCK_WIDTH] at a time: the dK/dV kernels stream q, dO
    (and add dQ) of every query head of a group through one descriptor; the
    copy engine clips at ``rows``."""
    return tma.make_tensor_descriptor(base + b64 * stride_b, shape=[heads, rows, WIDTH],
                                      strides=[stride_h, stride_row, 1], block_shape=[1, BLOCK_ROWS, BLOCK_WIDTH],
                                      layout=layout)


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
def _stream_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The barriers of every Hopper kernel: one for the tile loaded once
    (q, or q and dO; K and V in the dK/dV kernel), then ready/empty per slot
    of the two operands that stream (K and V; q and dO); an empty barrier
    counts the releases of all CONSUMERS consumer warp groups."""
    tile_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(tile_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=CONSUMERS)
        mbarrier.init(b_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    return tile_bar, a_ready, a_empty, b_ready, b_empty


@gluon.jit
def _program_rounds(n_tiles):
    """How many tiles this program takes (see ``_round_tile``)."""
    P = gl.num_programs(0)
    p = gl.program_id(0)
    full = n_tiles // P
    last_pos = gl.where(full % 2 == 0, p, P - 1 - p)
    return full + (last_pos < n_tiles - full * P).to(gl.int32)


@gluon.jit
def _round_tile(r):
    """The tile index program p takes in its round ``r``. Round r covers
    tiles r·P .. r·P + P - 1 (P programs), handed out in program order in
    even rounds and in reverse in odd ones, so that under a band a program
    that had a long tile gets a short one next."""
    P = gl.num_programs(0)
    p = gl.program_id(0)
    return r * P + gl.where(r % 2 == 0, p, P - 1 - p)


# Mask tensors (MASK_KIND 1: bool read as bytes, nonzero takes part; 2:
# float, added to the scores) reach the forward with the key table of
# ``mask_ranges`` (one entry per GROUP query rows: the keys some row lets
# take part, and those every row sees through a neutral value). Both
# partitions narrow a tile's key blocks to the table's range; a consumer
# reads the mask only in the blocks its rows do not all see as neutral.
_INT_MAX = gl.constexpr(2147483647)
# int32 values per entry of the key and query tables (``mask_ranges``).
KEY_ENTRY = gl.constexpr(mask_ranges.KEY_ENTRY)
QUERY_ENTRY = gl.constexpr(mask_ranges.QUERY_ENTRY)
# The float-mask conventions of the portable kernels, theirs (common.py):
# rows whose largest base-2 score is at or below AVERAGE_AT_BASE2 average
# their keys, and their lse is a marker holding the key count.
AVERAGE_AT_BASE2 = common.AVERAGE_AT_BASE2
FLT_MAX = common.FLT_MAX
LSE_MARK_UNIT = common.LSE_MARK_UNIT
LSE_MARK_MAX_KEYS = common.LSE_MARK_MAX_KEYS


@gluon.jit
def _table_reduce(Table, tab_off, first, end, GROUPS: gl.constexpr, GROUP: gl.constexpr, ENTRY: gl.constexpr,
                  WARPS: gl.constexpr):
    """A mask table's entries (``ENTRY`` int32 each, the first four
    ``(lo, hi, free_lo, free_hi)``) for ``first .. first + GROUPS * GROUP -
    1`` (query rows in the key table, keys in the query table), reduced over
    the groups holding one below ``end``: the union of the ranges that take
    part and the intersection of the neutral ones (none below ``end``:
    nothing takes part, all is neutral)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    g = gl.arange(0, GROUPS, layout=layout)
    real = first + g * GROUP < end
    e = Table + tab_off + (first // GROUP + g) * ENTRY
    r_lo = gl.min(gl.load(e, mask=real, other=_INT_MAX), axis=0)
    r_hi = gl.max(gl.load(e + 1, mask=real, other=0), axis=0)
    f_lo = gl.max(gl.load(e + 2, mask=real, other=0), axis=0)
    f_hi = gl.min(gl.load(e + 3, mask=real, other=_INT_MAX), axis=0)
    return _warp_uniform(r_lo), _warp_uniform(r_hi), _warp_uniform(f_lo), _warp_uniform(f_hi)


@gluon.jit
def _warp_uniform(x):
    """``x``, an int32 every thread of the warp holds alike, as lane 0's
    copy: ptxas then knows it is warp-uniform. A table value as the loads
    and reductions leave it is not known to be, and neither is anything
    computed from it (the tile's block range, the ring counter, the smem
    slots): the masked kernels then kept those in vector registers,
    converting them (R2UR) for every wgmma descriptor and barrier, and
    guarded each barrier wait against divergence (BSSY/BSYNC)."""
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _free_blocks(f_lo, f_hi, BLOCK_N: gl.constexpr):
    """``[free_lo, free_hi)``: the key blocks lying wholly inside the
    neutral keys ``[f_lo, f_hi)``."""
    return gl.cdiv(f_lo, BLOCK_N) * BLOCK_N, (gl.maximum(f_hi, 0) // BLOCK_N) * BLOCK_N


@gluon.jit
def _masked_scores(s, mask_base, r0, start_n, N, M, stride_mask_q, stride_mask_k, MASK_KIND: gl.constexpr,
                   ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Base-2 scores ``s`` of rows ``r0 ..`` and keys ``start_n ..`` with the
    mask applied as the portable forward applies it: a bool mask hides
    (-inf) where it is zero; a float mask is added in base 2, values at or
    below -1e38 as they are (a row they hide entirely then averages its keys,
    and -inf stays -inf). ``mask_base`` points at the (batch, head)'s mask;
    the pointers are formed here, in the blocks that read it (kept across
    the loop they cost the D = 128 kernel spills)."""
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ok = gl.expand_dims(rows < N, 1) & gl.expand_dims(cols < M, 0)
    ptrs = (mask_base + gl.expand_dims(rows.to(gl.int64) * stride_mask_q, 1)
            + gl.expand_dims(cols.to(gl.int64) * stride_mask_k, 0))
    return _with_mask_values(s, gl.load(ptrs, mask=ok, other=0), MASK_KIND)


@gluon.jit
def _with_mask_values(s, mv, MASK_KIND: gl.constexpr):
    """Base-2 scores with the loaded mask values applied (``_masked_scores``)."""
    if MASK_KIND == 1:
        s = gl.where(mv != 0, s, float("-inf"))
    else:
        x = mv.to(gl.float32)
        s = s + gl.where(x > -1.0e38, gl.maximum(x, -1.0e38) * LOG2E, x)
    return s


@gluon.jit
def _masked_scores_t_direct(st, mask_base, qi, kj, N, M, stride_mask_q, stride_mask_k, MASK_KIND: gl.constexpr):
    """``_masked_scores_t`` loading the mask straight into the scores'
    layout: one load per element (``BWD_MASK_LOADS`` "direct": faster at
    D = 128, where the coalesced tile's shared-memory round trip costs more)."""
    i2 = gl.expand_dims(qi, 0)
    ok = (kj < M) & (i2 < N)
    ptrs = mask_base + kj.to(gl.int64) * stride_mask_k + i2.to(gl.int64) * stride_mask_q
    return _with_mask_values(st, gl.load(ptrs, mask=ok, other=0), MASK_KIND)


@gluon.jit
def _masked_scores_t(st, mask_base, q0, k0, N, M, stride_mask_q, stride_mask_k, MASK_KIND: gl.constexpr,
                     KEYS: gl.constexpr, QUERIES: gl.constexpr, layout: gl.constexpr):
    """``_masked_scores`` for the backward's transposed scores ``st`` (keys
    ``k0 ..`` by query rows ``q0 ..``, in ``layout``). The mask lies query
    row by query row, keys contiguous, while ``layout`` gives adjacent
    threads adjacent queries: loaded in it, every element was its own load
    of 1-2 bytes from another row (64 per thread and block, run 27's SASS).
    So the tile is loaded with threads running along the keys, eight
    consecutive keys a thread (one 16-byte vector of a 16-bit mask), and
    moved into ``layout`` through shared memory."""
    coalesced: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    kj = k0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, coalesced))
    qi = q0 + gl.arange(0, QUERIES, layout=gl.SliceLayout(0, coalesced))
    ok = gl.expand_dims(kj < M, 1) & gl.expand_dims(qi < N, 0)
    ptrs = (mask_base + gl.expand_dims(kj.to(gl.int64) * stride_mask_k, 1)
            + gl.expand_dims(qi.to(gl.int64) * stride_mask_q, 0))
    mv = gl.convert_layout(gl.load(ptrs, mask=ok, other=0), layout)
    return _with_mask_values(st, mv, MASK_KIND)


@gluon.jit
def _fwd_tile(r, n_m, Hq, BLOCK_M: gl.constexpr):
    """The query tile program p takes in its round ``r``: ``(m0, h, b)``
    (the hand-out: ``_round_tile``). Tiles are numbered with the ``n_m``
    query blocks of one (batch, head) consecutive, last block first: tiles
    running together share K and V in L2, and under a causal band the
    longest rows start first. Split tails (``_fwd_tails``) come after all
    of them."""
    t = _round_tile(r)
    bh = t // n_m
    m0 = (n_m - 1 - t % n_m) * BLOCK_M
    return m0, bh % Hq, bh // Hq


@gluon.jit
def _fwd_tail_tile(r, first, n_m, Hq, BLOCK_M: gl.constexpr):
    """The split tail program p takes in its round ``r``: ``(m0, h, b)``.
    Tiles ``first`` on are the tails, tail t the last of the ``n_m``
    query blocks of (batch, head) t. Last, so that the hand-out gives them
    to the programs with fewer full tiles."""
    t = _round_tile(r) - first
    return (n_m - 1) * BLOCK_M, t % Hq, t // Hq


@gluon.jit
def _fwd_tails(N, B, Hq, BLOCK_M: gl.constexpr, PART_M: gl.constexpr, SPLIT_TAIL: gl.constexpr):
    """``(tails, n_m)``: the split tails (one per (batch, head) when a
    head's last query block holds one part of rows, else none) and the
    other query blocks per head. Without SPLIT_TAIL, none."""
    n_m = gl.cdiv(N, BLOCK_M)
    if SPLIT_TAIL:
        rest = N % BLOCK_M
        lone = ((rest > 0) & (rest <= PART_M)).to(gl.int32)
        return lone * (B * Hq), n_m - lone
    else:
        return n_m * 0, n_m


@gluon.jit
def _fwd_blocks(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT: gl.constexpr,
                HAS_WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                KeyTable, tab_off, HAS_TABLE: gl.constexpr, GROUP: gl.constexpr, WARPS: gl.constexpr):
    """A tile's key blocks as both partitions stream them: ``(lo, n_blocks,
    key_end)``, the band's blocks narrowed with HAS_TABLE to the keys the
    mask lets some row of the tile see. A tile that sees no key still
    streams block 0, all of it masked (``key_end = 0``), so that its rows
    get out 0 and lse +inf."""
    lo, hi = _key_range(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_M,
                        BLOCK_N)
    if HAS_TABLE:
        r_lo, r_hi, f_lo, f_hi = _table_reduce(KeyTable, tab_off, m0, N, BLOCK_M // GROUP, GROUP, KEY_ENTRY, WARPS)
        lo = gl.maximum(lo, (gl.minimum(r_lo, M) // BLOCK_N) * BLOCK_N)
        hi = gl.minimum(hi, r_hi)
    n_blocks = gl.cdiv(hi - lo, BLOCK_N)
    none_visible = n_blocks <= 0
    key_end = gl.where(none_visible, 0, M)
    lo = gl.where(none_visible, 0, lo)
    return lo, gl.maximum(n_blocks, 1), key_end


@gluon.jit
def _load_ring_pair(a_desc, b_desc, a_smem, b_smem, a_ready, a_empty, b_ready, b_empty, g, b, h, row,
                    ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Rows ``row .. row + ROWS - 1`` of ``(b, h)`` from the two streamed
    operands (K and V in the forward, q and dO in the backward) into the
    ring slot of the program's ``g``-th block, each once both consumers
    have released that slot."""
    slot = g % STAGES
    phase = ((g // STAGES) & 1) ^ 1  # a fresh barrier's previous phase counts as done
    nbytes: gl.constexpr = ROWS * HEAD_DIM * 2
    mbarrier.wait(a_empty.index(slot), phase)
    mbarrier.expect(a_ready.index(slot), nbytes)
    tma.async_copy_global_to_shared(a_desc, [b, h, row, 0], a_ready.index(slot),
                                    a_smem.index(slot).reshape([1, 1, ROWS, HEAD_DIM]))
    mbarrier.wait(b_empty.index(slot), phase)
    mbarrier.expect(b_ready.index(slot), nbytes)
    tma.async_copy_global_to_shared(b_desc, [b, h, row, 0], b_ready.index(slot),
                                    b_smem.index(slot).reshape([1, 1, ROWS, HEAD_DIM]))


@gluon.jit
def _consumer_scores(s, qk_scale, start_n, free_lo, free_hi, key_end, mask_base, r0, N, M, stride_mask_q,
                     stride_mask_k, MASK_KIND: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                     layout: gl.constexpr):
    """``(scores, multiplier)`` of a forward block for the online softmax,
    whose base-2 scores are ``scores * multiplier``: the raw products and
    ``qk_scale`` (scaled inside exp2's argument, one FMA per score), except
    in a block that reads the mask (one outside the rows' neutral keys
    ``[free_lo, free_hi)`` of a tile that sees some key: ``key_end`` > 0).
    There a bool mask hides scores as they are, and a float mask is added to
    the scaled scores (``_masked_scores``), the multiplier then 1. Scaling
    every block first, as this did until run 29, cost the masked kernel one
    more instruction per score in every block."""
    sc = qk_scale
    if MASK_KIND != 0:
        if ((start_n < free_lo) | (start_n + BLOCK_N > free_hi)) & (key_end > 0):
            if MASK_KIND == 2:
                s = s * qk_scale
            s = _masked_scores(s, mask_base, r0, start_n, N, M, stride_mask_q, stride_mask_k, MASK_KIND, ROWS,
                               BLOCK_N, layout)
            if MASK_KIND == 2:
                sc = 1.0
    return s, sc


@gluon.jit
def _fwd_load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                   v_empty, m0, h, b, hk, q_step, c, n_done, N, M, diag_off, window_left, window_right, KeyTable,
                   tab_off, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr, PART_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_TABLE: gl.constexpr,
                   GROUP: gl.constexpr, CONSUMERS: gl.constexpr):
    """One tile's loads: q part p from row ``m0 + p * q_step`` (each once
    its consumer has issued the last product that reads the previous
    tile's; ``q_step`` 0 gives every consumer the same rows), then the
    tile's K and V blocks into the ring from its ``c``-th slot use. Returns
    the number of blocks."""
    q_bytes: gl.constexpr = PART_M * HEAD_DIM * 2
    lo, n_blocks, key_end = _fwd_blocks(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT,
                                        HAS_WINDOW_RIGHT, CONSUMERS * PART_M, BLOCK_N, KeyTable, tab_off, HAS_TABLE,
                                        GROUP, 1)
    for part in gl.static_range(CONSUMERS):
        mbarrier.wait(q_empty.index(part), (n_done & 1) ^ 1)  # a fresh barrier's previous phase counts as done
        mbarrier.expect(q_ready.index(part), q_bytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + part * q_step, 0], q_ready.index(part),
                                        q_smem.index(part).reshape([1, 1, PART_M, HEAD_DIM]))
    for i in range(n_blocks):
        _load_ring_pair(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, c + i, b, hk,
                        lo + i * BLOCK_N, BLOCK_N, HEAD_DIM, STAGES)
    return n_blocks


@gluon.jit
def _fwd_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                B, Hq, Hkv, N, M, n_tiles, diag_off, window_left, window_right, KeyTable, stride_tab_b,
                stride_tab_h, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr, PART_M: gl.constexpr,
                BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_TABLE: gl.constexpr,
                GROUP: gl.constexpr, CONSUMERS: gl.constexpr, SPLIT_TAIL: gl.constexpr):
    """The copy warp: for each of the program's tiles, q's CONSUMERS parts of
    PART_M rows, then the tile's K and V blocks into the ring of slots,
    whose counter runs on across tiles. Split tails last (every part the
    same rows; ``_fwd_tail_part``)."""
    BLOCK_M: gl.constexpr = CONSUMERS * PART_M
    tails, n_m = _fwd_tails(N, B, Hq, BLOCK_M, PART_M, SPLIT_TAIL)
    full_rounds = _program_rounds(n_tiles - tails)
    c = 0
    n_done = 0
    for r in range(full_rounds):
        m0, h, b = _fwd_tile(r, n_m, Hq, BLOCK_M)
        tab_off = b.to(gl.int64) * stride_tab_b + h.to(gl.int64) * stride_tab_h
        c += _fwd_load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                            v_ready, v_empty, m0, h, b, h // (Hq // Hkv), PART_M, c, n_done, N, M, diag_off,
                            window_left, window_right, KeyTable, tab_off, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M,
                            BLOCK_N, HEAD_DIM, STAGES, HAS_TABLE, GROUP, CONSUMERS)
        n_done += 1
    if SPLIT_TAIL:
        for r in range(full_rounds, _program_rounds(n_tiles)):
            m0, h, b = _fwd_tail_tile(r, n_tiles - tails, n_m + 1, Hq, BLOCK_M)
            c += _fwd_load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                                v_ready, v_empty, m0, h, b, h // (Hq // Hkv), 0, c, n_done, N, M, diag_off,
                                window_left, window_right, KeyTable, 0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M,
                                BLOCK_N, HEAD_DIM, STAGES, False, GROUP, CONSUMERS)
            n_done += 1


@gluon.jit
def _fwd_step(j, c, lo, p, m_i, l_i, acc, q_part, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, zero_s, r0,
              key_end, full_end, right_edge, left_edge, diag_off, window_left, window_right, qk_scale, free_lo,
              free_hi, mask_base, N, M, stride_mask_q, stride_mask_k, HAS_WINDOW_LEFT: gl.constexpr,
              HAS_WINDOW_RIGHT: gl.constexpr, PART_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              MASK_KIND: gl.constexpr, ROW_MAX_FOLDS: gl.constexpr, EXP_POLY: gl.constexpr,
              s_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr):
    """Block ``j`` (from 1) of a consumer's tile: S_j = q·K_jᵀ issued with
    O += P_{j-1}·V_{j-1}, the softmax of S_j while the second runs, then the
    rescaled accumulator. ``MASK_KIND`` 0 for blocks known to need no mask
    (those of unmasked calls, and a masked call's blocks inside its rows'
    neutral keys)."""
    slot = (c + j) % STAGES
    prev = (c + j - 1) % STAGES
    start_n = lo + j * BLOCK_N
    mbarrier.wait(k_ready.index(slot), ((c + j) // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((c + j - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(q_part.dtype), p_layout)
    s_tok = warpgroup_mma(q_part, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(slot))
    s = _mask_if_crossing(s, start_n, r0, key_end, full_end, right_edge, left_edge, diag_off, window_left,
                          window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, s_layout)
    s, sc = _consumer_scores(s, qk_scale, start_n, free_lo, free_hi, key_end, mask_base, r0, N, M, stride_mask_q,
                             stride_mask_k, MASK_KIND, PART_M, BLOCK_N, s_layout)
    m_new = gl.maximum(m_i, _row_max(s, ROW_MAX_FOLDS, s_layout) * sc)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = _exp2(s * sc - gl.expand_dims(m_use, 1), EXP_POLY)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
    mbarrier.arrive(v_empty.index(prev))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    return p, m_new, l_i, acc


@gluon.jit
def _normalized(acc, l_i, m_i, row_o: gl.constexpr):
    """``(out, lse, l, m)`` of a part's rows from its accumulator, running
    sum and base-2 running max: a row that saw no key gets 0 and lse +inf;
    l and m come back in the output's row layout."""
    l_o = gl.convert_layout(l_i, row_o)
    m_o = gl.convert_layout(m_i, row_o)
    empty = l_o == 0.0
    inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_o))
    out = acc * gl.expand_dims(inv_l, 1)
    lse = gl.where(empty, float("inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) * 0.6931471805599453)
    return out, lse, l_o, m_o


@gluon.jit
def _store_part(out, lse, o_part, o_desc, Lse, b, h, r0, Hq, N, PART_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                row_o: gl.constexpr):
    """Rows ``r0 .. r0 + PART_M - 1`` of (b, h): their lse, and their
    output through the part's staging tile ``o_part`` by the copy engine."""
    rows = r0 + gl.arange(0, PART_M, layout=row_o)
    gl.store(Lse + ((b.to(gl.int64) * Hq + h) * N + rows), lse, mask=rows < N)
    # The previous tile's output has left o_part: the issuing thread
    # waits for its store, the barrier holds the others until it has.
    tma.store_wait(0)
    gl.thread_barrier()
    o_part.store(out.to(o_part.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [b, h, r0, 0], o_part.reshape([1, 1, PART_M, HEAD_DIM]))


@gluon.jit
def _fwd_tail_part(i_tail, m0, h, b, c, n_done, o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty,
                   k_ready, k_empty, v_ready, v_empty, part_acc, part_m, part_l, merge_ready, merge_free, Hq, N, M,
                   qk_scale, diag_off, window_left, window_right, PART: gl.constexpr, HAS_WINDOW_LEFT: gl.constexpr,
                   HAS_WINDOW_RIGHT: gl.constexpr, PART_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, ROW_MAX_FOLDS: gl.constexpr,
                   EXP_POLY: gl.constexpr, CONSUMERS: gl.constexpr, s_layout: gl.constexpr,
                   o_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr):
    """Consumer PART's share of a split tail: a head's last query block
    when it holds one part of rows (``_fwd_tails``). Every consumer has
    those rows' q, and consumer p takes the tile's key blocks p, p +
    CONSUMERS, ...: run as a normal tile, two of the three would compute
    on rows past N, and the tile would cost about as much as a full one
    (bench/NOTES.md run 42). A block it does not take it only releases,
    once loaded (an empty barrier counts every consumer's release of each
    load). Its own blocks are not pipelined (the product with V waits for
    the softmax): V's slot is then free at the end of the block, so the
    copy warp, which loads in order, never waits three blocks for it.
    Consumers 1 and 2 then hand their running max, sum and accumulator to
    consumer 0 through shared memory, which merges them and stores the
    rows. Returns the K/V slot uses of the tile."""
    dtype: gl.constexpr = q_smem.dtype
    BLOCK_M: gl.constexpr = CONSUMERS * PART_M
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    lo, n_blocks, key_end = _fwd_blocks(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT,
                                        HAS_WINDOW_RIGHT, BLOCK_M, BLOCK_N, Lse, 0, False, GROUP, 4)
    last_row = gl.minimum(m0 + PART_M, N) - 1
    full_end = key_end - BLOCK_N
    right_edge = m0 + diag_off + window_right - BLOCK_N + 1
    left_edge = last_row + diag_off - window_left
    q_part = q_smem.index(PART)
    zero_s = gl.zeros([PART_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([PART_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([PART_M], gl.float32, row_s)
    acc = gl.zeros([PART_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_ready.index(PART), n_done & 1)
    for j in range(n_blocks):
        slot = (c + j) % STAGES
        phase = ((c + j) // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        if j % CONSUMERS == PART:
            s_tok = warpgroup_mma(q_part, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(slot))
            s = _mask_if_crossing(s, lo + j * BLOCK_N, m0, key_end, full_end, right_edge, left_edge, diag_off,
                                  window_left, window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N,
                                  s_layout)
            m_new = gl.maximum(m_i, _row_max(s, ROW_MAX_FOLDS, s_layout) * qk_scale)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = _exp2(s * qk_scale - gl.expand_dims(m_use, 1), EXP_POLY)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(slot), phase)
            o_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(v_empty.index(slot))
        else:
            mbarrier.arrive(k_empty.index(slot))
            mbarrier.wait(v_ready.index(slot), phase)
            mbarrier.arrive(v_empty.index(slot))
    mbarrier.arrive(q_empty.index(PART))

    if PART != 0:
        # The previous tail's partials have been read (a fresh barrier's
        # previous phase counts as done).
        mbarrier.wait(merge_free, (i_tail & 1) ^ 1)
        part_acc.index(PART - 1).store(acc)
        part_m.index(PART - 1).store(m_i)
        part_l.index(PART - 1).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(merge_ready)
    else:
        mbarrier.wait(merge_ready, i_tail & 1)
        m_all = m_i
        for i in gl.static_range(CONSUMERS - 1):
            m_all = gl.maximum(m_all, part_m.index(i).load(row_s))
        m_use = gl.where(m_all == float("-inf"), 0.0, m_all)
        w = gl.exp2(m_i - m_use)
        l_all = l_i * w
        acc = acc * gl.expand_dims(gl.convert_layout(w, row_o), 1)
        for i in gl.static_range(CONSUMERS - 1):
            w = gl.exp2(part_m.index(i).load(row_s) - m_use)
            l_all += part_l.index(i).load(row_s) * w
            acc += part_acc.index(i).load(o_layout) * gl.expand_dims(gl.convert_layout(w, row_o), 1)
        gl.thread_barrier()
        mbarrier.arrive(merge_free)

        out, lse, l_o, m_o = _normalized(acc, l_all, m_all, row_o)
        _store_part(out, lse, o_smem.index(0), o_desc, Lse, b, h, m0, Hq, N, PART_M, HEAD_DIM, row_o)
    return n_blocks


@gluon.jit
def _fwd_consumer(o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  part_acc, part_m, part_l, merge_ready, merge_free,
                  B, Hq, N, M, n_tiles, qk_scale, diag_off, window_left, window_right,
                  Mask, KeyTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_tab_b,
                  stride_tab_h,
                  PART: gl.constexpr, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
                  PART_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  MASK_KIND: gl.constexpr, GROUP: gl.constexpr, ROW_MAX_FOLDS: gl.constexpr,
                  EXP_POLY: gl.constexpr, SPLIT_RUNS: gl.constexpr, CONSUMERS: gl.constexpr,
                  SPLIT_TAIL: gl.constexpr):
    """One warp group: part PART of each of the program's tiles, its rows
    PART * PART_M .. (PART + 1) * PART_M - 1 (64 of the CONSUMERS * 64), the
    whole online softmax for them. Iteration j issues S_j = q·K_jᵀ and
    O += P_{j-1}·V_{j-1} together and computes the softmax of S_j while the
    tensor cores work on the second. The groups never wait for each
    other (taking turns to issue, FlashAttention-3's ping-pong, measured
    slower: runs 19 and 24). The output is staged in this group's own tile
    of ``o_smem``, so the next tile's q may load while it is stored."""
    dtype: gl.constexpr = q_smem.dtype
    BLOCK_M: gl.constexpr = CONSUMERS * PART_M
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_part = q_smem.index(PART)
    o_part = o_smem.index(PART)
    zero_s = gl.zeros([PART_M, BLOCK_N], gl.float32, s_layout)
    # c: K/V blocks consumed before this tile; n_done: tiles before it.
    tails, n_m = _fwd_tails(N, B, Hq, BLOCK_M, PART_M, SPLIT_TAIL)
    full_rounds = _program_rounds(n_tiles - tails)
    c = 0
    n_done = 0
    for r in range(full_rounds):
        m0, h, b = _fwd_tile(r, n_m, Hq, BLOCK_M)
        tab_off = b.to(gl.int64) * stride_tab_b + h.to(gl.int64) * stride_tab_h
        lo, n_blocks, key_end = _fwd_blocks(m0, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT,
                                            HAS_WINDOW_RIGHT, BLOCK_M, BLOCK_N, KeyTable, tab_off, MASK_KIND != 0,
                                            GROUP, 4)
        r0 = m0 + PART * PART_M
        last_row = gl.minimum(r0 + PART_M, N) - 1
        full_end = key_end - BLOCK_N
        right_edge = r0 + diag_off + window_right - BLOCK_N + 1
        left_edge = last_row + diag_off - window_left
        if MASK_KIND != 0:
            # The blocks this group's rows all see as neutral.
            unused_lo, unused_hi, f_lo, f_hi = _table_reduce(KeyTable, tab_off, r0, N, PART_M // GROUP, GROUP, KEY_ENTRY,
                                                             4)
            free_lo, free_hi = _free_blocks(f_lo, f_hi, BLOCK_N)
            mask_base = Mask + b.to(gl.int64) * stride_mask_b + h.to(gl.int64) * stride_mask_h
        else:
            free_lo = 0
            free_hi = 0
            mask_base = Mask

        slot = c % STAGES
        mbarrier.wait(q_ready.index(PART), n_done & 1)
        mbarrier.wait(k_ready.index(slot), (c // STAGES) & 1)
        s_tok = warpgroup_mma(q_part, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot))
        s = _mask_if_crossing(s, lo, r0, key_end, full_end, right_edge, left_edge, diag_off, window_left,
                              window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, s_layout)
        s, sc = _consumer_scores(s, qk_scale, lo, free_lo, free_hi, key_end, mask_base, r0, N, M, stride_mask_q,
                                 stride_mask_k, MASK_KIND, PART_M, BLOCK_N, s_layout)
        m_i = _row_max(s, ROW_MAX_FOLDS, s_layout) * sc
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = _exp2(s * sc - gl.expand_dims(m_use, 1), EXP_POLY)
        l_i = gl.sum(p, axis=1)
        acc = gl.zeros([PART_M, HEAD_DIM], gl.float32, o_layout)

        # The tile's blocks in three runs: before the rows' neutral keys,
        # inside them ([j_a, j_b), run with the unmasked body: the mask code
        # stays out of the hot loop's code and registers) and after. An
        # unmasked call has the one run, and so has a masked one without
        # SPLIT_RUNS: each block then branches on whether it reads the mask.
        for run in gl.static_range(1 if MASK_KIND == 0 or not SPLIT_RUNS else 3):
            if MASK_KIND == 0 or not SPLIT_RUNS:
                j_lo = 1
                j_hi = n_blocks
            else:
                j_a = gl.minimum(gl.maximum(gl.cdiv(free_lo - lo, BLOCK_N), 1), n_blocks)
                j_b = gl.minimum(gl.maximum((free_hi - lo) // BLOCK_N, j_a), n_blocks)
                if run == 0:
                    j_lo = 1
                    j_hi = j_a
                elif run == 1:
                    j_lo = j_a
                    j_hi = j_b
                else:
                    j_lo = j_b
                    j_hi = n_blocks
            for j in range(j_lo, j_hi):
                p, m_i, l_i, acc = _fwd_step(j, c, lo, p, m_i, l_i, acc, q_part, k_smem, v_smem, k_ready, k_empty,
                                             v_ready, v_empty, zero_s, r0, key_end, full_end, right_edge, left_edge,
                                             diag_off, window_left, window_right, qk_scale, free_lo, free_hi,
                                             mask_base, N, M, stride_mask_q, stride_mask_k, HAS_WINDOW_LEFT,
                                             HAS_WINDOW_RIGHT, PART_M, BLOCK_N, STAGES,
                                             MASK_KIND * (run != 1 or not SPLIT_RUNS), ROW_MAX_FOLDS, EXP_POLY,
                                             s_layout, p_layout, row_o)
        # Every product that reads this tile's q has finished: the next tile's may load.
        mbarrier.arrive(q_empty.index(PART))

        last = (c + n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((c + n_blocks - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(v_empty.index(last))
        c += n_blocks
        n_done += 1

        out, lse, l_o, m_o = _normalized(acc, l_i, m_i, row_o)
        if MASK_KIND == 2:
            # Rows a finite mask value hides entirely: the marker holding l
            # (m + log2(l) would round to m).
            marked = (m_o <= AVERAGE_AT_BASE2) & (l_o > 0.0)
            lse = gl.where(marked, -FLT_MAX + gl.minimum(l_o, LSE_MARK_MAX_KEYS) * LSE_MARK_UNIT, lse)
        m0, h, b = _fwd_tile(r, n_m, Hq, BLOCK_M)  # recomputed: fewer registers live across the loop
        _store_part(out, lse, o_part, o_desc, Lse, b, h, m0 + PART * PART_M, Hq, N, PART_M, HEAD_DIM, row_o)
    if SPLIT_TAIL:
        for r in range(full_rounds, _program_rounds(n_tiles)):
            m0, h, b = _fwd_tail_tile(r, n_tiles - tails, n_m + 1, Hq, BLOCK_M)
            c += _fwd_tail_part(r - full_rounds, m0, h, b, c, n_done, o_desc, Lse, q_smem, o_smem, k_smem, v_smem,
                                q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, part_acc, part_m, part_l,
                                merge_ready, merge_free, Hq, N, M, qk_scale, diag_off, window_left, window_right, PART,
                                HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM, STAGES, GROUP,
                                ROW_MAX_FOLDS, EXP_POLY, CONSUMERS, s_layout, o_layout, p_layout, row_o)
            n_done += 1
    tma.store_wait(0)


@gluon.jit
def _heads_4d(base, B, H, rows, stride_b, stride_h, stride_row, BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
              layout: gl.constexpr):
    """A descriptor over a whole (B, H, rows, HEAD_DIM) tensor, copied
    [1, 1, BLOCK_ROWS, HEAD_DIM] at a time: the copy engine clips at each
    head's ``rows``, and one descriptor serves every tile of a program."""
    return tma.make_tensor_descriptor(base, shape=[B, H, rows, HEAD_DIM], strides=[stride_b, stride_h, stride_row, 1],
                                      block_shape=[1, 1, BLOCK_ROWS, HEAD_DIM], layout=layout)


@gluon.jit
def _hopper_attn_fwd(
    Q, K, V, Out, Lse, Mask, KeyTable,
    stride_q_b, stride_q_h, stride_q_n,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_o_b, stride_o_h, stride_o_n,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
    stride_tab_b, stride_tab_h,
    B, Hq, Hkv, N, M,
    qk_scale, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    MASK_KIND: gl.constexpr, GROUP: gl.constexpr, ROW_MAX_FOLDS: gl.constexpr, EXP_POLY: gl.constexpr,
    SPLIT_RUNS: gl.constexpr, CONSUMERS: gl.constexpr, SPLIT_TAIL: gl.constexpr, num_warps: gl.constexpr,
):
    """The forward over tiles of BLOCK_M query rows of one (batch, head),
    P programs taking one tile per round (``_fwd_tile``): one program per
    tile when P is the tile count, a persistent grid when P is at most the
    SM count (the launcher's plan). With a mask (MASK_KIND 1 bool as bytes,
    2 float; read through its (B, Hq, N, M) strides, 0 where it broadcasts)
    ``KeyTable`` is its key table (``mask_ranges``, one entry per GROUP
    rows, strides 0 where it broadcasts); without, both are unread.
    CONSUMERS (2 or 3) consumer warp groups take 64 rows of a tile each
    (BLOCK_M = 64 * CONSUMERS); three only without a mask (the tables'
    row groups assume a power-of-two tile). With SPLIT_TAIL (three
    consumers, no mask) a head's last query block, when it holds one part
    of rows, runs as a split tail (``_fwd_tail_part``) after the others."""
    dtype: gl.constexpr = Q.dtype.element_ty
    PART_M: gl.constexpr = BLOCK_M // CONSUMERS
    n_tiles = gl.cdiv(N, BLOCK_M) * Hq * B
    q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PART_M, HEAD_DIM], dtype)
    kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, PART_M, HEAD_DIM], dtype)
    kv4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, HEAD_DIM], dtype)
    q_desc = _heads_4d(Q, B, Hq, N, stride_q_b, stride_q_h, stride_q_n, PART_M, HEAD_DIM, q4_layout)
    k_desc = _heads_4d(K, B, Hkv, M, stride_k_b, stride_k_h, stride_k_n, BLOCK_N, HEAD_DIM, kv4_layout)
    v_desc = _heads_4d(V, B, Hkv, M, stride_v_b, stride_v_h, stride_v_n, BLOCK_N, HEAD_DIM, kv4_layout)
    o_desc = _heads_4d(Out, B, Hq, N, stride_o_b, stride_o_h, stride_o_n, PART_M, HEAD_DIM, q4_layout)

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, PART_M, HEAD_DIM], q2_layout)
    o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, PART_M, HEAD_DIM], q2_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv2_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv2_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    unused, k_ready, k_empty, v_ready, v_empty = _stream_barriers(STAGES, CONSUMERS)
    # A split tail's partials, handed from consumers 1 and 2 to consumer 0
    # (a token allocation without SPLIT_TAIL: at D = 128 the shared memory
    # has no 33 KiB to spare).
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    acc_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    if SPLIT_TAIL:
        part_acc = gl.allocate_shared_memory(gl.float32, [CONSUMERS - 1, PART_M, HEAD_DIM], acc_layout)
        part_m = gl.allocate_shared_memory(gl.float32, [CONSUMERS - 1, PART_M], stat_layout)
        part_l = gl.allocate_shared_memory(gl.float32, [CONSUMERS - 1, PART_M], stat_layout)
    else:
        part_acc = gl.allocate_shared_memory(gl.float32, [1, 1, 16], acc_layout)
        part_m = gl.allocate_shared_memory(gl.float32, [1, 16], stat_layout)
        part_l = gl.allocate_shared_memory(gl.float32, [1, 16], stat_layout)
    merge_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    merge_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(merge_ready, count=CONSUMERS - 1)
    mbarrier.init(merge_free, count=1)

    # The consumers' argument lists differ only in PART but are written out
    # in full, and so are the two partition lists, which differ only in the
    # third consumer: in Gluon 3.6 an argument tuple kept in a local, or
    # built once and concatenated ((PART, ) + rest), reaches the partition
    # with its constexprs turned into tensors, and a (function, arguments)
    # pair cannot be kept in a local at all (a JIT function is no tensor);
    # both tried, neither compiles.
    if CONSUMERS == 3:
        # 16 warps at launch, 128 registers each (the launcher's maxnreg);
        # the copy warp's group gives up all but 24, the three consumers
        # share the rest.
        gl.warp_specialize([
            (_fwd_consumer, (o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, part_acc, part_m, part_l, merge_ready, merge_free, B, Hq, N, M, n_tiles, qk_scale,
                             diag_off, window_left, window_right,
                             Mask, KeyTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_tab_b,
                             stride_tab_h, 0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM, STAGES,
                             MASK_KIND, GROUP, ROW_MAX_FOLDS, EXP_POLY, SPLIT_RUNS, CONSUMERS, SPLIT_TAIL)),
            (_fwd_consumer, (o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, part_acc, part_m, part_l, merge_ready, merge_free, B, Hq, N, M, n_tiles, qk_scale,
                             diag_off, window_left, window_right,
                             Mask, KeyTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_tab_b,
                             stride_tab_h, 1, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM, STAGES,
                             MASK_KIND, GROUP, ROW_MAX_FOLDS, EXP_POLY, SPLIT_RUNS, CONSUMERS, SPLIT_TAIL)),
            (_fwd_consumer, (o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, part_acc, part_m, part_l, merge_ready, merge_free, B, Hq, N, M, n_tiles, qk_scale,
                             diag_off, window_left, window_right,
                             Mask, KeyTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_tab_b,
                             stride_tab_h, 2, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM, STAGES,
                             MASK_KIND, GROUP, ROW_MAX_FOLDS, EXP_POLY, SPLIT_RUNS, CONSUMERS, SPLIT_TAIL)),
            (_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                           v_empty, B, Hq, Hkv, N, M, n_tiles, diag_off, window_left, window_right, KeyTable,
                           stride_tab_b, stride_tab_h, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM,
                           STAGES, MASK_KIND != 0, GROUP, CONSUMERS, SPLIT_TAIL)),
        ], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([
            (_fwd_consumer, (o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, part_acc, part_m, part_l, merge_ready, merge_free, B, Hq, N, M, n_tiles, qk_scale,
                             diag_off, window_left, window_right,
                             Mask, KeyTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_tab_b,
                             stride_tab_h, 0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM, STAGES,
                             MASK_KIND, GROUP, ROW_MAX_FOLDS, EXP_POLY, SPLIT_RUNS, CONSUMERS, SPLIT_TAIL)),
            (_fwd_consumer, (o_desc, Lse, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                             v_empty, part_acc, part_m, part_l, merge_ready, merge_free, B, Hq, N, M, n_tiles, qk_scale,
                             diag_off, window_left, window_right,
                             Mask, KeyTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_tab_b,
                             stride_tab_h, 1, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM, STAGES,
                             MASK_KIND, GROUP, ROW_MAX_FOLDS, EXP_POLY, SPLIT_RUNS, CONSUMERS, SPLIT_TAIL)),
            (_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                           v_empty, B, Hq, Hkv, N, M, n_tiles, diag_off, window_left, window_right, KeyTable,
                           stride_tab_b, stride_tab_h, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, PART_M, BLOCK_N, HEAD_DIM,
                           STAGES, MASK_KIND != 0, GROUP, CONSUMERS, SPLIT_TAIL)),
        ], [4, 1], [240, 24])


# The backward kernels (taken by the op's backward where
# hopper.backward_refusal says so): dK/dV per 128-key tile, its two consumer warp
# groups 64 keys each, looping over the group's query heads and the query
# blocks of the band; dQ per 128-query tile, as the forward streams K and V.
# Both deterministic (no atomics), the lse and delta the portable backward
# reads.


@gluon.jit
def _query_range(n0, N, G, diag_off, window_left, window_right, HAS_WINDOW_LEFT: gl.constexpr,
                 HAS_WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The query blocks a dK/dV program streams for keys ``n0 .. n0 +
    BLOCK_N - 1``: ``(lo_m, n_m, n_iters)``, the first row (rounded down to
    a block), the blocks per query head (at least 1: a divisor) and the
    iterations over the G heads of the group (0 when no row sees a key)."""
    lo_m = 0
    hi_m = N
    if HAS_WINDOW_RIGHT:
        lo_m = gl.maximum(n0 - diag_off - window_right, 0)
        lo_m = (lo_m // BLOCK_M) * BLOCK_M
    if HAS_WINDOW_LEFT:
        hi_m = gl.minimum(hi_m, n0 + BLOCK_N - diag_off + window_left)
    n_m = gl.cdiv(gl.maximum(hi_m - lo_m, 0), BLOCK_M)
    n_iters = G * n_m
    return lo_m, gl.maximum(n_m, 1), n_iters


@gluon.jit
def _mask_transposed_if_crossing(st, m0, kj, right_from, left_to, past_end, M, diag_off, window_left,
                                 window_right, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
                                 HIDES_PAST_END: gl.constexpr, BLOCK_M: gl.constexpr, col: gl.constexpr):
    """Transposed scores (keys ``kj`` by queries ``m0 .. m0 + BLOCK_M - 1``,
    their indices made here in the columns' layout ``col``: only crossing
    blocks need them, and a 128-row block's are 32 registers) set to -inf outside
    the band, only for a query block starting at ``m0`` that crosses an edge
    of it (``right_from`` / ``left_to``: the block starts between which every
    row sees all of this consumer's keys). With HIDES_PAST_END also at keys
    from ``M`` on, in every block of a consumer that holds some
    (``past_end``). Those keys are the copy engine's zero fill: their score
    0 would otherwise give exp2(-lse), which overflows to inf for a row
    whose lse lies below -88, and inf times the zero keys is NaN in dQ."""
    need = False
    if HIDES_PAST_END:
        need = past_end
    if HAS_WINDOW_RIGHT:
        need = need | (m0 < right_from)
    if HAS_WINDOW_LEFT:
        need = need | (m0 > left_to)
    if need:
        i2 = gl.expand_dims(m0 + gl.arange(0, BLOCK_M, layout=col), 0)
        if HIDES_PAST_END:
            vis = (kj < M) & (i2 >= 0)
        else:
            vis = (kj >= 0) & (i2 >= 0)
        if HAS_WINDOW_RIGHT:
            vis = vis & (kj <= i2 + diag_off + window_right)
        if HAS_WINDOW_LEFT:
            vis = vis & (kj >= i2 + diag_off - window_left)
        st = gl.where(vis, st, float("-inf"))
    return st


@gluon.jit
def _dkdv_descriptors(Q, K, V, DO, DK, DV, b64, hk, stride_q_b, stride_q_h, stride_q_n, stride_k_b, stride_k_h,
                      stride_k_n, stride_v_b, stride_v_h, stride_v_n, stride_do_b, stride_do_h, stride_do_n,
                      stride_dk_b, stride_dk_h, stride_dk_n, stride_dv_b, stride_dv_h, stride_dv_n, Hq, N, M,
                      BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The dK/dV kernels' descriptors for batch ``b64`` and key/value head
    ``hk``: q and dO over the batch's stacked query heads (``BLOCK_M``-row
    blocks), K, V, dK and dV over the head's keys (``HALF_N``-row halves)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    qo3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, HEAD_DIM], dtype)
    q_desc = _stacked_heads(Q, b64, stride_q_b, stride_q_h, stride_q_n, Hq, N, BLOCK_M, HEAD_DIM, HEAD_DIM,
                            qo3_layout)
    do_desc = _stacked_heads(DO, b64, stride_do_b, stride_do_h, stride_do_n, Hq, N, BLOCK_M, HEAD_DIM, HEAD_DIM,
                             qo3_layout)
    k_desc = _head_matrix(K, b64, hk, stride_k_b, stride_k_h, stride_k_n, M, HALF_N, HEAD_DIM, kv_layout)
    v_desc = _head_matrix(V, b64, hk, stride_v_b, stride_v_h, stride_v_n, M, HALF_N, HEAD_DIM, kv_layout)
    dk_desc = _head_matrix(DK, b64, hk, stride_dk_b, stride_dk_h, stride_dk_n, M, HALF_N, HEAD_DIM, kv_layout)
    dv_desc = _head_matrix(DV, b64, hk, stride_dv_b, stride_dv_h, stride_dv_n, M, HALF_N, HEAD_DIM, kv_layout)
    return q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc


@gluon.jit
def _dkdv_buffers(dtype: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr):
    """The dK/dV kernels' slots for the q and dO blocks that stream and the
    K and V halves held for the whole tile."""
    qo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qo_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qo_layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, HEAD_DIM], kv_layout)
    return q_smem, do_smem, k_smem, v_smem


@gluon.jit
def _store_dkdv(dk, dv, scale, k_half, v_half, dk_desc, dv_desc, j0):
    """A consumer's dK (times ``scale``) and dV out through its K and V
    halves in shared memory, which the loop no longer reads."""
    dtype: gl.constexpr = k_half.dtype
    k_half.store((dk * scale).to(dtype))
    v_half.store(dv.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [j0, 0], k_half)
    tma.async_copy_shared_to_global(dv_desc, [j0, 0], v_half)
    tma.store_wait(0)


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
        # Keys past the end stay as they are here: their dK and dV rows are
        # not stored, and this kernel forms no dQ.
        st = _mask_transposed_if_crossing(st, m0, kj, right_from, left_to, False, 0, diag_off, window_left,
                                          window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, False, BLOCK_M, col)
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
    _store_dkdv(dk, dv, scale, k_half, v_half, dk_desc, dv_desc, j0)


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
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc = _dkdv_descriptors(
        Q, K, V, DO, DK, DV, b64, hk, stride_q_b, stride_q_h, stride_q_n, stride_k_b, stride_k_h, stride_k_n,
        stride_v_b, stride_v_h, stride_v_n, stride_do_b, stride_do_h, stride_do_n, stride_dk_b, stride_dk_h,
        stride_dk_n, stride_dv_b, stride_dv_h, stride_dv_n, Hq, N, M, BLOCK_M, HALF_N, HEAD_DIM)

    lo_m, n_m, n_iters = _query_range(n0, N, G, diag_off, window_left, window_right, HAS_WINDOW_LEFT,
                                      HAS_WINDOW_RIGHT, BLOCK_M, BLOCK_N)

    q_smem, do_smem, k_smem, v_smem = _dkdv_buffers(dtype, STAGES, BLOCK_M, HALF_N, HEAD_DIM)
    kv_bar, q_ready, q_empty, do_ready, do_empty = _stream_barriers(STAGES, 2)
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
    qdo_bar, k_ready, k_empty, v_ready, v_empty = _stream_barriers(STAGES, 2)
    stat_base = b64 * stride_stat_b + h.to(gl.int64) * stride_stat_h
    gl.warp_specialize([
        (_dq_consumer, (dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, k_empty, v_ready,
                        v_empty, stat_base, N, M, m0, lo, n_blocks, qk_scale, scale, diag_off, window_left,
                        window_right, 0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
        (_dq_consumer, (dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, k_empty, v_ready,
                        v_empty, stat_base, N, M, m0, lo, n_blocks, qk_scale, scale, diag_off, window_left,
                        window_right, 1, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
        (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, k_empty,
                      v_ready, v_empty, m0, lo, n_blocks, HALF_M, BLOCK_N, HEAD_DIM, STAGES)),
    ], [4, 1], [240, 24])


# The fused backward (taken unless deterministic algorithms are asked for):
# the dK/dV kernel's schedule, plus dQ from the same dS, added into a
# zeroed float32 (B, Hq, N, D) buffer that a convert kernel (hopper.py)
# then scales and rounds into dq. 5 products per (query block, key block)
# instead of 7. How the two consumers share the dQ product: each stores its
# dSᵀ half (64 keys x 64 queries, in dtype) to shared memory, and after an
# mbarrier handshake each computes dQ for half of the head dim over all 128
# keys, dQ[:, cols] = dS · K[:, cols], as two products of 64 keys, reading
# both dSᵀ halves transposed. Against each consumer forming dQ over its own
# 64 keys for the full head dim: the same products, but every dQ element is
# added to global memory once instead of twice (the adds are the cost that
# made the portable one-pass schedule lose, backward.py), the accumulator
# is [64, D/2] (32 registers a thread at D = 128 instead of 64, on top of
# dK and dV), and nothing is combined through shared memory in float32.
# Storing dSᵀ also lets dK read it from shared memory, so the register
# copy of dSᵀ as an operand goes.


@_gluon_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord:] += src`` by the copy engine (``cp.reduce.async.bulk``),
    out-of-bounds rows dropped; completes like a TMA store (``store_wait``).
    Gluon 3.6 has the op in its builder but no wrapper for it."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _prefetch_stats(Shift, Delta, Cap, stat_smem, head, m0, valid, stat_b, stride_stat_h, BLOCK_M: gl.constexpr,
                    CAPS: gl.constexpr):
    """Shift and delta (with ``CAPS`` also the cap) of query head ``head``'s
    rows ``m0 .. m0 + BLOCK_M - 1`` into ``stat_smem`` (``_stat_width``
    elements: shift, delta, cap), by ``cp.async``; nothing when ``valid``
    is false (the copy issued past a tile's last iteration). The rows are
    ``hopper.fused_row_inputs``', padded past N with shift +inf and delta
    0, so a block reaching past N needs no row test here or in the loop."""
    WIDTH: gl.constexpr = _stat_width(BLOCK_M, CAPS)
    gl.static_assert(WIDTH % 128 == 0, "one or more elements per copying thread")
    cp_layout: gl.constexpr = gl.BlockedLayout([WIDTH // 128], [32], [4], [0])
    idx = gl.arange(0, WIDTH, layout=cp_layout)
    part = idx // BLOCK_M  # 0 shift, 1 delta, 2 cap (3: none, the width's rounding)
    off = stat_b + head.to(gl.int64) * stride_stat_h + m0 + (idx - part * BLOCK_M)
    ptrs = gl.where(part == 0, Shift + off, gl.where(part == 1, Delta + off, Cap + off))
    async_copy.async_copy_global_to_shared(stat_smem, ptrs, mask=(part < 3) & valid)
    async_copy.commit_group()


@gluon.constexpr_function
def _stat_width(BLOCK_M, CAPS):
    """Elements of one ``stat_smem`` buffer: shift and delta, with ``CAPS``
    the cap too, rounded up to a multiple of the 128 copying threads."""
    return (4 if CAPS else 2) * BLOCK_M


@gluon.jit
def _row_caps(stats, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """Per query row, the most a recomputed probability may be under a
    float mask (``fused_row_inputs``' cap: 1 / l for a row whose lse marks
    it as averaging l keys hidden by a finite value, 1 for the others),
    from the iteration's ``stat_smem`` buffer; read only in blocks that
    read the mask, where such rows can be."""
    return stats.slice(2 * BLOCK_M, BLOCK_M).load(layout)


@gluon.jit
def _bwd_tile(r, n_n, G, Hkv, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT: gl.constexpr,
              HAS_WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              QueryTable, stride_qtab_b, stride_qtab_h, HAS_TABLE: gl.constexpr, COL_GROUP: gl.constexpr,
              WARPS: gl.constexpr):
    """The key tile program p takes in its round ``r`` and the query blocks
    it streams: ``(n0, hk, b, h0, lo_m, n_m, n_iters)``, ``h0`` the first
    of the ``G`` query heads of key/value head ``hk``, the rest
    ``_query_range``'s. Tiles are handed out as
    ``_fwd_tile`` hands out query tiles, numbered with the key blocks of one
    (batch, key/value head) consecutive, first block first: tiles running
    together read the same q and dO from L2, and under a top-left causal
    band the first key blocks, seen by the most rows, start first."""
    t = _round_tile(r)
    bh = t // n_n
    n0, hk, b = (t % n_n) * BLOCK_N, bh % Hkv, bh // Hkv
    lo_m, n_m, n_iters = _query_range(n0, N, G, diag_off, window_left, window_right, HAS_WINDOW_LEFT,
                                      HAS_WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    if HAS_TABLE:
        # The band's query blocks narrowed to the rows the mask lets take
        # part for some key of the tile (the table of its first query head:
        # the launcher takes only masks alike for the group's heads).
        tab_off = b.to(gl.int64) * stride_qtab_b + (hk * G).to(gl.int64) * stride_qtab_h
        r_lo, r_hi, f_lo, f_hi = _table_reduce(QueryTable, tab_off, n0, M, BLOCK_N // COL_GROUP, COL_GROUP, QUERY_ENTRY,
                                               WARPS)
        hi_m = gl.minimum(lo_m + (n_iters // G) * BLOCK_M, r_hi)
        lo_m = gl.maximum(lo_m, (gl.minimum(r_lo, N) // BLOCK_M) * BLOCK_M)
        blocks = gl.cdiv(gl.maximum(hi_m - lo_m, 0), BLOCK_M)
        n_m = gl.maximum(blocks, 1)
        n_iters = G * blocks
    return n0, hk, b, hk * G, lo_m, n_m, n_iters


@gluon.jit
def _fused_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready,
                  q_empty, do_ready, do_empty, Hq, Hkv, N, M, n_n, n_tiles, diag_off, window_left, window_right,
                  QueryTable, stride_qtab_b, stride_qtab_h,
                  HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr, HALF_N: gl.constexpr,
                  BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HAS_TABLE: gl.constexpr,
                  COL_GROUP: gl.constexpr):
    """The copy warp of the fused backward: for each of the program's key
    tiles, the first q/dO blocks (as the previous tile's last iterations
    free their slots), then the tile's K and V halves (once both consumers
    have finished the previous tile's products), then the rest of the q/dO
    blocks. The slot counter runs on across tiles."""
    G = Hq // Hkv
    half_bytes: gl.constexpr = HALF_N * HEAD_DIM * 2
    c = 0
    n_done = 0
    for r in range(_program_rounds(n_tiles)):
        n0, hk, b, h0, lo_m, n_m, n_iters = _bwd_tile(r, n_n, G, Hkv, N, M, diag_off, window_left, window_right,
                                                      HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_M, 2 * HALF_N,
                                                      QueryTable, stride_qtab_b, stride_qtab_h, HAS_TABLE,
                                                      COL_GROUP, 1)
        n_first = gl.minimum(n_iters, STAGES)
        for i in range(n_first):
            _load_ring_pair(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, do_ready, do_empty, c + i, b,
                            h0 + i // n_m, lo_m + (i % n_m) * BLOCK_M, BLOCK_M, HEAD_DIM, STAGES)
        mbarrier.wait(kv_empty, (n_done & 1) ^ 1)
        mbarrier.expect(kv_ready, 4 * half_bytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [b, hk, n0 + half * HALF_N, 0], kv_ready,
                                            k_smem.index(half).reshape([1, 1, HALF_N, HEAD_DIM]))
            tma.async_copy_global_to_shared(v_desc, [b, hk, n0 + half * HALF_N, 0], kv_ready,
                                            v_smem.index(half).reshape([1, 1, HALF_N, HEAD_DIM]))
        for i in range(n_first, n_iters):
            _load_ring_pair(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, do_ready, do_empty, c + i, b,
                            h0 + i // n_m, lo_m + (i % n_m) * BLOCK_M, BLOCK_M, HEAD_DIM, STAGES)
        c += n_iters
        n_done += 1


@gluon.jit
def _store_key_rows(x, base, b64, hk, stride_b, stride_h, stride_n, j0, M, ROWS: gl.constexpr,
                    HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """Rows ``j0 .. j0 + ROWS - 1`` (those below M) of ``(b, hk)``'s matrix
    from registers, in ``base``'s dtype: the fused kernel's dK and dV go out
    without a shared-memory tile, so the loader may fill K and V for the
    next tile as soon as the products are done."""
    rows = j0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptrs = (base + b64 * stride_b + hk.to(gl.int64) * stride_h + gl.expand_dims(rows.to(gl.int64) * stride_n, 1)
            + gl.expand_dims(cols, 0))
    gl.store(ptrs, x.to(base.dtype.element_ty), mask=gl.expand_dims(rows < M, 1))


@gluon.jit
def _bwd_step(i, mi, head, c, n_m, lo_m, n_iters, dk, dv, q_smem, do_smem, k_half, v_half, k_cols0, k_cols1,
              ds_smem, dq_smem, stat_smem, q_ready, q_empty, do_ready, do_empty, ds_ready, Shift, Delta, Cap, stat_b,
              stride_stat_h,
              zero_st, zero_dq, kj, j0, right_from, left_to, past_end, diag_off, window_left, window_right, qk_scale,
              free_lo, free_hi, Mask, b, b64, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, N, M,
              dqa_desc, DQacc, stride_dqa_b, stride_dqa_h, stride_dqa_n, dq_r, dq_c,
              HALF: gl.constexpr, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
              HALF_N: gl.constexpr, BLOCK_M: gl.constexpr, HALF_D: gl.constexpr, STAGES: gl.constexpr,
              DQ_TMA: gl.constexpr, DQ_BUFFERS: gl.constexpr, MASK_KIND: gl.constexpr, READS_MASK: gl.constexpr,
              COALESCED_MASK: gl.constexpr, st_layout: gl.constexpr, a_layout: gl.constexpr, col: gl.constexpr):
    """Iteration ``i`` of a consumer's key tile: the q/dO block ``mi`` of
    query head ``head`` (``i % n_m`` and ``h0 + i // n_m``, carried by the
    caller rather than divided for in every iteration), its Sᵀ and dPᵀ,
    probabilities and dSᵀ, dV and dK accumulated, and its dQ share added
    into the float32 buffer. ``READS_MASK`` False for blocks known to need
    no mask (a masked call's blocks inside its keys' neutral query rows)."""
    dtype: gl.constexpr = q_smem.dtype
    g = c + i
    slot = g % STAGES
    phase = (g // STAGES) & 1
    m0 = lo_m + mi * BLOCK_M
    # The next iteration's block: the next one of this head, or the first
    # of the next head.
    wraps = mi + 1 == n_m
    _prefetch_stats(Shift, Delta, Cap, stat_smem.index(2 * HALF + (i + 1) % 2), head + wraps.to(gl.int32),
                    gl.where(wraps, lo_m, m0 + BLOCK_M), i + 1 < n_iters, stat_b, stride_stat_h, BLOCK_M,
                    MASK_KIND == 2)
    mbarrier.wait(q_ready.index(slot), phase)
    st_tok = warpgroup_mma(k_half, q_smem.index(slot).permute((1, 0)), zero_st, use_acc=False,
                           is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dpt_tok = warpgroup_mma(v_half, do_smem.index(slot).permute((1, 0)), zero_st, use_acc=False,
                            is_async=True)
    st = warpgroup_mma_wait(1, deps=(st_tok, ))
    async_copy.wait_group(1)  # this iteration's copy (the next one's may still fly)
    gl.thread_barrier()  # every thread's element, not only its own
    stats = stat_smem.index(2 * HALF + i % 2)
    shift = stats.slice(0, BLOCK_M).load(col)
    st = _mask_transposed_if_crossing(st, m0, kj, right_from, left_to, past_end, M, diag_off, window_left,
                                      window_right, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, True, BLOCK_M, col)
    # Probabilities as the unmasked kernel recomputes them (scale
    # and shift in one FMA), except in blocks that read the mask:
    # there a bool mask hides raw scores, a float one is added to
    # the scaled scores (multiplier 1 then), and marked rows are
    # capped. A block every row sees through neutral values holds
    # no marked row (its keys are all hidden), so the cap is needed
    # only where the mask is read; a key half wholly past M, which
    # the table calls neutral for every row, has its keys hidden by
    # past_end instead.
    sc = qk_scale
    if READS_MASK:
        reads_mask = (m0 < free_lo) | (m0 + BLOCK_M > free_hi)
        if reads_mask:
            mask_base = Mask + b64 * stride_mask_b + head.to(gl.int64) * stride_mask_h
            if MASK_KIND == 2:
                st = st * qk_scale
                sc = 1.0
            if COALESCED_MASK:
                st = _masked_scores_t(st, mask_base, m0, j0, N, M, stride_mask_q, stride_mask_k,
                                      MASK_KIND, HALF_N, BLOCK_M, st_layout)
            else:
                qi = m0 + gl.arange(0, BLOCK_M, layout=col)
                st = _masked_scores_t_direct(st, mask_base, qi, kj, N, M, stride_mask_q, stride_mask_k,
                                             MASK_KIND)
    pt = gl.exp2(st * sc - gl.expand_dims(shift, 0))
    if READS_MASK and MASK_KIND == 2:
        if reads_mask:
            pt = gl.minimum(pt, gl.expand_dims(_row_caps(stats, BLOCK_M, col), 0))
    dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
    # delta read only now: with 128-row blocks a column vector is 32
    # registers a thread, and shift and delta together beside Sᵀ and dPᵀ spill.
    delta = stats.slice(BLOCK_M, BLOCK_M).load(col)
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    # dSᵀ to shared memory first: the other consumer waits for it.
    # Two buffers, alternating with the block counter g: before this
    # consumer overwrites buffer g % 2, it has waited (at g - 1) for
    # the other's dS of block g - 1, which the other stores only
    # after its block g - 2 dQ product (the last reader of this
    # buffer) is done.
    ds0 = ds_smem.index((g % 2) * 2)
    ds1 = ds_smem.index((g % 2) * 2 + 1)
    ds_mine = ds_smem.index((g % 2) * 2 + HALF)
    ds_mine.store(dst.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ds_ready.index(g % 2))
    pt_op = gl.convert_layout(pt.to(dtype), a_layout)
    dv_tok = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
    dk_tok = warpgroup_mma(ds_mine, q_smem.index(slot), dk, is_async=True)
    mbarrier.wait(ds_ready.index(g % 2), (g // 2) & 1)
    dq_tok = warpgroup_mma(ds0.permute((1, 0)), k_cols0, zero_dq, use_acc=False, is_async=True)
    dq_tok = warpgroup_mma(ds1.permute((1, 0)), k_cols1, dq_tok, is_async=True)
    dv, dk, dq, pt_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, pt_op))
    mbarrier.arrive(q_empty.index(slot))
    mbarrier.arrive(do_empty.index(slot))
    if DQ_TMA:
        # The reduce that last read this staging buffer (DQ_BUFFERS
        # blocks ago) must be done reading it before any thread
        # overwrites it: the thread that issued it waits, the barrier
        # holds the others.
        dq_buf = dq_smem.index(HALF * DQ_BUFFERS + g % DQ_BUFFERS)
        tma.store_wait(DQ_BUFFERS - 1)
        gl.thread_barrier()
        dq_buf.store(dq)
        fence_async_shared()
        gl.thread_barrier()
        _tma_reduce_add(dqa_desc, [b, head, m0, HALF * HALF_D], dq_buf.reshape([1, 1, BLOCK_M, HALF_D]))
    else:
        rows = m0 + dq_r
        ptrs = (DQacc + b64 * stride_dqa_b + head.to(gl.int64) * stride_dqa_h
                + gl.expand_dims(rows.to(gl.int64) * stride_dqa_n, 1) + gl.expand_dims(dq_c, 0))
        gl.atomic_add(ptrs, dq, mask=gl.expand_dims(rows < N, 1), sem="relaxed")
    return dk, dv


@gluon.jit
def _fused_consumer(DK, DV, dqa_desc, DQacc, Shift, Delta, Cap, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                    stat_smem, kv_ready, kv_empty, q_ready, q_empty, do_ready, do_empty, ds_ready,
                    stride_dk_b, stride_dk_h, stride_dk_n, stride_dv_b, stride_dv_h, stride_dv_n,
                    stride_stat_b, stride_stat_h, stride_dqa_b, stride_dqa_h, stride_dqa_n,
                    Hq, Hkv, N, M, n_n, n_tiles, qk_scale, scale, diag_off, window_left, window_right,
                    Mask, QueryTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_qtab_b,
                    stride_qtab_h,
                    HALF: gl.constexpr, HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
                    HALF_N: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    DQ_TMA: gl.constexpr, DQ_BUFFERS: gl.constexpr, MASK_KIND: gl.constexpr,
                    COL_GROUP: gl.constexpr, COALESCED_MASK: gl.constexpr, SPLIT_RUNS: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    HALF_D: gl.constexpr = HEAD_DIM // 2
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col: gl.constexpr = gl.SliceLayout(0, st_layout)
    row: gl.constexpr = gl.SliceLayout(1, st_layout)
    G = Hq // Hkv
    k_half = k_smem.index(HALF)
    v_half = v_smem.index(HALF)
    # This consumer's columns of K, both key halves: dQ's B operands.
    k_cols0 = k_smem.index(0).slice(HALF * HALF_D, HALF_D, dim=1)
    k_cols1 = k_smem.index(1).slice(HALF * HALF_D, HALF_D, dim=1)
    zero_st = gl.zeros([HALF_N, BLOCK_M], gl.float32, st_layout)
    zero_dq = gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout)
    dq_rows_l: gl.constexpr = gl.SliceLayout(1, dq_layout)
    dq_cols_l: gl.constexpr = gl.SliceLayout(0, dq_layout)
    dq_r = gl.arange(0, BLOCK_M, layout=dq_rows_l)
    dq_c = HALF * HALF_D + gl.arange(0, HALF_D, layout=dq_cols_l)
    # c: q/dO blocks consumed before this tile (the ring's and the dS
    # buffers' counter); n_done: tiles before it (the K/V barriers' phase).
    c = 0
    n_done = 0
    for r in range(_program_rounds(n_tiles)):
        n0, hk, b, h0, lo_m, n_m, n_iters = _bwd_tile(r, n_n, G, Hkv, N, M, diag_off, window_left, window_right,
                                                      HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, BLOCK_M, 2 * HALF_N,
                                                      QueryTable, stride_qtab_b, stride_qtab_h, MASK_KIND != 0,
                                                      COL_GROUP, 4)
        b64 = b.to(gl.int64)
        stat_b = b64 * stride_stat_b
        j0 = n0 + HALF * HALF_N
        kj = gl.expand_dims(j0 + gl.arange(0, HALF_N, layout=row), 1)
        right_from = j0 + HALF_N - 1 - diag_off - window_right
        left_to = j0 - diag_off + window_left - BLOCK_M + 1
        past_end = j0 + HALF_N > M
        if MASK_KIND != 0:
            # The query blocks this group's keys all see as neutral.
            qtab_off = b64 * stride_qtab_b + h0.to(gl.int64) * stride_qtab_h
            unused_lo, unused_hi, f_lo, f_hi = _table_reduce(QueryTable, qtab_off, j0, M, HALF_N // COL_GROUP,
                                                             COL_GROUP, QUERY_ENTRY, 4)
            # A half with no key below M has nothing in the table, which then
            # calls every row neutral: its keys are hidden by ``past_end``.
            free_lo, free_hi = _free_blocks(f_lo, f_hi, BLOCK_M)
        else:
            free_lo = 0
            free_hi = 0
        dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
        # shift and delta go through shared memory, copied one iteration ahead:
        # held in registers from their load to their use they would live
        # across the wait for Sᵀ and dPᵀ, where dK, dV, Sᵀ and dPᵀ already
        # fill the 240 registers at D = 128 (ptxas spilled them). Two buffers
        # per consumer: buffer (i + 1) % 2, written at iteration i, was last
        # read at i - 1 before that iteration's thread barrier (and the
        # previous tile's reads before its last iteration's).
        _prefetch_stats(Shift, Delta, Cap, stat_smem.index(2 * HALF), h0, lo_m, n_iters > 0, stat_b,
                        stride_stat_h, BLOCK_M, MASK_KIND == 2)
        mbarrier.wait(kv_ready, n_done & 1)
        # Per query head (n_iters // n_m is G, or 0 when the tile sees no
        # query row), its q/dO blocks: unmasked, one run of them all;
        # masked, three runs, before the keys' neutral query rows, inside
        # them ([m_a, m_b), without the mask code, as the forward's split)
        # and after, or without SPLIT_RUNS one run whose blocks branch on
        # whether they read the mask. The blocks keep their order, so the
        # ring and dS counters run as before.
        n_heads = n_iters // n_m
        if MASK_KIND != 0 and SPLIT_RUNS:
            m_a = gl.minimum(gl.maximum(gl.cdiv(free_lo - lo_m, BLOCK_M), 0), n_m)
            m_b = gl.minimum(gl.maximum((free_hi - lo_m) // BLOCK_M, m_a), n_m)
        for hh in range(n_heads):
            for run in gl.static_range(1 if MASK_KIND == 0 or not SPLIT_RUNS else 3):
                if MASK_KIND == 0 or not SPLIT_RUNS:
                    m_lo = 0
                    m_hi = n_m
                elif run == 0:
                    m_lo = 0
                    m_hi = m_a
                elif run == 1:
                    m_lo = m_a
                    m_hi = m_b
                else:
                    m_lo = m_b
                    m_hi = n_m
                for mi in range(m_lo, m_hi):
                    dk, dv = _bwd_step(hh * n_m + mi, mi, h0 + hh, c, n_m, lo_m, n_iters, dk, dv, q_smem, do_smem,
                                       k_half, v_half, k_cols0, k_cols1, ds_smem, dq_smem, stat_smem, q_ready,
                                       q_empty, do_ready, do_empty, ds_ready, Shift, Delta, Cap, stat_b,
                                       stride_stat_h, zero_st, zero_dq, kj, j0, right_from, left_to, past_end,
                                       diag_off, window_left, window_right, qk_scale, free_lo, free_hi, Mask, b, b64,
                                       stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, N, M, dqa_desc,
                                       DQacc, stride_dqa_b, stride_dqa_h, stride_dqa_n, dq_r, dq_c, HALF,
                                       HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_N, BLOCK_M, HALF_D, STAGES, DQ_TMA,
                                       DQ_BUFFERS, MASK_KIND, MASK_KIND != 0 and (run != 1 or not SPLIT_RUNS),
                                       COALESCED_MASK,
                                       st_layout, a_layout, col)
        async_copy.wait_group(0)  # the (empty) copy issued for the iteration past the last
        # This group's products of the tile are done (its last dQ read the
        # other group's K half too): with both arrivals the loader refills K and V.
        mbarrier.arrive(kv_empty)
        _store_key_rows(dk * scale, DK, b64, hk, stride_dk_b, stride_dk_h, stride_dk_n, j0, M, HALF_N, HEAD_DIM,
                        acc_layout)
        _store_key_rows(dv, DV, b64, hk, stride_dv_b, stride_dv_h, stride_dv_n, j0, M, HALF_N, HEAD_DIM,
                        acc_layout)
        c += n_iters
        n_done += 1
    if DQ_TMA:
        tma.store_wait(0)


@gluon.jit
def _hopper_attn_bwd_fused(
    Q, K, V, DO, DK, DV, DQacc, Shift, Delta, Cap,
    stride_q_b, stride_q_h, stride_q_n,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_do_b, stride_do_h, stride_do_n,
    stride_dk_b, stride_dk_h, stride_dk_n,
    stride_dv_b, stride_dv_h, stride_dv_n,
    stride_dqa_b, stride_dqa_h, stride_dqa_n,
    stride_stat_b, stride_stat_h,
    B, Hq, Hkv, N, M,
    qk_scale, scale, diag_off, window_left, window_right,
    Mask, QueryTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_qtab_b, stride_qtab_h,
    HAS_WINDOW_LEFT: gl.constexpr, HAS_WINDOW_RIGHT: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    DQ_TMA: gl.constexpr, DQ_BUFFERS: gl.constexpr, MASK_KIND: gl.constexpr, COL_GROUP: gl.constexpr,
    COALESCED_MASK: gl.constexpr, SPLIT_RUNS: gl.constexpr, num_warps: gl.constexpr,
):
    """dK, dV of 128-key tiles as ``_hopper_attn_bwd_dkdv`` computes them,
    and each tile's unscaled dS·K added into ``DQacc`` (zeroed float32, unit
    stride along D): by relaxed atomics, or with ``DQ_TMA`` by the copy
    engine's reduce. P programs take one tile per round (``_bwd_tile``): one
    program per tile when P is the tile count, a persistent grid when P is
    at most the SM count (the launcher's plan), where one tile's last blocks
    and the next one's first q/dO loads overlap. With a mask (MASK_KIND 1
    bool as bytes, 2 float; read through its (B, Hq, N, M) strides)
    ``QueryTable`` is its query table (``mask_ranges``, one entry per
    COL_GROUP keys), alike for the query heads of a key/value head; without,
    both are unread. ``Shift``, ``Delta`` and ``Cap`` are the per-row inputs
    of ``hopper.fused_row_inputs`` (strides ``stride_stat_b``,
    ``stride_stat_h``, unit along the rows, padded past N): each row's
    base-2 shift, delta and, read only with a float mask, its cap."""
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF_N: gl.constexpr = BLOCK_N // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2
    n_n = gl.cdiv(M, BLOCK_N)
    n_tiles = n_n * Hkv * B
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_M], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_D], gl.float32)
    dq4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, HALF_D], gl.float32)
    qo4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, HEAD_DIM], dtype)
    kv4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, HALF_N, HEAD_DIM], dtype)
    q_desc = _heads_4d(Q, B, Hq, N, stride_q_b, stride_q_h, stride_q_n, BLOCK_M, HEAD_DIM, qo4_layout)
    do_desc = _heads_4d(DO, B, Hq, N, stride_do_b, stride_do_h, stride_do_n, BLOCK_M, HEAD_DIM, qo4_layout)
    k_desc = _heads_4d(K, B, Hkv, M, stride_k_b, stride_k_h, stride_k_n, HALF_N, HEAD_DIM, kv4_layout)
    v_desc = _heads_4d(V, B, Hkv, M, stride_v_b, stride_v_h, stride_v_n, HALF_N, HEAD_DIM, kv4_layout)
    dqa_desc = tma.make_tensor_descriptor(DQacc, shape=[B, Hq, N, HEAD_DIM],
                                          strides=[stride_dqa_b, stride_dqa_h, stride_dqa_n, 1],
                                          block_shape=[1, 1, BLOCK_M, HALF_D], layout=dq4_layout)

    q_smem, do_smem, k_smem, v_smem = _dkdv_buffers(dtype, STAGES, BLOCK_M, HALF_N, HEAD_DIM)
    # dSᵀ of both consumers, two blocks' worth (see _fused_consumer).
    ds_smem = gl.allocate_shared_memory(dtype, [4, HALF_N, BLOCK_M], ds_layout)  # [buffer * 2 + consumer]
    stat_smem = gl.allocate_shared_memory(gl.float32, [4, _stat_width(BLOCK_M, MASK_KIND == 2)],
                                          gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if DQ_TMA:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS, BLOCK_M, HALF_D], dq_layout)
    else:
        dq_smem = ds_smem  # not read
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumers' dSᵀ halves
    mbarrier.init(kv_empty, count=2)
    kv_ready, q_ready, q_empty, do_ready, do_empty = _stream_barriers(STAGES, 2)
    # Both consumers' arguments written out, as in _hopper_attn_fwd (why there).
    gl.warp_specialize([
        (_fused_consumer, (DK, DV, dqa_desc, DQacc, Shift, Delta, Cap, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                           stat_smem, kv_ready, kv_empty, q_ready, q_empty, do_ready, do_empty, ds_ready,
                           stride_dk_b, stride_dk_h, stride_dk_n, stride_dv_b, stride_dv_h, stride_dv_n,
                           stride_stat_b, stride_stat_h, stride_dqa_b, stride_dqa_h, stride_dqa_n,
                           Hq, Hkv, N, M, n_n, n_tiles, qk_scale, scale, diag_off, window_left, window_right,
                           Mask, QueryTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
                           stride_qtab_b, stride_qtab_h,
                           0, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_N, BLOCK_M, HEAD_DIM, STAGES, DQ_TMA,
                           DQ_BUFFERS, MASK_KIND, COL_GROUP, COALESCED_MASK, SPLIT_RUNS)),
        (_fused_consumer, (DK, DV, dqa_desc, DQacc, Shift, Delta, Cap, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                           stat_smem, kv_ready, kv_empty, q_ready, q_empty, do_ready, do_empty, ds_ready,
                           stride_dk_b, stride_dk_h, stride_dk_n, stride_dv_b, stride_dv_h, stride_dv_n,
                           stride_stat_b, stride_stat_h, stride_dqa_b, stride_dqa_h, stride_dqa_n,
                           Hq, Hkv, N, M, n_n, n_tiles, qk_scale, scale, diag_off, window_left, window_right,
                           Mask, QueryTable, stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
                           stride_qtab_b, stride_qtab_h,
                           1, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HALF_N, BLOCK_M, HEAD_DIM, STAGES, DQ_TMA,
                           DQ_BUFFERS, MASK_KIND, COL_GROUP, COALESCED_MASK, SPLIT_RUNS)),
        (_fused_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty,
                         q_ready, q_empty, do_ready, do_empty, Hq, Hkv, N, M, n_n, n_tiles, diag_off, window_left,
                         window_right, QueryTable, stride_qtab_b, stride_qtab_h, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT,
                         HALF_N, BLOCK_M, HEAD_DIM, STAGES, MASK_KIND != 0, COL_GROUP)),
    ], [4, 1], [240, 24])
