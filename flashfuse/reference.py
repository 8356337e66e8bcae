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
    "visibility_mask",
    "dropout_keep_mask",
    "dropout_threshold",
    "blockwise_forward",
    "blockwise_backward",
]


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


def _reference_scores(q, k, attn_mask, scale, window_left, window_right, bottom_right):
    """float64 (B, Hq, N, M) scores with -inf where a key does not take part."""
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
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = torch.where(attn_mask, scores, neg_inf)
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

    Returns:
        float64 tensor (B, Hq, N, Dv).
    """
    scores = _reference_scores(q, k, attn_mask, scale, window_left, window_right, bottom_right)
    # Safe softmax: shift by the row max (0 for rows that are all -inf), and
    # divide by 1 where the row sum is 0, so empty rows give 0, not NaN.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
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
) -> Tensor:
    """float64 log-sum-exp (natural log) of each row's visible scores.

    Arguments as in ``reference_attention`` (v and dropout do not matter).
    Returns a float64 tensor (B, Hq, N); rows with no visible key give +inf.
    """
    scores = _reference_scores(q, k, attn_mask, scale, window_left, window_right, bottom_right)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


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
    """Integer threshold ``round(p * 2**24)``: a word r keeps when ``(r >> 8) >= threshold``."""
    return int(round(float(dropout_p) * (1 << 24)))


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
    ``(j >> 2, i, b * H + h, 0)``, takes word ``j & 3`` and keeps when
    ``(r >> 8) >= round(dropout_p * 2**24)``.

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
    # One Philox call serves four consecutive keys, so draw per group of four
    # (counter word c0 = j >> 2) and spread the four words over the keys.
    quad0, quad1 = j0 >> 2, ((j1 - 1) >> 2) + 1
    c0 = torch.arange(quad0, quad1, dtype=torch.int64, device=device).view(1, 1, 1, -1)
    c1 = torch.arange(r0, r1, dtype=torch.int64, device=device).view(1, 1, -1, 1)
    c2 = torch.arange(B * H, dtype=torch.int64, device=device).view(B, H, 1, 1)
    shape = (B, H, r1 - r0, quad1 - quad0)
    c0, c1, c2 = c0.expand(shape), c1.expand(shape), c2.expand(shape)
    c3 = torch.zeros(shape, dtype=torch.int64, device=device)
    words = torch.stack(_philox4x32(int(seed), c0, c1, c2, c3), dim=-1)  # (..., quads, 4)
    words = words.reshape(B, H, r1 - r0, 4 * (quad1 - quad0))
    words = words[..., j0 - 4 * quad0 : j1 - 4 * quad0]
    return (words >> 8) >= threshold
