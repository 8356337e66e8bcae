"""Warp-specialised attention kernels for Hopper (compute capability 9.0).

The portable kernels (``forward.py``, ``backward.py``) run one warp group
that issues its loads, its matrix products and its softmax in turn. On an
H100/H200 Triton can instead split a loop into a *producer* warp that only
issues tensor-memory-accelerator (TMA) copies and *consumer* warp groups that
only compute (``tl.range(..., warp_specialize=True)``), with registers moved
from the producer to the consumers (``setmaxnreg``). Triton applies it only
under conditions these kernels are written to meet:

- ``num_warps=4`` (the pass gives up otherwise; it then adds the producer
  and, for 128-row tiles, splits the consumer into two 64-row groups);
- loads through tensor descriptors made *inside* the kernel
  (``tl.make_tensor_descriptor``);
- one loop with no data-dependent branch in its body: band and bounds masks
  are applied to every block unconditionally (compile-time flags only), not
  split into boundary and interior phases as the portable kernels do.

Coverage (anything else stays on the portable kernels; see
:func:`hopper_unsuitable`, the one selection rule): fp16/bf16, head dims 64
and 128 (the same for keys and values), no mask tensor, no dropout, no
soft-cap, no sinks; causal (either alignment), sliding windows and grouped
heads are covered. Conventions match ``forward.py`` exactly: ``out`` laid out
as ``empty(B, N, Hq, D).transpose(1, 2)``, ``lse`` float32 (B, Hq, N) in
natural-log units, ``+inf`` with a zero output for rows that see no key, so
the portable backward can consume this forward's ``lse`` and vice versa.

Supported Triton versions: 3.6 (the GPU machine's) and 3.9; both have
``tl.make_tensor_descriptor`` and ``tl.range(warp_specialize=...)``; older
versions are declined by the selection rule.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import triton
import triton.language as tl

from .. import config
from .launch import ConfigLauncher, _autotune_enabled, _bucket, _traced, cdiv, ensure_scratch_allocator, static_int

__all__ = ["hopper_problem", "hopper_unsuitable", "hopper_forward", "hopper_backward", "HOPPER_HEAD_DIMS"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

HOPPER_HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16)
_MIN_TRITON = (3, 6)


def _triton_version() -> tuple[int, int]:
    parts = triton.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):  # a development build without a plain version
        return (0, 0)


def _triton_supports_ws() -> str | None:
    """Why this Triton cannot build the kernels, or None."""
    if _triton_version() < _MIN_TRITON:
        return f"Triton {triton.__version__} is older than {'.'.join(map(str, _MIN_TRITON))}"
    if not hasattr(tl, "make_tensor_descriptor"):
        return "this Triton has no tl.make_tensor_descriptor"
    import inspect

    try:
        params = inspect.signature(tl.range.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    if "warp_specialize" not in params:
        return "this Triton's tl.range has no warp_specialize"
    return None


def _descriptor_layout(t: torch.Tensor) -> bool:
    """(B, H, L, D) tensor the copy engine can read as per-(b, h) 2-d tiles:
    unit last stride, 16-byte aligned base and strides."""
    elt = t.element_size()
    if t.stride(3) != 1 or t.data_ptr() % 16:
        return False
    return all(size <= 1 or (st > 0 and (st * elt) % 16 == 0) for size, st in zip(t.shape[:3], t.stride()[:3]))


def hopper_unsuitable(q, k, v, attn_mask=None, *, dropout_p: float = 0.0, softcap=None, sinks=None,
                      mask_fill=None, grad_out=None, device_capability=None) -> str | None:
    """The one selection rule of the Hopper kernels: None when they may run
    this call, else the first reason they may not (for ``explain`` and
    benchmark rows). ``FLASHFUSE_HOPPER`` decides whether a suitable call
    takes them (:func:`hopper_enabled`); this function only says whether it
    could. ``grad_out``: also check the backward's extra tensor.
    ``device_capability``: for tests, in place of the tensors' device's."""
    if _traced((q,)):
        return "traced call (tensor descriptors need real addresses to check)"
    if q.device.type != "cuda" and device_capability is None:
        return f"tensors on {q.device.type}, not a CUDA GPU"
    cap = device_capability if device_capability is not None else _capability(q.device.index)
    if tuple(cap) != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}, not 9.0 (Hopper)"
    why = _triton_supports_ws()
    if why:
        return why
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype}, not float16/bfloat16"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    D, Dv = q.shape[-1], v.shape[-1]
    if D != Dv:
        return f"head dims differ (q/k {D}, v {Dv})"
    if D not in HOPPER_HEAD_DIMS:
        return f"head dim {D}, not one of {HOPPER_HEAD_DIMS}"
    if attn_mask is not None:
        return "mask tensor"
    if dropout_p > 0.0:
        return "dropout"
    if softcap is not None:
        return "soft-cap"
    if sinks is not None:
        return "sinks"
    if q.shape[1] % k.shape[1]:
        return "query heads not a multiple of key/value heads"
    B, Hq, N = q.shape[:3]
    if B * Hq * (cdiv(N, _ROW_PAD) * _ROW_PAD) >= 2**31:
        # The dQ kernel indexes a flat copy of lse and delta by an int32
        # descriptor coordinate.
        return "more than 2**31 query rows over all heads"
    for name, t in (("q", q), ("k", k), ("v", v), ("grad_out", grad_out)):
        if t is not None and not _descriptor_layout(t):
            return f"{name}'s layout does not suit tensor descriptors (unit last stride, 16-byte aligned)"
    return None


def hopper_problem(q, k, v, attn_mask=None, *, dropout_p: float = 0.0, softcap=None, sinks=None, mask_fill=None,
                   grad_out=None) -> str | None:
    """None when this call runs on the Hopper kernels now, else why not:
    ``FLASHFUSE_HOPPER`` off, or :func:`hopper_unsuitable`'s reason. The
    launch dispatch (``flashfuse.kernels``) asks exactly this."""
    if not hopper_enabled():
        return "FLASHFUSE_HOPPER is not 1"
    return hopper_unsuitable(q, k, v, attn_mask, dropout_p=dropout_p, softcap=softcap, sinks=sinks,
                             mask_fill=mask_fill, grad_out=grad_out)


def hopper_enabled() -> bool:
    """``FLASHFUSE_HOPPER=1``: suitable calls take the Hopper kernels (off by
    default until measured)."""
    return config.hopper() == "1"


def _capability(index):
    from .launch import _capability as cap

    return cap(index)


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _hopper_fwd(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Hq, Hkv, N, M,
    qk_scale, diag_off, window_left, window_right,
    HEAD_DIM: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, CHECK_M: tl.constexpr,
    WARP_SPEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_M), Hq, B): one query tile of one (batch, head).

    ``qk_scale`` is ``scale * log2(e)`` (scores in base 2). A key j is
    visible to query i when ``i + diag_off - window_left <= j`` (HAS_WL) and
    ``j <= i + diag_off + window_right`` (HAS_WR); CHECK_M: M is not a
    multiple of BLOCK_N, so the last block needs its column mask.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes fp64 scalars
    # Last tiles first: under a causal band they have the most keys.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // (Hq // Hkv)
    b64 = b.to(tl.int64)
    start_m = pid_m * BLOCK_M

    # Per-(b, h) 2-d descriptors: rows past N or M read as zeros and stores
    # past N are dropped by the copy engine, so no bounds masks on data.
    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh, shape=[N, HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh, shape=[M, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh, shape=[M, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(Out + b64 * stride_ob + h.to(tl.int64) * stride_oh, shape=[N, HEAD_DIM],
                                       strides=[stride_om, 1], block_shape=[BLOCK_M, HEAD_DIM])

    # Key blocks that any row of the tile may see; outside them nothing.
    row_last = tl.minimum(start_m + BLOCK_M, N) - 1
    lo = start_m * 0
    hi = lo + M
    if HAS_WL:
        lo = tl.maximum(start_m + diag_off - window_left, 0)
    if HAS_WR:
        hi = tl.minimum(row_last + diag_off + window_right + 1, M)
    lo_blk = (lo // BLOCK_N) * BLOCK_N
    hi_blk = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N) * BLOCK_N, lo_blk)  # empty band: no block

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    MASKED: tl.constexpr = HAS_WL or HAS_WR or CHECK_M
    q = q_desc.load([start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # One loop, every block masked alike: the warp-specialisation pass does
    # not take loops with branches (or two loops in a row for one band).
    for start_n in tl.range(lo_blk, hi_blk, BLOCK_N, warp_specialize=WARP_SPEC):
        k = k_desc.load([start_n, 0])
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            j = (start_n + offs_n0)[None, :]
            i = offs_m[:, None]
            vis = j < M
            if HAS_WR:
                vis = vis & (j <= i + diag_off + window_right)
            if HAS_WL:
                vis = vis & (j >= i + diag_off - window_left)
            qk = tl.where(vis, qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # A row with nothing visible yet keeps -inf: a finite shift
            # keeps exp2 from -inf - -inf = NaN.
            m_shift = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            m_shift = m_ij
        p = tl.exp2(qk - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij

    # Rows that saw no key (l == 0): output 0, lse +inf (forward.py's rule).
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    o_desc.store([start_m, 0], (acc * inv_l[:, None]).to(Out.dtype.element_ty))
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(Lse + (b64 * Hq + h) * N + offs_m, lse, mask=offs_m < N)


# (BLOCK_M, BLOCK_N, num_stages) per head dim, best guess first; num_warps is
# always 4 (see the module docstring). 128-row tiles give two 64-row consumer
# groups.
_FWD_TILES = {
    64: [(128, 128, 2), (128, 64, 3), (128, 128, 3)],
    128: [(128, 128, 2), (128, 64, 2), (128, 64, 3)],
}
_fwd_launcher = ConfigLauncher(_hopper_fwd, name="_hopper_fwd")


def _configs(tiles):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=s) for bm, bn, s in tiles]


def _strides3(t):
    """The batch, head and row strides of a (B, H, L, D) tensor for the
    kernels' descriptors. A dimension of size 1 may carry any stride (the
    selection rule does not check it), but a descriptor's strides must be
    16-byte multiples; with one index only, D (64 or 128 elements) serves."""
    return tuple(st if size > 1 else t.shape[3] for size, st in zip(t.shape[:3], t.stride()[:3]))


def _clamp(w, limit):
    return 0 if w is None else max(-limit, min(int(w), limit))


def hopper_forward(q, k, v, *, scale: float, window_left, window_right, bottom_right: bool,
                   warp_specialize: bool = True):
    """Forward on the Hopper kernel, for calls :func:`hopper_unsuitable`
    accepts; returns ``(out, lse)`` exactly as ``forward.attention_forward``."""
    B, Hq, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    D = static_int(D)
    out = torch.empty_strided((B, Hq, N, D), (N * Hq * D, D, Hq * D, 1), dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    if B * Hq * N == 0:
        return out, lse
    limit = N + M
    args = (q, k, v, out, lse, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out),
            Hq, Hkv, N, M, float(scale) * _LOG2E, (M - N) if bottom_right else 0,
            _clamp(window_left, limit), _clamp(window_right, limit))
    tiles = _tiles(_FWD_TILES, D)
    meta = dict(HEAD_DIM=D, HAS_WL=window_left is not None, HAS_WR=window_right is not None,
                WARP_SPEC=warp_specialize)
    # The candidates' BLOCK_N are powers of two, so M divisible by the
    # largest is divisible by each: one CHECK_M for the whole list.
    meta["CHECK_M"] = M % max(bn for _, bn, _ in tiles) != 0
    _launch(_fwd_launcher, q, tiles, lambda m: (cdiv(N, m["BLOCK_M"]), Hq, B), args, meta, N, M)
    return out, lse


def _tiles(table, D):
    """The candidates for head dim D; other head dims (never chosen by the
    selection rule) only in the interpreter's tests, at its tile."""
    return table.get(D, [(_INTERPRET_TILE["BLOCK_M"], _INTERPRET_TILE["BLOCK_N"], 1)])


# Under the interpreter (tests only: the selection rule never picks CPU
# tensors) one small tile, as the portable kernels use there.
_INTERPRET_TILE = {"BLOCK_M": 16, "BLOCK_N": 16}


def _launch(launcher, q, tiles, grid, args, meta, N, M):
    """Launch one of the kernels: config chosen per key (and tuned when
    autotuning is on) on CUDA, one small tile in Triton's interpreter."""
    if q.device.type != "cuda" or config.interpreter_on():
        launcher.kernel[grid(_INTERPRET_TILE)](*args, **meta, **_INTERPRET_TILE)
        return
    ensure_scratch_allocator()
    key = (q.dtype, q.device, _bucket(N, 1 << 16), _bucket(M, 1 << 16), tuple(meta.items()))
    failed = _FAILED.get((launcher.name, key))
    if failed:
        raise HopperCompileFailed(failed)
    try:
        with torch.cuda.device(q.device):
            launcher(key, lambda: _configs(tiles), grid, *args, tune=_autotune_enabled(), **meta)
    except Exception as exc:
        if not _compile_failure(exc):
            raise
        why = f"{launcher.name} does not compile here ({type(exc).__name__}: {str(exc).strip()[:200]})"
        _FAILED[(launcher.name, key)] = why
        warnings.warn(f"flashfuse: {why}; the portable kernels run instead", RuntimeWarning, stacklevel=3)
        raise HopperCompileFailed(why) from exc


class HopperCompileFailed(RuntimeError):
    """A Hopper kernel failed to compile (before anything ran); the launch
    dispatch then takes the portable kernels."""


# (launcher, key) -> why: compile failures, remembered so that each is
# warned about and paid for once.
_FAILED: dict = {}


def _compile_failure(exc: BaseException) -> bool:
    """The compiler refused the kernel: the warp-specialisation pass is
    young and fails on some variants (see the kernels' comments) with an
    MLIR pass failure rather than a Python error."""
    errors = getattr(getattr(triton, "compiler", None), "errors", None)
    if errors is not None and isinstance(exc, getattr(errors, "CompilationError", ())):
        return True
    return isinstance(exc, RuntimeError) and "PassManager" in str(exc)


# ---------------------------------------------------------------------------
# Backward: dK and dV per key tile, then dQ per query tile
# ---------------------------------------------------------------------------


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _hopper_dkdv(
    Q, K, V, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, G, N, M, NP, diag_off, window_left, window_right,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    WARP_SPEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_N), Hkv, B): one key/value tile of one (batch,
    key/value head), its dK and dV kept in registers over every query block
    of the G query heads that read it. dQ is left to ``_hopper_dq``: with
    its product in this loop (pointer or descriptor atomics into an fp32
    buffer) the warp-specialisation pass fails to compile (Triton 3.9,
    sm_90), since dQ sums over the keys that the two consumer groups split.

    Lse (B, Hq, NP) natural log, +inf for rows that see no key; Delta
    (B, Hq, NP) ``rowsum(dO * O)`` (minus any lse gradient), both contiguous
    fp32, padded to NP (a multiple of every BLOCK_M) with lse +inf and delta
    0, so the rows past N need no bounds mask: their probabilities are 0.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    start_n = pid_n * BLOCK_N

    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh, shape=[M, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh, shape=[M, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    # Rank-3 (head, row, dim) views of the batch: the loop walks the query
    # heads of the group, and each head's rows stay bounded by N (a flat
    # row view would read the next head's rows past the end).
    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb, shape=[Hq, N, HEAD_DIM],
                                       strides=[stride_qh, stride_qm, 1], block_shape=[1, BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DO + b64 * stride_dob, shape=[Hq, N, HEAD_DIM],
                                        strides=[stride_doh, stride_dom, 1], block_shape=[1, BLOCK_M, HEAD_DIM])
    k = k_desc.load([start_n, 0])
    v = v_desc.load([start_n, 0])

    # Query rows that see any key of the tile (the band read from the keys'
    # side): j <= i + off + wr  <=>  i >= j - off - wr, and
    # j >= i + off - wl  <=>  i <= j - off + wl.
    n_last = tl.minimum(start_n + BLOCK_N, M) - 1
    q_lo = start_n * 0
    q_hi = q_lo + N
    if HAS_WR:
        q_lo = tl.maximum(start_n - diag_off - window_right, 0)
    if HAS_WL:
        q_hi = tl.minimum(n_last - diag_off + window_left + 1, N)
    lo_blk = (q_lo // BLOCK_M) * BLOCK_M
    n_blocks = tl.where(q_hi > q_lo, tl.cdiv(q_hi, BLOCK_M) - q_lo // BLOCK_M, 0)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    MASKED: tl.constexpr = HAS_WL or HAS_WR
    # One flat loop over (query head of the group, query block): the
    # warp-specialisation pass takes a single loop without branches.
    for t in tl.range(0, G * n_blocks, warp_specialize=WARP_SPEC):
        g = t // n_blocks
        start_m = lo_blk + (t - g * n_blocks) * BLOCK_M
        h = kvh * G + g
        offs_m = start_m + offs_m0
        q = q_desc.load([h, start_m, 0]).reshape([BLOCK_M, HEAD_DIM])
        do = do_desc.load([h, start_m, 0]).reshape([BLOCK_M, HEAD_DIM])
        row = (b64 * Hq + h) * NP + offs_m
        lse = tl.load(Lse + row)
        delta = tl.load(Delta + row)
        # Scores transposed, (keys, queries): dK and dV need P^T and dS^T.
        # Key rows past M are zero (K reads zeros), their dK/dV never stored.
        s_t = tl.dot(k, tl.trans(q))
        p_t = tl.exp2(s_t * qk_scale - (lse * 1.4426950408889634)[None, :])
        if MASKED:
            i = offs_m[None, :]
            j = offs_n[:, None]
            vis = j < M
            if HAS_WR:
                vis = vis & (j <= i + diag_off + window_right)
            if HAS_WL:
                vis = vis & (j >= i + diag_off - window_left)
            p_t = tl.where(vis, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        ds16 = ds_t.to(q.dtype)
        dk = tl.dot(ds16, q, dk)

    dk_desc = tl.make_tensor_descriptor(DK + b64 * stride_dkb + kvh.to(tl.int64) * stride_dkh, shape=[M, HEAD_DIM],
                                        strides=[stride_dkn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    dv_desc = tl.make_tensor_descriptor(DV + b64 * stride_dvb + kvh.to(tl.int64) * stride_dvh, shape=[M, HEAD_DIM],
                                        strides=[stride_dvn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    dk_desc.store([start_n, 0], (dk * scale).to(DK.dtype.element_ty))
    dv_desc.store([start_n, 0], dv.to(DV.dtype.element_ty))



# (BLOCK_M, BLOCK_N, num_stages) per head dim; 128 keys per program hold
# dK and dV (2 x 128 x D fp32) across the consumer groups.
_BWD_TILES = {
    # (128, 128) fails to compile warp-specialised (Triton 3.9: "unsupported
    # load type for producer commit"), so 64-row query blocks.
    64: [(64, 128, 2), (64, 128, 3)],
    128: [(64, 128, 2), (64, 128, 3), (32, 128, 2)],
}
_dkdv_launcher = ConfigLauncher(_hopper_dkdv, name="_hopper_dkdv")


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _hopper_dq(
    Q, K, V, DO, Lse, Delta, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    Hq, G, N, M, NP, diag_off, window_left, window_right,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, CHECK_M: tl.constexpr,
    WARP_SPEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_M), Hq, B): dQ of one query tile, streaming the
    key blocks of its band as the forward does (scores and dP recomputed).
    Lse and Delta as in ``_hopper_dkdv`` (padded to NP)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal rows first
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // G
    b64 = b.to(tl.int64)
    start_m = pid_m * BLOCK_M

    q_desc = tl.make_tensor_descriptor(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh, shape=[N, HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DO + b64 * stride_dob + h.to(tl.int64) * stride_doh, shape=[N, HEAD_DIM],
                                        strides=[stride_dom, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh, shape=[M, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh, shape=[M, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM])

    row_last = tl.minimum(start_m + BLOCK_M, N) - 1
    lo = start_m * 0
    hi = lo + M
    if HAS_WL:
        lo = tl.maximum(start_m + diag_off - window_left, 0)
    if HAS_WR:
        hi = tl.minimum(row_last + diag_off + window_right + 1, M)
    lo_blk = (lo // BLOCK_N) * BLOCK_N
    hi_blk = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N) * BLOCK_N, lo_blk)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    # lse and delta through descriptors too: with pointer loads feeding the
    # loop the warp-specialisation pass fails ("unsupported load type for
    # producer commit", Triton 3.9). Padded rows hold lse +inf, delta 0.
    # Flat 1-d views: a (row, column) view's [1, BLOCK_M] block reshaped to
    # [BLOCK_M] fails the pass's split of the rows over the consumer groups.
    total = Hq * tl.num_programs(2) * NP
    lse_desc = tl.make_tensor_descriptor(Lse, shape=[total], strides=[1], block_shape=[BLOCK_M])
    delta_desc = tl.make_tensor_descriptor(Delta, shape=[total], strides=[1], block_shape=[BLOCK_M])
    row0 = (b * Hq + h) * NP + start_m
    lse2 = lse_desc.load([row0]) * 1.4426950408889634
    delta = delta_desc.load([row0])
    q = q_desc.load([start_m, 0])
    do = do_desc.load([start_m, 0])
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    MASKED: tl.constexpr = HAS_WL or HAS_WR or CHECK_M
    for start_n in tl.range(lo_blk, hi_blk, BLOCK_N, warp_specialize=WARP_SPEC):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASKED:
            j = (start_n + offs_n0)[None, :]
            i = offs_m[:, None]
            vis = j < M
            if HAS_WR:
                vis = vis & (j <= i + diag_off + window_right)
            if HAS_WL:
                vis = vis & (j >= i + diag_off - window_left)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    dq_desc = tl.make_tensor_descriptor(DQ + b64 * stride_dqb + h.to(tl.int64) * stride_dqh, shape=[N, HEAD_DIM],
                                        strides=[stride_dqm, 1], block_shape=[BLOCK_M, HEAD_DIM])
    dq_desc.store([start_m, 0], (dq * scale).to(DQ.dtype.element_ty))


_DQ_TILES = {
    64: [(128, 128, 2), (128, 64, 2), (128, 64, 3)],
    128: [(128, 64, 2), (128, 128, 2), (128, 64, 3)],
}
_dq_launcher = ConfigLauncher(_hopper_dq, name="_hopper_dq")
_ROW_PAD = 128  # a multiple of every BLOCK_M above (and of the interpreter's)


@triton.jit(do_not_specialize=["N", "NP"])
def _hopper_prep(
    O, DO, Lse, Glse, LseP, DeltaP,
    s_ob, s_oh, s_om, s_od, s_dob, s_doh, s_dom, s_dod, s_lb, s_lh, s_lm, s_gb, s_gh, s_gm,
    N, NP,
    HEAD_DIM: tl.constexpr, HAS_GLSE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid (NP // BLOCK_M, Hq, B): LseP = lse and DeltaP = rowsum(dO * O)
    (minus the lse gradient) as contiguous (B, Hq, NP) fp32, rows past N
    holding +inf and 0."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < N
    cols = tl.arange(0, HEAD_DIM)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    o = tl.load(O + b * s_ob + h * s_oh + r64 * s_om + cols * s_od, mask=ok[:, None], other=0.0)
    do = tl.load(DO + b * s_dob + h * s_doh + r64 * s_dom + cols * s_dod, mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_GLSE:  # d lse / d s = P: the lse gradient joins delta
        delta -= tl.load(Glse + b * s_gb + h * s_gh + rows * s_gm, mask=ok, other=0.0).to(tl.float32)
    lse = tl.load(Lse + b * s_lb + h * s_lh + rows * s_lm, mask=ok, other=float("inf"))
    dst = (b * tl.num_programs(1) + h) * NP + rows
    tl.store(LseP + dst, lse)
    tl.store(DeltaP + dst, delta)


def hopper_backward(grad_out, q, k, v, out, lse, *, scale: float, window_left, window_right, bottom_right: bool,
                    grad_lse=None, warp_specialize: bool = True):
    """dq, dk, dv on the Hopper kernels, for calls :func:`hopper_unsuitable`
    accepts (``grad_out`` included); ``lse`` is either forward's. Returns
    ``empty_like`` tensors of q, k, v, as ``backward.attention_backward``."""
    B, Hq, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    D = static_int(D)
    G = Hq // Hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if B * Hq * N == 0 or M == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # lse and delta = rowsum(dO * O) - grad_lse, padded to a multiple of
    # every query tile (lse +inf, delta 0): rows past N then take no part
    # without a bounds mask, and every tile's start is aligned for the copy
    # engine.
    NP = cdiv(N, _ROW_PAD) * _ROW_PAD
    lse_p = torch.empty((B, Hq, NP), dtype=torch.float32, device=q.device)
    delta_p = torch.empty((B, Hq, NP), dtype=torch.float32, device=q.device)
    glse = grad_lse if grad_lse is not None else lse
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        _hopper_prep[(NP // _ROW_PAD, Hq, B)](
            out, grad_out, lse, glse, lse_p, delta_p, *out.stride(), *grad_out.stride(), *lse.stride(),
            *glse.stride(), N, NP, HEAD_DIM=D, HAS_GLSE=grad_lse is not None, BLOCK_M=_ROW_PAD,
            num_warps=4)
    limit = N + M
    band = ((M - N) if bottom_right else 0, _clamp(window_left, limit), _clamp(window_right, limit))
    scalars = (float(scale) * _LOG2E, float(scale))
    flags = dict(HEAD_DIM=D, HAS_WL=window_left is not None, HAS_WR=window_right is not None,
                 WARP_SPEC=warp_specialize)
    s3 = _strides3
    _launch(_dkdv_launcher, q, _tiles(_BWD_TILES, D), lambda m: (cdiv(M, m["BLOCK_N"]), Hkv, B),
            (q, k, v, grad_out, lse_p, delta_p, dk, dv, *s3(q), *s3(k), *s3(v), *s3(grad_out), *s3(dk), *s3(dv),
             Hq, G, N, M, NP, *band, *scalars), flags, N, M)
    dq_tiles = _tiles(_DQ_TILES, D)
    _launch(_dq_launcher, q, dq_tiles, lambda m: (cdiv(N, m["BLOCK_M"]), Hq, B),
            (q, k, v, grad_out, lse_p, delta_p, dq, *s3(q), *s3(k), *s3(v), *s3(grad_out), *s3(dq),
             Hq, G, N, M, NP, *band, *scalars), dict(flags, CHECK_M=M % max(bn for _, bn, _ in dq_tiles) != 0),
            N, M)
    return dq, dk, dv
