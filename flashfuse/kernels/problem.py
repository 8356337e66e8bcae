"""One description of an attention call for the forward and backward launchers.

``AttentionProblem.build`` reads the inputs once: sizes, dtype, device,
strides, the mask as the kernels read it, the band, the fill, dropout, the
score scaling, the dot precision and whether K and V go through tensor
descriptors. The forward launcher and the backward launcher both start from
it, so the two passes cannot disagree on any of these (they must agree bit
for bit on visibility, dropout and the scores they recompute). It describes;
it allocates nothing and launches nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .common import MASK_BOOL, MASK_NONE, dropout_threshold, mask_kind
from .launch import _dot_precision, _interpreting, bool_mask_as_bytes, descriptor_loads, kernel_band, next_pow2
from .launch import static_int
from .mask_ranges import fill_hides
from .. import reference as _reference

__all__ = ["AttentionProblem", "LOG2E", "fill_kind"]

LOG2E = math.log2(math.e)


def fill_kind(bool_mask: bool, mask_fill: float | None) -> tuple[int, float]:
    """The kernels' FILL flag and fill argument for a call: ``(0, 0.0)``
    without a fill (or without a bool mask), else the fill in base 2 (values
    at or below -1e38 kept as they are, as the kernels convert float masks)
    and 2 when it is low enough that a row scoring the fill at most is taken
    as hidden entirely (``reference.FILL_MARKS_AT``), 1 otherwise."""
    if not bool_mask or mask_fill is None or mask_fill == float("-inf"):
        return 0, 0.0
    fill = float(mask_fill)
    base2 = fill * LOG2E if fill > -1.0e38 else fill
    return (2 if fill <= _reference.FILL_MARKS_AT else 1), base2


# No kernel config of the forward or backward has a wider key block
# (tests/kernels/test_problem.py holds the configs to it).
LARGEST_BLOCK_N = 128


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """What the kernels need to know about one attention call.

    Sizes: q (B, Hq, N, D), k (B, Hkv, M, D), v (B, Hkv, M, Dv); D and Dv
    are plain ints (tile widths are compiled in), the others may be
    symbolic in a traced graph. ``mask`` is the mask as the kernels read it
    (expanded to (B, Hq, N, M), a bool mask as bytes) or None, with
    ``mask_strides`` (zeros without a mask).
    """

    B: object
    Hq: object
    Hkv: object
    N: object
    M: object
    D: int
    Dv: int
    dtype: torch.dtype
    device: torch.device
    q_strides: tuple
    k_strides: tuple
    v_strides: tuple
    mask: torch.Tensor | None
    mask_strides: tuple
    mask_kind: int  # common.MASK_NONE / MASK_BOOL / MASK_FLOAT
    # The band (launch.kernel_band): diagonal offset and clamped windows.
    diag_off: object
    window_left: int
    window_right: int
    has_window_left: bool
    has_window_right: bool
    # Bool masks' fill: the kernels' FILL flag and the fill in base 2
    # (fill_kind); ``mask_fill`` as the caller gave it.
    fill: int
    fill_arg: float
    mask_fill: float | None
    # Dropout: p, the 16-bit keep threshold, and 1 / (1 - p) (0 for p = 1,
    # which keeps the zero output finite).
    dropout_p: float
    threshold: int
    keep_scale: float
    # Scores: ``scale`` multiplies q.k; ``qk_scale`` takes the (capped)
    # product to base 2 (``cap * log2(e)`` with a soft-cap, whose tanh then
    # takes ``softcap_scale = scale / cap``); ``softcap`` None or the cap.
    scale: float
    qk_scale: float
    softcap: float | None
    softcap_scale: float
    precision: str  # tl.dot input precision (launch._dot_precision)
    interpret: bool  # launched through Triton's interpreter
    # Whether the pass's K/V-streaming kernel (the forward; dQ in the
    # backward) reads K and V through tensor descriptors.
    kv_descriptors: bool

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def block_d(self) -> int:
        return max(16, next_pow2(self.D))

    @property
    def block_dv(self) -> int:
        return max(16, next_pow2(self.Dv))

    @property
    def full_key_blocks(self) -> bool:
        """Whether every key block ends at or before M whatever the tile (M a
        multiple of ``LARGEST_BLOCK_N``, known when the call is built; a
        symbolic M says no). The kernels then read the mask without per-key
        bounds, which would stop its loads from vectorising; rows past N stay
        bounded."""
        return isinstance(self.M, int) and self.M % LARGEST_BLOCK_N == 0

    def band(self) -> dict:
        """The band as the table builders (``mask_ranges``) take it."""
        return dict(diag_off=self.diag_off, window_left=self.window_left, window_right=self.window_right,
                    has_window_left=self.has_window_left, has_window_right=self.has_window_right)

    def tables_apply(self) -> bool:
        """Whether the mask's tables can skip blocks for this call: a mask,
        and no fill or one low enough to hide (``mask_ranges.fill_hides``).
        The launchers also ask their own SKIP_HIDDEN_BLOCKS switch."""
        return self.mask_kind != MASK_NONE and (self.fill == 0 or fill_hides(self.mask_fill))

    @classmethod
    def build(cls, q, k, v, attn_mask, *, dropout_p: float, scale: float, window_left, window_right,
              bottom_right: bool, mask_fill=None, softcap=None, backward: bool = False) -> "AttentionProblem":
        """The description of a call with the launchers' arguments (see
        ``forward.attention_forward``). ``backward``: built for the backward
        launcher, which differs only in its descriptor rule (dQ takes them
        with a mask too; the forward measured slower so with one)."""
        B, Hq, N, D = q.shape
        Hkv, M = k.shape[1], k.shape[2]
        if attn_mask is None:
            mask, kind, mask_strides = None, MASK_NONE, (0, 0, 0, 0)
        else:
            mask = attn_mask.expand(B, Hq, N, M)  # broadcast dims get stride 0, never materialised
            kind = mask_kind(mask)
            if kind == MASK_BOOL:
                mask = bool_mask_as_bytes(mask)
            mask_strides = mask.stride()
        fill, fill_arg = fill_kind(kind == MASK_BOOL, mask_fill)
        band = kernel_band(N, M, window_left, window_right, bottom_right)
        if dropout_p > 0.0:
            # p == 1 drops everything; scale 0 keeps the (zero) output finite.
            threshold, keep_scale = dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
        else:
            threshold, keep_scale = 0, 1.0
        if backward:
            # dQ streams K and V through descriptors where the layout allows
            # (measured 3-6 % faster at D = 128: bench/NOTES.md run 11).
            kv_desc = descriptor_loads(k, v)
        else:
            # With a mask tensor the forward's descriptor tiles measured
            # 19-25 % slower (bench/NOTES.md run 11): pointer loads then,
            # unless forced.
            kv_desc = descriptor_loads(k, v, faster=kind == MASK_NONE)
        return cls(
            B=B, Hq=Hq, Hkv=Hkv, N=N, M=M, D=static_int(D), Dv=static_int(v.shape[3]),
            dtype=q.dtype, device=q.device, q_strides=tuple(q.stride()), k_strides=tuple(k.stride()),
            v_strides=tuple(v.stride()), mask=mask, mask_strides=tuple(mask_strides), mask_kind=kind,
            **band, fill=fill, fill_arg=fill_arg, mask_fill=mask_fill,
            dropout_p=dropout_p, threshold=threshold, keep_scale=keep_scale,
            scale=scale, qk_scale=float(softcap if softcap is not None else scale) * LOG2E, softcap=softcap,
            softcap_scale=float(scale) / softcap if softcap is not None else 0.0,
            precision=_dot_precision(q), interpret=_interpreting(q), kv_descriptors=kv_desc,
        )

