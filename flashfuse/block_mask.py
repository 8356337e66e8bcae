"""Block masks: the mask tables built once and shared by every attention that
uses the mask (every layer of a model, and each layer's backward).

``flashfuse::attention`` with a mask tensor reads two small tables that say,
per block of the score matrix, which blocks the mask hides and where it is
neutral (``kernels/mask_ranges.py``). Without a block mask each call builds
them again: one pass over the mask in every layer's forward and two in its
backward. A block mask builds them once:

* ``flashfuse::block_mask(mask, q_len, kv_len, *, window_left, window_right,
  bottom_right, mask_fill, queries) -> (key_table, query_table)``, an op with
  a fake implementation, so a graph traced by ``torch.compile`` holds one
  node per mask (the graph pass emits one per distinct mask and band);
* ``attention(..., mask_key_table=, mask_query_table=)`` takes the tables
  instead of building them, and autograd saves them for the backward;
* :func:`block_mask` / :class:`BlockMask`, the same for users calling
  :func:`flashfuse.attention` directly.

Why the tables can be shared by every kernel config: they are kept at a
fixed granularity that does not depend on the kernels' tiles, one entry per
``ROW_GROUP`` (16) query rows and per ``COL_GROUP`` (32) keys, divisors of
every tile the forward, dQ and dK/dV kernels may be tuned to; a kernel reads
the entries its tile covers and takes their union. So a table's shape depends
only on the mask's shape, N and M, and is known without the data (the fake
implementation), whatever config the autotuner picks later.

A mask can also be a band in disguise: a causal or sliding-window pattern
written out as a tensor (a model's own tril mask, a mask built block by
block). :func:`block_mask` reads the mask once to find out
(:func:`find_band`); the calls then run the band's kernels with no mask and
no tables, which is what the mask computes, without its per-tile cost.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import config, reference
from . import ops as _ops

__all__ = ["BlockMask", "MaskBand", "block_mask", "check_tables", "find_band", "table_shapes"]

# Fixed table granularity (see the module docstring); equal to
# kernels.mask_ranges.ROW_GROUP / COL_GROUP, which import Triton.
ROW_GROUP, COL_GROUP = 16, 32
KEY_ENTRY, QUERY_ENTRY = 5, 4
# Fills at or below this may be skipped like hidden pairs
# (``mask_ranges.fill_hides``); higher fills make the kernels build no tables.
_FILL_HIDES_AT = -65504.0

_OP_DOC = "block_mask"
# find_band reads masks up to this many distinct elements (a (1, 1, 8k, 8k)
# or (8, 1, 4k, 4k) mask), in chunks of _BAND_CHUNK so that its temporaries
# stay a few tens of MB whatever the mask's size; larger masks keep their tables.
BAND_CHECK_MAX_ELEMENTS = 1 << 27
_BAND_CHUNK = 1 << 22


def _mask_batch_heads(mask: Tensor) -> tuple[int, int]:
    """The tables' (batch, heads): the mask's own, 1 where it has none."""
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return shape[0], shape[1]


def table_fill(mask_fill: Optional[float]) -> tuple[Optional[float], bool]:
    """A bool mask's fill as the tables are built for it (-inf as None),
    and whether the kernels read tables at all: not for a fill too high to
    skip filled pairs."""
    if mask_fill is None or mask_fill == -math.inf:
        return None, True
    return mask_fill, mask_fill <= _FILL_HIDES_AT


def _uses_tables(mask: Tensor, mask_fill: Optional[float]) -> bool:
    """Whether the kernels read tables for this mask and fill."""
    return mask.dtype != torch.bool or table_fill(mask_fill)[1]


def table_shapes(mask: Tensor, q_len, kv_len, mask_fill: Optional[float], queries: bool):
    """Shapes of ``(key_table, query_table)`` for a mask: (Bm, Hm,
    cdiv(N, 16), 5) and (Bm, Hm, cdiv(M, 32), 4), where Bm and Hm are the
    mask's batch and head sizes (1 where it broadcasts); (0,) for a table not
    built (a fill too high to skip, or no query table asked for)."""
    if not _uses_tables(mask, mask_fill):
        return (0,), (0,)
    Bm, Hm = _mask_batch_heads(mask)
    keys = (Bm, Hm, -(-q_len // ROW_GROUP), KEY_ENTRY)
    return keys, ((Bm, Hm, -(-kv_len // COL_GROUP), QUERY_ENTRY) if queries else (0,))


def _kernels_available(mask: Tensor) -> bool:
    """The table kernels can run: CUDA, or CPU under Triton's interpreter
    (as ``ops._use_triton`` decides for the attention)."""
    k = _ops._kernels
    if k is None:
        return False
    if mask.device.type == "cuda":
        return True
    return k.BUILT_FOR_INTERPRETER and config.interpreter_on()


def _kernel_args(mask: Tensor, N: int, M: int, window_left, window_right, bottom_right: bool):
    """The kernel modules, the mask as the table and band kernels read it
    (expanded to (Bm, Hm, N, M), a bool mask as bytes) and the band as they
    take it (``launch.kernel_band``: the attention kernels' own rule)."""
    kernels = _ops._kernels.modules()
    Bm, Hm = _mask_batch_heads(mask)
    arg = mask.expand(Bm, Hm, N, M)
    if arg.dtype == torch.bool:
        arg = kernels.launch.bool_mask_as_bytes(arg)
    return kernels, arg, kernels.launch.kernel_band(N, M, window_left, window_right, bottom_right)


def _block_mask(mask: Tensor, q_len: int, kv_len: int, window_left: Optional[int] = None,
                window_right: Optional[int] = None, bottom_right: bool = False,
                mask_fill: Optional[float] = None, queries: bool = True) -> tuple[Tensor, Tensor]:
    """The tables, exactly as the attention launchers would build them for
    this mask, band and fill: the same band (``launch.kernel_band``) and the
    same builder (``mask_ranges.mask_tables``)."""
    key_shape, query_shape = table_shapes(mask, q_len, kv_len, mask_fill, queries)
    if len(key_shape) == 1 or q_len == 0 or kv_len == 0 or not _kernels_available(mask):
        # No tables to build (CPU's blockwise path reads none, nothing reads
        # them for an empty N or M): zeros of the promised shapes, two
        # tensors (an op's outputs may not alias each other).
        return mask.new_zeros(key_shape, dtype=torch.int32), mask.new_zeros(query_shape, dtype=torch.int32)
    N, M = q_len, kv_len
    kernels, arg, band = _kernel_args(mask, N, M, window_left, window_right, bottom_right)
    keys, qs = kernels.mask_ranges.mask_tables(arg, N, M, band, fills=mask.dtype == torch.bool and mask_fill is not None,
                           queries=queries)
    if not queries:
        qs = mask.new_empty((0,), dtype=torch.int32)

    def full(t, shape):
        # A dimension the mask broadcasts through stride 0 gets one entry
        # from mask_ranges; the promised shape follows the mask's sizes.
        return t if tuple(t.shape) == tuple(shape) else t.expand(shape).contiguous()

    return full(keys, key_shape), (full(qs, query_shape) if queries else qs)


def _block_mask_fake(mask, q_len, kv_len, window_left=None, window_right=None, bottom_right=False,
                     mask_fill=None, queries=True):
    key_shape, query_shape = table_shapes(mask, q_len, kv_len, mask_fill, queries)
    return mask.new_empty(key_shape, dtype=torch.int32), mask.new_empty(query_shape, dtype=torch.int32)


# CPU: an opaque op (as ops' CPU attention ops), so that AOTAutograd never
# traces into an interpreted launch.
_ops._lib.define(
    "_block_mask_cpu(Tensor mask, SymInt q_len, SymInt kv_len, SymInt? window_left=None, "
    "SymInt? window_right=None, bool bottom_right=False, float? mask_fill=None, bool queries=True) "
    "-> (Tensor, Tensor)"
)
_ops._lib.impl("_block_mask_cpu", _block_mask, "CPU")
torch.library.register_fake("flashfuse::_block_mask_cpu", _block_mask_fake, lib=_ops._lib)


@torch.library.triton_op("flashfuse::block_mask", mutates_args=())
def _block_mask_op(
    mask: Tensor, q_len: int, kv_len: int, *, window_left: Optional[int] = None,
    window_right: Optional[int] = None, bottom_right: bool = False, mask_fill: Optional[float] = None,
    queries: bool = True,
) -> tuple[Tensor, Tensor]:
    """The mask tables of ``mask`` for attention of ``q_len`` queries over
    ``kv_len`` keys with this band and fill: see :func:`block_mask`. The
    arguments are the private attention ops' (``window_right=0`` is causal;
    ``mask_fill`` normalised, None for -inf)."""
    args = (mask, q_len, kv_len, window_left, window_right, bottom_right, mask_fill, queries)
    if mask.device.type == "cuda":
        return _block_mask(*args)
    return torch.ops.flashfuse._block_mask_cpu(*args)


_block_mask_op.register_fake(_block_mask_fake)


@dataclasses.dataclass(frozen=True)
class MaskBand:
    """The band a mask acts as (see :func:`find_band`), as the attention
    op takes one: ``window_right=0`` is causal, None an open side."""

    window_left: Optional[int]
    window_right: Optional[int]
    alignment: str


def _band_check_possible(mask: Tensor, q_len: int, kv_len: int) -> bool:
    """Whether find_band may read the mask now: a plain tensor with real
    data (not traced, fake or functional: those are subclasses), no
    gradient wanted for it, not inside a CUDA graph capture (the check
    synchronises), and not too large to read."""
    if type(mask) is not Tensor or q_len == 0 or kv_len == 0 or mask.requires_grad \
            or torch.compiler.is_compiling():
        return False
    if mask.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    Bm, Hm = _mask_batch_heads(mask)
    return Bm * Hm * q_len * kv_len <= BAND_CHECK_MAX_ELEMENTS


# find_band's flag bits (``mask_ranges._mask_band_rows``).
_NOT_NEUTRAL, _FINITE_HIDDEN, _DIFFERS = 1, 2, 4


def _band_rows_kernel(mask, N, M, window_left, window_right, alignment):
    """Per row of the first batch and head: first and last key taking part
    and their count (CPU int64), and the flag bits, from one kernel pass
    over the mask and one copy to the host."""
    kernels, arg, band = _kernel_args(mask, N, M, window_left, window_right, alignment == "bottom_right")
    rows, flags = kernels.mask_ranges.mask_band_rows(arg, N, M, band)
    host = torch.cat([flags, rows.reshape(-1)]).cpu().long()
    rows = host[1:].view(N, 3)
    return rows[:, 0], rows[:, 1], rows[:, 2], int(host[0])


def _band_rows_torch(mask, N, M, window_left, window_right, alignment):
    """``_band_rows_kernel`` in torch operations, where the kernels cannot
    run (CPU without Triton's interpreter): the mask read in row chunks of
    ``_BAND_CHUNK`` elements, so that temporaries stay small."""
    Bm, Hm = _mask_batch_heads(mask)
    own4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(Bm, Hm, -1, -1)
    x2 = own4[0, 0].expand(N, M)  # the first batch and head; the others must equal it
    is_bool = mask.dtype == torch.bool
    # mask_ranges.mask_hidden_at's values, not imported from there: this
    # path serves where the Triton kernels are not to be defined.
    hidden_at = -65504.0 if mask.dtype == torch.float16 else -1.0e38
    dev = mask.device
    flags = torch.zeros((), dtype=torch.long, device=dev)
    firsts, lasts, counts = [], [], []
    with torch.no_grad():
        if Bm * Hm > 1:
            rows = max(1, _BAND_CHUNK // (Bm * Hm * own4.shape[3]))
            for r0 in range(0, own4.shape[2], rows):
                x = own4[:, :, r0:r0 + rows]
                flags |= (x != x[:1, :1]).any().long() * _DIFFERS
        rows = max(1, _BAND_CHUNK // M)
        for r0 in range(0, N, rows):
            x = x2[r0:r0 + rows]
            in_band = reference.visibility_mask(N, M, window_left=window_left, window_right=window_right,
                                                bottom_right=alignment == "bottom_right",
                                                rows=(r0, r0 + x.shape[0]), device=dev)
            if in_band is None:  # no band: every key
                in_band = torch.ones(x.shape, dtype=torch.bool, device=dev)
            if is_bool:
                takes_part = x & in_band
            else:
                part = (x > hidden_at) | torch.isnan(x)
                takes_part = part & in_band
                flags |= (takes_part & (x != 0)).any().long() * _NOT_NEUTRAL
                flags |= (in_band & ~part & torch.isfinite(x)).any().long() * _FINITE_HIDDEN
            counts.append(takes_part.sum(-1))
            # argmax gives the first maximal index: the first (last) key taking part.
            as_bytes = takes_part.to(torch.uint8)
            firsts.append(as_bytes.argmax(-1))
            lasts.append(M - 1 - as_bytes.flip(-1).argmax(-1))
        host = torch.cat([flags.view(1), *firsts, *lasts, *counts]).cpu()
    return host[1:N + 1], host[N + 1:2 * N + 1], host[2 * N + 1:], int(host[0])


def find_band(
    mask: Tensor,
    q_len: int,
    kv_len: int,
    *,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    alignment: str = "top_left",
    mask_fill: Optional[float] = None,
) -> Optional[MaskBand]:
    """The band (causal, sliding window, or none) that, with no mask, gives
    exactly what ``mask`` gives inside the band and fill passed; None when
    there is none (or the mask cannot be read now, see below).

    A mask is a band when, in every batch and head it holds, the pairs it
    lets take part (inside the band passed) are those with
    ``lo <= j - i <= hi`` for one ``lo`` and ``hi``, and it leaves them as
    they are: bool True, or float exactly 0. The pairs it hides must take no
    part: bool False (a ``mask_fill`` at or below -65504 counts as hidden
    only when every row keeps a key, as then ``exp`` of it is exactly 0),
    float -inf or values at or below the kernels' hiding threshold (-1e38;
    -65504 for float16; finite ones again only when every row keeps a key,
    since a row they hide entirely averages them).

    Reads the mask once on its device in chunks and synchronises once.
    Returns None without reading for an empty problem, a mask that needs its
    gradient, a traced or fake mask, during CUDA graph capture, and for
    masks of more than ``BAND_CHECK_MAX_ELEMENTS`` distinct (batch, head,
    query, key) elements.
    """
    N, M = int(q_len), int(kv_len)
    fill, _ = table_fill(mask_fill)
    if mask.dtype == torch.bool and fill is not None and fill > _FILL_HIDES_AT:
        return None  # filled pairs take part with a score of their own
    if not _band_check_possible(mask, N, M):
        return None
    first = None
    if _kernels_available(mask):
        try:
            first, last, count, flags = _band_rows_kernel(mask, N, M, window_left, window_right, alignment)
        except Exception as e:  # the check is an optimisation: it must never fail block_mask
            warnings.warn(f"flashfuse.find_band: the band kernel failed ({type(e).__name__}: {e}); "
                          "checking with torch operations instead", RuntimeWarning, stacklevel=2)
    if first is None:
        first, last, count, flags = _band_rows_torch(mask, N, M, window_left, window_right, alignment)
    if flags & (_NOT_NEUTRAL | _DIFFERS):
        return None
    kept = count > 0
    if not bool(kept.any()):
        return None
    if (flags & _FINITE_HIDDEN or fill is not None) and not bool(kept.all()):
        return None  # a row hidden entirely by finite values averages them
    # The band's bounds on j - i, from the rows that keep a key; then every
    # row, kept or not, must be that band's.
    i = torch.arange(N)
    lo = int(torch.where(kept, first - i, 2 * (N + M)).min())
    hi = int(torch.where(kept, last - i, -2 * (N + M)).max())
    want_first = torch.clamp(i + lo, min=0)
    want_last = torch.clamp(i + hi, max=M - 1)
    want_count = torch.clamp(want_last - want_first + 1, min=0)
    if not bool(((count == want_count) & (~kept | ((first == want_first) & (last == want_last)))).all()):
        return None
    # The same pattern as the op's arguments: windows >= 0, None where no row reaches the bound.
    open_left, open_right = N - 1 + lo <= 0, hi >= M - 1
    own = M - N if alignment == "bottom_right" else 0
    found = []
    for align, o in ((alignment, own), ("bottom_right" if alignment == "top_left" else "top_left", M - N - own)):
        wl = None if open_left else o - lo
        wr = None if open_right else hi - o
        if (wl is None or wl >= 0) and (wr is None or wr >= 0):
            found.append(MaskBand(wl, wr, align))
    # Causal (window_right = 0) first: the kernels' most used band.
    found.sort(key=lambda b: b.window_right != 0)
    return found[0] if found else None


_find_band = find_band  # block_mask's argument of the same name hides it there


def check_tables(query: Tensor, key: Tensor, attn_mask: Optional[Tensor], key_table: Optional[Tensor],
                 query_table: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Check the tables passed to ``flashfuse::attention`` (``ValueError``
    for a mismatch the shapes show) and return them, None for an empty one
    (a table not built). Whether they were built for this mask and band
    cannot be checked without the data: :class:`BlockMask` and the graph
    pass guarantee it."""
    tables = []
    B, Hq, N = query.shape[0], query.shape[1], query.shape[2]
    M = key.shape[2]
    for name, t, groups, entry in (("mask_key_table", key_table, -(-N // ROW_GROUP), KEY_ENTRY),
                                   ("mask_query_table", query_table, -(-M // COL_GROUP), QUERY_ENTRY)):
        if t is None or t.numel() == 0 and t.dim() == 1:
            tables.append(None)
            continue
        if attn_mask is None:
            raise ValueError(f"flashfuse.attention: {name} was given without the attn_mask it was built from")
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"flashfuse.attention: {name} must be int32 on {query.device}, got {t.dtype} on "
                             f"{t.device}; build it with flashfuse.block_mask")
        if t.dim() != 4 or t.shape[0] not in (1, B) or t.shape[1] not in (1, Hq) or t.shape[2] != groups \
                or t.shape[3] != entry:
            raise ValueError(
                f"flashfuse.attention: {name} of shape {tuple(t.shape)} does not fit (batch, heads, "
                f"query_len, key_len) = {(B, Hq, N, M)}: it was built for another problem; "
                "build the block mask with this query and key length"
            )
        tables.append(t)
    if tables[1] is not None and tables[0] is None:
        raise ValueError("flashfuse.attention: mask_query_table needs the mask_key_table built with it")
    return tables[0], tables[1]


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """A mask with its tables, built once by :func:`block_mask` and passed
    as ``attn_mask`` to every :func:`flashfuse.attention` call that uses it.

    Attributes:
        mask: the mask tensor, bool (True takes part) or floating (added to
            the scores), broadcastable to (B, H, q_len, kv_len).
        key_table: int32 (Bm, Hm, ceil(q_len / 16), 5), Bm / Hm the mask's
            batch / head sizes (1 where it broadcasts): per 16 query rows,
            the keys that take part and the keys the mask leaves neutral.
        query_table: int32 (Bm, Hm, ceil(kv_len / 32), 4): the same per 32
            keys over query rows (for the backward); shape (0,) when built
            with ``backward=False`` (the backward then builds it itself).
        q_len, kv_len: the query and key lengths it was built for.
        window_left, window_right, alignment, mask_fill: the band and fill
            it was built for (``is_causal`` is ``window_right=0``).
        band: the band the mask acts as (:func:`find_band`), or None. When
            set, the calls run that band with no mask and no tables (the
            tables are then not built: shape (0,)).
    """

    mask: Tensor
    key_table: Tensor
    query_table: Tensor
    q_len: int
    kv_len: int
    window_left: Optional[int]
    window_right: Optional[int]
    alignment: str
    mask_fill: Optional[float]
    band: Optional[MaskBand] = None

    def attention_args(self, query: Tensor, key: Tensor, is_causal: bool, window_left, window_right,
                       alignment: str, mask_fill) -> dict:
        """The op's mask, band and table arguments for a call that passes
        this block mask with these band arguments; ``ValueError`` when they
        contradict the band it was built for, or the lengths differ."""
        if query.shape[2] != self.q_len or key.shape[2] != self.kv_len:
            raise ValueError(
                f"flashfuse.attention: the block mask was built for q_len={self.q_len}, kv_len={self.kv_len}, "
                f"but query has {query.shape[2]} rows and key {key.shape[2]}; build one for these lengths"
            )
        given_right = _ops.causal_window_right(is_causal, window_right)
        for name, given, own, default in (("is_causal / window_right", given_right, self.window_right, None),
                                          ("window_left", window_left, self.window_left, None),
                                          ("alignment", alignment, self.alignment, "top_left"),
                                          ("mask_fill", mask_fill, self.mask_fill, None)):
            if given != default and given != own:
                raise ValueError(
                    f"flashfuse.attention: {name}={given!r} contradicts the block mask, built with {own!r}; "
                    "the band belongs to the block mask: pass it to flashfuse.block_mask"
                )
        if self.band is not None:
            b = self.band
            return dict(attn_mask=None, is_causal=False, window_left=b.window_left, window_right=b.window_right,
                        alignment=b.alignment, mask_fill=None, mask_key_table=None, mask_query_table=None)
        return dict(attn_mask=self.mask, is_causal=False, window_left=self.window_left,
                    window_right=self.window_right, alignment=self.alignment, mask_fill=self.mask_fill,
                    mask_key_table=self.key_table, mask_query_table=self.query_table)


def block_mask(
    mask: Tensor,
    q_len: Optional[int] = None,
    kv_len: Optional[int] = None,
    *,
    is_causal: bool = False,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    alignment: str = "top_left",
    mask_fill: Optional[float] = None,
    backward: bool = True,
    find_band: bool = True,
) -> BlockMask:
    """Build a mask's tables once, for every attention call that uses it.

    Pass the result as ``attn_mask`` to :func:`flashfuse.attention` (in every
    layer): the calls read the tables instead of scanning the mask again, and
    their backward reuses them. The results are bit-identical to passing the
    mask itself; for a mask found to be a band (``find_band``), they are the
    band's, which computes the same softmax over the same keys.

    Args:
        mask: bool (True takes part) or floating (added to the scaled
            scores), broadcastable to (B, H, q_len, kv_len), e.g. a padding
            mask (B, 1, 1, kv_len) or a causal one (1, 1, q_len, kv_len).
            Dimensions it broadcasts over are computed once.
        q_len, kv_len: query and key lengths (N, M); default the mask's last
            two sizes (give them when it broadcasts over one).
        is_causal, window_left, window_right, alignment, mask_fill: the band
            and fill of the attention calls, as :func:`flashfuse.attention`
            takes them; the calls then take them from the block mask.
        backward: also build the query table the backward reads (False for
            inference: one pass over the mask instead of two).
        find_band: first read the mask to see whether it is a band in
            disguise (a causal or sliding-window pattern, or nothing hidden,
            written out as a tensor; see :func:`find_band`). If so, ``band``
            is set and the calls run that band without the mask: the same
            result, without the mask's cost. This check synchronises with
            the device once; False skips it. Skipped anyway for a mask that
            needs its gradient, under tracing or CUDA graph capture, and
            for masks above ``BAND_CHECK_MAX_ELEMENTS`` elements.

    Returns:
        a :class:`BlockMask`. Its tables hold int32 (Bm, Hm, ceil(N / 16), 5)
        and (Bm, Hm, ceil(M / 32), 4) entries, Bm / Hm the mask's batch and
        head sizes (1 where it broadcasts): a few bytes per 16 x 32 block.
        Reuse it only while the mask is unchanged: the tables describe the
        values the mask had when it was built.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"flashfuse.block_mask: mask must be a Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ValueError(f"flashfuse.block_mask: mask dtype {mask.dtype} is not supported; use bool or floating")
    if mask.dim() < 2 or mask.dim() > 4:
        raise ValueError(f"flashfuse.block_mask: mask must have 2 to 4 dimensions, got shape {tuple(mask.shape)}")
    N = mask.shape[-2] if q_len is None else int(q_len)
    M = mask.shape[-1] if kv_len is None else int(kv_len)
    if mask.shape[-2] not in (1, N) or mask.shape[-1] not in (1, M):
        raise ValueError(f"flashfuse.block_mask: mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"(q_len, kv_len) = {(N, M)}")
    if alignment not in _ops.ALIGNMENTS:
        raise ValueError(f"flashfuse.block_mask: alignment must be one of {_ops.ALIGNMENTS}, got {alignment!r}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if w is not None and w < 0:
            raise ValueError(f"flashfuse.block_mask: {name} must be None or >= 0, got {w}")
    fill, _ = table_fill(_ops.check_mask_fill(mask, mask_fill))
    window_right = _ops.causal_window_right(is_causal, window_right)
    band = None
    if find_band:
        band = _find_band(mask, N, M, window_left=window_left, window_right=window_right,
                           alignment=alignment, mask_fill=fill)
    if band is not None:  # no tables: the calls run the band
        no_table = mask.new_empty((0,), dtype=torch.int32)
        return BlockMask(mask, no_table, no_table, N, M, window_left, window_right, alignment, fill, band)
    keys, queries = torch.ops.flashfuse.block_mask(
        mask, N, M, window_left=window_left, window_right=window_right, bottom_right=alignment == "bottom_right",
        mask_fill=fill, queries=backward,
    )
    return BlockMask(mask, keys, queries, N, M, window_left, window_right, alignment, fill)
