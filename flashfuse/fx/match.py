"""What an attention match is.

The finder (:mod:`flashfuse.fx.find`) turns every softmax in a graph into a
:class:`Candidate`. A candidate either carries a complete :class:`Plan` (how to
compute the same tensor with ``torch.ops.flashfuse.attention``) or the reason
why the graph around that softmax must stay as it is. The rewriter
(:mod:`flashfuse.fx.rewrite`) only ever reads plans; ``explain`` reads both.

A plan describes operands as a graph node plus a short list of *view steps*
(transpose, permute, unsqueeze, expand, squeeze): cheap, data-free reshapes
that the rewriter replays in front of the op. Nothing in a plan copies a
tensor except the casts it lists explicitly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.fx

class _Tagged(tuple):
    """A tuple ``(tag, *args)`` whose tag is checked when it is built: the
    base of the plan's two vocabularies below."""

    __slots__ = ()
    TAGS: frozenset = frozenset()
    WHAT = "tag"

    def __new__(cls, tag: str, *args: Any):
        if tag not in cls.TAGS:
            raise ValueError(f"unknown {cls.WHAT} {tag!r}; one of {sorted(cls.TAGS)}")
        return super().__new__(cls, (tag, *args))

    def __getnewargs__(self):  # copy and pickle rebuild it from (tag, *args)
        return tuple(self)

    @property
    def args(self) -> tuple:
        return tuple(self[1:])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self))})"


class Step(_Tagged):
    """A view step replayed in front of the op (``find.apply_steps``,
    ``rewrite``): the tensor method's name, then its arguments.

    ``Step("transpose", d0, d1)``, ``Step("permute", dims)``,
    ``Step("unsqueeze", d)``, ``Step("squeeze", d)``, ``Step("to", dtype)``,
    ``Step("not")`` (logical not, for masks), ``Step("flatten", d0, d1)``,
    ``Step("unflatten", d, sizes)``, ``Step("expand", sizes)``; sizes may hold
    graph nodes (symbolic sizes). It is the tuple ``(name, *args)``, so the
    replays index it and it compares equal to that tuple.
    """

    __slots__ = ()
    TAGS = frozenset({"transpose", "permute", "unsqueeze", "squeeze", "to", "not", "flatten", "unflatten", "expand"})
    WHAT = "view step"

    @property
    def name(self) -> str:
        return self[0]


# A scale factor applied to the scores: a Python number, or a graph node that
# evaluates to a SymInt/SymFloat or a 0-d tensor, or a per-head tensor (an
# Operand when it needs views to reach the op's layout): folded into q at run time.
Factor = Union[float, torch.fx.Node, "Operand"]


@dataclasses.dataclass
class Operand:
    """A tensor the op consumes: ``node`` followed by ``steps`` (views/casts)."""

    node: torch.fx.Node
    steps: list[Step] = dataclasses.field(default_factory=list)

    def then(self, *steps: Step) -> "Operand":
        return Operand(self.node, self.steps + list(steps))


class Transform(_Tagged):
    """A score transform between the q·kᵀ product and the softmax, in the
    order it applies: its kind, then its arguments.

    ``Transform("scale", "mul" | "div", factor)``,
    ``Transform("add", term, negate, alpha)``,
    ``Transform("fill", cond, hide_where_true, value)``, ``Transform("noop")``
    (a constant shift), ``Transform("transpose")`` (scores built as k @ qᵀ),
    ``Transform("tanh")``, which ``capsink.fold_softcap`` turns with its two
    scales into ``Transform("softcap", cap)``. It is the tuple
    ``(kind, *args)``, indexed by its readers, equal to that tuple.
    """

    __slots__ = ()
    TAGS = frozenset({"scale", "add", "fill", "noop", "transpose", "tanh", "softcap"})
    WHAT = "score transform"

    @property
    def kind(self) -> str:
        return self[0]


class ProbsPath(NamedTuple):
    """The probabilities' way from the softmax to the value product."""

    product: torch.fx.Node  # probs @ v (matmul, bmm or einsum)
    dropout_p: float
    chain: list  # the nodes in between (casts, views, dropout, the sink slice)


class ScoresPath(NamedTuple):
    """The scores' way from the q·kᵀ product to the softmax."""

    product: torch.fx.Node  # q @ kᵀ (matmul, bmm, baddbmm or einsum)
    transforms: list  # Transform, in the order they apply
    chain: list  # the nodes in between, from the softmax inward


class ScoreOperands(NamedTuple):
    """q and k of the score product, and what the product itself applies."""

    query: Operand
    key: Operand
    transforms: list  # Transform applied by the product (baddbmm's alpha and bias)
    perm: tuple  # the scores' dims as the product lays them out, from (batch..., N, M)


class ValueOperands(NamedTuple):
    """v of the value product, and the steps from the op's result to its output."""

    value: Operand
    out_steps: list


class Operands(NamedTuple):
    """q, k and v as the op takes them, and the steps from its result to
    the value product's output: what a layout of the products (batch views,
    folded batch dims, grouped heads) makes of them."""

    query: Operand
    key: Operand
    value: Operand
    out_steps: list


@dataclasses.dataclass
class MaskTerm:
    """An additive score term: ``node * factor`` where factor is the product of
    the scales applied after the term was added (so it is in the op's units).
    ``node`` may be a boolean or integer tensor; it is cast to a float."""

    node: torch.fx.Node
    factors: list[tuple[str, Factor]] = dataclasses.field(default_factory=list)
    negate: bool = False
    # View steps that bring ``node`` into the op's (B, H, N, M) layout (when
    # views between the products split or merge the batch dims).
    steps: list[Step] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Plan:
    """Everything the rewriter needs to emit one op call.

    The op computes ``softmax(scale * q @ k^T + mask, visibility) @ v`` where
    ``mask`` is the sum of ``additive`` terms with every ``hide`` position
    removed (or, with ``mask_fill``, set to that value); ``out_steps`` turn the op's (B, Hq, N, Dv) result into the tensor
    the original ``output`` node produced, and ``out_dtype`` is that tensor's
    dtype.
    """

    query: Operand
    key: Operand
    value: Operand
    scale: float
    # Non-constant factors (SymFloat nodes, 0-d tensors) multiplied into q.
    q_factors: list[tuple[str, Factor]]
    additive: list[MaskTerm]
    # Boolean tensors (as operands) marking positions that take no part.
    hide: list[Operand]
    window_left: Optional[int]
    window_right: Optional[int]
    alignment: str
    enable_gqa: bool
    dropout_p: float
    out_steps: list[Step]
    out_dtype: torch.dtype
    # Broadcast dims made explicit: (operand "q"/"k"/"v", dim, size) where
    # size is an int or ("q"/"k"/"v", dim): that operand's size (a SymInt).
    expand: list[tuple] = dataclasses.field(default_factory=list)
    # Cast q, k and v to this dtype before the op (None: leave as they are).
    compute_dtype: Optional[torch.dtype] = None
    # The dtype the op computes in and returns (q's, after compute_dtype).
    op_dtype: Optional[torch.dtype] = None
    # A finite masked_fill value: the scores ``hide`` marks are replaced by
    # it (in the op's units), as eager's fill does; None: they are removed.
    mask_fill: Optional[float] = None
    # Soft-capping of the scaled scores before any mask (the op's softcap).
    softcap: Optional[float] = None
    # gpt-oss's per-head sink logits, (Hq,) (the op's sinks).
    sinks: Optional[Operand] = None

    @property
    def is_causal(self) -> bool:
        return self.window_right == 0 and self.window_left is None


@dataclasses.dataclass
class Candidate:
    """One softmax of the graph and what the finder made of it."""

    softmax: torch.fx.Node
    # The node whose value the op replaces (the probabilities @ v product).
    output: Optional[torch.fx.Node] = None
    # The score product (q @ k^T), when found.
    scores: Optional[torch.fx.Node] = None
    plan: Optional[Plan] = None
    # Why the graph is left as it is (None when ``plan`` is set).
    reason: Optional[str] = None
    # Nodes between the two products (inclusive) that the op makes dead.
    replaced: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    # Human-readable facts for ``explain``: scale, mask, causal, window, ...
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Set by the rewriter once the op is in the graph.
    rewritten: bool = False

    @property
    def ok(self) -> bool:
        return self.plan is not None

    def where(self) -> tuple[str, str]:
        """(module path, source line) of the softmax, from the node's metadata."""
        return module_path(self.softmax), source_line(self.softmax)


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost nn.Module the node was traced in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    # Dynamo spells paths like "L['self'].layers[0].attn"; make it a plain
    # dotted path relative to the compiled module.
    path = str(path)
    for prefix in ("L['self'].", "L['self']", "L['mod'].", "L['mod']"):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    path = path.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    return path.lstrip(".")


def source_line(node: torch.fx.Node) -> str:
    """``file:line`` of the user code that created the node, and the code."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln for ln in trace.strip().splitlines() if ln.strip()]
    # The innermost frame is the last "File ..." line; the code follows it.
    for idx in range(len(lines) - 1, -1, -1):
        line = lines[idx].strip()
        if line.startswith("File "):
            parts = line.split(",")
            fname = parts[0][len("File ") :].strip().strip('"')
            lineno = parts[1].strip().replace("line ", "") if len(parts) > 1 else "?"
            code = lines[idx + 1].strip() if idx + 1 < len(lines) else ""
            short = fname.replace("\\", "/").rsplit("/", 1)[-1]
            return f"{short}:{lineno}  {code}".rstrip()
    return ""
