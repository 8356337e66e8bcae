"""One mask, and one block mask, per distinct mask of a graph.

A model's layers usually all get the same mask; in a Dynamo graph each layer
still has its own nodes for it (a slice of the same input per layer, the same
``~mask`` per layer). The rewriter asks :class:`SharedMasks` for each
attention's mask: the first attention with a given mask recipe emits the
mask and its ``flashfuse::block_mask`` node, and the later ones whose recipe,
band and lengths are the same read those nodes, so the mask tables are built
once per step and not in every layer's forward and backward.

Two recipes are the same when their nodes compute the same values: the same
node, or pure operations (views, casts, arithmetic, comparisons, constant
factories) of the same inputs with the same arguments. A graph that writes
any tensor in place compares nodes only by identity. A node is reused only
where it comes before the attention that would read it.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx

from ..block_mask import table_fill
from ..ops import causal_window_right
from . import nodes as N

# Operations whose result depends only on their arguments (no randomness, no
# state): nodes of these kinds with equal inputs and arguments compute equal
# values.
_PURE = {"getitem", "view", "reshape", "unsqueeze", "expand", "transpose", "permute", "swapaxes", "swapdims",
         "contiguous", "clone", "detach", "to", "type", "type_as", "float", "half", "bfloat16", "double", "bool",
         "int", "long", "neg", "add", "sub", "mul", "div", "true_divide", "eq", "ne", "lt", "le", "gt", "ge",
         "not", "and", "or", "logical_not", "logical_and", "logical_or", "bitwise_not", "where", "masked_fill",
         "tril", "triu", "ones", "zeros", "full", "arange", "ones_like", "zeros_like", "full_like", "new_ones",
         "new_zeros", "new_full", "size", "repeat_interleave", "cumsum", "diff"}


class _Unkeyable(Exception):
    pass


def _block_mask_op():
    return torch.ops.flashfuse.block_mask.default  # registered by flashfuse.block_mask, imported above


class SharedMasks:
    """Per graph: the emitted masks by recipe, and their block masks by
    (recipe, band, lengths). ``begin`` / ``commit`` / ``rollback`` bracket
    one attention's emission, so that nodes a failed emission erased are
    forgotten."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.by_identity = any(N.is_inplace(n) for n in gm.graph.nodes)
        self.masks: dict = {}
        self.tables: dict = {}
        self._pending: list = []

    # -- bracketing ---------------------------------------------------------

    def begin(self) -> None:
        self._pending = []

    def commit(self) -> None:
        self._pending = []

    def rollback(self) -> None:
        for store, key in self._pending:
            store.pop(key, None)
        self._pending = []

    # -- keys ---------------------------------------------------------------

    def _key(self, x: Any, memo: dict, depth: int = 0) -> Any:
        """A hashable value equal for arguments that compute the same values."""
        if isinstance(x, torch.fx.Node):
            if x in memo:
                return memo[x]
            if self.by_identity or depth > 32 or x.op not in ("call_function", "call_method") \
                    or N.kind(x) not in _PURE:
                k = ("node", x)
            else:
                k = ("op", x.op, x.target, self._key(tuple(x.args), memo, depth + 1),
                     self._key(tuple(sorted(x.kwargs.items())), memo, depth + 1))
            memo[x] = k
            return k
        if isinstance(x, (list, tuple)):
            return (type(x).__name__,) + tuple(self._key(a, memo, depth) for a in x)
        if isinstance(x, slice):
            return ("slice", self._key(x.start, memo, depth), self._key(x.stop, memo, depth),
                    self._key(x.step, memo, depth))
        if isinstance(x, float) and math.isnan(x):
            return ("nan",)
        try:
            hash(x)
        except TypeError:
            raise _Unkeyable from None
        return (type(x).__name__, x)

    def recipe(self, plan) -> Optional[tuple]:
        """The key of the mask a plan assembles, or None (not shareable)."""
        memo: dict = {}
        try:
            additive = tuple((self._key(t.node, memo), self._key(tuple(t.factors), memo), t.negate)
                             for t in plan.additive)
            hide = tuple((self._key(h.node, memo), self._key(tuple(h.steps), memo)) for h in plan.hide)
        except _Unkeyable:
            return None
        if not additive and not hide:
            return None
        return additive, hide

    # -- lookups ------------------------------------------------------------

    def mask(self, recipe, anchor: torch.fx.Node) -> Optional[torch.fx.Node]:
        """The mask node already emitted for this recipe, if it precedes
        ``anchor``."""
        node = self.masks.get(recipe) if recipe is not None else None
        return node if node is not None and _precedes(node, anchor) else None

    def remember_mask(self, recipe, node: torch.fx.Node) -> None:
        if recipe is not None and recipe not in self.masks:
            self.masks[recipe] = node
            self._pending.append((self.masks, recipe))

    def block_mask(self, em, mask: torch.fx.Node, recipe, q: torch.fx.Node, k: torch.fx.Node, kwargs: dict,
                   backward: bool) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
        """The (key table, query table) nodes for this attention's mask,
        emitted now or reused; None when the kernels would read no tables."""
        fill, builds_tables = table_fill(kwargs.get("mask_fill"))
        if not builds_tables:
            return None
        qv, kv = N.tensor_val(q), N.tensor_val(k)
        if qv is None or kv is None:
            return None
        window_right = causal_window_right(kwargs["is_causal"], kwargs["window_right"])
        band = dict(window_left=kwargs["window_left"], window_right=window_right,
                    bottom_right=kwargs["alignment"] == "bottom_right", mask_fill=fill, queries=bool(backward))
        n_len, m_len = qv.shape[2], kv.shape[2]
        key = None
        if recipe is not None:
            key = (recipe, tuple(sorted(band.items())), str(n_len), str(m_len))
            found = self.tables.get(key)
            if found is not None and _precedes(found[0], em.anchor):
                return found

        def length(node, t, dim):
            c = N.const_int(t.shape[dim])
            return c if c is not None else em.call("method", "size", node, dim)

        out = em.call("function", _block_mask_op(), mask, length(q, qv, 2), length(k, kv, 2), **band)
        tables = (em.call("function", operator.getitem, out, 0), em.call("function", operator.getitem, out, 1))
        if key is not None:
            self.tables[key] = tables
            self._pending.append((self.tables, key))
        return tables


def _precedes(node: torch.fx.Node, anchor: torch.fx.Node) -> bool:
    """``node`` is still in the graph and comes before ``anchor``."""
    if getattr(node, "_erased", False):
        return False
    n = node.next
    while n.op != "root":
        if n is anchor:
            return True
        n = n.next
    return False
