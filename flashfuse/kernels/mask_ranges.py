"""Which blocks of a mask hide everything: the key range of each group of
query rows and the query range of each group of keys, computed by one pass
over the mask in each forward and each backward call, so the attention
kernels can skip those blocks.

Padding masks, block-sparse masks and causal masks given as tensors (a model
compiled block by block passes its causal mask in as an input, so the graph
pass cannot know it is causal) hide whole blocks. Reading a small table of
ranges costs the attention kernels next to nothing; scanning the mask inside
them (once per query head and kernel) measured slower than not skipping.

Ranges are in units of ``GROUP`` rows and keys, which divides every kernel
tile, and are exact: a skipped block holds only probabilities that are 0.
See ``_mask_ranges`` for the rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _visible
from .launch import ConfigLauncher, _interpreting, _traced, cdiv

__all__ = ["GROUP", "mask_block_ranges", "mask_hidden_at", "table_strides"]

# Rows and keys per table entry: a divisor of every BLOCK_M and BLOCK_N.
GROUP = 16
# Keys per step of the pass (a multiple of GROUP).
_STEP = 128


@triton.jit
def _mask_takes_part(mv, MASK_KIND: tl.constexpr, HIDDEN_AT: tl.constexpr):
    """Element-wise: the mask lets this score take part. Bool masks (read as
    bytes): nonzero. Float masks: above HIDDEN_AT, or NaN (which must reach
    the output as it would without skipping)."""
    if MASK_KIND == 1:
        part = mv != 0
    else:
        x = mv.to(tl.float32)
        part = (x > HIDDEN_AT) | (x != x)
    return part


@triton.jit
def _widen(q_base, chunk, ok, lo_code, hi):
    """Widen the query ranges of the chunks where ``ok`` to include rows
    ``[N - lo_code, hi)`` (stored as (N - lo, hi), see _mask_ranges)."""
    zero = tl.zeros(chunk.shape, tl.int32)
    tl.atomic_max(q_base + chunk * 2, zero + lo_code, mask=ok, sem="relaxed")
    tl.atomic_max(q_base + chunk * 2 + 1, zero + hi, mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _mask_ranges(
    Mask, KeyRange, QueryRange,
    s_mb, s_mh, s_mn, s_mm,
    s_kb, s_kh, s_qb, s_qh,
    N, M, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, HIDDEN_AT: tl.constexpr,
    GROUP: tl.constexpr, STEP: tl.constexpr,
):
    """Grid (cdiv(N, GROUP), mask heads, mask batches): one group of rows.

    A score takes part when the mask lets it (``_mask_takes_part``) and it is
    in the band (``_visible``). A float-masked row none of whose band scores
    takes part, but some of which are finite (hidden by values like -3.4e38),
    averages all its band keys, so all of them take part. Writes the group's
    key range ``[lo, hi)`` into ``KeyRange[b, h, group]`` (empty: lo >= hi),
    and widens the query range of each chunk of GROUP keys where the group
    has a score that takes part to include the group's rows, with atomic max
    (order-independent). ``QueryRange[b, h, chunk]`` holds ``(N - lo, hi)``,
    so that zeros, its initial value, are the empty range.
    """
    g = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = g * GROUP + tl.arange(0, GROUP)
    real = offs_m < N
    rows = Mask + b.to(tl.int64) * s_mb + h.to(tl.int64) * s_mh + offs_m.to(tl.int64)[:, None] * s_mn
    q_base = QueryRange + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh
    FLOAT: tl.constexpr = MASK_KIND == 2
    CHUNKS: tl.constexpr = STEP // GROUP
    first = tl.full([GROUP], 0, tl.int32) + M  # per row: first / last key taking part
    last = tl.full([GROUP], -1, tl.int32)
    band_first = tl.full([GROUP], 0, tl.int32) + M  # per row: first / last band key
    band_last = tl.full([GROUP], -1, tl.int32)
    finite = tl.zeros([GROUP], tl.int32)
    for start in range(0, M, STEP):
        offs_n = start + tl.arange(0, STEP)
        vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                       HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
        mv = tl.load(rows + offs_n[None, :] * s_mm, mask=real[:, None] & (offs_n < M)[None, :], other=0)
        part = _mask_takes_part(mv, MASK_KIND, HIDDEN_AT) & vis
        first = tl.minimum(first, tl.min(tl.where(part, offs_n[None, :], M), 1))
        last = tl.maximum(last, tl.max(tl.where(part, offs_n[None, :], -1), 1))
        if FLOAT:
            band_first = tl.minimum(band_first, tl.min(tl.where(vis, offs_n[None, :], M), 1))
            band_last = tl.maximum(band_last, tl.max(tl.where(vis, offs_n[None, :], -1), 1))
            finite = tl.maximum(finite, tl.max((vis & (mv.to(tl.float32) > float("-inf"))).to(tl.int32), 1))
        # Chunks of GROUP keys where some row of the group takes part.
        hit = tl.max(tl.max(tl.reshape(part.to(tl.int32), (GROUP, CHUNKS, GROUP)), 2), 0)
        chunk = start // GROUP + tl.arange(0, CHUNKS)
        ok = (hit > 0) & (chunk * GROUP < M)
        _widen(q_base, chunk, ok, N - g * GROUP, g * GROUP + GROUP)
    if FLOAT:
        needs_all = real & (last < 0) & (finite > 0)
        first = tl.where(needs_all, band_first, first)
        last = tl.where(needs_all, band_last, last)
        if tl.max(needs_all.to(tl.int32), 0) > 0:
            # Those rows' band keys take part too: widen their chunks.
            for start in range(0, M, STEP):
                offs_n = start + tl.arange(0, STEP)
                vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                               HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
                part = vis & needs_all[:, None]
                hit = tl.max(tl.max(tl.reshape(part.to(tl.int32), (GROUP, CHUNKS, GROUP)), 2), 0)
                chunk = start // GROUP + tl.arange(0, CHUNKS)
                ok = (hit > 0) & (chunk * GROUP < M)
                _widen(q_base, chunk, ok, N - g * GROUP, g * GROUP + GROUP)
    lo = tl.min(tl.where(real, first, M), 0)
    hi = tl.max(tl.where(real, last + 1, 0), 0)
    k_ptr = KeyRange + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh + g * 2
    tl.store(k_ptr, lo)
    tl.store(k_ptr + 1, hi)


def mask_hidden_at(mask_is_fp16: bool) -> float:
    """Float-mask values at or below this hide a score (see ``_mask_takes_part``).

    Models mark hidden keys with -inf or their dtype's lowest value: about
    -3.4e38 in float32 and bfloat16, -65504 in float16. Next to any score the
    mask leaves visible, ``exp`` of such a value underflows to exactly 0, so
    the kernels may skip a block of them without changing the result.
    """
    return -65504.0 if mask_is_fp16 else -1.0e38


def mask_block_ranges(
    mask: torch.Tensor, N: int, M: int, *, diag_off: int, window_left: int, window_right: int,
    has_window_left: bool, has_window_right: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key range per group of GROUP query rows and query range per chunk of
    GROUP keys, of an attention mask.

    Args:
        mask: the mask expanded to (B, Hq, N, M): bool (as
            ``launch.bool_mask_as_bytes`` gives it) or floating. Dimensions it
            broadcasts over (stride 0) are computed once.
        N, M: queries and keys.
        diag_off, window_left, window_right, has_window_left,
        has_window_right: the band, as the attention kernels take it.

    Returns:
        ``(key_ranges, query_ranges)``: int32 tensors (Bm, Hm, cdiv(N, GROUP),
        2) holding key ranges ``[lo, hi)`` (empty: lo >= hi), and (Bm, Hm,
        cdiv(M, GROUP), 2) holding query ranges as ``(N - lo, hi)``, where Bm
        and Hm are 1 over a broadcast batch / head dimension and B / Hq
        otherwise. Index them with stride 0 over broadcast dimensions.
    """
    B, H = mask.shape[0], mask.shape[1]
    s_mb, s_mh, s_mn, s_mm = mask.stride()
    Bm = 1 if s_mb == 0 else B
    Hm = 1 if s_mh == 0 else H
    groups, chunks = cdiv(N, GROUP), cdiv(M, GROUP)
    # Zeros are the empty query range.
    if _traced((mask,)):
        # In a traced graph, a kernel must write whole tensors, not views.
        key_ranges = torch.zeros(Bm, Hm, groups, 2, dtype=torch.int32, device=mask.device)
        query_ranges = torch.zeros(Bm, Hm, chunks, 2, dtype=torch.int32, device=mask.device)
    else:
        # One zeroed buffer for both tables: one allocation and one fill, as
        # host time counts at small shapes.
        buf = torch.zeros(Bm * Hm * 2 * (groups + chunks), dtype=torch.int32, device=mask.device)
        key_ranges = buf[: Bm * Hm * groups * 2].view(Bm, Hm, groups, 2)
        query_ranges = buf[Bm * Hm * groups * 2:].view(Bm, Hm, chunks, 2)
    args = (mask, key_ranges, query_ranges, s_mb, s_mh, s_mn, s_mm,
            *key_ranges.stride()[:2], *query_ranges.stride()[:2],
            N, M, diag_off, window_left, window_right)
    meta = dict(HAS_WINDOW_LEFT=has_window_left, HAS_WINDOW_RIGHT=has_window_right,
                MASK_KIND=1 if mask.dtype in (torch.uint8, torch.bool) else 2,
                HIDDEN_AT=mask_hidden_at(mask.dtype == torch.float16), GROUP=GROUP)
    if _interpreting(mask):
        _mask_ranges[(groups, Hm, Bm)](*args, **meta, STEP=_STEP)
    else:
        with torch.cuda.device(mask.device):  # the mask's device, whatever the current one
            _launcher((mask.dtype, mask.device, tuple(meta.items())), lambda: [_CONFIG],
                      lambda m: (groups, Hm, Bm), *args, **meta)
    return key_ranges, query_ranges


def table_strides(table: torch.Tensor) -> tuple[int, int]:
    """Batch and head strides of a range table for the kernels: 0 over a
    dimension the mask broadcasts (size 1), so every (batch, head) finds its
    entry with the same indexing."""
    return tuple(st if n > 1 else 0 for st, n in zip(table.stride()[:2], table.shape[:2]))


_CONFIG = triton.Config({"STEP": _STEP}, num_warps=4, num_stages=2)
_launcher = ConfigLauncher(_mask_ranges)
