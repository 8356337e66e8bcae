"""Graph surgery: replace each matched attention with one op call.

For every candidate that has a plan, the pass inserts, just before the
``probs @ v`` product, the views the plan lists, the mask it assembles and a
call to ``torch.ops.flashfuse.attention``, makes the product's users read the
op's result, and erases the nodes that became dead. Nodes outside the matched
patterns are never touched (FX's own dead-code elimination would also drop
in-place method calls whose results are unused, so it is not used).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Optional, Sequence

import torch
import torch.fx

from . import mha as _mha
from . import nodes as N
from .find import find
from .match import Candidate, Operand, Plan
from .shared_masks import SharedMasks

log = logging.getLogger("flashfuse")


def _attention_op():
    if not hasattr(torch.ops.flashfuse, "attention"):
        import flashfuse.ops  # noqa: F401  (registers the op)
    return torch.ops.flashfuse.attention.default


class FlashAttentionPass:
    """An FX pass that rewrites attention into ``torch.ops.flashfuse.attention``.

    Call it on a ``torch.fx.GraphModule`` traced by Dynamo (or any graph whose
    nodes carry ``example_value``/``val`` metadata). ``example_inputs`` (the
    graph's real inputs, as a ``torch.compile`` backend receives them) let the
    pass read registered buffers, e.g. to recognise a causal-mask buffer.

    Returns the list of candidates (see :class:`flashfuse.fx.match.Candidate`),
    each marked ``rewritten`` or carrying the reason it was left alone.
    """

    def uuid(self) -> str:
        """Identifies the pass and its version (for caches keyed on passes,
        as Inductor's ``CustomGraphPass`` interface expects)."""
        return "flashfuse.fx.FlashAttentionPass/1"

    def __init__(self, example_inputs: Optional[Sequence[Any]] = None):
        self.example_inputs = example_inputs

    def __call__(self, gm: torch.fx.GraphModule) -> list[Candidate]:
        try:
            candidates = find(gm, self.example_inputs)
        except Exception as e:  # noqa: BLE001 - never break a user's compile
            log.warning("flashfuse: attention search failed, graph left as it is: %r", e, exc_info=True)
            return []
        # nn.MultiheadAttention's one-call attention (no softmax in the graph).
        candidates += _mha.find_mha(gm)
        replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        shared = SharedMasks(gm)  # one mask and one block mask per distinct mask
        changed = False
        for cand in candidates:
            if not cand.ok:
                log.debug("flashfuse: left %s: %s", cand.softmax.name, cand.reason)
                continue
            try:
                new = _mha.emit(gm, cand, replaced) if _mha.is_mha(cand) else _emit(gm, cand, replaced, shared)
            except CannotLaunch as e:
                cand.plan, cand.reason = None, f"the kernels cannot run this shape on this GPU: {e}"
                log.warning("flashfuse: left %s unrewritten: %s", cand.softmax.name, cand.reason)
                continue
            except Exception as e:  # noqa: BLE001 - leave the graph correct
                # Building the replacement failed (e.g. a view the example
                # values did not foresee): nothing was rewired yet, so drop
                # what was inserted and keep the original computation.
                cand.plan, cand.reason = None, f"rewrite failed: {e}"
                log.warning("flashfuse: could not rewrite %s: %s", cand.softmax.name, e)
                continue
            replaced[cand.output] = new
            cand.rewritten = True
            changed = True
            where = " ".join(x for x in cand.where() if x)
            log.info("flashfuse: rewrote attention %s (%s)", where or cand.softmax.name, cand.facts)
        if changed:
            _erase_dead(gm, candidates)
            gm.graph.lint()
            gm.recompile()
        return candidates


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module with a copy of ``gm``'s graph (node metadata copied
    shallowly, example values shared) over the same submodules, parameters
    and buffers: what the backend falls back to if the rewritten graph
    fails to compile."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta = dict(getattr(gm, "meta", {}))
    return copy


def rewrite(gm: torch.fx.GraphModule, example_inputs: Optional[Sequence[Any]] = None) -> list[Candidate]:
    """Run :class:`FlashAttentionPass` on ``gm`` in place; returns the candidates."""
    return FlashAttentionPass(example_inputs)(gm)


# ---------------------------------------------------------------------------


class _Emitter:
    """Inserts nodes before ``anchor`` and gives each one example metadata."""

    def __init__(self, gm: torch.fx.GraphModule, anchor: torch.fx.Node, meta_from: torch.fx.Node):
        self.graph = gm.graph
        self.anchor = anchor
        self.meta_from = meta_from
        self.created: list[torch.fx.Node] = []

    def call(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            if kind == "method":
                node = self.graph.call_method(target, args, kwargs)
            else:
                node = self.graph.call_function(target, args, kwargs)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        _propagate(node)
        self.created.append(node)
        return node


def _propagate(node: torch.fx.Node) -> None:
    """Record the node's example value by running it on the example values
    of its inputs (under their fake mode), as Dynamo would have."""
    try:
        args = torch.fx.node.map_arg(node.args, N.val)
        kwargs = torch.fx.node.map_arg(node.kwargs, N.val)
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        mode = _fake_mode(flat)
        if mode is None:
            return
        with mode:
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
        node.meta["example_value"] = value
    except Exception as e:  # noqa: BLE001 - metadata is a convenience
        log.debug("flashfuse: no example value for %s: %s", node.name, e)


def _fake_mode(tensors: list) -> Any:
    """The fake mode the example values were made in (Dynamo may hand the
    backend a different active mode; mixing the two is an error)."""
    for t in tensors:
        mode = getattr(t, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _resolve(x: Any, replaced: dict) -> Any:
    while isinstance(x, torch.fx.Node) and x in replaced:
        x = replaced[x]
    return x


def _materialize(em: _Emitter, op: Operand, replaced: dict) -> torch.fx.Node:
    node = _resolve(op.node, replaced)
    for step in op.steps:
        name = step[0]
        if name == "transpose":
            node = em.call("method", "transpose", node, step[1], step[2])
        elif name == "permute":
            node = em.call("method", "permute", node, *step[1])
        elif name == "unsqueeze":
            node = em.call("method", "unsqueeze", node, step[1])
        elif name == "squeeze":
            node = em.call("method", "squeeze", node, step[1])
        elif name == "to":
            node = em.call("method", "to", node, step[1])
        elif name == "not":
            node = em.call("function", torch.logical_not, node)
        elif name in ("flatten", "unflatten", "expand"):
            node = _layout_step(em, node, step, replaced)
        else:
            raise ValueError(f"unknown operand step {name}")
    return node


def _layout_step(em: _Emitter, node: torch.fx.Node, step: tuple, replaced: dict) -> torch.fx.Node:
    """flatten/unflatten/expand steps (batch views); sizes may be nodes."""
    name = step[0]
    if name == "flatten":
        return em.call("method", "flatten", node, step[1], step[2])
    if name == "unflatten":
        return em.call("method", "unflatten", node, step[1], tuple(_resolve(x, replaced) for x in step[2]))
    return em.call("method", "expand", node, *(_resolve(x, replaced) for x in step[1]))


def _factor(em: _Emitter, f: Any, replaced: dict) -> Any:
    """A scale factor as a graph argument (a per-head tensor may need views)."""
    if isinstance(f, Operand):
        return _materialize(em, f, replaced)
    return _resolve(f, replaced)


def _emit(gm: torch.fx.GraphModule, cand: Candidate, replaced: dict, shared: Optional[SharedMasks] = None
          ) -> torch.fx.Node:
    plan: Plan = cand.plan
    em = _Emitter(gm, cand.output, cand.softmax)
    shared = shared if shared is not None else SharedMasks(gm)
    shared.begin()
    try:
        out = _emit_plan(em, cand, plan, replaced, shared)
    except Exception:
        shared.rollback()  # before the erasure: forget the nodes it removes
        for node in reversed(em.created):
            if not node.users:
                gm.graph.erase_node(node)
        raise
    shared.commit()
    return out


def _emit_plan(em: _Emitter, cand: Candidate, plan: Plan, replaced: dict, shared: SharedMasks) -> torch.fx.Node:
    q = _materialize(em, plan.query, replaced)
    k = _materialize(em, plan.key, replaced)
    v = _materialize(em, plan.value, replaced)
    base = {"q": q, "k": k, "v": v}

    def size(ref):
        if isinstance(ref, tuple):
            name, dim = ref
            c = N.const_int(N.tensor_val(base[name]).shape[dim]) if N.tensor_val(base[name]) is not None else None
            return c if c is not None else em.call("method", "size", base[name], dim)
        return ref

    expanded = dict(base)
    for name, dim, ref in plan.expand:
        sizes = [-1] * 4
        sizes[dim] = size(ref)
        expanded[name] = em.call("method", "expand", expanded[name], *sizes)
    q, k, v = expanded["q"], expanded["k"], expanded["v"]

    if plan.compute_dtype is not None:
        q = em.call("method", "to", q, plan.compute_dtype)
        k = em.call("method", "to", k, plan.compute_dtype)
        v = em.call("method", "to", v, plan.compute_dtype)
    # Non-constant scale factors (SymFloats, 0-d tensors) are folded into q.
    for op, f in plan.q_factors:
        q = em.call("function", operator.mul if op == "mul" else operator.truediv, q, _factor(em, f, replaced))

    # The same mask as an earlier attention's (same recipe): its node, so
    # that both read one block mask.
    recipe = shared.recipe(plan) if not replaced_inputs(plan, replaced) else None
    mask = shared.mask(recipe, em.anchor)
    if mask is None:
        mask = _build_mask(em, cand, plan, replaced)
        if mask is not None:
            shared.remember_mask(recipe, mask)
    kwargs = dict(
        attn_mask=mask,
        dropout_p=float(plan.dropout_p),
        is_causal=plan.is_causal,
        scale=float(plan.scale),
        enable_gqa=plan.enable_gqa,
        window_left=plan.window_left,
        window_right=None if plan.is_causal else plan.window_right,
        alignment=plan.alignment,
    )
    if plan.mask_fill is not None:
        # Only with a bool mask (the finder keeps no additive term then).
        kwargs["mask_fill"] = float(plan.mask_fill)
    if plan.softcap is not None:
        kwargs["softcap"] = float(plan.softcap)
    if plan.sinks is not None:
        kwargs["sinks"] = _sinks_operand(em, plan, replaced)
    problem = _launch_problem(q, k, v, mask, kwargs)
    if problem is not None:
        raise CannotLaunch(problem)
    kernel = _forward_kernel(q, k, v, mask, kwargs)
    if kernel is not None:
        cand.facts["kernel"] = kernel
        if _needs_backward(q, k, v, mask):
            cand.facts["backward_kernel"] = _backward_kernel(q, k, v, mask, kwargs)
    if mask is not None:
        # The mask's tables, built once per distinct mask (block_mask node)
        # and read by every attention using it, forward and backward.
        tables = shared.block_mask(em, mask, recipe, q, k, kwargs, backward=_needs_backward(q, k, v, mask))
        if tables is not None:
            kwargs["mask_key_table"], kwargs["mask_query_table"] = tables
    out = em.call("function", _attention_op(), q, k, v, **kwargs)
    for step in plan.out_steps:
        if step[0] == "squeeze":
            out = em.call("method", "squeeze", out, step[1])
        elif step[0] == "permute":
            out = em.call("method", "permute", out, *step[1])
        elif step[0] in ("flatten", "unflatten"):
            out = _layout_step(em, out, step, replaced)
    if plan.op_dtype != plan.out_dtype:
        out = em.call("method", "to", out, plan.out_dtype)

    # The op's result is laid out (B, N, H, Dv) in memory where eager's
    # product was contiguous: a user that calls .view() on it may need the
    # old layout, so give those users a contiguous copy.
    old = cand.output
    old.replace_all_uses_with(out)
    contiguous = None
    for user in list(out.users):
        if N.kind(user) == "view" and user.args and user.args[0] is out and not _view_ok(user, out):
            if contiguous is None:
                with em.graph.inserting_after(out):
                    contiguous = em.graph.call_method("contiguous", (out,))
                contiguous.meta.update({k2: v2 for k2, v2 in out.meta.items() if k2 != "example_value"})
                _propagate(contiguous)
            user.replace_input_with(out, contiguous)
    return out


def _sinks_operand(em: _Emitter, plan: Plan, replaced: dict) -> torch.fx.Node:
    """The plan's (Hq,) sinks, cast to float32 unless they already are in
    float32 or the op's dtype (what the op accepts)."""
    node = _materialize(em, plan.sinks, replaced)
    sv = N.tensor_val(node)
    if sv is None or sv.dtype not in (torch.float32, plan.op_dtype):
        node = em.call("method", "to", node, torch.float32)
    return node


class CannotLaunch(RuntimeError):
    """The op's CUDA kernels have no config that fits the GPU for this
    attention's shapes and dtype; the candidate is left as it is."""


def _example_call(q, k, v, mask, kwargs) -> Optional[tuple]:
    """The op call about to be emitted on its operands' example values:
    ``(q, k, v, mask, options)``, or None when an operand has none."""
    qv, kv, vv = N.tensor_val(q), N.tensor_val(k), N.tensor_val(v)
    if qv is None or kv is None or vv is None:
        return None
    options = {name: value for name, value in kwargs.items() if name != "attn_mask"}
    if options.get("sinks") is not None:
        options["sinks"] = N.tensor_val(options["sinks"])
    return qv, kv, vv, (N.tensor_val(mask) if mask is not None else None), options


def _launch_problem(q, k, v, mask, kwargs) -> Optional[str]:
    """Why the kernels could not run the op call about to be emitted (from
    the operands' example values), or None. Only CUDA graphs can hit a
    limit: e.g. fp32 at the largest head dims needs more shared memory than
    every candidate tile fits in."""
    call = _example_call(q, k, v, mask, kwargs)
    if call is None:
        return None
    from .. import ops

    qv, kv, vv, mv, options = call
    return ops.kernel_problem(qv, kv, vv, mv, **options, backward=_needs_backward(q, k, v, mask))


def _forward_kernel(q, k, v, mask, kwargs) -> Optional[str]:
    """Which forward kernel the op call about to be emitted takes on CUDA
    (``ops.forward_kernel``, from the operands' example values), or None."""
    return _kernel_name("forward_kernel", q, k, v, mask, kwargs)


def _backward_kernel(q, k, v, mask, kwargs) -> Optional[str]:
    """The same for its backward kernels (``ops.backward_kernel``)."""
    return _kernel_name("backward_kernel", q, k, v, mask, kwargs)


def _kernel_name(which: str, q, k, v, mask, kwargs) -> Optional[str]:
    call = _example_call(q, k, v, mask, kwargs)
    if call is None or call[0].device.type != "cuda":
        return None
    from .. import ops

    qv, kv, vv, mv, options = call
    try:
        return getattr(ops, which)(qv, kv, vv, mv, **options)
    except Exception as exc:  # noqa: BLE001 - a report, never a reason to refuse the rewrite
        return f"unknown ({type(exc).__name__})"


def _needs_backward(q, k, v, mask) -> bool:
    """Some operand of the call requires grad (by its example value)."""
    vals = [N.tensor_val(x) for x in (q, k, v, mask) if x is not None]
    return any(t is not None and t.requires_grad for t in vals)


def replaced_inputs(plan: Plan, replaced: dict) -> bool:
    """A mask term reads the result of an attention already rewritten: its
    recipe names a node that no longer computes it, so it is not shared."""
    return any(t.node in replaced for t in plan.additive) or any(h.node in replaced for h in plan.hide)


def _view_ok(user: torch.fx.Node, src: torch.fx.Node) -> bool:
    """Whether ``user`` (a .view) still works on the op's layout."""
    t = N.tensor_val(src)
    if t is None:
        return False
    try:
        args = torch.fx.node.map_arg(user.args[1:], N.val)
        mode = _fake_mode([t])
        if mode is None:
            return False
        with mode:
            t.view(*args)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not provably fine"
        return False


def _build_mask(em: _Emitter, cand: Candidate, plan: Plan, replaced: dict) -> Optional[torch.fx.Node]:
    total = None
    scores_dtype = N.tensor_val(cand.scores).dtype
    for term in plan.additive:
        node = _materialize(em, Operand(term.node, list(term.steps)), replaced)
        tv = N.tensor_val(node)
        if tv is not None and not tv.dtype.is_floating_point:
            node = em.call("method", "to", node, scores_dtype)
        if term.negate:
            node = em.call("function", operator.neg, node)
        for op, f in term.factors:
            node = em.call("function", operator.mul if op == "mul" else operator.truediv, node, _factor(em, f, replaced))
        total = node if total is None else em.call("function", operator.add, total, node)
    hidden = None
    for h in plan.hide:
        node = _materialize(em, h, replaced)
        hidden = node if hidden is None else em.call("function", torch.logical_or, hidden, node)
    if hidden is None:
        return total
    if total is None:
        return em.call("function", torch.logical_not, hidden)
    return em.call("function", torch.where, hidden, float("-inf"), total)


def _erase_dead(gm: torch.fx.GraphModule, candidates: list[Candidate]) -> None:
    """Erase the matched nodes that lost their users, and pure views feeding
    them that did too. Nothing else in the graph is removed."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    work = set()
    for cand in candidates:
        if cand.rewritten:
            work.update(n for n in cand.replaced if n in order)
    pure_inputs = {"transpose", "permute", "mT", "T", "contiguous", "mul", "div", "reshape", "view",
                   "expand", "unsqueeze", "getitem", "to", "float", "half", "bfloat16", "type_as",
                   "repeat_interleave", "eq", "ne", "ge", "gt", "le", "lt", "not", "and", "or",
                   "tril", "triu", "ones", "zeros", "full", "arange", "add", "sub", "neg", "where",
                   "masked_fill", "clone"}
    while work:
        node = max(work, key=lambda n: order.get(n, -1))
        work.discard(node)
        if node.users or node.op not in ("call_function", "call_method"):
            continue
        inputs = [a for a in node.all_input_nodes]
        gm.graph.erase_node(node)
        for a in inputs:
            if not a.users and a.op in ("call_function", "call_method") and N.kind(a) in pure_inputs and not N.is_inplace(a):
                work.add(a)

