"""What a mask does to each block: which keys a group of query rows can skip
(the mask hides them) and which it can compute without reading the mask (the
mask adds nothing there), and the same per group of keys over the queries.

Two small passes over the mask build the tables the attention kernels read:

* the key table, one entry per ``ROW_GROUP`` query rows (forward and dQ):
  ``[lo, hi)``, the keys some row of the group lets take part, and
  ``[free_lo, free_hi)``, keys that every row of the group sees through a
  neutral mask value (float 0, bool True): there the kernels skip the mask's
  loads and arithmetic altogether, the way causal kernels skip the masking of
  blocks below the diagonal;
* the query table, one entry per ``COL_GROUP`` keys (dK/dV): the same two
  ranges over query rows.

Padding masks, block-sparse masks and causal masks given as tensors (models
compiled block by block, and Hugging Face models even when compiled whole,
pass their masks in as data) hide whole blocks and leave the rest neutral.
Scanning the mask inside the attention kernels measured slower than not
skipping; a table costs them a few integer loads.

Both tables are exact: a skipped block holds only probabilities that are 0,
and a block computed without its mask holds only neutral values. Rules in
``_mask_key_table`` and ``_mask_query_table``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import MASK_BOOL_C, MASK_FLOAT, MASK_FLOAT_C, _visible, mask_kind
from .launch import ConfigLauncher, _interpreting, cdiv

__all__ = ["COL_GROUP", "ROW_GROUP", "fill_hides", "mask_band_rows", "mask_hidden_at", "mask_key_table",
           "mask_query_table", "mask_tables", "table_strides"]

# Query rows per key-table entry: a divisor of every forward and dQ BLOCK_M.
ROW_GROUP = 16
# Keys per query-table entry: a divisor of every dK/dV BLOCK_N (>= 32, so a
# bf16 mask row segment fills a 64-byte transaction).
COL_GROUP = 32
# Entry widths: (lo, hi, free_lo, free_hi[, averages]).
KEY_ENTRY = 5
QUERY_ENTRY = 4
# Keys (row pass) and rows (column pass) per loop step, with 4 warps: the
# fastest of the candidates measured on an H200 at GPT-2, LLaMA-style and
# BERT-style masks (bench/results/mask_table_times.csv).
_ROW_STEP = 256
_COL_STEP = 128


@triton.jit
def _mask_takes_part(mv, MASK_KIND: tl.constexpr, HIDDEN_AT: tl.constexpr):
    """Element-wise: the mask lets this score take part. Bool masks (read as
    bytes): nonzero. Float masks: above HIDDEN_AT, or NaN (which must reach
    the output as it would without skipping)."""
    if MASK_KIND == MASK_BOOL_C:
        part = mv != 0
    else:
        x = mv.to(tl.float32)
        part = (x > HIDDEN_AT) | (x != x)
    return part


@triton.jit
def _mask_neutral(mv, MASK_KIND: tl.constexpr):
    """Element-wise: the mask leaves this score exactly as it is (bool True,
    float +-0), so a kernel may skip reading it."""
    if MASK_KIND == MASK_BOOL_C:
        neutral = mv != 0
    else:
        neutral = mv.to(tl.float32) == 0.0
    return neutral


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _mask_key_table(
    Mask, Table,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_tab_b, stride_tab_h,
    N, M, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, HIDDEN_AT: tl.constexpr, AVERAGES: tl.constexpr,
    GROUP: tl.constexpr, STEP: tl.constexpr,
):
    """Grid (cdiv(N, GROUP), mask heads, mask batches): one group of rows.

    A score takes part when the mask lets it (``_mask_takes_part``) and it is
    in the band (``_visible``). With AVERAGES (a float mask, or a bool mask
    whose hidden pairs score a finite fill), a row none of whose band scores
    takes part, but some of which are finite (hidden by values like -3.4e38,
    or filled), averages all its band keys, so all of them take part
    ("averages").

    Per row: ``first`` / ``last``, its first and last key taking part, and
    ``z``, its first band key at or after ``first`` whose mask value is not
    neutral; its keys ``[first, z)`` are neutral or outside the band. Writes
    ``Table[b, h, group] = (lo, hi, free_lo, free_hi, averages)``: the union
    ``[min first, max last + 1)`` over the group's real rows (empty: lo >=
    hi), the intersection ``[max first, min z)`` (empty when some row has no
    key taking part), and whether some row averages.
    """
    g = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = g * GROUP + tl.arange(0, GROUP)
    real = offs_m < N
    rows = (Mask + b.to(tl.int64) * stride_mask_b + h.to(tl.int64) * stride_mask_h
            + offs_m.to(tl.int64)[:, None] * stride_mask_q)
    first = tl.full([GROUP], 0, tl.int32) + M
    last = tl.full([GROUP], -1, tl.int32)
    z = tl.full([GROUP], 0, tl.int32) + M
    band_first = tl.full([GROUP], 0, tl.int32) + M  # per row: first / last band key
    band_last = tl.full([GROUP], -1, tl.int32)
    finite = tl.zeros([GROUP], tl.int32)
    for start in range(0, M, STEP):
        offs_n = start + tl.arange(0, STEP)
        vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                       HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
        mv = tl.load(rows + offs_n[None, :] * stride_mask_k, mask=real[:, None] & (offs_n < M)[None, :], other=0)
        part = _mask_takes_part(mv, MASK_KIND, HIDDEN_AT) & vis
        first = tl.minimum(first, tl.min(tl.where(part, offs_n[None, :], M), 1))
        last = tl.maximum(last, tl.max(tl.where(part, offs_n[None, :], -1), 1))
        # Keys are visited in order, so ``first`` is final once it is < M.
        cut = vis & (~_mask_neutral(mv, MASK_KIND)) & (offs_n[None, :] >= first[:, None])
        z = tl.minimum(z, tl.min(tl.where(cut, offs_n[None, :], M), 1))
        if AVERAGES:
            band_first = tl.minimum(band_first, tl.min(tl.where(vis, offs_n[None, :], M), 1))
            band_last = tl.maximum(band_last, tl.max(tl.where(vis, offs_n[None, :], -1), 1))
            if MASK_KIND == MASK_FLOAT_C:
                finite = tl.maximum(finite, tl.max((vis & (mv.to(tl.float32) > float("-inf"))).to(tl.int32), 1))
            else:  # every filled pair is finite
                finite = tl.maximum(finite, tl.max(vis.to(tl.int32), 1))
    averages = tl.zeros([GROUP], tl.int32)
    if AVERAGES:
        averages = (real & (last < 0) & (finite > 0)).to(tl.int32)
        first = tl.where(averages > 0, band_first, first)
        last = tl.where(averages > 0, band_last, last)
        z = tl.where(averages > 0, band_first, z)  # none of its band values is neutral
    t = Table + b.to(tl.int64) * stride_tab_b + h.to(tl.int64) * stride_tab_h + g * 5
    tl.store(t, tl.min(tl.where(real, first, M), 0))
    tl.store(t + 1, tl.max(tl.where(real, last + 1, 0), 0))
    tl.store(t + 2, tl.max(tl.where(real, first, 0), 0))
    tl.store(t + 3, tl.min(tl.where(real, z, M), 0))
    tl.store(t + 4, tl.max(averages, 0))


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _mask_query_table(
    Mask, KeyTable, Table,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k, stride_keytab_b, stride_keytab_h, stride_tab_b,
    stride_tab_h,
    N, M, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, HIDDEN_AT: tl.constexpr, AVERAGES: tl.constexpr,
    GROUP: tl.constexpr, ROW_GROUP: tl.constexpr, STEP: tl.constexpr,
):
    """Grid (cdiv(M, GROUP), mask heads, mask batches): one group of keys.

    The column form of ``_mask_key_table``: per key, ``first`` / ``last``
    query rows taking part and ``z``, the first band row at or after
    ``first`` whose mask value is not neutral. Rows of a key-table group that
    averages take part wherever they are in the band (a superset of the rows
    that average: exact, since computing a block is always exact). Writes
    ``Table[b, h, group] = (lo, hi, free_lo, free_hi)`` over query rows,
    reduced over the group's real keys.
    """
    c = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_n = c * GROUP + tl.arange(0, GROUP)
    real = offs_n < M
    cols = (Mask + b.to(tl.int64) * stride_mask_b + h.to(tl.int64) * stride_mask_h
            + offs_n.to(tl.int64)[None, :] * stride_mask_k)
    kt = KeyTable + b.to(tl.int64) * stride_keytab_b + h.to(tl.int64) * stride_keytab_h
    first = tl.full([GROUP], 0, tl.int32) + N
    last = tl.full([GROUP], -1, tl.int32)
    z = tl.full([GROUP], 0, tl.int32) + N
    for start in range(0, N, STEP):
        offs_m = start + tl.arange(0, STEP)
        row_ok = offs_m < N
        vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right,
                       HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT)
        mv = tl.load(cols + offs_m.to(tl.int64)[:, None] * stride_mask_q, mask=row_ok[:, None] & real[None, :], other=0)
        part = _mask_takes_part(mv, MASK_KIND, HIDDEN_AT)
        if AVERAGES:
            averages = tl.load(kt + (offs_m // ROW_GROUP) * 5 + 4, mask=row_ok, other=0)
            part = part | (averages > 0)[:, None]
        part = part & vis
        first = tl.minimum(first, tl.min(tl.where(part, offs_m[:, None], N), 0))
        last = tl.maximum(last, tl.max(tl.where(part, offs_m[:, None], -1), 0))
        cut = vis & (~_mask_neutral(mv, MASK_KIND)) & (offs_m[:, None] >= first[None, :])
        z = tl.minimum(z, tl.min(tl.where(cut, offs_m[:, None], N), 0))
    t = Table + b.to(tl.int64) * stride_tab_b + h.to(tl.int64) * stride_tab_h + c * 4
    tl.store(t, tl.min(tl.where(real, first, N), 0))
    tl.store(t + 1, tl.max(tl.where(real, last + 1, 0), 0))
    tl.store(t + 2, tl.max(tl.where(real, first, 0), 0))
    tl.store(t + 3, tl.min(tl.where(real, z, N), 0))


@triton.jit
def _or_bits(a, b):
    return a | b


@triton.jit(do_not_specialize=["N", "M", "diag_off", "window_left", "window_right"])
def _mask_band_rows(
    Mask, Rows, Flags,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
    N, M, diag_off, window_left, window_right,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    MASK_KIND: tl.constexpr, HIDDEN_AT: tl.constexpr, GROUP: tl.constexpr, STEP: tl.constexpr,
):
    """Grid (cdiv(N, GROUP), mask heads, mask batches): what
    ``block_mask.find_band`` needs to know of a mask, in one pass over it.

    The first batch and head: per row its first and last band key taking
    part and how many take part, ``Rows[row] = (first, last, count)``
    (first = M, last = -1 for none); ``Flags`` gets bit 1 where a key
    taking part has a float value other than 0 (NaN included) and bit 2
    where a band key is hidden by a finite float value. Every other batch
    and head: bit 4 where a value differs from the first's.
    """
    g = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = g * GROUP + tl.arange(0, GROUP)
    real = offs_m < N
    row_off = offs_m.to(tl.int64)[:, None] * stride_mask_q
    rows = Mask + b.to(tl.int64) * stride_mask_b + h.to(tl.int64) * stride_mask_h + row_off
    first = tl.full([GROUP], 0, tl.int32) + M
    last = tl.full([GROUP], -1, tl.int32)
    count = tl.zeros([GROUP], tl.int32)
    bits = tl.zeros([GROUP], tl.int32)
    if (b == 0) & (h == 0):
        for start in range(0, M, STEP):
            offs_n = start + tl.arange(0, STEP)
            vis = _visible(offs_m, offs_n, N, M, diag_off, window_left, window_right, HAS_WINDOW_LEFT,
                           HAS_WINDOW_RIGHT)
            mv = tl.load(rows + offs_n[None, :] * stride_mask_k, mask=real[:, None] & (offs_n < M)[None, :], other=0)
            takes = _mask_takes_part(mv, MASK_KIND, HIDDEN_AT)
            part = takes & vis
            first = tl.minimum(first, tl.min(tl.where(part, offs_n[None, :], M), 1))
            last = tl.maximum(last, tl.max(tl.where(part, offs_n[None, :], -1), 1))
            count += tl.sum(part.to(tl.int32), 1)
            if MASK_KIND != MASK_BOOL_C:
                x = mv.to(tl.float32)
                bits = bits | tl.max((part & (x != 0.0)).to(tl.int32), 1)
                bits = bits | tl.max((vis & (~takes) & (x > float("-inf"))).to(tl.int32), 1) * 2
        tl.store(Rows + offs_m * 3, first, mask=real)
        tl.store(Rows + offs_m * 3 + 1, last, mask=real)
        tl.store(Rows + offs_m * 3 + 2, count, mask=real)
    else:
        rows0 = Mask + row_off
        for start in range(0, M, STEP):
            offs_n = start + tl.arange(0, STEP)
            inside = real[:, None] & (offs_n < M)[None, :]
            mv = tl.load(rows + offs_n[None, :] * stride_mask_k, mask=inside, other=0)
            mv0 = tl.load(rows0 + offs_n[None, :] * stride_mask_k, mask=inside, other=0)
            bits = bits | tl.max((mv != mv0).to(tl.int32), 1) * 4
    tl.atomic_or(Flags, tl.reduce(bits, 0, _or_bits))


def mask_band_rows(mask: torch.Tensor, N: int, M: int, band: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over a mask for ``block_mask.find_band`` (``_mask_band_rows``).

    Args:
        mask: expanded to (B, Hq, N, M) as ``mask_key_table`` takes it.
        N, M: queries and keys.
        band: ``launch.kernel_band``'s dict.

    Returns:
        ``(rows, flags)``: int32 (N, 3), each row's first and last key taking
        part and their count in the first batch and head; int32 (1,), the
        kernel's flag bits (1: a key taking part is not neutral; 2: a finite
        value hides a band key; 4: another batch or head differs).
    """
    Bm, Hm = _table_shape(mask)
    rows = torch.empty(N, 3, dtype=torch.int32, device=mask.device)
    flags = torch.zeros(1, dtype=torch.int32, device=mask.device)
    kind = mask_kind(mask)
    meta = dict(HAS_WINDOW_LEFT=band["has_window_left"], HAS_WINDOW_RIGHT=band["has_window_right"], MASK_KIND=kind,
                HIDDEN_AT=mask_hidden_at(mask.dtype == torch.float16), GROUP=ROW_GROUP)
    args = (mask, rows, flags, *mask.stride(), N, M, band["diag_off"], band["window_left"], band["window_right"])
    # The key table's config: the same pass along each row group's keys.
    _launch(_band_launcher, lambda: _KEY_CONFIG, mask, (cdiv(N, ROW_GROUP), Hm, Bm), args, meta)
    return rows, flags


def mask_hidden_at(mask_is_fp16: bool) -> float:
    """Float-mask values at or below this hide a score (see ``_mask_takes_part``).

    Models mark hidden keys with -inf or their dtype's lowest value: about
    -3.4e38 in float32 and bfloat16, -65504 in float16. Next to any score the
    mask leaves visible, ``exp`` of such a value underflows to exactly 0, so
    the kernels may skip a block of them without changing the result.
    """
    return -65504.0 if mask_is_fp16 else -1.0e38


def fill_hides(mask_fill: float) -> bool:
    """Whether the pairs a bool mask fills with ``mask_fill`` may be skipped
    like hidden ones (in rows that do not average): at or below -65504, the
    lowest float16, ``exp`` of the fill underflows to exactly 0 next to any
    score a row sees. Higher fills (e.g. 0) take part: no tables then."""
    return mask_fill <= -65504.0


def _table_shape(mask: torch.Tensor) -> tuple[int, int]:
    """(Bm, Hm): 1 over a dimension the mask broadcasts (stride 0)."""
    B, H = mask.shape[0], mask.shape[1]
    stride_mask_b, stride_mask_h = mask.stride()[:2]
    return (1 if stride_mask_b == 0 else B), (1 if stride_mask_h == 0 else H)


def _meta(mask: torch.Tensor, has_window_left: bool, has_window_right: bool, fills: bool) -> dict:
    kind = mask_kind(mask)
    return dict(HAS_WINDOW_LEFT=has_window_left, HAS_WINDOW_RIGHT=has_window_right, MASK_KIND=kind,
                HIDDEN_AT=mask_hidden_at(mask.dtype == torch.float16), AVERAGES=kind == MASK_FLOAT or fills)


def mask_key_table(
    mask: torch.Tensor, N: int, M: int, *, diag_off: int, window_left: int, window_right: int,
    has_window_left: bool, has_window_right: bool, fills: bool = False,
) -> torch.Tensor:
    """Key ranges of each group of ``ROW_GROUP`` query rows of a mask.

    Args:
        mask: the mask expanded to (B, Hq, N, M): bool (as
            ``launch.bool_mask_as_bytes`` gives it) or floating. Dimensions it
            broadcasts over (stride 0) are computed once.
        N, M: queries and keys.
        diag_off, window_left, window_right, has_window_left,
        has_window_right: the band, as the attention kernels take it.
        fills: a bool mask whose hidden pairs score a finite fill (see
            ``fill_hides``): rows it hides entirely average their band keys.

    Returns:
        int32 (Bm, Hm, cdiv(N, ROW_GROUP), 5): ``(lo, hi, free_lo, free_hi,
        averages)`` per group (see ``_mask_key_table``), where Bm and Hm are
        1 over a broadcast batch / head dimension and B / Hq otherwise. Index
        it with ``table_strides``.
    """
    Bm, Hm = _table_shape(mask)
    groups = cdiv(N, ROW_GROUP)
    # Every entry is written: no fill. A tensor of its own (see launch._traced).
    table = torch.empty(Bm, Hm, groups, KEY_ENTRY, dtype=torch.int32, device=mask.device)
    args = (mask, table, *mask.stride(), *table.stride()[:2], N, M, diag_off, window_left, window_right)
    meta = dict(_meta(mask, has_window_left, has_window_right, fills), GROUP=ROW_GROUP)
    _launch(_key_launcher, lambda: _KEY_CONFIG, mask, (groups, Hm, Bm), args, meta)
    return table


def mask_query_table(
    mask: torch.Tensor, key_table: torch.Tensor, N: int, M: int, *, diag_off: int, window_left: int,
    window_right: int, has_window_left: bool, has_window_right: bool, fills: bool = False,
) -> torch.Tensor:
    """Query ranges of each group of ``COL_GROUP`` keys of a mask.

    Args: as ``mask_key_table``, plus ``key_table``, its result for the same
    mask, band and fill (read for float masks and fills: rows that average
    take part).

    Returns:
        int32 (Bm, Hm, cdiv(M, COL_GROUP), 4): ``(lo, hi, free_lo,
        free_hi)`` over query rows per group of keys (see
        ``_mask_query_table``).
    """
    Bm, Hm = _table_shape(mask)
    groups = cdiv(M, COL_GROUP)
    table = torch.empty(Bm, Hm, groups, QUERY_ENTRY, dtype=torch.int32, device=mask.device)
    args = (mask, key_table, table, *mask.stride(), *table_strides(key_table), *table.stride()[:2],
            N, M, diag_off, window_left, window_right)
    meta = dict(_meta(mask, has_window_left, has_window_right, fills), GROUP=COL_GROUP, ROW_GROUP=ROW_GROUP)
    _launch(_query_launcher, lambda: _QUERY_CONFIG, mask, (groups, Hm, Bm), args, meta)
    return table


def mask_tables(
    mask: torch.Tensor, N: int, M: int, band: dict, *, fills: bool, key_table: torch.Tensor | None = None,
    query_table: torch.Tensor | None = None, keys: bool = True, queries: bool = True,
    unread: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The key and query tables of a mask for one band and fill: the one
    builder of the forward and backward launchers and of block masks, so
    that tables built ahead (``flashfuse.block_mask``) are the ones a
    launcher would build.

    Args:
        mask: as ``mask_key_table`` takes it (expanded; a bool mask as bytes).
        N, M: queries and keys.
        band: ``launch.kernel_band``'s dict (or ``AttentionProblem.band()``).
        fills: a bool mask whose hidden pairs score a finite fill.
        key_table, query_table: tables already built for this mask, band
            and fill (a block mask's), kept as they are.
        keys, queries: which tables are wanted when not given; the query
            pass reads the key table only for float masks and fills, so
            ``keys=False`` is for a bool mask without a fill.
        unread: what the query pass gets in place of a key table it never
            reads (``keys=False``).

    Returns:
        ``(key_table, query_table)``, None for one neither given nor wanted.
    """
    if key_table is None and keys:
        key_table = mask_key_table(mask, N, M, **band, fills=fills)
    if query_table is None and queries:
        query_table = mask_query_table(mask, key_table if key_table is not None else unread, N, M, **band,
                                       fills=fills)
    return key_table, query_table


def _launch(launcher: ConfigLauncher, config, mask: torch.Tensor, grid: tuple, args: tuple, meta: dict) -> None:
    """Run a table pass: its one config (``config()``, read at call time so
    that the benchmark can swap it) through the launcher on the mask's
    device, or the kernel itself under the interpreter."""
    if _interpreting(mask):
        launcher.kernel[grid](*args, **meta, **config().kwargs)
    else:
        with torch.cuda.device(mask.device):  # the mask's device, whatever the current one
            launcher((mask.dtype, mask.device, tuple(meta.items())), lambda: [config()], lambda m: grid,
                     *args, **meta)


def table_strides(table: torch.Tensor) -> tuple[int, int]:
    """Batch and head strides of a table for the kernels: 0 over a dimension
    the mask broadcasts (size 1), so every (batch, head) finds its entry with
    the same indexing."""
    return tuple(st if n > 1 else 0 for st, n in zip(table.stride()[:2], table.shape[:2]))


_KEY_CONFIG = triton.Config({"STEP": _ROW_STEP}, num_warps=4, num_stages=2)
_QUERY_CONFIG = triton.Config({"STEP": _COL_STEP}, num_warps=4, num_stages=2)
_key_launcher = ConfigLauncher(_mask_key_table)
_band_launcher = ConfigLauncher(_mask_band_rows)
_query_launcher = ConfigLauncher(_mask_query_table)
