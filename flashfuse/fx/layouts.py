"""Scores held in another layout than (batch..., query, key).

Two ways code lays out its scores that the op can still serve exactly:

* **Permuted scores.** ``einsum('bnhd,bmhd->bnhm')`` puts the heads after
  the query axis; ``(k @ qᵀ).transpose(-1, -2)`` builds the scores as
  (key, query) and transposes them. Every score transform (scale, mask,
  fill) is elementwise, so the scores at each step of the chain are the
  canonical (batch..., N, M) scores seen through a permutation of their
  dims. A *stage* is that permutation ``p`` (the tensor is
  ``canonical.permute(p)``); a mask or scale tensor that meets the scores at
  a stage reaches the op's layout through ``permute(inverse(p))``.
* **Grouped heads as a 5-D broadcast.** ``q.view(B, Hkv, G, N, D) @
  k[:, :, None].transpose(-2, -1)``: scores (B, Hkv, G, N, M) whose query
  head ``(j, g)`` is ``q``'s head ``j * G + g`` and reads kv head ``j``,
  exactly the op's grouped heads (query head ``h`` reads kv head
  ``h // G``). Flattening the two head dims keeps the row-major order, so q
  and every mask are flattened, k and v lose their size-1 group dim, and the
  op's (B, Hkv·G, N, Dv) result is unflattened back. A k or v broadcast over
  the kv-head dim instead (query head ``h`` reading kv head ``h % Hkv``) is
  another mapping and is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from . import nodes as N
from . import views as V
from .match import Step


class LayoutMismatch(Exception):
    """The layout cannot be served exactly; the message says why."""


def identity(perm) -> bool:
    return list(perm) == list(range(len(perm)))


def inverse(perm) -> tuple:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def swap_last_two(perm) -> tuple:
    p = list(perm)
    p[-2], p[-1] = p[-1], p[-2]
    return tuple(p)


def _tensor_nodes(t: tuple) -> list:
    """The tensor nodes a score transform reads (masks, fill conditions,
    tensor scale factors)."""
    if t[0] in ("add", "fill"):
        nodes = [t[1]]
    elif t[0] == "scale":
        nodes = [t[2]]
    else:
        nodes = []
    return [n for n in nodes
            if isinstance(n, torch.fx.Node) and N.tensor_val(n) is not None and N.tensor_val(n).dim() > 0]


def stages(perm0, transforms) -> tuple:
    """Walk the score transforms (in the order they apply) from the
    product's layout ``perm0``: ({tensor node: stage}, final stage). A
    ("transpose",) transform swaps the last two dims."""
    perm = tuple(perm0)
    where: dict = {}
    for t in transforms:
        if t[0] == "transpose":
            perm = swap_last_two(perm)
            continue
        for n in _tensor_nodes(t):
            if n in where and where[n] != perm:
                raise LayoutMismatch(f"{n.name} meets the scores in two layouts")
            where[n] = perm
    return where, perm


class GroupLayout:
    """Grouped heads as a 5-D broadcast (module docstring): ``scores5`` are
    the canonical 5-D scores (B, Hkv, G, N, M)."""

    def __init__(self, gm: torch.fx.GraphModule, scores5: torch.Tensor, pv: torch.fx.Node):
        self.gm, self.pv = gm, pv
        self.hkv, self.g = scores5.shape[1], scores5.shape[2]
        self.scores = scores5.flatten(1, 2)
        self.hints: list = []

    def _size(self, s) -> Any:
        return V.size_arg(self.gm, s, self.pv, self.hints)

    def query(self, op, t: torch.Tensor):
        """q (.., Hkv, G, N, D) as (.., Hkv·G, N, D): the view it came from
        when there is one (it only split the heads), else a flatten."""
        if t.dim() != 5 or not (N.known_eq(t.shape[1], self.hkv) and N.known_eq(t.shape[2], self.g)):
            raise LayoutMismatch("q broadcasts over the kv heads or the groups of the 5-D product; left alone")
        node = op.node
        if not op.steps and N.kind(node) in V.VIEW_KINDS:
            self.hints += [a for a in torch.fx.node.map_aggregate(node.args[1:], lambda x: x)
                           if isinstance(a, torch.fx.Node)]
            src = N.tensor_val(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
            want = (t.shape[0], t.shape[1] * t.shape[2], t.shape[3], t.shape[4])
            if src is not None and src.dim() == 4 and all(N.known_eq(x, y) for x, y in zip(src.shape, want)):
                # A view keeps the row-major order: splitting dim 1 is unflatten.
                return type(op)(node.args[0])
        return op.then(Step("flatten", 1, 2))

    def mode(self, t: torch.Tensor, what: str) -> str:
        """How k or v (.., a, b, M, D) meets the (Hkv, G) head dims."""
        if t.dim() != 5:
            raise LayoutMismatch(f"{what} is not 5-D in the 5-D grouped product; left alone")
        a, b = t.shape[1], t.shape[2]
        if N.known_eq(b, 1) and (N.known_eq(a, self.hkv) or N.known_eq(a, 1)):
            return "grouped"
        if N.known_eq(a, self.hkv) and N.known_eq(b, self.g):
            return "full"
        raise LayoutMismatch(
            f"{what} broadcasts over the kv-head dim of the 5-D product, not the group dim: query head h "
            "would read kv head h % Hkv, while the op's grouped heads read kv head h // G; left alone")

    def kv(self, op, t: torch.Tensor, mode: str, unsqueezed_source):
        if mode == "full":
            return op.then(Step("flatten", 1, 2))
        # Drop the size-1 group dim; peel the unsqueeze that made it.
        if not op.steps or op.steps == [Step("transpose", -2, -1)]:
            src = unsqueezed_source(op.node)
            if src is not None:
                return type(op)(src, list(op.steps))
        return op.then(Step("squeeze", 2))

    def output_steps(self) -> list:
        g = self._size(self.g)
        if g is None:
            raise LayoutMismatch("the group size of the 5-D product is not a size the graph holds")
        return [Step("unflatten", 1, (-1, g))]

    def mask_steps(self, t: torch.Tensor) -> list:
        """Steps taking a tensor that broadcasts to (B, Hkv, G, N, M) into one
        that broadcasts to (B, Hkv·G, N, M) with the same values per head."""
        if t.dim() > 5:
            raise LayoutMismatch("a mask has more dims than the scores")
        steps: list = [Step("unsqueeze", 0)] * (5 - t.dim())
        shape = [1] * (5 - t.dim()) + list(t.shape)
        a, b = shape[1], shape[2]
        if N.known_eq(a, 1) and N.known_eq(b, 1):
            return steps + [Step("squeeze", 2)]
        if N.known_eq(a, self.hkv) and N.known_eq(b, self.g):
            return steps + [Step("flatten", 1, 2)]
        # Broadcast over one of the two head dims only: make it full first.
        sizes: list = [-1] * 5
        for dim, (have, full) in enumerate(((a, self.hkv), (b, self.g)), start=1):
            if not N.known_eq(have, full):
                arg = self._size(full)
                if arg is None:
                    raise LayoutMismatch("a mask broadcasts over head dims whose sizes the graph does not hold")
                sizes[dim] = arg
        return steps + [Step("expand", tuple(sizes)), Step("flatten", 1, 2)]


class ScoresLayout:
    """What :func:`flashfuse.fx.find._build_plan` needs of a non-canonical
    layout: the canonical scores as the op sees them, and the steps that
    bring each mask or scale tensor into them (permutation, then groups)."""

    def __init__(self, scores: torch.Tensor, where: dict, rank: int, group: Optional[GroupLayout]):
        self.scores = scores if group is None else group.scores
        self.where, self.rank, self.group = where, rank, group

    def steps_for(self, node) -> list:
        steps: list = []
        t = N.tensor_val(node)
        perm = self.where.get(node)
        if perm is not None and not identity(perm):
            if t.dim() > self.rank:
                raise LayoutMismatch("a mask has more dims than the scores")
            steps = [Step("unsqueeze", 0)] * (self.rank - t.dim()) + [Step("permute", inverse(perm))]
            t = t.reshape((1,) * (self.rank - t.dim()) + tuple(t.shape)).permute(*inverse(perm))
        if self.group is not None and t is not None and t.dim() > 0:
            steps += self.group.mask_steps(t)
        return steps


def reorders(steps) -> bool:
    """Whether view steps move dims (a band proved on the mask's own last two
    dims would then be about other dims)."""
    return any(s[0] in ("permute", "transpose") for s in steps)


def _mergeable(t: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether ``t.flatten(lo, hi)`` is provably a view (no copy): each
    merged dim steps over the whole of the next, size-1 dims aside."""
    dims = [d for d in range(lo, hi + 1) if not N.known_eq(t.shape[d], 1)]
    for a, b in zip(dims, dims[1:]):
        if not N.known_eq(t.stride(a), t.stride(b) * t.shape[b]):
            return False
    return True


class BatchFold:
    """Scores with more than two batch dims: (b_1, ..., b_f, H, N, M), e.g.
    windowed or locally grouped attention over (B, windows, heads, N, D)
    (timm's Twins, Swin-style windows kept 5-D). Each score matrix is one
    (batch index, head) pair whatever the leading dims are, so folding
    b_1..b_f into the op's batch, ``flatten(0, f - 1)``, computes the same
    attention, and the op's (b_1·...·b_f, H, N, Dv) result is unflattened
    back. The dim before N stays the heads, so k and v with one head (a
    broadcast over the heads) are still the op's grouped heads.

    Exact only when every tensor folds into the same linear batch index: q,
    k and v each hold the full leading dims or none of them (size 1 each,
    then the op broadcasts it). A mask may broadcast over part of them: it
    is expanded first, so its one (heads, N, M) slice per batch index is
    copied (named as a cost in ``explain``)."""

    def __init__(self, gm: torch.fx.GraphModule, scores: torch.Tensor, pv: torch.fx.Node):
        self.gm, self.pv = gm, pv
        self.nd = scores.dim()
        self.f = self.nd - 3  # leading dims folded: all but the heads
        self.lead = tuple(scores.shape[: self.f])
        self.scores = scores.flatten(0, self.f - 1)
        self.hints: list = [a for n in gm.graph.nodes if N.kind(n) in V.VIEW_KINDS
                            for a in torch.fx.node.map_aggregate(n.args[1:], lambda x: x) if isinstance(a, torch.fx.Node)]
        self.copies: list[str] = []

    @staticmethod
    def why_not(shapes: list, scores_shape) -> Optional[str]:
        """None when q, k and v (``[(name, shape)]``, k's as in the
        product) fold exactly, each holding the scores' leading dims in full
        or none; else why not."""
        f = len(scores_shape) - 3
        lead = tuple(scores_shape[:f])
        for what, s in shapes:
            if s is None or len(s) > len(scores_shape):
                return f"{what} has no example value or more dims than the scores"
            have = ((1,) * (len(scores_shape) - len(s)) + tuple(s))[:f]
            if not (all(N.known_eq(x, y) for x, y in zip(have, lead)) or all(N.known_eq(x, 1) for x in have)):
                return (f"scores with more than two batch dims: {what} broadcasts over part of the leading batch "
                        "dims, which then do not fold into one batch index; left alone")
        return None

    def _size(self, s) -> Any:
        return V.size_arg(self.gm, s, self.pv, self.hints)

    def operand(self, op, t: torch.Tensor, what: str):
        """``op`` (.., H?, N, D), padded to the scores' rank, with its leading
        dims flattened into one."""
        if t.dim() > self.nd:
            raise LayoutMismatch(f"{what} has more dims than the scores")
        pad = self.nd - t.dim()
        have = ((1,) * pad + tuple(t.shape))[: self.f]
        full = all(N.known_eq(x, y) for x, y in zip(have, self.lead))
        if not full and not all(N.known_eq(x, 1) for x in have):
            raise LayoutMismatch(f"{what} broadcasts over part of the folded batch dims; left alone")
        padded = t.reshape((1,) * pad + tuple(t.shape))
        if not _mergeable(padded, 0, self.f - 1):
            self.copies.append(what)
        return op.then(*([Step("unsqueeze", 0)] * pad), Step("flatten", 0, self.f - 1))

    def output_steps(self, out: torch.Tensor) -> list:
        if out.dim() != self.nd or not all(N.known_eq(x, y) for x, y in zip(out.shape[: self.f], self.lead)):
            raise LayoutMismatch("the value product's leading dims are not the scores' leading dims")
        sizes = [self._size(s) for s in self.lead[1:]]
        if any(s is None for s in sizes):
            raise LayoutMismatch("the folded batch dims are not sizes the graph holds")
        return [Step("unflatten", 0, tuple([-1] + sizes))]

    def mask_steps(self, t: torch.Tensor) -> list:
        """Steps taking a tensor that broadcasts to the scores into one that
        broadcasts to the folded scores with the same values per batch index."""
        if t.dim() > self.nd:
            raise LayoutMismatch("a mask has more dims than the scores")
        pad = self.nd - t.dim()
        steps: list = [Step("unsqueeze", 0)] * pad
        shape = [1] * pad + list(t.shape)
        have = shape[: self.f]
        ones = [N.known_eq(x, 1) for x in have]
        if all(ones) or all(N.known_eq(x, y) for x, y in zip(have, self.lead)):
            return steps + [Step("flatten", 0, self.f - 1)]
        sizes: list = []
        for x, full, one in zip(have, self.lead, ones):
            if N.known_eq(x, full):
                sizes.append(-1)
            elif one:
                arg = self._size(full)
                if arg is None:
                    raise LayoutMismatch("a mask broadcasts over part of the folded batch dims, whose sizes the "
                                         "graph does not hold; left alone")
                sizes.append(arg)
            else:
                raise LayoutMismatch("a mask does not provably broadcast over the folded batch dims")
        # One slice per batch index: the flatten copies the expanded mask.
        return steps + [Step("expand", tuple(sizes) + (-1,) * (self.nd - self.f)), Step("flatten", 0, self.f - 1)]

    def describe(self, plan) -> str:
        """For ``explain``: the folded dims, and what the fold copies (an
        operand whose dims do not merge in memory, a mask expanded over
        part of them)."""
        lead = ", ".join(str(N.const_int(s)) if N.const_int(s) is not None else str(s) for s in self.lead)
        copies = list(dict.fromkeys(self.copies))
        masks = [t.steps for t in plan.additive] + [h.steps for h in plan.hide]
        if any(s[0] == "expand" for steps in masks for s in steps):
            copies.append("mask")
        text = f"batch dims folded: ({lead})"
        return text + ("; copies " + ", ".join(copies) if copies else "")
