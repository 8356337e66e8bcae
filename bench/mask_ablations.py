"""Stand-ins for parts of the masked Hopper kernels, to time what each part
costs (``mask_cost_probe.py --ablate``) and to compile the kernels without
it (``kernel_report.py --hopper --ablate``).

A kernel built with a stand-in is right only for masks that hide nothing
with a band on top (the probe's "neutral" rows): their tables say "the
whole band takes part, every block neutral", which is what the table
stand-in returns, and no block of theirs reads the mask, which is what the
mask-code stand-ins drop. The probe runs nothing else under them.

* ``tables``: ``_table_reduce`` loads no table entry and reduces nothing.
  The constants also let the compiler fold each tile's three runs into one
  loop, so this times the loads and the run split together.
* ``tables-opaque``: ``_table_reduce`` loads and reduces the entries as
  before, then widens them to the whole band through operations the
  compiler cannot fold (for the neutral rows they select the same blocks
  as the real values). The runs stay three, with bounds known only at run time: what
  this saves against no ablation is what the table values themselves cost
  (none for the neutral rows), and ``tables`` against it is what folding
  the run split away saves.
* ``mask-code``: the per-score mask work goes: the forward's
  ``_consumer_scores`` becomes the unmasked one (raw scores, the scale in
  exp2's FMA), the backward's mask loads return the scores as they are and
  its float cap is 1.
* ``all``: both.

The stand-ins replace the helpers in ``hopper_gluon``'s namespace before
the kernels first compile, so they must run in a fresh process.
"""

from __future__ import annotations

from common import MASK_ABLATIONS
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flashfuse.kernels.hopper_gluon import _INT_MAX
from flashfuse.kernels.hopper_gluon import _table_reduce as _real_table_reduce


@gluon.jit
def _whole_band_table(Table, tab_off, first, end, GROUPS: gl.constexpr, GROUP: gl.constexpr, ENTRY: gl.constexpr,
                      WARPS: gl.constexpr):
    """``_table_reduce`` for a mask that hides nothing: every key (or query
    row) takes part and is neutral; the band alone narrows the blocks."""
    zero = first * 0
    return zero, zero + _INT_MAX, zero, zero + _INT_MAX


@gluon.jit
def _opaque_whole_band_table(Table, tab_off, first, end, GROUPS: gl.constexpr, GROUP: gl.constexpr,
                             ENTRY: gl.constexpr, WARPS: gl.constexpr):
    """``_table_reduce`` with its loads, widened at run time to "every key
    takes part and is neutral" (lo and free_lo at most 0, hi and free_hi
    _INT_MAX): the values of ``_whole_band_table``, unknown to the
    compiler (table entries are never negative, which it cannot know)."""
    r_lo, r_hi, f_lo, f_hi = _real_table_reduce(Table, tab_off, first, end, GROUPS, GROUP, ENTRY, WARPS)
    return (gl.where(r_lo >= 0, 0, r_lo), gl.where(r_hi >= 0, _INT_MAX, r_hi), gl.where(f_lo >= 0, 0, f_lo),
            gl.where(f_hi >= 0, _INT_MAX, f_hi))


@gluon.jit
def _unmasked_scores(s, qk_scale, start_n, free_lo, free_hi, key_end, mask_base, r0, N, M, stride_mask_q,
                     stride_mask_k, MASK_KIND: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                     layout: gl.constexpr):
    """``_consumer_scores`` of the unmasked kernel."""
    return s, qk_scale


@gluon.jit
def _scores_as_they_are_t_direct(st, mask_base, qi, kj, N, M, stride_mask_q, stride_mask_k, MASK_KIND: gl.constexpr):
    """The backward's direct mask loads, dropped."""
    return st


@gluon.jit
def _scores_as_they_are_t(st, mask_base, q0, k0, N, M, stride_mask_q, stride_mask_k, MASK_KIND: gl.constexpr,
                          KEYS: gl.constexpr, QUERIES: gl.constexpr, layout: gl.constexpr):
    """The backward's coalesced mask loads, dropped."""
    return st


@gluon.jit
def _no_caps(stats, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """The float cap, 1 for every row."""
    return gl.full([BLOCK_M], 1.0, gl.float32, layout)


def apply(name: str) -> list[str]:
    """Swap the stand-ins of ablation ``name`` into ``hopper_gluon``;
    returns the helpers replaced (those the kernels have)."""
    if name not in MASK_ABLATIONS:
        raise ValueError(f"ablation {name!r}: one of {MASK_ABLATIONS}")
    from flashfuse.kernels import hopper_gluon

    swaps = {}
    if name in ("tables", "all"):
        swaps["_table_reduce"] = _whole_band_table
    if name == "tables-opaque":
        swaps["_table_reduce"] = _opaque_whole_band_table
    if name in ("mask-code", "all"):
        swaps.update(_consumer_scores=_unmasked_scores, _masked_scores_t_direct=_scores_as_they_are_t_direct,
                     _row_caps=_no_caps, _masked_scores_t=_scores_as_they_are_t)
    for helper, stand_in in swaps.items():
        if not hasattr(hopper_gluon, helper):  # a stand-in for a helper the kernels lost would time nothing
            raise RuntimeError(f"mask_ablations: hopper_gluon has no {helper} to stand in for")
        setattr(hopper_gluon, helper, stand_in)
    return list(swaps)
