"""Soft-capping and attention sinks, as the graph pass recognises them.

Two spellings, each kept apart from the rest of the finder:

* soft-capping, ``c * tanh(s / c)`` of the scaled scores before any mask
  (Gemma 2: ``w = q @ k^T * scaling; w = w / cap; w = tanh(w); w = w * cap``;
  also ``tanh(s * (1 / c)) * c`` and ``c * tanh(...)``). The finder turns
  ``tanh`` into a ``("tanh",)`` transform; :func:`fold_softcap` checks that
  it sits between a division by c and a multiplication by c, with nothing
  but scales before it, and replaces the three with ``("softcap", c)``.
  A mask or a constant added before the tanh, or a tanh without its two
  matching scales, leaves the graph alone.
* attention sinks (gpt-oss: ``cat([s, sinks.reshape(1, -1, 1, 1).expand(B,
  -1, N, 1)], -1)``, optionally minus its row max, softmax, ``[..., :-1]``).
  :func:`peel_sinks` walks from the softmax input back through the max
  subtraction and the concatenation to the scores and the (Hq,) sink
  tensor; :func:`drops_last_column` recognises the slice after the softmax.
"""

from __future__ import annotations

import builtins
import dataclasses
import math
from typing import Optional

import torch
import torch.fx

from . import nodes as N
from .match import Operand, Step, Transform


def _no_match(reason: str) -> Exception:
    from .find import NoMatch  # the finder's refusal (imported late: find imports this module)

    return NoMatch(reason)


# ---------------------------------------------------------------------------
# soft-capping
# ---------------------------------------------------------------------------

def _scale_of(t: tuple) -> Optional[float]:
    """The constant factor a ("scale", op, f) transform multiplies by, or
    None when it is not a constant scale."""
    if t[0] != "scale":
        return None
    _, op, f = t
    if isinstance(f, torch.fx.Node):
        fv = N.val(f)
        if not isinstance(fv, torch.SymFloat):
            return None
        try:
            # A symbolic cap (a float attribute under dynamic shapes):
            # specialised with a guard, so another value recompiles.
            f = float(fv)
        except Exception:  # noqa: BLE001 - no hint to guard on
            return None
    if not isinstance(f, float):
        return None
    if op == "mul":
        return f
    return 1.0 / f if f != 0 else None


def fold_softcap(transforms: list) -> list:
    """``transforms`` (in the order they apply) with ``scale 1/c, tanh,
    scale c`` replaced by ``("softcap", |c|)``. Raises the finder's NoMatch
    for a tanh that is not a soft-cap of the scaled, unmasked scores."""
    at = [i for i, t in enumerate(transforms) if t[0] == "tanh"]
    if not at:
        return transforms
    if len(at) > 1:
        raise _no_match("two tanh on the scores: not one soft-cap")
    i = at[0]
    if i == 0 or i + 1 >= len(transforms):
        raise _no_match("tanh of the scores without the division and multiplication by one cap, "
                        "c * tanh(s / c)")
    inner, outer = _scale_of(transforms[i - 1]), _scale_of(transforms[i + 1])
    if inner is None or outer is None:
        raise _no_match("tanh of the scores with a scale that is not a constant on both sides")
    if not (math.isfinite(inner) and math.isfinite(outer)) or inner == 0 or abs(inner * outer - 1.0) > 1e-9:
        raise _no_match(f"tanh of the scores divided by {_num(1 / inner if inner else math.inf)} but multiplied "
                        f"by {_num(outer)}: not a soft-cap c * tanh(s / c)")
    for t in transforms[: i - 1]:
        if t[0] != "scale":
            kind = {"add": "a mask is added", "fill": "a mask is filled in", "noop": "a constant is added"}.get(
                t[0], f"{t[0]} is applied")
            raise _no_match(f"{kind} before the soft-cap: tanh would cap the masked scores (left alone)")
    return transforms[: i - 1] + [Transform("softcap", abs(outer))] + transforms[i + 2:]


def _num(x: float) -> str:
    return f"{x:g}"


# ---------------------------------------------------------------------------
# attention sinks
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class SinkMatch:
    """The softmax input's sink spelling: ``scores`` (the node the usual
    walk back to q @ k^T starts from), ``cat`` (its consumer there), the
    (Hq,) ``sinks`` operand, and the nodes between the scores and the
    softmax that the op replaces (the concatenation and the max shift);
    ``wide`` those of them shaped as the scores plus the sink column."""

    scores: torch.fx.Node
    cat: torch.fx.Node
    sinks: Operand
    nodes: list
    wide: list


def _is_row_max_of(t, x: torch.fx.Node) -> bool:
    """``t`` is ``x.max(-1, keepdim=True).values`` / ``x.amax(-1,
    keepdim=True)`` (maybe detached): one value per row of ``x``."""
    if isinstance(t, torch.fx.Node) and N.kind(t) == "detach":
        t = t.args[0]
    if not isinstance(t, torch.fx.Node):
        return False
    src = t
    if t.op == "call_function" and t.target is builtins.getattr and len(t.args) == 2 and t.args[1] == "values":
        src = t.args[0]
    elif N.kind(t) == "getitem" and len(t.args) == 2 and t.args[1] == 0:
        src = t.args[0]
    k = N.kind(src)
    if k not in ("max", "amax") or not src.args or src.args[0] is not x:
        return False
    if k == "max" and src is t:
        return False  # max without an index is the global max (or a tuple)
    dim = N.arg(src, 1, "dim")
    keep = N.arg(src, 2, "keepdim", False)
    xv = N.tensor_val(x)
    if xv is None:
        return False
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return keep is True and isinstance(dim, int) and dim in (-1, xv.dim() - 1)


def peel_sinks(x, softmax: torch.fx.Node) -> Optional[SinkMatch]:
    """The sink spelling ending at the softmax input ``x``, or None when
    ``x`` is not a concatenation (maybe shifted by its row max). Raises the
    finder's NoMatch for a concatenation that is not scores plus a sink
    column."""
    if not isinstance(x, torch.fx.Node):
        return None
    nodes: list = []
    cur = x
    if N.kind(cur) == "sub" and len(cur.args) == 2 and isinstance(cur.args[0], torch.fx.Node) \
            and N.kind(cur.args[0]) == "cat" and _is_row_max_of(cur.args[1], cur.args[0]):
        # A per-row shift changes nothing in a softmax.
        shift = cur.args[1]
        users = set(N.real_users(cur.args[0]))
        shift_nodes = _chain_to(shift, cur.args[0])
        if users != {cur, shift_nodes[-1]}:
            raise _no_match("the concatenated scores have other users (returned or reused)")
        if any(len(N.real_users(n)) != 1 for n in shift_nodes):
            raise _no_match("the row max of the concatenated scores has other users")
        nodes += [cur, *shift_nodes]
        cur = cur.args[0]
    if N.kind(cur) != "cat":
        return None
    if not nodes and len(N.real_users(cur)) != 1:
        raise _no_match("the concatenated scores have other users (returned or reused)")
    tensors = N.arg(cur, 0, "tensors")
    dim = N.arg(cur, 1, "dim", 0)
    cv = N.tensor_val(cur)
    if cv is None or not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        raise _no_match("a concatenation of the scores with more or less than one sink column")
    if not isinstance(dim, int) or dim not in (-1, cv.dim() - 1):
        raise _no_match("the scores are concatenated along a dimension other than the keys")
    scores, col = tensors
    sv, colv = N.tensor_val(scores), N.tensor_val(col)
    if sv is None or colv is None or sv.dim() != 4 or colv.dim() != 4:
        raise _no_match("a sink concatenation on scores that are not 4-D (batch, heads, queries, keys)")
    if N.tensor_val(col) is not None and _leads_to_scores(col):
        raise _no_match("the column concatenated to the scores is computed from the scores")
    if not (N.known_eq(colv.shape[-1], 1) and all(N.known_eq(a, b) for a, b in zip(colv.shape[:3], sv.shape[:3]))):
        raise _no_match("the tensor concatenated after the scores is not one column per row (a sink)")
    sinks = _per_head_vector(col, sv.shape[1])
    if sinks is None:
        raise _no_match("the column concatenated after the scores is not a per-head sink "
                        "(sinks.reshape(1, -1, 1, 1).expand(B, -1, N, 1))")
    wide = [cur] + nodes[:1]  # the concatenation and the shifted scores
    nodes.append(cur)
    return SinkMatch(scores=scores, cat=cur, sinks=sinks, nodes=nodes, wide=wide)


def _chain_to(t: torch.fx.Node, x: torch.fx.Node) -> list:
    """The nodes from ``t`` back to (not including) ``x``, ``t`` first."""
    out = []
    cur = t
    while isinstance(cur, torch.fx.Node) and cur is not x:
        out.append(cur)
        cur = cur.args[0] if cur.args else None
    return out


def _leads_to_scores(col: torch.fx.Node) -> bool:
    from .find import _leads_to_product

    return _leads_to_product(col)


def _per_head_vector(col: torch.fx.Node, heads) -> Optional[Operand]:
    """The (H,) tensor that ``col`` broadcasts as ``v[h]`` at [b, h, i, 0],
    through ``reshape/view(1, H, 1, 1)`` (or ``[None, :, None, None]``) and
    ``expand``; casts on the way are kept as steps. None otherwise."""
    cur = col
    casts: list = []
    expanded = False
    while isinstance(cur, torch.fx.Node):
        cv = N.tensor_val(cur)
        if cv is None:
            return None
        k = N.kind(cur)
        if cv.dim() == 1:
            if not N.known_eq(cv.shape[0], heads) or not cv.dtype.is_floating_point:
                return None
            return Operand(cur, list(reversed(casts)))
        if k == "expand" and not expanded:
            expanded = True
            cur = cur.args[0]
            continue
        if k in N.CAST_KINDS:
            if not cv.dtype.is_floating_point:
                return None
            casts.append(Step("to", cv.dtype))
            cur = cur.args[0]
            continue
        if k in ("reshape", "view") or (k == "getitem" and _adds_axes_around_heads(cur)):
            src = N.tensor_val(cur.args[0])
            if src is None or src.dim() != 1 or cv.dim() != 4:
                return None
            if not (N.known_eq(cv.shape[1], heads) and all(N.known_eq(cv.shape[d], 1) for d in (0, 2, 3))):
                return None
            cur = cur.args[0]
            continue
        return None
    return None


def _adds_axes_around_heads(node: torch.fx.Node) -> bool:
    idx = node.args[1] if len(node.args) > 1 else None
    return isinstance(idx, tuple) and len(idx) == 4 and idx[0] is None and idx[2] is None and idx[3] is None \
        and idx[1] == slice(None, None, None)


def drops_last_column(node: torch.fx.Node, probs: torch.fx.Node) -> bool:
    """``node`` is ``probs[..., :-1]`` (or ``probs[:, :, :, :-1]``)."""
    if N.kind(node) != "getitem" or len(node.args) != 2 or node.args[0] is not probs:
        return False
    idx = node.args[1]
    pv = N.tensor_val(probs)
    if pv is None or not isinstance(idx, tuple):
        return False
    last = slice(None, -1, None)
    full = slice(None, None, None)
    if len(idx) == 2 and idx[0] is Ellipsis and idx[1] == last:
        return True
    return len(idx) == pv.dim() and idx[-1] == last and all(i == full for i in idx[:-1])
