"""Views between the two products that only split or merge the batch dims.

Code that computes attention with ``bmm`` on (B·H, N, D) tensors views the
scores to (B, H, N, M) to add a mask and back to (B·H, N, M) for the product
with v. Such a view keeps the last two (query, key) dims and the product of
the leading ones: it maps the element at row-major batch index ``l`` to the
same ``l``. Every tensor of the pattern is therefore indexed by one linear
batch index, whatever the factorisation of its leading dims (its *layout*).

The finder picks one layout with two batch dims as the op's (B, H) (the
*canonical* layout) and turns each operand from its own layout into it:
flatten the leading dims, unflatten them to (B, H). Splitting one dim is
always a view, so q, k and v of a bmm are never copied; a mask broadcast over
all batch dims just loses them. Nothing here is trusted without a proof on
the example values: a view whose last two dims or batch total are not
provably equal (symbolically, with dynamic shapes) is not a batch view.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx

from . import nodes as N
from .match import Step

VIEW_KINDS = ("view", "reshape")


def _prod(sizes) -> Any:
    return math.prod(sizes) if sizes else 1


def why_not_batch_view(node: torch.fx.Node) -> Optional[str]:
    """None when ``node`` is a view/reshape that only splits or merges the
    leading dims of its input (last two kept), else why not."""
    src = node.args[0] if node.args else None
    st, t = N.tensor_val(src), N.tensor_val(node)
    if st is None or t is None:
        return f"{N.describe(node)} has no recorded example value"
    if st.dtype != t.dtype:
        return f"{N.describe(node)} reinterprets the dtype"
    if t.dim() < 2 or st.dim() < 2:
        return f"{N.describe(node)} does not keep the (query, key) dims"
    if not (N.known_eq(st.shape[-1], t.shape[-1]) and N.known_eq(st.shape[-2], t.shape[-2])):
        return f"{N.describe(node)} changes the last two (query, key) dims, not only the batch dims"
    if not N.known_eq(_prod(st.shape[:-2]), _prod(t.shape[:-2])):
        return f"{N.describe(node)} does not provably keep the batch total"
    return None


def is_batch_view(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and N.kind(node) in VIEW_KINDS and why_not_batch_view(node) is None


def same_layout(a, b) -> bool:
    return len(a) == len(b) and all(N.known_eq(x, y) for x, y in zip(a, b))


def size_arg(gm: torch.fx.GraphModule, s: Any, before: torch.fx.Node, hints=()) -> Any:
    """A graph argument for size ``s``: an int, or a node defined before
    ``before`` whose value is provably ``s`` (a view's size argument, a
    symbolic input). None when there is none."""
    c = N.const_int(s)
    if c is not None:
        return c
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    limit = order[before]
    for n in list(hints) + list(gm.graph.nodes):
        if not isinstance(n, torch.fx.Node) or order.get(n, limit) >= limit:
            continue
        v = N.val(n)
        if isinstance(v, torch.SymInt) and N.known_eq(v, s):
            return n
    return None


def to_canonical(nd: int, layout: tuple, canon_args: list, lead: Any = -1) -> list:
    """Steps turning a tensor with leading ``layout`` (all dims full) and
    ``nd`` dims into the canonical two batch dims. ``canon_args``: the graph
    arguments of the canonical sizes after the first; ``lead``: the first
    (-1: inferred from the total)."""
    steps: list = []
    nb = len(layout)
    if nb == 0:
        return [Step("unsqueeze", 0), Step("unsqueeze", 0)]
    if nb > 1:
        steps.append(Step("flatten", 0, nb - 1))
    steps.append(Step("unflatten", 0, tuple([lead] + list(canon_args))))
    return steps


def from_canonical(layout: tuple, layout_args: list) -> list:
    """Steps turning the op's (B, H, ...) result into leading ``layout``."""
    steps: list = [Step("flatten", 0, 1)]
    if len(layout) > 1:
        steps.append(Step("unflatten", 0, tuple([-1] + list(layout_args))))
    elif len(layout) == 0:
        steps.append(Step("squeeze", 0))
    return steps


def mask_steps(t: torch.Tensor, layout: tuple, canon: tuple, nd_scores: int, layout_args, canon_tail_args) -> Optional[list]:
    """Steps that turn a tensor broadcasting to ``layout + (N, M)`` into one
    broadcasting to ``canon + (N, M)`` (same values at each linear batch
    index), or None when no graph sizes are known to do it."""
    if same_layout(layout, canon):
        return []
    nb = len(layout)
    pad = nd_scores - t.dim()
    shape = [1] * pad + list(t.shape)
    lead = shape[:nb]
    steps: list = [Step("unsqueeze", 0)] * pad
    if all(N.known_eq(x, 1) for x in lead):
        # Broadcast over every batch dim: drop them, keep two size-1 dims.
        steps += [Step("squeeze", 0)] * nb
        return steps + [Step("unsqueeze", 0), Step("unsqueeze", 0)]
    if any(a is None for a in canon_tail_args):
        return None
    partial = [not N.known_eq(x, f) for x, f in zip(lead, layout)]
    if any(partial):
        # Broadcast over some batch dims only: make them full first (the mask
        # then holds one (N, M) slice per batch index).
        sizes = []
        for bcast, arg in zip(partial, layout_args):
            if bcast and arg is None:
                return None
            sizes.append(arg if bcast else -1)
        steps.append(Step("expand", tuple(sizes) + (-1, -1)))
    return steps + to_canonical(nd_scores, layout, canon_tail_args)
