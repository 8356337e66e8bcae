"""Finding attention in a Dynamo FX graph, structurally.

Every softmax over the last dim is a candidate. From it the finder walks

* forward through probability transforms (casts, dropout) to a product
  ``probs @ v`` (matmul, ``@``, bmm or einsum), and
* backward through score transforms (casts, scaling, additive masks,
  ``masked_fill``/``where`` with -inf or a very negative value) to a product
  ``q @ k^T`` (matmul, bmm, baddbmm or einsum),

and then proves, from the example values Dynamo recorded on the nodes, that
the pieces fit the op: shapes, broadcasting, dtypes, head sizes. Anything it
does not understand stops the walk with a reason and the graph is left as it
is. There is no list of known attention spellings: each step is one small
rule about one operation.

Correctness does not depend on recognising a transposed key: for a score
product ``a @ b`` the op's key is ``b.transpose(-2, -1)``, whatever ``b`` is;
a transpose already in the graph is merely peeled so no extra view is added.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.fx

from . import layouts as L
from . import capsink as _capsink
from . import nodes as N
from . import views as V
from .masks import Band, MaskEvaluator
from .match import (Candidate, MaskTerm, Operand, Operands, Plan, ProbsPath, ScoreOperands, ScoresPath, Step,
                    Transform, ValueOperands, source_line)

# Head sizes and dtypes the op supports.
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A masked_fill value v removes a position when exp(v - row max) is 0 in
# float32 for any realistic score: exp(-1e4) underflows by thousands of
# orders of magnitude.
HIDE_THRESHOLD = -1e4


log = logging.getLogger("flashfuse")


class NoMatch(Exception):
    """The graph around a softmax must stay as it is; the message says why."""


def find(gm: torch.fx.GraphModule, example_inputs: Optional[Sequence[Any]] = None) -> list[Candidate]:
    """All softmax candidates of ``gm``, each with a plan or a reason.

    The one change it makes to the graph keeps what it computes: a read of a
    tensor after an in-place op on it reads that op's result (the same
    tensor), see :func:`read_after_mutation`."""
    if read_after_mutation(gm.graph):
        gm.recompile()
    constants = _constants(gm, example_inputs)
    evaluator = MaskEvaluator(constants)
    muts = Mutations(gm.graph)
    out = []
    for node in list(gm.graph.nodes):
        if N.kind(node, gm) != "softmax":
            continue
        cand = Candidate(softmax=node)
        try:
            _analyse(cand, gm, evaluator, muts)
        except NoMatch as e:
            cand.plan = None
            cand.reason = str(e)
        except Exception as e:  # noqa: BLE001 - a bug must not change a model
            log.warning("flashfuse: error analysing %s, left as it is: %r", node.name, e, exc_info=True)
            cand.plan = None
            cand.reason = f"internal error: {e!r}"
        out.append(cand)
    return out


# ---------------------------------------------------------------------------
# constants: buffers and graph attributes whose values may be read


def _is_buffer_placeholder(node: torch.fx.Node) -> bool:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = ""
    if source is not None:
        try:
            name = source.name() if callable(getattr(source, "name", None)) else str(source.name)
        except Exception:  # noqa: BLE001 - naming a source is best effort
            name = str(source)
    if "_buffers" in name:
        return True
    return bool(re.search(r"(^|_)buffers_", str(node.target)))


def _constants(gm: torch.fx.GraphModule, example_inputs) -> dict:
    consts: dict = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is not None and len(example_inputs) == len(placeholders):
        for node, value in zip(placeholders, example_inputs):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                if _is_buffer_placeholder(node):
                    consts[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                value = gm
                for part in node.target.split("."):
                    value = getattr(value, part)
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                consts[node] = value
    return consts


# ---------------------------------------------------------------------------
# in-place ops: which tensors change, and when


def read_after_mutation(graph: torch.fx.Graph) -> bool:
    """Make every read of a tensor that follows an in-place op on it read the
    op's result instead (``q.mul_(s); q @ k`` becomes ``q2 = q.mul_(s); q2 @
    k``). Only where the op returns the very tensor it wrote (the same
    example value), so the graph computes exactly what it did; the finder
    then sees the mutation as an ordinary new value. Returns whether any
    read changed."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for m in list(graph.nodes):
        written = N.mutated_args(m)
        x = m.args[0] if m.args else None
        if not written or not isinstance(x, torch.fx.Node) or not any(w is x for w in written):
            continue
        tv = N.tensor_val(x)
        if tv is None or N.tensor_val(m) is not tv:
            continue
        for user in list(x.users):
            if user is not m and order.get(user, -1) > order[m]:
                user.replace_input_with(x, m)
                changed = True
    return changed


def _storage(x: Any):
    """An identity for the memory a node's tensor lives in (views share it),
    or None for non-tensors."""
    t = N.tensor_val(x)
    if t is None:
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor without a plain storage
        return _UNKNOWN


# The storage of a tensor that has none PyTorch can name: may alias anything.
_UNKNOWN = object()


def _storages_held(x: Any) -> list:
    """The storages of the tensors a node's value holds: its own, or those of
    a tuple's or list's items (``unbind``, ``split``); empty for a number."""
    v = N.val(x)
    items = v if isinstance(v, (tuple, list)) else (v,)
    out = []
    for t in items:
        if isinstance(t, torch.Tensor):
            try:
                from torch.multiprocessing.reductions import StorageWeakRef

                out.append(StorageWeakRef(t.untyped_storage()))
            except Exception:  # noqa: BLE001 - a tensor without a plain storage
                out.append(_UNKNOWN)
    return out


class Mutations:
    """The graph's in-place ops, in order, with the storages they write."""

    def __init__(self, graph: torch.fx.Graph):
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.events: list[tuple] = []  # (position, node, set of storages | None = any)
        for n in graph.nodes:
            written = N.mutated_args(n)
            if written is None:
                continue
            keys: Optional[set] = set()
            for w in written:
                key = _storage(w) if isinstance(w, torch.fx.Node) else None
                if key is None or key is _UNKNOWN:
                    keys = None  # writes something unknown: assume anything
                    break
                keys.add(key)
            self.events.append((self.pos[n], n, keys))

    def between(self, x: torch.fx.Node, lo: int, hi: int, skip=()) -> Optional[torch.fx.Node]:
        """The first in-place op strictly between positions ``lo`` and ``hi``
        that may write the memory of ``x``'s tensor (``skip``: ops already
        understood)."""
        if not self.events or hi - lo < 2:
            return None
        key = _storage(x)
        if key is None:
            return None
        for p, m, keys in self.events:
            if lo < p < hi and m not in skip and (keys is None or key is _UNKNOWN or key in keys):
                return m
        return None

    def in_ancestry(self, root: torch.fx.Node, until: int) -> Optional[torch.fx.Node]:
        """An in-place op that changes a tensor of ``root``'s ancestry between
        its creation and a read of it, or ``root`` itself before ``until``:
        then the values that built ``root`` are not what its nodes say."""
        if not self.events:
            return None
        m = self.between(root, self.pos[root], until)
        seen: set = set()
        stack = [root]
        while stack and m is None:
            c = stack.pop()
            if c in seen or N.kind(c) == "size":  # metadata reads see no values
                continue
            seen.add(c)
            for n in c.all_input_nodes:
                m = m or self.between(n, self.pos[n], self.pos[c])
                stack.append(n)
        return m


def _mutation_reason(what: str, m: torch.fx.Node) -> str:
    line = source_line(m)
    at = f" at {line}" if line else ""
    return f"{what} is mutated in place by {N.describe(m)}{at}; left alone"


def _check_mutations(cand: Candidate, plan: Plan, muts: Mutations) -> None:
    """The op reads its inputs where the ``probs @ v`` product was, and the
    finder read the nodes between them and the products as values fixed when
    each was computed. Refuse when an in-place op could make either untrue:

    * a tensor the finder interpreted (a peeled view or scaling of q or k,
      a mask proved to be a band, a constant scale) is written between its
      creation and its read;
    * an input the op reads (q, k, v, a mask tensor, a scale tensor) is
      written between the pattern's first read of it and the op.

    In-place ops on the scores that the finder recognised are part of the
    pattern. Writes before the pattern reads a tensor are fine: the op sees
    the written value, as eager did."""
    if not muts.events:
        return
    op_pos = muts.pos[cand.output]
    chain = set(cand.replaced)
    inputs: dict = {}
    for op, role in ((plan.query, "q"), (plan.key, "k"), (plan.value, "v")):
        inputs.setdefault(op.node, role)
    for term in plan.additive:
        inputs.setdefault(term.node, "the mask")
        for _, f in term.factors:
            f = f.node if isinstance(f, Operand) else f
            if isinstance(f, torch.fx.Node):
                inputs.setdefault(f, "a scale factor")
    for h in plan.hide:
        inputs.setdefault(h.node, "the mask")
    if plan.sinks is not None:
        inputs.setdefault(plan.sinks.node, "the sinks")
    for _, f in plan.q_factors:
        f = f.node if isinstance(f, Operand) else f
        if isinstance(f, torch.fx.Node):
            inputs.setdefault(f, "a scale factor")
    region: set = set()
    stack = list(chain)
    while stack:
        c = stack.pop()
        if c in region or c in inputs or N.kind(c) == "size":
            continue
        region.add(c)
        for n in c.all_input_nodes:
            if n in inputs:
                continue
            m = muts.between(n, muts.pos[n], muts.pos[c], skip=chain)
            if m is not None:
                raise NoMatch(_mutation_reason(f"{n.name}, which the attention is computed from,", m))
            stack.append(n)
    for n, role in inputs.items():
        reads = [muts.pos[c] for c in n.users if c in region]
        first = min(reads) if reads else muts.pos[n]
        m = muts.between(n, first, op_pos, skip=chain)
        if m is not None:
            raise NoMatch(_mutation_reason(f"{role} ({n.name}), read by the attention,", m))


# ---------------------------------------------------------------------------
# the walk


def _analyse(cand: Candidate, gm: torch.fx.GraphModule, masks: MaskEvaluator, muts: Mutations) -> None:
    sm = cand.softmax
    if sm.op == "call_module":
        mod = gm.get_submodule(sm.target)
        x, dim, sm_dtype = sm.args[0], mod.dim, None
    else:
        x = N.arg(sm, 0, "input")
        dim = N.arg(sm, 1, "dim")
        sm_dtype = N.arg(sm, 3 if N.describe(sm).endswith("functional.softmax") else 2, "dtype")
    xv = N.tensor_val(x)
    if xv is None or xv.dim() < 2:
        raise NoMatch("softmax input is not a tensor of rank >= 2")
    if not isinstance(dim, int) or dim not in (-1, xv.dim() - 1):
        raise NoMatch(f"softmax over dim {dim}, not the last (key) dim")
    if sm_dtype is not None and not (isinstance(sm_dtype, torch.dtype) and sm_dtype.is_floating_point):
        raise NoMatch("softmax dtype is not a floating dtype")

    pv, dropout_p, probs_chain = _walk_probs(sm, gm)
    cand.output = pv
    # gpt-oss's sinks: a column concatenated to the scores, dropped after.
    sink = _capsink.peel_sinks(x, sm)
    sliced = [n for n in probs_chain if N.kind(n) == "getitem"]
    if sink is None and sliced:
        raise NoMatch("the probabilities are sliced, not a sink column dropped")
    if sink is not None and not sliced:
        raise NoMatch("a column is concatenated to the scores but not dropped after the softmax")
    qk, transforms, scores_chain = _walk_scores(sink.scores if sink else x, sink.cat if sink else sm)
    cand.scores = qk
    cand.replaced = [qk, *scores_chain, *(n for n in (sink.nodes[::-1] if sink else []) if N.tensor_val(n) is not None), sm, *probs_chain, pv]

    # The op must run where the products ran: every chain tensor on one device.
    dev = N.tensor_val(sm).device
    for n in cand.replaced:
        t = N.tensor_val(n)
        if t is None or t.device != dev:
            raise NoMatch("a tensor of the pattern lives on another device")
    if dev.type not in ("cpu", "cuda"):
        raise NoMatch(f"device {dev.type} is not supported by the op")
    if sink is not None:  # the row max's (values, indices) pair dies with the rest
        cand.replaced += [n for n in sink.nodes if N.tensor_val(n) is None]
    _check_no_mutation_between(qk, pv, set(cand.replaced))

    # Transposes of the last two dims between the product and the softmax
    # (scores built as k @ qᵀ): see flashfuse.fx.layouts.
    flipped = sum(1 for t in transforms if t[0] == "transpose") % 2 == 1
    layout = None
    if any(N.kind(n) in V.VIEW_KINDS for n in scores_chain + probs_chain):
        # Views that split/merge the batch dims: see _BatchLayout.
        if any(t[0] == "transpose" for t in transforms):
            raise NoMatch("a transpose of the scores together with views of their batch dims is not understood")
        if sink is not None:
            raise NoMatch("sinks together with views of the scores' batch dims are not understood")
        layout = _BatchLayout(cand, gm, qk, pv, scores_chain, probs_chain)
    else:
        # Every transform keeps the product's shape (or its transpose): a mask
        # that broadcasts the scores to a larger tensor is not an attention mask.
        scores_shape = N.shape(qk)
        shapes = [scores_shape]
        if scores_shape is not None and len(scores_shape) >= 2 and any(t[0] == "transpose" for t in transforms):
            shapes.append(tuple(scores_shape[:-2]) + (scores_shape[-1], scores_shape[-2]))
        with_sink = []
        if sink is not None:  # up to the slice, one more column: the sink's
            if len(shapes) > 1:
                raise NoMatch("sinks together with transposed scores are not understood")
            with_sink = sink.wide + [sm]
            with_sink += probs_chain[: probs_chain.index(sliced[0]) + 1]
            wide = tuple(scores_shape[:-1]) + (scores_shape[-1] + 1,)
            for n in with_sink[:-1]:
                if not _same_shape(N.shape(n), wide):
                    raise NoMatch(f"{N.describe(n)} changes the shape of the scores and their sink column")
        for n in scores_chain + [sm] + probs_chain:
            if n in with_sink:
                continue
            if not any(_same_shape(N.shape(n), s) for s in shapes):
                raise NoMatch(f"{N.describe(n)} changes the shape of the scores")
    # More than two batch dims folded into the op's batch (layouts.BatchFold),
    # else grouped heads as a 5-D broadcast (layouts.GroupLayout).
    nd = N.tensor_val(qk).dim()
    fold = layout is None and nd >= 5 and _folds(qk, pv)
    grouped = layout is None and nd == 5 and not fold
    batch_fold = None
    if grouped and sink is not None:
        raise NoMatch("sinks together with grouped heads as a 5-D broadcast are not understood")
    if fold and sink is not None:
        raise NoMatch("sinks together with more than two batch dims are not understood")

    q_op, k_op, pre, perm0 = _score_operands(qk, pad=layout is None and not grouped and not fold, flipped=flipped,
                                             max_batch=nd - 2 if fold else 3 if grouped else 2)
    transforms = _capsink.fold_softcap(pre + transforms)
    if N.kind(qk) == "baddbmm" and any(t[0] == "add" for t in pre):
        # A bias-first product (Bloom/Falcon ALiBi): named in explain.
        cand.facts["alibi"] = next(t[1] for t in pre if t[0] == "add")
    try:
        where, final = L.stages(perm0, transforms)
        permuted = not L.identity(perm0) or any(t[0] == "transpose" for t in transforms)
        if layout is not None and permuted:
            raise NoMatch("scores in another layout than (batch, query, key) together with views of their "
                          "batch dims are not understood")
        if fold:
            batch_fold = _fold_operands(gm, qk, q_op, k_op, pv, perm0, final)
            q_op, k_op, v_op, out_steps = batch_fold.ops
            layout = L.ScoresLayout(batch_fold.scores, where, nd, batch_fold)
        elif grouped:
            group = L.GroupLayout(gm, _canonical(N.tensor_val(qk), perm0), pv)
            q_op, k_op, v_op, out_steps = _group_operands(group, q_op, k_op, pv, final)
            layout = L.ScoresLayout(group.scores, where, 5, group)
        elif layout is None:
            v_op, out_steps = _value_operand(pv, final)
            if permuted:
                layout = L.ScoresLayout(_canonical(N.tensor_val(qk), perm0), where, len(perm0), None)
        else:
            q_op, k_op, v_op, out_steps = layout.operands(q_op, k_op)
        plan = _build_plan(cand, q_op, k_op, v_op, out_steps, transforms, dropout_p, masks, muts, layout,
                           grouped=grouped)
    except L.LayoutMismatch as e:
        raise NoMatch(str(e)) from None
    if batch_fold is not None:
        cand.facts["layout"] = batch_fold.describe(plan)
    if sink is not None:
        plan.sinks = sink.sinks
        cand.facts["mask"] = cand.facts["mask"] + ", sinks" if cand.facts["mask"] != "none" else "sinks"
    _check_mutations(cand, plan, muts)
    cand.plan = plan


def _same_shape(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(N.known_eq(x, y) for x, y in zip(a, b))


def _walk_probs(sm: torch.fx.Node, gm) -> ProbsPath:
    """From the softmax forward to ``probs @ v``."""
    cur = sm
    chain: list[torch.fx.Node] = []
    dropout_p = 0.0
    seen_dropout = False
    while True:
        users = N.real_users(cur)
        if len(users) != 1:
            if not users:
                raise NoMatch("the probabilities are not used")
            raise NoMatch("the probabilities have other users (returned or reused)")
        u = users[0]
        k = N.kind(u, gm)
        if k in N.CAST_KINDS or k in ("contiguous", "clone"):
            t = N.tensor_val(u)
            if t is None or not t.dtype.is_floating_point:
                raise NoMatch(f"{N.describe(u)} turns the probabilities into a non-float tensor")
            if k in ("to", "type") and u.args[0] is not cur:
                raise NoMatch(f"{N.describe(u)} reads the probabilities in an unexpected position")
            chain.append(u)
            cur = u
            continue
        if k in V.VIEW_KINDS and u.args and u.args[0] is cur:
            why = V.why_not_batch_view(u)
            if why is not None:
                raise NoMatch(f"the probabilities go into {why}; left alone")
            chain.append(u)
            cur = u
            continue
        if k == "dropout":
            inp = u.args[0] if u.args else u.kwargs.get("input")
            if u.op != "call_module" and inp is not cur:
                raise NoMatch("dropout reads the probabilities in an unexpected position")
            if u.op == "call_module":
                mod = gm.get_submodule(u.target)
                p, training = mod.p, mod.training
            else:
                p = N.arg(u, 1, "p", 0.5)
                training = N.arg(u, 2, "training", None)
                if training is None:
                    training = N.arg(u, 2, "train", True)
            if not isinstance(training, bool):
                raise NoMatch("dropout's training flag is not a compile-time constant")
            if training:
                pn = N.guarded_number(p)
                if pn is None:
                    raise NoMatch("dropout probability is not a compile-time constant")
                if seen_dropout and pn > 0:
                    raise NoMatch("two dropouts on the probabilities")
                if not 0.0 <= pn < 1.0:
                    raise NoMatch(f"dropout probability {pn} is not in [0, 1)")
                if pn > 0:
                    seen_dropout = True
                    dropout_p = pn
            chain.append(u)
            cur = u
            continue
        if _capsink.drops_last_column(u, cur):  # the sink's column (see _analyse)
            chain.append(u)
            cur = u
            continue
        if k in ("matmul", "bmm"):
            if len(u.args) >= 2 and u.args[0] is cur and u.args[1] is not cur:
                return ProbsPath(u, dropout_p, chain)
            raise NoMatch("the probabilities are not the left operand of the product with v")
        if k == "einsum":
            ops = _einsum_operands(u)
            if ops is not None and len(ops[1]) == 2 and ops[1][0] is cur and ops[1][1] is not cur:
                return ProbsPath(u, dropout_p, chain)
            raise NoMatch("the probabilities go into an einsum that is not probs x v")
        raise NoMatch(f"the probabilities go into {N.describe(u)}, not a product with v")


def _other_users_inplace(cur: torch.fx.Node, consumer: torch.fx.Node) -> Optional[torch.fx.Node]:
    """An in-place op that mutates ``cur`` before ``consumer`` reads it, as in
    ``s.masked_fill_(m, -inf); p = s.softmax(-1)``. Raises on any other user."""
    others = [u for u in N.real_users(cur) if u is not consumer]
    if not others:
        return None
    if len(others) == 1:
        u = others[0]
        if N.is_inplace(u) and u.args and u.args[0] is cur and not N.real_users(u):
            # It must run before the consumer reads the tensor.
            for n in cur.graph.nodes:
                if n is u:
                    return u
                if n is consumer:
                    break
    raise NoMatch("the scores have other users (returned or reused)")


def _walk_scores(x: torch.fx.Node, consumer: torch.fx.Node) -> ScoresPath:
    """From the softmax input back to the q @ k^T product (transforms: see
    :data:`flashfuse.fx.match.Transform`)."""
    outer: list[Transform] = []  # collected from the softmax inward
    chain: list[torch.fx.Node] = []
    cur = x
    while True:
        if not isinstance(cur, torch.fx.Node):
            raise NoMatch("the scores are not computed in the graph")
        side = _other_users_inplace(cur, consumer)
        if side is not None:
            # The in-place op runs after ``cur`` is computed: it applies last.
            step = _transform(side, cur)
            if step.scores is not cur:
                raise NoMatch(f"{N.describe(side)} mutates the scores unexpectedly")
            if step.transform is not None:
                outer.append(step.transform)
            chain.append(side)
        if N.kind(cur) in N.PRODUCT_KINDS:
            return ScoresPath(cur, list(reversed(outer)), chain)
        step = _transform(cur, None)
        chain.append(cur)
        if step.transform is not None:
            outer.append(step.transform)
        consumer, cur = cur, step.scores


class _ScoreStep(NamedTuple):
    """One node between the q·kᵀ product and the softmax, read back from the softmax."""

    transform: Optional[Transform]  # what it does to the scores; None: nothing the op needs
    scores: torch.fx.Node  # its scores input, one step closer to the product


def _transform(node: torch.fx.Node, known_chain: Optional[torch.fx.Node]) -> _ScoreStep:
    """Classify one score transform: the transform (None for one that changes
    nothing the op needs to know) and its scores input.
    ``known_chain`` is the scores input when it is already known (in-place
    ops found as side users)."""
    k = N.kind(node)
    base = k[:-1] if k and k.endswith("_") else k
    sv = N.tensor_val(node)
    if k in N.CAST_KINDS or k in ("contiguous", "clone"):
        if sv is None or not sv.dtype.is_floating_point:
            raise NoMatch(f"{N.describe(node)} casts the scores to a non-float dtype")
        return _ScoreStep(None, node.args[0])
    if known_chain is None and _swaps_last_two(node):
        # Scores built transposed, (k @ qᵀ).transpose(-1, -2): see layouts.
        return _ScoreStep(Transform("transpose"), node.args[0])
    if k in V.VIEW_KINDS and known_chain is None:
        why = V.why_not_batch_view(node)
        if why is not None:
            raise NoMatch(f"{why} between the q·kᵀ product and the softmax; left alone")
        return _ScoreStep(None, node.args[0])
    if base == "mul":
        a, b = node.args[0], node.args[1]
        for chain_arg, other in ((a, b), (b, a)):
            if known_chain is not None and chain_arg is not known_chain:
                continue
            ct = N.tensor_val(chain_arg)
            if isinstance(chain_arg, torch.fx.Node) and ct is not None and ct.dim() > 0 and N.is_scalar_like(other):
                return _ScoreStep(Transform("scale", "mul", _factor(other)), chain_arg)
            if isinstance(chain_arg, torch.fx.Node) and _per_head_factor(other, ct):
                return _ScoreStep(Transform("scale", "mul", other), chain_arg)
        raise NoMatch("the scores are multiplied by a tensor that varies over the query or key dim")
    if base == "div":
        if N.arg(node, 2, "rounding_mode") is not None:
            raise NoMatch("the scores are divided with a rounding mode")
        a, b = node.args[0], node.args[1]
        if (known_chain is None or a is known_chain) and N.is_scalar_like(b) and isinstance(a, torch.fx.Node):
            return _ScoreStep(Transform("scale", "div", _factor(b)), a)
        if (known_chain is None or a is known_chain) and isinstance(a, torch.fx.Node) and _per_head_factor(b, N.tensor_val(a)):
            return _ScoreStep(Transform("scale", "div", b), a)
        raise NoMatch("the scores are divided by a tensor that varies over the query or key dim, or divide something")
    if base in ("add", "sub"):
        a, b = node.args[0], node.args[1]
        alpha = N.number(node.kwargs.get("alpha", 1))
        if alpha is None:
            raise NoMatch("add with a non-constant alpha")
        if known_chain is not None:
            options = [(a, b)] if a is known_chain else []
        else:
            options = [(a, b)]
            if base == "add" and alpha == 1:
                options.append((b, a))
            # Prefer the operand that leads back to a product (the scores).
            options.sort(key=lambda o: not _leads_to_product(o[0]))
        for chain_arg, other in options:
            if not isinstance(chain_arg, torch.fx.Node) or N.tensor_val(chain_arg) is None:
                continue
            if N.tensor_val(chain_arg).dim() == 0:
                continue
            if isinstance(other, (int, float)) and not isinstance(other, bool):
                if not math.isfinite(other):
                    raise NoMatch("an infinite constant is added to the scores")
                return _ScoreStep(Transform("noop"), chain_arg)  # softmax ignores a constant shift
            ov = N.val(other)
            if isinstance(ov, (torch.SymInt, torch.SymFloat)):
                return _ScoreStep(Transform("noop"), chain_arg)
            if isinstance(other, torch.fx.Node) and isinstance(ov, torch.Tensor):
                if ov.dim() == 0:
                    raise NoMatch("a 0-d tensor is added to the scores")
                return _ScoreStep(Transform("add", other, base == "sub", alpha), chain_arg)
        raise NoMatch(f"{N.describe(node)} combines the scores in a way that is not understood")
    if base == "masked_fill":
        chain_arg, cond, value = node.args[0], N.arg(node, 1, "mask"), N.arg(node, 2, "value")
        v = N.number(value)
        if v is None:
            raise NoMatch("masked_fill with a value that is not a compile-time constant")
        return _ScoreStep(Transform("fill", cond, True, _in_dtype(v, sv)), chain_arg)
    if base == "where":
        if len(node.args) < 3:
            raise NoMatch("torch.where with one argument")
        cond, a, b = node.args[:3]
        a_chain = isinstance(a, torch.fx.Node) and not N.is_scalar_like(a)
        b_chain = isinstance(b, torch.fx.Node) and not N.is_scalar_like(b)
        if a_chain and not b_chain:
            v = N.number(b)
            if v is None:
                raise NoMatch("torch.where with a non-constant fill value")
            return _ScoreStep(Transform("fill", cond, False, _in_dtype(v, sv)), a)
        if b_chain and not a_chain:
            v = N.number(a)
            if v is None:
                raise NoMatch("torch.where with a non-constant fill value")
            return _ScoreStep(Transform("fill", cond, True, _in_dtype(v, sv)), b)
        raise NoMatch("torch.where mixes the scores with another tensor")
    if k == "tanh" and node.args and isinstance(node.args[0], torch.fx.Node):
        return _ScoreStep(Transform("tanh"), node.args[0])  # a soft-cap, checked by capsink.fold_softcap
    raise NoMatch(f"{N.describe(node)} between the q·kᵀ product and the softmax is not understood")


def _in_dtype(v: float, t: Optional[torch.Tensor]) -> float:
    """A fill value as the scores hold it (-1e9 is -inf in float16)."""
    if t is None or not t.dtype.is_floating_point or math.isnan(v):
        return v
    return float(torch.tensor(v, dtype=torch.float64).to(t.dtype).item())


def _rows_keep_a_key(band: Band, n, m) -> bool:
    """Every query row 0..n-1 provably has a key 0..m-1 with
    ``lo <= j - i <= hi``."""
    lo, hi = band.lo, band.hi
    if not N.known_le(1, m):
        return False
    if hi is not None and not N.known_le(0, hi):  # row 0 needs j = 0 <= hi
        return False
    if lo is not None and not N.known_le(lo + n, m):  # row n-1 needs j = m-1 >= n-1+lo
        return False
    return lo is None or hi is None or N.known_le(lo, hi)


def _leads_to_product(x: Any, depth: int = 12) -> bool:
    """Cheap look-back: does ``x`` reach a product through score-like ops?"""
    cur = x
    for _ in range(depth):
        if not isinstance(cur, torch.fx.Node):
            return False
        k = N.kind(cur)
        if k in N.PRODUCT_KINDS:
            return True
        if k in ("where",) and len(cur.args) == 3:
            cur = cur.args[1] if isinstance(cur.args[1], torch.fx.Node) else cur.args[2]
            continue
        # The first tensor operand: ``cap * torch.tanh(s / cap)`` puts a
        # number first.
        nodes = [a for a in cur.args if isinstance(a, torch.fx.Node)]
        if not nodes:
            return False
        cur = nodes[0]
    return False


def _factor(x: Any):
    """A scale factor: a float when constant, else the node itself."""
    n = N.number(x)
    if n is not None:
        return n
    if isinstance(x, torch.fx.Node):
        return x
    raise NoMatch(f"scale {x!r} is not understood")


def _check_no_mutation_between(first: torch.fx.Node, last: torch.fx.Node, chain: set) -> None:
    """The op runs at ``last``; any in-place op after ``first`` might have
    changed q, k or a mask in between, so refuse."""
    inside = False
    for n in first.graph.nodes:
        if n is first:
            inside = True
            continue
        if n is last:
            return
        if inside and n not in chain and N.is_inplace(n) and not _writes_private_tensor(n):
            line = source_line(n)
            at = f" at {line}" if line else ""
            raise NoMatch(f"in-place {N.describe(n)}{at} between the two products; left alone")


def _writes_private_tensor(m: torch.fx.Node) -> bool:
    """An in-place op (e.g. ``nn.ReLU(inplace=True)`` in Swin-v2's bias MLP)
    that writes only tensors nothing else reads: each written node has the op
    as its only user and shares its memory with no earlier node (not a view,
    input or alias). Then only the op's own result sees the write."""
    written = N.mutated_args(m)
    if not written:
        return False
    for w in written:
        if not isinstance(w, torch.fx.Node) or len(w.users) != 1:
            return False
        key = _storage(w)
        if key is None or key is _UNKNOWN:
            return False
        for other in m.graph.nodes:
            if other is m:
                break
            if other is w:
                continue
            # A storage PyTorch cannot name may be this one: not private.
            for theirs in _storages_held(other):
                if theirs is _UNKNOWN or theirs == key:
                    return False
    return True


# ---------------------------------------------------------------------------
# operands


def _einsum_operands(node: torch.fx.Node):
    if not node.args or not isinstance(node.args[0], str):
        return None
    ops = node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    return node.args[0].replace(" ", ""), tuple(ops)


def _parse_einsum(eq: str, n_ops: int):
    if "..." in eq or "->" not in eq:
        raise NoMatch("einsum with an ellipsis or an implicit output")
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != n_ops:
        raise NoMatch("einsum operand count")
    for t in terms + [out]:
        if len(set(t)) != len(t) or not t.isalpha():
            raise NoMatch("einsum with repeated subscripts")
    return terms, out


class _Peeled(NamedTuple):
    """A score factor with constant scalings (and transposes) peeled off."""

    node: Any  # what is left
    scale: float  # the product of the peeled scalings
    transposed: int  # 1 if an odd number of last-two-dims transposes was peeled


def _peel(x: Any, transposes: bool = True) -> _Peeled:
    """Peel constant scalar mul/div of the same dtype off ``x`` and, with
    ``transposes``, ``contiguous`` and last-two-dims transposes."""
    scale, flips = 1.0, 0
    while isinstance(x, torch.fx.Node):
        k = N.kind(x)
        t = N.tensor_val(x)
        if t is None:
            break
        if k in ("mul", "div") and len(x.args) == 2:
            a, b = x.args
            if k == "mul" and N.number(a) is not None and isinstance(b, torch.fx.Node):
                a, b = b, a
            c = N.number(b)
            if c is None or not isinstance(a, torch.fx.Node) or c == 0 or "rounding_mode" in x.kwargs:
                break
            at = N.tensor_val(a)
            if at is None or at.dtype != t.dtype:
                break
            scale = scale * c if k == "mul" else scale / c
            x = a
            continue
        if transposes and k == "contiguous":
            x = x.args[0]
            continue
        if transposes and _swaps_last_two(x):
            flips ^= 1
            x = x.args[0]
            continue
        break
    return _Peeled(x, scale, flips)


def _swaps_last_two(x: torch.fx.Node) -> bool:
    """``x`` is its input with exactly the last two dims swapped."""
    k = N.kind(x)
    t = N.tensor_val(x)
    if t is None or t.dim() < 2:
        return False
    nd = t.dim()
    if k == "mT":
        return True
    if k == "T":
        return nd == 2
    if k == "transpose":
        d0, d1 = N.arg(x, 1, "dim0"), N.arg(x, 2, "dim1")
        if not isinstance(d0, int) or not isinstance(d1, int):
            return False
        return {d0 % nd, d1 % nd} == {nd - 2, nd - 1}
    if k == "permute":
        dims = x.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = tuple(dims[0])
        if "dims" in x.kwargs:
            dims = tuple(x.kwargs["dims"])
        if len(dims) != nd or not all(isinstance(d, int) for d in dims):
            return False
        dims = [d % nd for d in dims]
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def _score_operands(qk: torch.fx.Node, pad: bool = True, flipped: bool = False, max_batch: int = 2) -> ScoreOperands:
    """q (..., N, D) and k (..., M, D) operands of the score product, with the
    batch dims of the scores in order, any transforms the product itself
    applies (baddbmm's alpha and bias), and the product's layout: the
    permutation ``p`` with product = canonical (batch..., N, M) scores
    ``.permute(p)``. ``pad``: right-align them to two batch dims (else they
    keep the product's batch dims). ``flipped``: the chain transposes the
    last two dims an odd number of times, so the product's last dim holds
    the queries (``k @ qᵀ``)."""
    k = N.kind(qk)
    pre: list[tuple] = []
    pad_batch = _pad_batch if pad else (lambda op, ndim, nb: op)
    if k in ("matmul", "bmm", "baddbmm"):
        if k == "baddbmm":
            # Bias-first spellings pass the operands by keyword
            # (``alibi.baddbmm(batch1=q, batch2=kt, beta=b, alpha=s)``).
            bias = N.arg(qk, 0, "input")
            a, b = N.arg(qk, 1, "batch1"), N.arg(qk, 2, "batch2")
            beta = N.number(qk.kwargs.get("beta", qk.args[3] if len(qk.args) > 3 else 1))
            alpha_arg = qk.kwargs.get("alpha", qk.args[4] if len(qk.args) > 4 else 1)
            alpha = N.number(alpha_arg)
            if alpha is None and isinstance(N.val(alpha_arg), torch.SymFloat):
                alpha = alpha_arg  # a symbolic scale: folded into q like any other
            if beta is None or alpha is None:
                raise NoMatch("baddbmm with a beta or alpha that is not a constant or a symbolic number")
            pre.append(Transform("scale", "mul", alpha))
            if beta != 0:
                if not isinstance(bias, torch.fx.Node):
                    pre.append(Transform("noop"))
                else:
                    pre.append(Transform("add", bias, False, beta))
        else:
            a, b = qk.args[0], qk.args[1]
        av, bv = N.tensor_val(a), N.tensor_val(b)
        if av is None or bv is None or av.dim() < 2 or bv.dim() < 2:
            raise NoMatch("the score product has an operand of rank < 2")
        # a @ b: a is an operand of the op as it is (transposes on it are
        # peeled only when they cancel out), b's transpose the other one.
        # Unflipped that is q @ kᵀ, flipped k @ qᵀ.
        pa = _peel(a)
        if pa.transposed:
            pa = _peel(a, transposes=False)
        pb = _peel(b)
        if pa.scale != 1.0:
            pre.insert(0, Transform("scale", "mul", pa.scale))
        if pb.scale != 1.0:
            pre.insert(0, Transform("scale", "mul", pb.scale))
        a_op = Operand(pa.node)
        b_op = Operand(pb.node) if pb.transposed else Operand(pb.node, [Step("transpose", -2, -1)])
        nb = max(av.dim(), bv.dim()) - 2
        if nb > max_batch:
            raise NoMatch("scores with more than two batch dims")
        a_op = pad_batch(a_op, av.dim(), nb)
        b_op = pad_batch(b_op, bv.dim(), nb)
        perm = tuple(range(nb + 2 if not pad else 4))
        if flipped:
            return ScoreOperands(b_op, a_op, pre, L.swap_last_two(perm))
        return ScoreOperands(a_op, b_op, pre, perm)
    if k == "einsum":
        eq, ops = _einsum_operands(qk)
        if len(ops) != 2:
            raise NoMatch("einsum for the scores does not have two operands")
        (ta, tb), to = _parse_einsum(eq, 2)
        if len(to) < 2:
            raise NoMatch("einsum scores of rank < 2")
        # Roles from the equation, not the letters' names or order: the key
        # is the dim the softmax reaches last, free in one operand (k); the
        # query a dim free in the other (q); one summed dim (the head dim).
        final = list(to)
        if flipped:
            final[-2], final[-1] = final[-1], final[-2]
        m_l = final[-1]
        contracted = [c for c in ta if c in tb and c not in to]
        if len(contracted) > 1:
            raise NoMatch(f"einsum '{eq}' sums over more than the head dim")
        if len(contracted) != 1:
            raise NoMatch(f"einsum '{eq}' is not a q·kᵀ product")
        if (m_l in ta) == (m_l in tb):
            raise NoMatch(f"einsum '{eq}': the softmax's dim '{m_l}' is not a key dim of one operand")
        qo, ko = ops[0], ops[1]
        if m_l in ta:
            (ta, tb), (qo, ko) = (tb, ta), (ko, qo)
        queries = [c for c in to if c in ta and c not in tb]
        n_l = queries[0] if len(queries) == 1 else final[-2] if final[-2] in queries else None
        if n_l is None:
            raise NoMatch(f"einsum '{eq}' is not a q·kᵀ product")
        d_l = contracted[0]
        batch = [c for c in to if c not in (n_l, m_l)]
        if set(ta) - set(batch) != {n_l, d_l} or set(tb) - set(batch) != {m_l, d_l}:
            raise NoMatch(f"einsum '{eq}' sums over more than the head dim")
        if len(batch) > 2:
            raise NoMatch("scores with more than two batch dims")
        q_op = _einsum_to(qo, ta, batch + [n_l, d_l])
        k_op = _einsum_to(ko, tb, batch + [m_l, d_l])
        q_op = pad_batch(q_op, len(batch) + 2, len(batch))
        k_op = pad_batch(k_op, len(batch) + 2, len(batch))
        canon = batch + [n_l, m_l]
        perm = tuple(canon.index(c) for c in to)
        if pad and len(batch) < 2:
            # The op's scores gain leading size-1 dims; the product's layout too.
            extra = 2 - len(batch)
            perm = tuple(range(extra)) + tuple(p + extra for p in perm)
        return ScoreOperands(q_op, k_op, pre, perm)
    raise NoMatch(f"{N.describe(qk)} is not a score product")


def _canonical(scores: torch.Tensor, perm) -> torch.Tensor:
    """The product's example value in the canonical (batch..., N, M) layout
    (``perm`` may count leading size-1 dims the product lacks)."""
    scores = scores.reshape((1,) * (len(perm) - scores.dim()) + tuple(scores.shape))
    return scores if L.identity(perm) else scores.permute(*L.inverse(perm))


def _group_operands(group: "L.GroupLayout", q_op: Operand, k_op: Operand, pv: torch.fx.Node, final) -> Operands:
    """q, k, v and the output steps of a 5-D grouped product (see
    flashfuse.fx.layouts.GroupLayout)."""
    if not L.identity(final) or N.kind(pv) not in ("matmul",):
        raise NoMatch("the probabilities of a 5-D product go into something other than a matmul with v")
    if len(pv.args) < 2 or not isinstance(pv.args[1], torch.fx.Node):
        raise NoMatch("the value of the 5-D product is not a tensor")
    v_op = Operand(pv.args[1])
    q_op = group.query(q_op, _operand_val(q_op))
    kt, vt = _operand_val(k_op), _operand_val(v_op)
    km, vm = group.mode(kt, "k"), group.mode(vt, "v")
    if km == vm == "full" and not N.known_eq(group.g, 1):
        # A plain third batch dim, not grouped heads: not what the 5-D path is for.
        raise NoMatch("scores with more than two batch dims (k and v do not broadcast over a group dim)")
    if km != vm or not (N.known_eq(kt.shape[1], vt.shape[1]) and N.known_eq(kt.shape[2], vt.shape[2])):
        raise NoMatch("k and v are grouped differently in the 5-D product; left alone")
    k_op = group.kv(k_op, kt, km, _unsqueezed_at_2)
    v_op = group.kv(v_op, vt, vm, _unsqueezed_at_2)
    return Operands(q_op, k_op, v_op, group.output_steps())


def _folds(qk: torch.fx.Node, pv: torch.fx.Node) -> bool:
    """Whether matmul scores with more than two batch dims fold into the
    op's batch (see flashfuse.fx.layouts.BatchFold). A 5-D product that
    does not goes to the grouped-heads reading (layouts.GroupLayout), which
    also keeps those whose v has one head for several query heads; with
    more dims, why not is the reason."""
    if N.kind(qk) != "matmul" or N.kind(pv) != "matmul" or len(pv.args) < 2:
        return False
    s, vs = N.shape(qk), N.shape(pv.args[1])
    if s is None or vs is None:
        return False
    if len(s) == 5 and len(vs) >= 3 and N.known_eq(vs[-3], 1) and not N.known_eq(s[-3], 1):
        return False
    why = L.BatchFold.why_not([("the left factor of the scores", N.shape(qk.args[0])),
                               ("the right factor of the scores", N.shape(qk.args[1])), ("v", vs)], s)
    if why is not None and len(s) > 5:
        raise NoMatch(why)
    return why is None


def _fold_operands(gm, qk: torch.fx.Node, q_op: Operand, k_op: Operand, pv: torch.fx.Node, perm0, final):
    """The BatchFold of a product with more than two batch dims, with q, k,
    v and the output steps in its ``ops``."""
    if not L.identity(final):
        raise NoMatch("the probabilities of scores with more than two batch dims are not laid out "
                      "(batch..., query, key); left alone")
    fold = L.BatchFold(gm, _canonical(N.tensor_val(qk), perm0), pv)
    v_op = Operand(pv.args[1])
    ops = [fold.operand(op, _operand_val(op), what) for op, what in ((q_op, "q"), (k_op, "k"), (v_op, "v"))]
    fold.ops = Operands(*ops, fold.output_steps(N.tensor_val(pv)))
    return fold


def _einsum_to(node: Any, have: str, want: list) -> Operand:
    """Operand with subscripts ``have`` laid out as ``want`` (missing batch
    letters become size-1 dims)."""
    if not isinstance(node, torch.fx.Node) or N.tensor_val(node) is None:
        raise NoMatch("einsum operand is not a tensor")
    extra = [c for c in have if c not in want]
    if extra:
        raise NoMatch("einsum operand has a letter that is summed away")
    op = Operand(node)
    letters = list(have)
    perm = [letters.index(c) for c in want if c in letters]
    if perm != list(range(len(perm))):
        op = op.then(Step("permute", tuple(perm)))
    for pos, c in enumerate(want):
        if c not in letters:
            op = op.then(Step("unsqueeze", pos))
    return op


def _pad_batch(op: Operand, ndim: int, nb: int) -> Operand:
    """Right-align an operand with ``ndim - 2`` batch dims to two batch dims."""
    for _ in range(2 - (ndim - 2)):
        op = op.then(Step("unsqueeze", 0))
    return op


def _value_operand(pv: torch.fx.Node, perm=None) -> ValueOperands:
    """v (B?, H?, M, Dv) operand and the steps that turn the op's
    (B, H, N, Dv) result into ``pv``'s tensor. ``perm``: the layout of the
    probabilities (probs = canonical (batch..., N, M) ``.permute(perm)``)."""
    k = N.kind(pv)
    if k in ("matmul", "bmm") and perm is not None and not L.identity(perm):
        raise NoMatch("the probabilities are not laid out (batch, query, key) and go into a matmul with v; left alone")
    if k in ("matmul", "bmm"):
        v = pv.args[1]
        vv, pvv = N.tensor_val(v), N.tensor_val(pv)
        if vv is None or vv.dim() < 2:
            raise NoMatch("v has rank < 2")
        nb = pvv.dim() - 2
        if nb > 2:
            raise NoMatch("output with more than two batch dims")
        v_op = _pad_batch(Operand(v), vv.dim(), nb)
        out_steps = [Step("squeeze", 0)] * (2 - nb)
        return ValueOperands(v_op, out_steps)
    # einsum: probabilities carry the score layout (batch..., n, m).
    eq, ops = _einsum_operands(pv)
    (tp, tv), to = _parse_einsum(eq, 2)
    if len(tp) < 2:
        raise NoMatch("einsum probabilities of rank < 2")
    if perm is not None and len(perm) > len(tp):
        # Leading size-1 dims the op's layout added to the scores.
        extra = len(perm) - len(tp)
        if list(perm[:extra]) != list(range(extra)):
            raise NoMatch("internal: a padded layout moves its padding")
        perm = tuple(p - extra for p in perm[extra:])
    if perm is not None and len(perm) != len(tp):
        raise NoMatch(f"einsum '{eq}' reads the probabilities with another rank than the scores")
    # The probabilities' dims in canonical order (the query where the scores had it).
    canon_l = list(tp) if perm is None else [tp[perm.index(j)] for j in range(len(tp))]
    n_l, m_l, batch = canon_l[-2], canon_l[-1], canon_l[:-2]
    if m_l not in tv or m_l in to or n_l not in to or n_l in tv:
        raise NoMatch(f"einsum '{eq}' is not probs x v")
    e_ls = [c for c in tv if c not in tp]
    if len(e_ls) != 1 or e_ls[0] not in to:
        raise NoMatch(f"einsum '{eq}' does not keep exactly one value dim")
    e_l = e_ls[0]
    if set(to) != set(batch) | {n_l, e_l} or not set(tv) <= set(batch) | {m_l, e_l}:
        raise NoMatch(f"einsum '{eq}' mixes batch dims")
    if len(batch) > 2:
        raise NoMatch("output with more than two batch dims")
    v_op = _pad_batch(_einsum_to(ops[1], tv, batch + [m_l, e_l]), len(batch) + 2, len(batch))
    canon = batch + [n_l, e_l]
    out_steps: list = [Step("squeeze", 0)] * (2 - len(batch))
    perm = tuple(canon.index(c) for c in to)
    if perm != tuple(range(len(perm))):
        out_steps.append(Step("permute", perm))
    return ValueOperands(v_op, out_steps)


# ---------------------------------------------------------------------------
# shapes, GQA, scale and masks -> plan


def apply_steps(value: torch.Tensor, steps) -> torch.Tensor:
    """Replay view steps on an example value (fake tensors are fine)."""
    for step in steps:
        name = step[0]
        if name == "transpose":
            value = value.transpose(step[1], step[2])
        elif name == "permute":
            value = value.permute(*step[1])
        elif name == "unsqueeze":
            value = value.unsqueeze(step[1])
        elif name == "squeeze":
            value = value.squeeze(step[1])
        elif name == "to":
            value = value.to(step[1])
        elif name == "not":
            value = value.logical_not()
        elif name == "flatten":
            value = value.flatten(step[1], step[2])
        elif name == "unflatten":
            value = value.unflatten(step[1], tuple(N.val(x) for x in step[2]))
        elif name == "expand":
            value = value.expand(*(N.val(x) for x in step[1]))
        else:
            raise ValueError(f"unknown view step {name}")
    return value


def _operand_val(op: Operand) -> torch.Tensor:
    t = N.tensor_val(op.node)
    if t is None:
        raise NoMatch("an operand has no recorded example value")
    try:
        return apply_steps(t, op.steps)
    except Exception as e:  # noqa: BLE001 - a step the shapes do not allow
        raise NoMatch(f"operand views do not apply: {e}") from None


class _Repeated(NamedTuple):
    """A head-repeated k or v: head ``h`` reads ``source``'s head ``h // n_rep``."""

    source: Operand
    n_rep: int


def _repeat_source(op: Operand) -> Optional[_Repeated]:
    """The source of a head-repeated operand (repeat_kv's expand+reshape, or
    repeat_interleave on the head dim), or None."""
    if op.steps:
        return None
    node = op.node
    k = N.kind(node)
    t = N.tensor_val(node)
    if t is None or t.dim() != 4:
        return None
    if k == "repeat_interleave":
        reps = N.arg(node, 1, "repeats")
        dim = N.arg(node, 2, "dim")
        src = node.args[0]
        sv = N.tensor_val(src)
        r = N.const_int(N.val(reps)) if not isinstance(reps, torch.fx.Node) or N.tensor_val(reps) is None else None
        if sv is None or sv.dim() != 4 or r is None or r < 1 or dim not in (1, -3):
            return None
        return _Repeated(Operand(src), r)
    if k in ("reshape", "view"):
        ex = node.args[0]
        if N.kind(ex) != "expand":
            return None
        et = N.tensor_val(ex)
        un = ex.args[0]
        ut = N.tensor_val(un)
        if et is None or ut is None or et.dim() != 5 or ut.dim() != 5:
            return None
        src = _unsqueezed_at_2(un)
        if src is None:
            return None
        st = N.tensor_val(src)
        b, hkv, r, m, d = et.shape
        if not (N.known_eq(ut.shape[2], 1) and all(N.known_eq(x, y) for x, y in zip(st.shape, (b, hkv, m, d)))):
            return None
        if not all(N.known_eq(x, y) for x, y in zip(t.shape, (b, hkv * r, m, d))):
            return None
        rc = N.const_int(r)
        if rc is None:
            return None
        return _Repeated(Operand(src), rc)
    return None


def _unsqueezed_at_2(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    k = N.kind(node)
    t = N.tensor_val(node)
    src = node.args[0] if node.args else None
    st = N.tensor_val(src) if isinstance(src, torch.fx.Node) else None
    if t is None or st is None or st.dim() != 4:
        return None
    if k == "unsqueeze" and N.arg(node, 1, "dim") in (2, -3):
        return src
    if k == "getitem":
        idx = node.args[1]
        if not isinstance(idx, tuple):
            return None
        full = slice(None, None, None)
        items = list(idx) + [full] * (5 - len(idx))
        if len(items) == 5 and items[2] is None and all(
            isinstance(i, slice) and i == full for j, i in enumerate(items) if j != 2
        ):
            return src
        if idx and idx[-1] is Ellipsis:
            return None
    if k in ("view", "reshape"):
        if all(N.known_eq(x, y) for x, y in zip(t.shape, (st.shape[0], st.shape[1], 1, st.shape[2], st.shape[3]))):
            return src
    return None


def _bcast(a, b, what: str):
    if N.known_eq(a, 1):
        return b
    if N.known_eq(b, 1) or N.known_eq(a, b):
        return a
    raise NoMatch(f"{what} sizes do not provably match")


def _check_head_dim(d, what: str) -> None:
    c = N.const_int(d)
    if c is None:
        # A symbolic head size: decide by guarding on the range, so a later
        # call with an unsupported size recompiles without the rewrite.
        try:
            ok = bool(d >= MIN_HEAD_DIM) and bool(d <= MAX_HEAD_DIM)
        except Exception:  # noqa: BLE001 - guard not possible here
            raise NoMatch(f"{what} head size is symbolic") from None
        if not ok:
            raise NoMatch(f"{what} head size is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
        return
    if not MIN_HEAD_DIM <= c <= MAX_HEAD_DIM:
        raise NoMatch(f"{what} head size {c} is outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")


class _Fill(NamedTuple):
    """A ``masked_fill`` / ``where`` of the scores, as ``_build_plan`` reads
    the transforms after it."""

    cond: torch.fx.Node  # the bool condition
    hide_true: bool  # whether it fills where the condition is True
    value: float  # the value it fills in
    factor: Optional[float]  # the constant the scores are scaled by after it (None: a tensor scale, only for -inf)


def _build_plan(cand, q_op, k_op, v_op, out_steps, transforms, dropout_p, masks, muts=None, layout=None,
                grouped=False) -> Plan:
    qv, kv, vv = _operand_val(q_op), _operand_val(k_op), _operand_val(v_op)
    out_t = N.tensor_val(cand.output)
    # The scores as the op sees them, and the steps that bring a mask (or
    # per-head scale) from the layout where it was applied into them.
    scores_t = N.tensor_val(cand.scores) if layout is None else layout.scores
    steps_of = (lambda node: []) if layout is None else layout.steps_for
    for t, name in ((qv, "q"), (kv, "k"), (vv, "v")):
        if t.dim() != 4:
            raise NoMatch(f"{name} is not 4-D after normalisation")
        if t.dtype not in SUPPORTED_DTYPES:
            raise NoMatch(f"{name} has dtype {t.dtype}, not supported by the op")
    if out_t.dtype not in SUPPORTED_DTYPES:
        raise NoMatch(f"the output dtype {out_t.dtype} is not supported")
    _check_head_dim(qv.shape[-1], "q/k")
    _check_head_dim(vv.shape[-1], "v")
    if not N.known_eq(kv.shape[-2], vv.shape[-2]):
        raise NoMatch("k and v lengths do not provably match")

    # Batch and head dims: B, H of the output; q follows, k/v share heads.
    B = _bcast(_bcast(qv.shape[0], kv.shape[0], "batch"), vv.shape[0], "batch")
    if grouped:
        # 5-D grouped heads: q holds every query head, k/v one per group.
        H = qv.shape[1]
        if not N.known_eq(kv.shape[1], vv.shape[1]):
            raise NoMatch("k and v are grouped differently in the 5-D product; left alone")
    else:
        Hs = _bcast(qv.shape[1], kv.shape[1], "head")
        H = _bcast(Hs, vv.shape[1], "head")
    facts = cand.facts

    expands: list[tuple] = []
    vals = {"q": qv, "k": kv, "v": vv}

    def ref(dim: int, target):
        c = N.const_int(target)
        if c is not None:
            return c
        for name, t in vals.items():
            if N.known_eq(t.shape[dim], target):
                return (name, dim)
        raise NoMatch("a broadcast size has no operand to take it from")

    for name, t in vals.items():
        if not N.known_eq(t.shape[0], B):
            expands.append((name, 0, ref(0, B)))
    if not N.known_eq(qv.shape[1], H):
        expands.append(("q", 1, ref(1, H)))

    # Grouped heads: fold repeat_kv / repeat_interleave of both k and v.
    enable_gqa = False
    kr, vr = (None, None) if grouped else (_repeat_source(k_op), _repeat_source(v_op))
    if grouped:
        enable_gqa = not N.known_eq(kv.shape[1], H)
        if enable_gqa:
            facts["gqa"] = f"{_fmt(H)}q/{_fmt(kv.shape[1])}kv (5-D broadcast)"
    elif kr and vr and kr.n_rep == vr.n_rep and kr.n_rep > 1:
        ksrc, vsrc = _operand_val(kr.source), _operand_val(vr.source)
        if N.known_eq(ksrc.shape[1], vsrc.shape[1]) and N.known_eq(kv.shape[1], vv.shape[1]):
            if not N.known_eq(qv.shape[1], H):
                raise NoMatch("grouped heads with a broadcast query")
            k_op, v_op, kv, vv = kr.source, vr.source, ksrc, vsrc
            enable_gqa = True
            facts["gqa"] = f"{_fmt(H)}q/{_fmt(kv.shape[1])}kv (repeat folded)"
    hk, hv = kv.shape[1], vv.shape[1]
    if not enable_gqa and not grouped:
        if N.known_eq(hk, H) and N.known_eq(hv, H):
            pass
        elif N.known_eq(hk, 1) and N.known_eq(hv, 1):
            if not N.known_eq(H, 1):
                enable_gqa = True
                facts["gqa"] = f"{_fmt(H)}q/1kv (broadcast)"
        else:
            # One of k/v broadcasts over the heads of the other.
            for name, h in (("k", hk), ("v", hv)):
                if N.known_eq(h, 1):
                    expands.append((name, 1, ref(1, H)))
                elif not N.known_eq(h, H):
                    raise NoMatch("k and v head counts do not provably match")

    # Scale and masks, in the order the graph applies them.
    scale = 1.0
    q_factors: list = []
    additive: list[MaskTerm] = []
    hides: list[_Fill] = []
    softcap = None
    for t in transforms:
        if t[0] in ("noop", "transpose"):
            continue
        if t[0] == "softcap":  # fold_softcap put it before any mask
            softcap = t[1]
            continue
        if t[0] == "scale":
            if softcap is not None:
                raise NoMatch("the soft-capped scores are scaled again")
            _, op, f = t
            if isinstance(f, float):
                c = f if op == "mul" else 1.0 / f if f != 0 else math.inf
                if not math.isfinite(c) or c == 0:
                    raise NoMatch("the scores are scaled by 0 or infinity")
                if c < 0 and hides:
                    raise NoMatch("a negative scale after a masked_fill")
                scale *= c
                for term in additive:
                    term.factors.append(("mul", c))
                hides = [h._replace(factor=h.factor * c) for h in hides]
            else:
                fv = N.val(f)
                if isinstance(fv, torch.Tensor) and hides:
                    raise NoMatch("a tensor scale after a masked_fill (its sign is unknown)")
                if isinstance(fv, torch.Tensor) and not fv.dtype.is_floating_point:
                    raise NoMatch("the scores are scaled by a non-float tensor")
                q_factors.append((op, f))
                for term in additive:
                    term.factors.append((op, f))
                hides = [h._replace(factor=None if math.isfinite(h.value) else h.factor) for h in hides]
        elif t[0] == "add":
            _, node, negate, alpha = t
            term = MaskTerm(node, [], negate)
            if alpha != 1:
                term.factors.append(("mul", float(alpha)))
            additive.append(term)
        elif t[0] == "fill":
            _, cond, hide_true, value = t
            if math.isnan(value) or (math.isinf(value) and value > 0):
                raise NoMatch(f"masked_fill with {value}")
            hides.append(_Fill(cond, hide_true, value, 1.0))
        else:  # pragma: no cover - _transform only makes the kinds above
            raise NoMatch(f"internal: unknown transform {t[0]}")

    N_, M_ = scores_t.shape[-2], scores_t.shape[-1]

    def mask_value(node):
        # A mask written in place after (part of) it was built is not what
        # its nodes say: it stays a tensor, read as the op finds it.
        if muts is not None and muts.in_ancestry(node, muts.pos[cand.output]) is not None:
            return None
        return masks(node)

    # A finite fill is masked_fill's value for the rows it hides entirely
    # (eager averages them; the op returns 0 for a -inf hide or a window), and
    # such rows pass no gradient to q or k: it becomes a window only when no
    # row can be hidden entirely, else a bool mask with mask_fill.
    bands: list[_BandMask] = []
    hide_ops: list[tuple] = []  # (operand, fill value in the op's units)
    for cond, hide_true, value, factor in hides:
        if not math.isinf(value):
            if factor is None or value * factor > HIDE_THRESHOLD:
                raise NoMatch(f"masked_fill with {value:g} does not remove positions (only -inf or <= {HIDE_THRESHOLD:g} do)")
        fill = -math.inf if math.isinf(value) else value * factor
        cv = N.tensor_val(cond)
        if cv is None or cv.dtype != torch.bool:
            raise NoMatch("masked_fill/where condition is not a bool tensor")
        _check_mask_shape(cond, scores_t, steps_of(cond))
        operand = Operand(cond, steps_of(cond) + ([] if hide_true else [Step("not")]))
        # A band is proved on the mask's own last two dims: not when a
        # permuted layout moves them (the mask then stays a tensor).
        band = None if L.reorders(steps_of(cond)) else _visible_band(mask_value(cond), cond, hide_true, N_, M_)
        if band is not None:
            bands.append(_BandMask(band, math.isfinite(fill), fill_op=(operand, fill)))
            continue
        hide_ops.append((operand, fill))
    kept_terms: list[MaskTerm] = []
    for term in additive:
        tv = N.tensor_val(term.node)
        _check_mask_shape(term.node, scores_t, steps_of(term.node))
        term.steps = steps_of(term.node)
        band = None
        if tv.dtype.is_floating_point and not term.negate and not L.reorders(term.steps):
            band = _additive_band(mask_value(term.node), term, N_, M_)
        if band is not None:
            bands.append(band)
            continue
        kept_terms.append(term)

    from .masks import conjoin

    def combined(items: list[_BandMask]):
        band = items[0].band
        for other in items[1:]:
            band = conjoin(band, other.band)
            if band is None:
                raise NoMatch("two window masks that cannot be combined")
        return band

    if any(b.finite for b in bands):
        # Exact as a window only if every row keeps a key and no mask tensor
        # could hide the rest of a row; else such masks stay tensors.
        if hide_ops or kept_terms or not _rows_keep_a_key(combined(bands), N_, M_):
            for b in bands:
                if b.finite and b.fill_op is not None:
                    hide_ops.append(b.fill_op)
                elif b.finite:
                    kept_terms.append(b.term)
            bands = [b for b in bands if not b.finite]
    mask_fill = None
    fills = {fill for _, fill in hide_ops}
    if any(math.isfinite(f) for f in fills):
        if len(fills) > 1:
            raise NoMatch("masked_fill with different values (" + ", ".join(f"{f:g}" for f in sorted(fills))
                          + "): the op replaces hidden scores with one value; left alone")
        if kept_terms:
            raise NoMatch("masked_fill with a finite value and an additive mask: the op cannot replace hidden "
                          "scores and add a mask at once; left alone")
        if bands:
            raise NoMatch("masked_fill with a finite value and a causal/window mask: rows it hides entirely "
                          "would not average the same keys; left alone")
        mask_fill = float(next(iter(fills)))
    mask_kinds = ["bool"] * len(hide_ops) + ["additive"] * len(kept_terms)

    window_left = window_right = None
    alignment = "top_left"
    if bands:
        band = combined(bands)
        window = _band_to_window(band, N_, M_)
        if window is None:
            raise NoMatch("internal: a recognised band has no window form")
        window_left, window_right, alignment = window

    # Dtypes: the op runs in one dtype; the result is cast to eager's.
    dtypes = {qv.dtype, kv.dtype, vv.dtype}
    compute_dtype = None
    if len(dtypes) > 1:
        compute_dtype = qv.dtype
        for dt in dtypes:
            compute_dtype = torch.promote_types(compute_dtype, dt)

    # Per-head scales (tensors of shape (..., H, 1, 1)) in the op's layout.
    def factor_operand(f):
        if isinstance(f, torch.fx.Node) and N.tensor_val(f) is not None and N.tensor_val(f).dim() > 0:
            _check_mask_shape(f, scores_t, steps_of(f))
            fv = _operand_val(Operand(f, steps_of(f)))
            if not (fv.dim() >= 2 and N.known_eq(fv.shape[-1], 1) and N.known_eq(fv.shape[-2], 1)):
                # In a permuted layout a factor constant over its own last two
                # dims may vary over the queries or keys.
                raise NoMatch("the scores are multiplied by a tensor that varies over the query or key dim")
            facts["per_head_scale"] = f.name
            return Operand(f, steps_of(f)) if steps_of(f) else f
        return f

    q_factors = [(op, factor_operand(f)) for op, f in q_factors]
    for term in kept_terms:
        term.factors = [(op, factor_operand(f)) for op, f in term.factors]

    plan = Plan(
        query=q_op, key=k_op, value=v_op, scale=scale, q_factors=q_factors,
        additive=kept_terms, hide=[op for op, _ in hide_ops], window_left=window_left,
        window_right=window_right, alignment=alignment, enable_gqa=enable_gqa,
        dropout_p=dropout_p, out_steps=out_steps, out_dtype=out_t.dtype,
        expand=expands, compute_dtype=compute_dtype, op_dtype=compute_dtype or qv.dtype,
        mask_fill=mask_fill, softcap=softcap,
    )
    # Facts for explain.
    facts["scale"] = _fmt_scale(scale, q_factors)
    if plan.is_causal:
        facts["causal"] = "top-left" if alignment == "top_left" else "bottom-right"
    elif window_left is not None or window_right is not None:
        facts["window"] = f"({_fmt(window_left)}, {_fmt(window_right)}) {alignment}"
    facts["mask"] = "+".join(sorted(set(mask_kinds))) or "none"
    if "alibi" in facts and any(t.node is facts["alibi"] for t in kept_terms):
        facts["mask"] += " (alibi bias)"
    facts.pop("alibi", None)
    if "per_head_scale" in facts:
        facts["scale"] += " (per-head scale)"
    if softcap is not None:
        facts["softcap"] = softcap
        facts["mask"] = f"softcap {softcap:g}" + ("" if facts["mask"] == "none" else ", " + facts["mask"])
    if mask_fill is not None:
        facts["mask_fill"] = mask_fill
    facts["dropout"] = dropout_p
    facts.setdefault("gqa", "")
    return plan


def _check_mask_shape(node: torch.fx.Node, scores_t: torch.Tensor, steps=()) -> None:
    t = N.tensor_val(node)
    if t is None:
        raise NoMatch("a mask has no recorded example value")
    if steps:
        t = _operand_val(Operand(node, list(steps)))
    if t.dim() > scores_t.dim():
        raise NoMatch("a mask has more dims than the scores")
    for ms, ss in zip(reversed(t.shape), reversed(scores_t.shape)):
        if not (N.known_eq(ms, ss) or N.known_eq(ms, 1)):
            raise NoMatch("a mask does not provably broadcast to the scores")


def _visible_band(v, cond, hide_true: bool, n, m) -> Optional[Band]:
    """The visible band when the hidden positions form the complement of one."""
    if not isinstance(v, Band) or v.trivial or not isinstance(v.inside, bool):
        return None
    if not _band_dims_full(cond, n, m):
        return None
    # Positions where cond is True are hidden when hide_true.
    visible = v.map(lambda x: (not x) if hide_true else x).normalized()
    if visible.inside is not True or visible.outside is not False:
        return None
    return visible if _band_to_window(visible, n, m) is not None else None


class _BandMask(NamedTuple):
    """A mask recognised as a causal or window band, and where it came from:
    a ``masked_fill`` / ``where`` (``fill_op``: its (operand, fill in the
    op's units)) or an additive mask (``term``). One whose hidden value is
    finite may have to stay a tensor (see ``_build_plan``); then it goes back as
    what it came from."""

    band: Band  # the positions it leaves visible
    finite: bool  # whether it hides them with a finite value (eager averages rows it hides entirely)
    fill_op: Optional[tuple] = None
    term: Optional[MaskTerm] = None


def _additive_band(v, term: MaskTerm, n, m) -> Optional[_BandMask]:
    """An additive mask that is 0 (or any constant) on a band and -inf (or a
    value that removes positions) elsewhere, as a ``_BandMask`` (None if it
    is not one)."""
    if not isinstance(v, Band) or v.trivial:
        return None
    if not _band_dims_full(term.node, n, m):
        return None
    factor = 1.0
    for op, f in term.factors:
        if not isinstance(f, float):
            return None
        factor = factor * f if op == "mul" else factor / f
    try:
        inside, outside = float(v.inside) * factor, float(v.outside) * factor
    except (TypeError, ValueError):
        return None

    def hides(x: float, kept: float) -> bool:
        return x == -math.inf or (math.isfinite(x) and x - kept <= HIDE_THRESHOLD)

    if math.isfinite(inside) and hides(outside, inside):
        visible, hidden = Band(v.lo, v.hi, True, False, v.ndim), outside
    elif math.isfinite(outside) and hides(inside, outside):
        visible, hidden = Band(v.lo, v.hi, False, True, v.ndim).normalized(), inside
        if visible.inside is not True:
            return None
    else:
        return None
    if _band_to_window(visible, n, m) is None:
        return None
    return _BandMask(visible, math.isfinite(hidden), term=term)


def _band_dims_full(node, n, m) -> bool:
    s = N.shape(node)
    return s is not None and len(s) >= 2 and N.known_eq(s[-2], n) and N.known_eq(s[-1], m)


class _Window(NamedTuple):
    """The op's band arguments: ``-left <= j - i - offset <= right``."""

    left: Optional[int]
    right: Optional[int]
    alignment: str  # "top_left" (offset 0) or "bottom_right" (offset M - N)


def _band_to_window(band: Band, n, m) -> Optional[_Window]:
    """The window that shows exactly ``lo <= j - i <= hi``, or None."""
    offsets = [("top_left", 0)]
    if not N.known_eq(n, m):
        offsets.append(("bottom_right", m - n))
    found = []
    for alignment, off in offsets:
        wr = wl = None
        ok = True
        if band.hi is not None:
            wr = N.const_int(band.hi - off)
            ok = ok and wr is not None and wr >= 0
        if band.lo is not None:
            wl = N.const_int(off - band.lo)
            ok = ok and wl is not None and wl >= 0
        if ok:
            found.append(_Window(wl, wr, alignment))
    # Prefer the alignment in which the band touches the diagonal (causal).
    found.sort(key=lambda w: w.right != 0)
    return found[0] if found else None


def _fmt(x) -> str:
    if x is None:
        return "-"
    c = N.const_int(x)
    return str(c) if c is not None else str(x)


def _fmt_scale(scale: float, q_factors) -> str:
    parts = [f"{scale:.6g}"] if (scale != 1.0 or not q_factors) else []
    for op, f in q_factors:
        if isinstance(f, Operand):
            f = f.node
        name = f.name if isinstance(f, torch.fx.Node) else repr(f)
        parts.append(("*" if op == "mul" else "/") + name)
    return " ".join(parts)


# ---------------------------------------------------------------------------
# per-head scales and batch views


def _per_head_factor(other: Any, scores: Optional[torch.Tensor]) -> bool:
    """A tensor factor that is constant over the query and key dims (shape
    (..., H, 1, 1), e.g. Swin-v2's ``logit_scale.exp()``): it scales each
    batch/head's scores, so it folds into q exactly (gradients flow to it
    through the product with q)."""
    t = N.tensor_val(other)
    if not isinstance(other, torch.fx.Node) or t is None or scores is None or t.dim() == 0:
        return False
    if not t.dtype.is_floating_point or t.dtype != scores.dtype or t.dim() > scores.dim():
        return False
    last = list(t.shape[-2:])
    return all(N.known_eq(x, 1) for x in last)


class _BatchLayout:
    """The op's (B, H) when views between the products split or merge the
    batch dims (see :mod:`flashfuse.fx.views`): the canonical layout is a
    two-batch-dim layout of the pattern, preferring the softmax's; every
    other tensor is flattened and unflattened into it."""

    def __init__(self, cand: Candidate, gm, qk, pv, scores_chain, probs_chain):
        self.gm, self.pv = gm, pv
        chain = [qk, *scores_chain, cand.softmax, *probs_chain, pv]
        self.chain = set(chain)
        qs, ps = N.shape(qk), N.shape(pv)
        self.qk_layout = tuple(qs[:-2])
        total = V._prod(qs[:-2])
        for n in chain[1:-1]:
            s = N.shape(n)
            if s is None or len(s) < 2 or not (N.known_eq(s[-2], qs[-2]) and N.known_eq(s[-1], qs[-1])):
                raise NoMatch(f"{N.describe(n)} changes the (query, key) dims of the scores")
            if not N.known_eq(V._prod(s[:-2]), total):
                raise NoMatch(f"{N.describe(n)} changes the number of score matrices")
        if not N.known_eq(V._prod(ps[:-2]), total):
            raise NoMatch("the value product has another batch total than the scores")
        self.hints = [a for n in chain if N.kind(n) in V.VIEW_KINDS
                      for a in torch.fx.node.map_aggregate(n.args[1:], lambda x: x) if isinstance(a, torch.fx.Node)]
        layouts = [tuple(N.shape(n)[:-2]) for n in [cand.softmax, *scores_chain[::-1], *probs_chain, qk, pv]]
        two = [lay for lay in layouts if len(lay) == 2]
        if not two:
            raise NoMatch("no layout of the scores between the views has exactly two batch dims")
        self.canon = two[0]
        tail = V.size_arg(gm, self.canon[1], pv, self.hints)
        if tail is None:
            raise NoMatch("the head count of the views is not a size the graph holds")
        self.tail = [tail]
        # The canonical batch size for the operands' unflatten (see _operand);
        # -1 with static sizes, where it proves the same and reads better.
        lead = None if N.const_int(self.canon[0]) is not None else V.size_arg(gm, self.canon[0], pv, self.hints)
        self.lead = -1 if lead is None else lead
        self.scores = N.tensor_val(qk).flatten(0, len(qs) - 3).unflatten(0, (-1, N.val(tail))) \
            if len(qs) > 3 else N.tensor_val(qk).unflatten(0, (-1, N.val(tail)))
        # Where each mask or scale tensor meets the scores: (layout, rank);
        # a bias-first product's bias meets them in the product's layout.
        self.where: dict = {}
        if N.kind(qk) == "baddbmm" and isinstance(N.arg(qk, 0, "input"), torch.fx.Node):
            self.where[N.arg(qk, 0, "input")] = (self.qk_layout, len(qs))
        for n in scores_chain:
            if N.kind(n) in V.VIEW_KINDS:
                continue
            s = N.shape(n)
            for a in n.all_input_nodes:
                if a in self.chain or N.tensor_val(a) is None:
                    continue
                here = (tuple(s[:-2]), len(s))
                if a in self.where and not V.same_layout(self.where[a][0], here[0]):
                    raise NoMatch(f"{a.name} meets the scores in two layouts")
                self.where[a] = here

    def _args(self, layout) -> list:
        return [V.size_arg(self.gm, x, self.pv, self.hints) for x in layout]

    def steps_for(self, node) -> list:
        if node not in self.where:
            return []
        layout, nd = self.where[node]
        steps = V.mask_steps(N.tensor_val(node), layout, self.canon, nd, self._args(layout), self.tail)
        if steps is None:
            raise NoMatch(f"{node.name} broadcasts over part of a view's batch dims whose sizes the graph does not hold")
        return steps

    def _operand(self, op: Operand, layout, what: str) -> Operand:
        t = _operand_val(op)
        if V.same_layout(layout, self.canon):
            return _pad_batch(op, t.dim(), len(layout))
        if t.dim() != len(layout) + 2 or not V.same_layout(tuple(t.shape[:-2]), layout):
            raise NoMatch(f"{what} broadcasts over the batch dims of a view; left alone")
        # Both canonical sizes when the first is symbolic and the graph holds
        # it: with -1, separately symbolic inputs whose batch totals are equal
        # only by a guard (a bmm's) would leave a batch size like (a·b)//h
        # that no proof matches to B.
        return op.then(*V.to_canonical(t.dim(), layout, self.tail, self.lead))

    def operands(self, q_op: Operand, k_op: Operand) -> Operands:
        pv = self.pv
        if N.kind(pv) not in ("matmul", "bmm"):
            raise NoMatch("the value product after a view is not a matmul or bmm")
        qk_layout = self.qk_layout
        out_layout = tuple(N.shape(pv)[:-2])
        q_op = self._operand(q_op, qk_layout, "q")
        k_op = self._operand(k_op, qk_layout, "k")
        v_op = self._operand(Operand(pv.args[1]), out_layout, "v")
        if V.same_layout(out_layout, self.canon):
            return Operands(q_op, k_op, v_op, [])
        args = self._args(out_layout)[1:]
        if any(a is None for a in args):
            raise NoMatch("the value product's batch sizes are not sizes the graph holds")
        return Operands(q_op, k_op, v_op, V.from_canonical(out_layout, args))
