"""PyTorch implementations of flashfuse attention.

Three things live here:

* ``reference_attention`` / ``reference_lse``: the float64 ground truth that
  every other implementation is tested against. It materialises the full score
  matrix, so it is for tests only.
* ``dropout_keep_mask``: the dropout rule of ``flashfuse.kernels.common``
  (Philox4x32-10 as implemented by ``tl.philox``) re-implemented bit for bit in
  PyTorch integer arithmetic.
* ``blockwise_forward`` / ``blockwise_backward``: the CPU path used when the
  Triton interpreter is off. Same signatures and conventions as the Triton
  launchers (see ARCHITECTURE.md), memory linear in sequence length.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "reference_attention",
    "reference_lse",
    "reference_stored_lse",
    "visibility_mask",
    "dropout_keep_mask",
    "dropout_threshold",
    "blockwise_forward",
    "blockwise_backward",
    "lse_marker",
    "lse_marked_keys",
]


# ---------------------------------------------------------------------------
# rows that a finite mask value hides entirely
# ---------------------------------------------------------------------------

# A row whose every score is a huge finite value (a float mask of
# finfo.min, a bool mask with a finite ``mask_fill``) averages the values of
# the keys holding its largest score, as eager softmax does. Its true lse,
# m + log(l), rounds to m in float32 (log(l) is far below m's spacing), so the
# backward could not recover the probabilities 1 / l from it. Such rows store
# instead the marker ``-FLT_MAX + l * 2**104`` (exact for l < 2**23; within
# l * 2**-24 of the true lse when m is finfo(float32).min), and the backward
# reads l back from it. Real lse values never come near: a row is marked
# only when its largest score is at or below ``_AVERAGE_AT`` (float64 scores
# keep log(l) down to far smaller values) or, with a fill at or below
# ``FILL_MARKS_AT``, equals the fill.
FLT_MAX = 3.4028234663852886e38
LSE_MARK_UNIT = 2.0 ** 104
LSE_MARK_MAX_KEYS = 2 ** 23 - 1
LSE_MARKED_BELOW = -1e38  # a stored lse at or below this is a marker
# Largest scores at or below these: every other score of the row is at
# least 64 (float32) below it, so exp gives exactly the uniform average.
_AVERAGE_AT = {torch.float32: -(2.0 ** 29), torch.float64: -(2.0 ** 58)}
# Fills above this (e.g. 0) leave rows whose visible scores are all below
# the fill as ordinary rows: their lse keeps log(l) anyway.
FILL_MARKS_AT = -1e4


def lse_marker(row_sum: Tensor) -> Tensor:
    """The stored lse of rows that average ``row_sum`` keys (see above)."""
    return -FLT_MAX + row_sum.clamp(max=LSE_MARK_MAX_KEYS) * LSE_MARK_UNIT


def lse_marked_keys(lse: Tensor) -> Tuple[Tensor, Tensor]:
    """``(marked, l)``: which rows of a stored lse are markers, and for those
    the number of keys they average (1 elsewhere)."""
    marked = lse <= LSE_MARKED_BELOW
    count = torch.where(marked, (lse + FLT_MAX) / LSE_MARK_UNIT, torch.ones_like(lse))
    return marked, count


# ---------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------


def visibility_mask(
    N: int,
    M: int,
    *,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    bottom_right: bool = False,
    rows: Optional[Tuple[int, int]] = None,
    cols: Optional[Tuple[int, int]] = None,
    device="cpu",
) -> Optional[Tensor]:
    """Bool (n, m) tile: query ``i`` may look at key ``j`` (causal / window rule).

    Args:
        N: number of queries of the full problem (sets the diagonal offset).
        M: number of keys of the full problem.
        window_left: keys at most this far left of the diagonal are visible
            (``None``: no left bound).
        window_right: keys at most this far right of the diagonal are visible
            (``None``: no right bound; ``0`` is causal).
        bottom_right: diagonal offset ``M - N`` (aligned to the bottom-right
            corner) instead of 0 (top-left).
        rows: ``(start, stop)`` query range of the tile; default all N.
        cols: ``(start, stop)`` key range of the tile; default all M.
        device: device of the result.

    Returns:
        ``None`` when there is no window at all (everything visible), else a
        bool tensor of shape (rows, cols).
    """
    if window_left is None and window_right is None:
        return None
    r0, r1 = rows if rows is not None else (0, N)
    c0, c1 = cols if cols is not None else (0, M)
    off = (M - N) if bottom_right else 0
    i = torch.arange(r0, r1, device=device).unsqueeze(1)
    j = torch.arange(c0, c1, device=device).unsqueeze(0)
    vis = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
    if window_right is not None:
        vis = vis & (j <= i + off + window_right)
    if window_left is not None:
        vis = vis & (j >= i + off - window_left)
    return vis


def _reference_scores(q, k, attn_mask, scale, window_left, window_right, bottom_right, mask_fill=None,
                      softcap=None):
    """float64 (B, Hq, N, M) scores with -inf where a key does not take part
    (``mask_fill`` where a bool mask hides it, if given); soft-capped before
    the mask, as Gemma 2 and flash-attn do."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-d (B, H, L, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    group = Hq // Hkv
    q64 = q.to(torch.float64)
    # GQA: query head h reads key/value head h // group.
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1)
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            # torch.where passes no gradient to the replaced scores, as
            # eager masked_fill does.
            fill = neg_inf if mask_fill is None else torch.tensor(float(mask_fill), dtype=torch.float64,
                                                                  device=q.device)
            scores = torch.where(attn_mask, scores, fill)
        else:
            scores = scores + attn_mask.to(torch.float64)
        scores = scores.expand(B, Hq, N, M)
    vis = visibility_mask(
        N, M, window_left=window_left, window_right=window_right,
        bottom_right=bottom_right, device=q.device,
    )
    if vis is not None:
        scores = torch.where(vis, scores, neg_inf)
    return scores


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    bottom_right: bool = False,
    dropout_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    mask_fill: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention computed naively in float64: the ground truth for tests.

    Differentiable by autograd with respect to q, k, v and a floating mask;
    rows where no key is visible give output 0 and zero gradients (no NaN).

    Args:
        q: queries (B, Hq, N, D), any float dtype.
        k: keys (B, Hkv, M, D) with ``Hq % Hkv == 0``; query head h reads
            key/value head ``h // (Hq // Hkv)``.
        v: values (B, Hkv, M, Dv).
        attn_mask: None, bool (True takes part) or floating (added to the
            scaled scores); broadcastable to (B, Hq, N, M).
        scale: multiplier of q·k; default ``1 / sqrt(D)``.
        window_left: key j is visible to query i only if
            ``j >= i + off - window_left`` (None: no left bound).
        window_right: key j is visible to query i only if
            ``j <= i + off + window_right`` (None: no right bound; 0: causal).
        bottom_right: ``off = M - N`` if True, else 0.
        dropout_mask: bool (B, Hq, N, M), True keeps the probability; kept
            probabilities are scaled by ``1 / (1 - dropout_p)``. None: no dropout.
        dropout_p: dropout probability used for the rescaling.
        mask_fill: with a bool mask, the score that hidden pairs take instead
            of -inf (``scores.masked_fill(~mask, mask_fill)``: no gradient
            flows to them); None: -inf.
        softcap: the scaled scores become ``softcap * tanh(s / softcap)``
            before the mask; None: no capping.
        sinks: (Hq,) logits appended to every row of their head's scores
            before the softmax, their column dropped after it (gpt-oss).

    Returns:
        float64 tensor (B, Hq, N, Dv).
    """
    scores = _reference_scores(q, k, attn_mask, scale, window_left, window_right, bottom_right, mask_fill,
                               softcap)
    if sinks is not None:
        # gpt-oss's spelling: one more column, softmax, drop it.
        B, Hq, N, _ = scores.shape
        col = sinks.to(torch.float64).reshape(1, Hq, 1, 1).expand(B, Hq, N, 1)
        scores = torch.cat([scores, col], dim=-1)
    # Safe softmax: shift by the row max (0 for rows that are all -inf), and
    # divide by 1 where the row sum is 0, so empty rows give 0, not NaN.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(torch.float64) / (1.0 - dropout_p)
    group = q.shape[1] // k.shape[1]
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
    return torch.matmul(probs, v64)


def reference_lse(
    q: Tensor,
    k: Tensor,
    attn_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    bottom_right: bool = False,
    mask_fill: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """float64 log-sum-exp (natural log) of each row's visible scores (and
    its sink).

    Arguments as in ``reference_attention`` (v and dropout do not matter).
    Returns a float64 tensor (B, Hq, N); rows with no visible key give +inf.
    (The true value: the implementations store a marker for rows that a
    finite value hides entirely, see ``lse_marker``.)
    """
    scores = _reference_scores(q, k, attn_mask, scale, window_left, window_right, bottom_right, mask_fill,
                               softcap)
    return _with_sinks(_row_lse(scores), sinks)


def _with_sinks(lse: Tensor, sinks: Optional[Tensor], stored: Optional[Tensor] = None) -> Tensor:
    """Fold a per-head sink logit into a (B, Hq, N) lse (+inf: no key), as
    every implementation does at the end of a row: logaddexp(lse, sink),
    +inf again where both are -inf. ``stored`` (the row's stored lse, a
    marker maybe) is kept where the sink changes nothing."""
    if sinks is None:
        return lse if stored is None else stored
    keys = torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)
    out = torch.logaddexp(keys, sinks.to(lse.dtype).view(1, -1, 1))
    out = torch.where(out == float("-inf"), torch.full_like(out, float("inf")), out)
    if stored is not None:
        out = torch.where(out == keys, stored.to(out.dtype), out)
    return out


def _row_lse(scores: Tensor) -> Tensor:
    """logsumexp over the last dimension, +inf where no score is finite."""
    lse = torch.logsumexp(scores, dim=-1)
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def reference_stored_lse(
    q: Tensor,
    k: Tensor,
    attn_mask: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    bottom_right: bool = False,
    mask_fill: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """The float32 lse the implementations store for float32-precision
    inputs: ``reference_lse``, with ``lse_marker(l)`` for rows that average
    the l keys holding their largest score (see ``lse_marker``), so that a
    backward can be tested on its own."""
    scores = _reference_scores(q, k, attn_mask, scale, window_left, window_right, bottom_right, mask_fill,
                               softcap)
    lse = _row_lse(scores).float()
    row_max = scores.amax(dim=-1)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        uniform = row_max <= _AVERAGE_AT[torch.float32]
    elif attn_mask is not None and mask_fill is not None and mask_fill <= FILL_MARKS_AT:
        uniform = row_max == float(torch.tensor(float(mask_fill), dtype=torch.float32))
    else:
        return _with_sinks(lse, sinks)
    uniform = uniform & torch.isfinite(row_max)
    count = (scores == row_max[..., None]).sum(dim=-1).to(torch.float32)
    # The sink is folded from the true lse; markers stay where it changes nothing.
    return _with_sinks(lse, sinks, torch.where(uniform, lse_marker(count), lse))


# ---------------------------------------------------------------------------
# dropout: Philox4x32-10 exactly as tl.philox computes it
# ---------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10


def dropout_threshold(dropout_p: float) -> int:
    """Integer threshold ``round(p * 2**16)``: a 16-bit draw r keeps when ``r >= threshold``."""
    return int(round(float(dropout_p) * (1 << 16)))


def _mul_hi_lo(const: int, x: Tensor) -> Tuple[Tensor, Tensor]:
    """High and low 32-bit halves of ``const * x`` for a 32-bit constant and an
    int64 tensor of 32-bit values.

    The full product needs 64 unsigned bits, which int64 cannot hold, so the
    constant is split into 16-bit halves and the carries are combined by hand.
    """
    c_lo = const & 0xFFFF
    c_hi = const >> 16
    low_part = x * c_lo  # < 2**48
    high_part = x * c_hi  # < 2**48, weight 2**16
    mid = low_part + ((high_part & 0xFFFF) << 16)  # < 2**49
    hi = (mid >> 32) + (high_part >> 16)
    lo = mid & _MASK32
    return hi & _MASK32, lo


def _philox4x32(seed: int, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor):
    """Philox4x32-10 on int64 tensors holding unsigned 32-bit counters.

    Mirrors ``tl.philox``: the 64-bit seed (reinterpreted as unsigned) gives
    key ``(seed_lo, seed_hi)``; each round updates the state then raises the key.
    """
    seed &= 0xFFFFFFFFFFFFFFFF
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    for _ in range(_PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def dropout_keep_mask(
    seed: int,
    B: int,
    H: int,
    N: int,
    M: int,
    dropout_p: float,
    device="cpu",
    *,
    rows: Optional[Tuple[int, int]] = None,
    cols: Optional[Tuple[int, int]] = None,
) -> Tensor:
    """Dropout keep mask, bit-identical to the Triton rule ``_dropout_keep``.

    Element (b, h, i, j) draws Philox4x32-10 with counter
    ``(4 * (j >> 5) + ((j >> 1) & 3), i, b * H + h, 0)``, takes the 16-bit
    half ``j & 1`` (0: low) of word ``(j >> 3) & 3`` and keeps when it is
    ``>= round(dropout_p * 2**16)``.

    Args:
        seed: the dropout seed (a Python int; 64-bit values, including
            negative int64 ones, are reinterpreted as unsigned like Triton does).
        B: batch size.
        H: number of query heads (``b * H + h`` is the third counter word).
        N: number of queries of the full problem.
        M: number of keys of the full problem.
        dropout_p: dropout probability in [0, 1).
        device: device of the result.
        rows: ``(start, stop)`` query range to generate; default ``(0, N)``.
        cols: ``(start, stop)`` key range to generate; default ``(0, M)``.

    Returns:
        bool tensor (B, H, rows, cols); True keeps the probability.
    """
    r0, r1 = rows if rows is not None else (0, N)
    j0, j1 = cols if cols is not None else (0, M)
    if not (0 <= r0 <= r1 <= N and 0 <= j0 <= j1 <= M):
        raise ValueError(f"tile rows={rows} cols={cols} outside a ({N}, {M}) problem")
    threshold = dropout_threshold(dropout_p)
    if r1 == r0 or j1 == j0:
        return torch.ones(B, H, r1 - r0, j1 - j0, dtype=torch.bool, device=device)
    # One Philox call serves the eight keys 32a + 8w + 2q + h (words w,
    # halves h) of a 32-key chunk a and pair slot q: draw per (chunk, slot),
    # counter word c0 = 4a + q, and put the eight halves back in key order.
    chunk0, chunk1 = j0 >> 5, ((j1 - 1) >> 5) + 1
    c0 = torch.arange(4 * chunk0, 4 * chunk1, dtype=torch.int64, device=device).view(1, 1, 1, -1)
    c1 = torch.arange(r0, r1, dtype=torch.int64, device=device).view(1, 1, -1, 1)
    c2 = torch.arange(B * H, dtype=torch.int64, device=device).view(B, H, 1, 1)
    shape = (B, H, r1 - r0, 4 * (chunk1 - chunk0))
    c0, c1, c2 = c0.expand(shape), c1.expand(shape), c2.expand(shape)
    c3 = torch.zeros(shape, dtype=torch.int64, device=device)
    words = torch.stack(_philox4x32(int(seed), c0, c1, c2, c3), dim=-1)  # (..., 4a + q, w)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # (..., 4a + q, w, h)
    halves = halves.reshape(B, H, r1 - r0, chunk1 - chunk0, 4, 4, 2)  # [.., a, q, w, h]
    halves = halves.transpose(-3, -2).reshape(B, H, r1 - r0, 32 * (chunk1 - chunk0))  # key order
    halves = halves[..., j0 - 32 * chunk0 : j1 - 32 * chunk0]
    return halves >= threshold


# ---------------------------------------------------------------------------
# blockwise CPU implementation
# ---------------------------------------------------------------------------

# Tile sizes of the blockwise path. Keys are processed KEY_BLOCK at a time and
# queries in chunks sized so that one (B, Hq, rows, keys) float32 temporary
# holds about TILE_ELEMENTS elements: memory stays linear in N and M while each
# step is one large batched matmul. Module-level so tests can shrink them.
KEY_BLOCK = 512
TILE_ELEMENTS = 1 << 22
MIN_QUERY_ROWS = 16


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> Tuple[int, int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-d; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, Hq, N, D = q.shape
    Bk, Hkv, M, Dk = k.shape
    if Bk != B or Dk != D or v.shape[0] != B or v.shape[1] != Hkv or v.shape[2] != M:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    return B, Hq, Hkv, N, M, D, v.shape[3]


def _mask_as_4d(attn_mask: Tensor) -> Tensor:
    """View of a broadcastable mask with exactly four dimensions."""
    if attn_mask.dim() < 4:
        return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if attn_mask.dim() > 4:
        if any(s != 1 for s in attn_mask.shape[:-4]):
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to 4-d")
        return attn_mask.reshape(attn_mask.shape[-4:])
    return attn_mask


def _seed_value(seed, dropout_p: float) -> Optional[int]:
    if dropout_p <= 0.0:
        return None
    if seed is None:
        raise ValueError("dropout_p > 0 needs a seed")
    return int(seed)


def _key_band(i0, i1, N, M, window_left, window_right, bottom_right) -> Tuple[int, int]:
    """Key range [lo, hi) holding every key visible to some query in [i0, i1)."""
    off = (M - N) if bottom_right else 0
    lo = 0 if window_left is None else max(0, i0 + off - window_left)
    hi = M if window_right is None else min(M, i1 - 1 + off + window_right + 1)
    return lo, max(lo, hi)


def _tile_fully_visible(i0, i1, j0, j1, N, M, window_left, window_right, bottom_right) -> bool:
    """True when every (query, key) pair of the tile passes the window rule."""
    off = (M - N) if bottom_right else 0
    right_ok = window_right is None or j1 - 1 <= i0 + off + window_right
    left_ok = window_left is None or j0 >= i1 - 1 + off - window_left
    return right_ok and left_ok


class _Tiler:
    """Shared per-tile work of the forward and backward passes.

    Holds float32 (float64 for float64 inputs) copies of q (pre-scaled,
    grouped as (B, Hkv, G, N, D) for GQA), k and v, and computes masked score
    tiles. K/V are never repeated per
    query head: a query chunk of all G heads sharing a key/value head is
    flattened to (B, Hkv, G * rows, D) and multiplied once.
    """

    def __init__(self, q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right,
                 mask_fill=None, softcap=None):
        self.B, self.Hq, self.Hkv, self.N, self.M, self.D, self.Dv = _check_shapes(q, k, v)
        self.G = self.Hq // self.Hkv
        # float32 accumulation like the kernels; float64 inputs (gradcheck)
        # are computed in float64 throughout.
        self.acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(self.D)
        # Pre-scaling q once folds the scale into every score tile for free.
        self.q_scaled = (q.to(self.acc_dtype) * self.scale).reshape(self.B, self.Hkv, self.G, self.N, self.D)
        self.k = k.to(self.acc_dtype)
        self.v = v.to(self.acc_dtype)
        self.mask = None
        if attn_mask is not None:
            self.mask = _mask_as_4d(attn_mask).expand(self.B, self.Hq, self.N, self.M)
        # What a bool mask's hidden pairs score: -inf, or a finite fill.
        self.fill = None
        if mask_fill is not None and self.mask is not None and self.mask.dtype == torch.bool:
            self.fill = float(torch.tensor(float(mask_fill), dtype=self.acc_dtype))  # as the tiles hold it
        # Which rows average their keys uniformly (see lse_marker): a bool
        # row at its fill, or a float row whose largest score is huge.
        self.float_mask = self.mask is not None and self.mask.dtype != torch.bool
        self.marks = self.float_mask or (self.fill is not None and self.fill <= FILL_MARKS_AT)
        self.dropout_p = float(dropout_p)
        self.seed = _seed_value(seed, self.dropout_p)
        self.drop_scale = 1.0 / (1.0 - self.dropout_p) if self.dropout_p < 1.0 else 0.0
        self.window_left, self.window_right, self.bottom_right = window_left, window_right, bottom_right
        self.softcap = None if softcap is None else float(softcap)
        key_block = max(1, min(self.M, KEY_BLOCK))
        rows = TILE_ELEMENTS // max(1, self.B * self.Hq * key_block)
        self.key_block = key_block
        self.query_rows = max(1, min(self.N, max(MIN_QUERY_ROWS, rows)))

    def query_chunks(self):
        for i0 in range(0, self.N, self.query_rows):
            yield i0, min(self.N, i0 + self.query_rows)

    def key_tiles(self, i0, i1):
        lo, hi = _key_band(i0, i1, self.N, self.M, self.window_left, self.window_right, self.bottom_right)
        for j0 in range(lo, hi, self.key_block):
            yield j0, min(hi, j0 + self.key_block)

    def grouped_rows(self, t: Tensor, i0: int, i1: int) -> Tensor:
        """(B, Hkv, G, N, X) -> rows [i0, i1) as (B, Hkv, G * rows, X)."""
        return t[:, :, :, i0:i1].reshape(self.B, self.Hkv, self.G * (i1 - i0), t.shape[-1])

    def scores(self, q_rows: Tensor, i0: int, i1: int, j0: int, j1: int, tanh_out: Optional[list] = None) -> Tensor:
        """(B, Hq, rows, keys) scaled (soft-capped) scores plus mask, -inf
        where invisible. With a soft-cap, ``tanh_out`` (a list) receives the
        tile's tanh values, for the backward's chain rule."""
        n, m = i1 - i0, j1 - j0
        s = torch.matmul(q_rows, self.k[:, :, j0:j1].transpose(-1, -2)).view(self.B, self.Hq, n, m)
        if self.softcap is not None:
            th = torch.tanh(s / self.softcap)
            if tanh_out is not None:
                tanh_out.append(th)
            s = th * self.softcap
        if self.mask is not None:
            tile = self.mask[:, :, i0:i1, j0:j1]
            if tile.dtype == torch.bool:
                s.masked_fill_(~tile, float("-inf") if self.fill is None else self.fill)
            else:
                s.add_(tile)
        if not _tile_fully_visible(i0, i1, j0, j1, self.N, self.M,
                                   self.window_left, self.window_right, self.bottom_right):
            vis = visibility_mask(
                self.N, self.M, window_left=self.window_left, window_right=self.window_right,
                bottom_right=self.bottom_right, rows=(i0, i1), cols=(j0, j1), device=s.device,
            )
            s.masked_fill_(~vis, float("-inf"))
        return s

    def keep(self, i0: int, i1: int, j0: int, j1: int, device) -> Optional[Tensor]:
        """Dropout keep tile (B, Hq, rows, keys), or None without dropout."""
        if self.seed is None:
            return None
        return dropout_keep_mask(
            self.seed, self.B, self.Hq, self.N, self.M, self.dropout_p, device,
            rows=(i0, i1), cols=(j0, j1),
        )


def blockwise_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    seed: Optional[Tensor],
    *,
    dropout_p: float,
    scale: Optional[float],
    window_left: Optional[int],
    window_right: Optional[int],
    bottom_right: bool,
    mask_fill: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention forward in tiles with an online softmax (no (N, M) tensor).

    Args:
        q: queries (B, Hq, N, D), any strides.
        k: keys (B, Hkv, M, D); ``Hq % Hkv == 0``.
        v: values (B, Hkv, M, Dv).
        attn_mask: None, bool (True takes part) or floating (added to the
            scaled scores), broadcastable to (B, Hq, N, M).
        seed: None, or an int64 0-d tensor keying the dropout stream.
        dropout_p: dropout probability (0 disables dropout).
        scale: multiplier of q·k (None: ``1 / sqrt(D)``).
        window_left: left bound of the visibility window (None: none).
        window_right: right bound of the visibility window (None: none; 0: causal).
        bottom_right: diagonal offset ``M - N`` instead of 0.
        mask_fill: with a bool mask, the score of the pairs it hides (as
            ``masked_fill``); None: -inf.
        softcap: scores become ``softcap * tanh(s / softcap)`` before the
            mask; None: no capping.
        sinks: None, or (Hq,) logits that join each row's denominator
            without a value; folded in at the end of the row.

    Returns:
        ``out`` (B, Hq, N, Dv) in q's dtype, laid out as
        ``empty(B, N, Hq, Dv).transpose(1, 2)``; ``lse`` float32 (B, Hq, N),
        natural log, +inf for rows with no visible key, ``lse_marker`` for
        rows that average their keys uniformly.
    """
    t = _Tiler(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right, mask_fill,
               softcap)
    B, Hq, Hkv, G, N, Dv = t.B, t.Hq, t.Hkv, t.G, t.N, t.Dv
    out = torch.empty(B, N, Hq, Dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    for i0, i1 in t.query_chunks():
        n = i1 - i0
        q_rows = t.grouped_rows(t.q_scaled, i0, i1)
        row_max = torch.full((B, Hq, n), float("-inf"), dtype=t.acc_dtype, device=q.device)
        row_sum = torch.zeros(B, Hq, n, dtype=t.acc_dtype, device=q.device)
        acc = torch.zeros(B, Hkv, G * n, Dv, dtype=t.acc_dtype, device=q.device)
        for j0, j1 in t.key_tiles(i0, i1):
            s = t.scores(q_rows, i0, i1, j0, j1)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            # A row with nothing visible so far keeps max -inf; shift it by 0
            # instead so exp gives 0 rather than NaN.
            shift = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
            p = torch.exp(s - shift.unsqueeze(-1))
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + p.sum(dim=-1)
            keep = t.keep(i0, i1, j0, j1, q.device)
            if keep is not None:
                p.masked_fill_(~keep, 0.0)
            acc = acc * alpha.reshape(B, Hkv, G * n, 1) + torch.matmul(
                p.view(B, Hkv, G * n, j1 - j0), t.v[:, :, j0:j1]
            )
            row_max = new_max
        empty = row_sum == 0
        inv = t.drop_scale / torch.where(empty, torch.ones_like(row_sum), row_sum)
        rows_out = acc.view(B, Hq, n, Dv) * inv.unsqueeze(-1)
        row_lse = torch.where(empty, torch.full_like(row_sum, float("inf")), row_max + torch.log(row_sum))
        keys_lse = row_lse  # before any marker (for the sinks)
        if t.marks:
            if t.float_mask:
                uniform = row_max <= _AVERAGE_AT[t.acc_dtype]
            else:
                uniform = row_max == t.fill
            row_lse = torch.where(uniform & ~empty, lse_marker(row_sum), row_lse)
        if sinks is not None:
            # The sink joins the denominator: out *= exp(lse - lse'), with
            # lse' = logaddexp(lse, sink) (markers: exp gives 0 there).
            with_sink = _with_sinks(keys_lse, sinks)
            keys = torch.where(empty, torch.full_like(row_lse, float("-inf")), keys_lse)
            factor = torch.exp(keys - torch.where(torch.isinf(with_sink), torch.zeros_like(with_sink), with_sink))
            rows_out = rows_out * torch.where(torch.isinf(with_sink), torch.zeros_like(factor), factor).unsqueeze(-1)
            row_lse = _with_sinks(keys_lse, sinks, row_lse)
        out[:, :, i0:i1] = rows_out
        lse[:, :, i0:i1] = row_lse
    return out, lse


def blockwise_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    seed: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    *,
    dropout_p: float,
    scale: Optional[float],
    window_left: Optional[int],
    window_right: Optional[int],
    bottom_right: bool,
    mask_grad: bool,
    mask_fill: Optional[float] = None,
    grad_lse: Optional[Tensor] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Attention backward in tiles, recomputing probabilities from ``lse``.

    Args:
        grad_out: gradient of the output (B, Hq, N, Dv), any strides.
        q, k, v, attn_mask, seed: the forward's inputs (see ``blockwise_forward``).
        out: the forward's output (B, Hq, N, Dv).
        lse: the forward's float32 log-sum-exp (B, Hq, N).
        dropout_p, scale, window_left, window_right, bottom_right: as in the forward.
        mask_grad: also return the gradient of a floating ``attn_mask``.
        mask_fill: as in the forward; the pairs it fills pass no gradient to
            q and k (as with ``masked_fill``).
        grad_lse: None, or the (B, Hq, N) gradient of ``lse``; since
            d lse / d s = P, it enters as ``delta - grad_lse``.
        softcap: as in the forward; the score gradient passes through the
            tanh (times ``1 - tanh**2``) to q and k, not to the mask.

    Returns:
        ``(dq, dk, dv, dmask)``: ``empty_like`` q, k, v filled with their
        gradients; ``dmask`` has the mask's own shape and dtype (summed over
        its broadcast dimensions) when ``mask_grad``, else None.
    """
    t = _Tiler(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right, mask_fill,
               softcap)
    B, Hq, Hkv, G, N, M, D, Dv = t.B, t.Hq, t.Hkv, t.G, t.N, t.M, t.D, t.Dv
    dev = q.device
    if mask_grad and (attn_mask is None or attn_mask.dtype == torch.bool):
        raise ValueError("mask_grad needs a floating attn_mask")
    grad_out32 = grad_out.to(t.acc_dtype)
    # delta_i = sum_j P_ij dP_ij = dO_i . O_i (with dropout, O already holds
    # the kept, rescaled probabilities, so the identity still holds).
    delta = (grad_out32 * out.to(t.acc_dtype)).sum(dim=-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(t.acc_dtype)
    grad_out_g = grad_out32.reshape(B, Hkv, G, N, Dv)
    lse32 = lse.to(t.acc_dtype)
    # Rows that average l keys: p = 1 / l at each of them (see lse_marker).
    # Float rows: exp(s - shift) is >= 1 at every finite score with the
    # shift at -FLT_MAX, and capped at 1 / l (the cap is 1 elsewhere, where
    # p <= 1 anyway). Bool rows at their fill: exp(s - fill) / l.
    cap = shift = None
    if t.marks:
        marked, count = lse_marked_keys(lse32)
        cap = 1.0 / count
        shift = torch.where(marked, torch.full_like(lse32, -FLT_MAX if t.float_mask else t.fill), lse32)
    dk_acc = torch.zeros(B, Hkv, M, D, dtype=t.acc_dtype, device=dev)
    dv_acc = torch.zeros(B, Hkv, M, Dv, dtype=t.acc_dtype, device=dev)
    dq = torch.empty_like(q)
    mask4 = dmask_acc = None
    if mask_grad:
        mask4 = _mask_as_4d(attn_mask)
        dmask_acc = torch.zeros(mask4.shape, dtype=t.acc_dtype, device=attn_mask.device)
    for i0, i1 in t.query_chunks():
        n = i1 - i0
        q_rows = t.grouped_rows(t.q_scaled, i0, i1)
        do_rows = t.grouped_rows(grad_out_g, i0, i1)
        lse_rows = lse32[:, :, i0:i1].unsqueeze(-1)
        if cap is not None:
            lse_rows = shift[:, :, i0:i1].unsqueeze(-1)
            cap_rows = cap[:, :, i0:i1].unsqueeze(-1)
        delta_rows = delta[:, :, i0:i1].unsqueeze(-1)
        dq_rows = torch.zeros(B, Hkv, G * n, D, dtype=t.acc_dtype, device=dev)
        for j0, j1 in t.key_tiles(i0, i1):
            m = j1 - j0
            tanh_tile = []
            s = t.scores(q_rows, i0, i1, j0, j1, tanh_tile)
            # Empty rows have lse = +inf, so p = exp(-inf) = 0 there: no NaN.
            p = torch.exp(s - lse_rows)
            if cap is not None:
                p = torch.minimum(p, cap_rows) if t.float_mask else p * cap_rows
            dp = torch.matmul(do_rows, t.v[:, :, j0:j1].transpose(-1, -2)).view(B, Hq, n, m)
            keep = t.keep(i0, i1, j0, j1, dev)
            if keep is not None:
                p_dropped = p.masked_fill(~keep, 0.0) * t.drop_scale
                dp = dp.masked_fill_(~keep, 0.0) * t.drop_scale
            else:
                p_dropped = p
            dv_acc[:, :, j0:j1] += torch.matmul(
                p_dropped.view(B, Hkv, G * n, m).transpose(-1, -2), do_rows
            )
            ds = p * (dp - delta_rows)  # gradient w.r.t. the scaled, masked scores
            if t.fill is not None:  # filled scores are constants
                ds.masked_fill_(~t.mask[:, :, i0:i1, j0:j1], 0.0)
            if dmask_acc is not None:
                _accumulate_mask_grad(dmask_acc, ds, i0, i1, j0, j1)
            if tanh_tile:  # through the soft-cap: d(c tanh(x / c)) / dx = 1 - tanh**2
                ds = ds * (1.0 - tanh_tile[0] * tanh_tile[0])
            ds_g = ds.view(B, Hkv, G * n, m)
            dq_rows += torch.matmul(ds_g, t.k[:, :, j0:j1])
            # q_rows already carries the scale, so this is scale * dS^T q.
            dk_acc[:, :, j0:j1] += torch.matmul(ds_g.transpose(-1, -2), q_rows)
        dq[:, :, i0:i1] = (dq_rows * t.scale).view(B, Hq, n, D)
    dk = torch.empty_like(k)
    dk.copy_(dk_acc)
    dv = torch.empty_like(v)
    dv.copy_(dv_acc)
    dmask = None
    if dmask_acc is not None:
        dmask = dmask_acc.reshape(attn_mask.shape).to(attn_mask.dtype)
    return dq, dk, dv, dmask


def _accumulate_mask_grad(dmask_acc: Tensor, ds: Tensor, i0: int, i1: int, j0: int, j1: int) -> None:
    """Add a (B, Hq, rows, keys) score-gradient tile into the 4-d mask gradient,
    summing over the mask's broadcast (size-1) dimensions."""
    sum_dims = [d for d in range(4) if dmask_acc.shape[d] == 1 and ds.shape[d] != 1]
    if sum_dims:
        ds = ds.sum(dim=sum_dims, keepdim=True)
    rows = slice(0, 1) if dmask_acc.shape[2] == 1 else slice(i0, i1)
    cols = slice(0, 1) if dmask_acc.shape[3] == 1 else slice(j0, j1)
    dmask_acc[:, :, rows, cols] += ds
