"""``nn.MultiheadAttention``: the attention Dynamo records as one call.

Dynamo keeps ``F.multi_head_attention_forward`` in the graph as a single
node (``nn.MultiheadAttention`` calls it, whatever ``need_weights`` says), so
its softmax never reaches the finder. When the attention weights it also
returns are unused (``need_weights=False``, or ``mha(x, x, x)[0]``), this
module replaces the call by the in-projections, one
``torch.ops.flashfuse.attention`` and the out-projection, following
PyTorch's definition step by step:

* in-projection: one packed ``in_proj_weight`` (one product for
  self-attention, q and a packed k/v product when key is value, three
  otherwise, as PyTorch splits it) or ``q/k/v_proj_weight`` (``kdim`` /
  ``vdim``), with the matching slices of ``in_proj_bias``;
* ``bias_k`` / ``bias_v`` appended as one more key and value, then the
  ``add_zero_attn`` zero key and value, each padding the masks with a column
  of 0 (the new keys take part);
* bool masks become ``-inf`` where True (as ``F._canonical_mask``); a 2-D
  ``attn_mask`` (L, S) broadcasts over batch and heads, a 3-D one is
  (B*H, L, S); ``key_padding_mask`` (B, S) is added to it (PyTorch's merge);
* ``is_causal`` is the op's causal flag only where PyTorch drops the mask
  for it (weights not needed, no key padding mask), else the mask is used;
* scale ``1/sqrt(head_dim)``; dropout on the weights when ``training``;
* unbatched (2-D) inputs as a batch of one.

``torch._native_multi_head_attention`` (the module's eval fast path, in
torches whose Dynamo still takes it) and ``torch._transformer_encoder_layer_fwd``
(``nn.TransformerEncoderLayer``'s) are whole fused layers: they are reported,
never rewritten.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import operator
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from . import nodes as N
from .find import MAX_HEAD_DIM, MIN_HEAD_DIM, SUPPORTED_DTYPES, NoMatch
from .match import Candidate

log = logging.getLogger("flashfuse")

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@dataclasses.dataclass
class MhaPlan:
    """What :func:`emit` needs to rebuild one ``multi_head_attention_forward``
    call; the arguments are graph nodes (or None) as the call received them."""

    args: dict
    num_heads: int
    head_dim: int
    batched: bool
    # The op's causal flag (PyTorch's is_causal hint where it drops the mask).
    is_causal: bool
    dropout_p: float
    scale: float
    # The node whose value the op's result replaces (``result[0]``).
    output: torch.fx.Node


def is_mha(cand: Candidate) -> bool:
    return isinstance(cand.plan, MhaPlan)


def _fused_layers() -> dict:
    """Fused ops that hold a whole attention layer, with what they are."""
    out = {}
    for name, what in (("_native_multi_head_attention", "nn.MultiheadAttention's fused fast path"),
                       ("_transformer_encoder_layer_fwd", "nn.TransformerEncoderLayer's fused fast path")):
        fn = getattr(torch, name, None)
        if fn is not None:
            out[fn] = (name, what)
    return out


def find_mha(gm: torch.fx.GraphModule) -> list[Candidate]:
    """A candidate for every ``multi_head_attention_forward`` call of ``gm``
    (and a refusal for every fused attention layer). Never raises."""
    try:
        return _find_mha(gm)
    except Exception as e:  # noqa: BLE001 - never break a user's compile
        log.warning("flashfuse: multi-head attention search failed, left as it is: %r", e, exc_info=True)
        return []


def _find_mha(gm: torch.fx.GraphModule) -> list[Candidate]:
    out = []
    fused = _fused_layers()
    autocast_seen = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if "autocast" in str(getattr(node.target, "__name__", "")):
            autocast_seen = True
        target = node.target
        try:
            name = fused.get(target)
        except TypeError:  # unhashable target
            name = None
        if name is not None:
            out.append(Candidate(softmax=node, reason=f"torch.{name[0]} ({name[1]}) computes the whole layer "
                                 "in one fused op; it is not rewritten (in eval, run the model with "
                                 "grad enabled or torch.backends.mha.set_fastpath_enabled(False) to "
                                 "trace the unfused path)", facts={"kind": name[0]}))
            continue
        if target is not F.multi_head_attention_forward:
            continue
        cand = Candidate(softmax=node, facts={"kind": "multi_head_attention_forward"})
        try:
            if autocast_seen:
                raise NoMatch("multi_head_attention_forward under autocast is not rewritten")
            _analyse(cand, node)
        except NoMatch as e:
            cand.plan, cand.reason = None, str(e)
        except Exception as e:  # noqa: BLE001 - a bug must not change a model
            log.warning("flashfuse: error analysing %s, left as it is: %r", node.name, e, exc_info=True)
            cand.plan, cand.reason = None, f"internal error: {e!r}"
        out.append(cand)
    return out


def _const(x: Any, what: str, types) -> Any:
    if isinstance(x, torch.fx.Node):
        raise NoMatch(f"multi_head_attention_forward's {what} is not a compile-time constant")
    if not isinstance(x, types) or (types is int and isinstance(x, bool)):
        raise NoMatch(f"multi_head_attention_forward's {what} is {x!r}")
    return x


def _tensor(args: dict, name: str) -> Optional[torch.Tensor]:
    x = args[name]
    if x is None:
        return None
    t = N.tensor_val(x)
    if t is None:
        raise NoMatch(f"multi_head_attention_forward's {name} has no example tensor")
    return t


def _dropout(p: Any) -> float:
    pn = N.guarded_number(p)
    if pn is None:
        raise NoMatch("the dropout probability is not a compile-time constant")
    if not 0.0 <= pn < 1.0:
        raise NoMatch(f"dropout probability {pn} is not in [0, 1)")
    return pn


def _analyse(cand: Candidate, node: torch.fx.Node) -> None:
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError as e:
        raise NoMatch(f"multi_head_attention_forward called with unexpected arguments: {e}") from None
    bound.apply_defaults()
    a = dict(bound.arguments)

    # Only result[0] may be read: the weights (result[1]) must be unused.
    output = None
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or len(user.args) != 2:
            raise NoMatch("the result of multi_head_attention_forward is used as a whole, not as result[0]")
        if user.args[1] == 0:
            if output is not None:
                raise NoMatch("result[0] of multi_head_attention_forward is read twice")
            output = user
        elif user.args[1] == 1:
            if user.users:
                raise NoMatch("the attention weights multi_head_attention_forward returns are used")
        else:
            raise NoMatch("an unexpected item of multi_head_attention_forward's result is read")
    if output is None:
        raise NoMatch("the attention output of multi_head_attention_forward is unused")

    need_weights = _const(a["need_weights"], "need_weights", bool)
    training = _const(a["training"], "training flag", bool)
    is_causal = _const(a["is_causal"], "is_causal", bool)
    add_zero_attn = _const(a["add_zero_attn"], "add_zero_attn", bool)
    separate = _const(a["use_separate_proj_weight"], "use_separate_proj_weight", bool)
    embed_dim = _const(a["embed_dim_to_check"], "embed_dim", int)
    num_heads = _const(a["num_heads"], "num_heads", int)
    if a["static_k"] is not None or a["static_v"] is not None:
        raise NoMatch("static_k / static_v are not rewritten")
    if (a["bias_k"] is None) != (a["bias_v"] is None):
        raise NoMatch("bias_k without bias_v (or the reverse)")

    q, k, v = _tensor(a, "query"), _tensor(a, "key"), _tensor(a, "value")
    if q is None or k is None or v is None:
        raise NoMatch("query, key or value is not a tensor")
    if q.dim() not in (2, 3) or k.dim() != q.dim() or v.dim() != q.dim():
        raise NoMatch("query, key and value are not all 2-D or all 3-D")
    out_t = N.tensor_val(output)
    if out_t is None:
        raise NoMatch("the attention output has no example tensor")
    if num_heads <= 0 or embed_dim % num_heads:
        raise NoMatch(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}")
    head_dim = embed_dim // num_heads
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise NoMatch(f"head size {head_dim} (embed_dim {embed_dim} / {num_heads} heads) is outside "
                      f"{MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise NoMatch(f"query has dtype {q.dtype}, not supported by the op")
    names = ["key", "value", "out_proj_weight", "out_proj_bias", "in_proj_bias", "bias_k", "bias_v"]
    names += ["q_proj_weight", "k_proj_weight", "v_proj_weight"] if separate else ["in_proj_weight"]
    for name in names:
        t = _tensor(a, name)
        if t is not None and t.dtype != q.dtype:
            raise NoMatch(f"{name} has dtype {t.dtype}, query {q.dtype}")
    if out_t.dtype != q.dtype:
        raise NoMatch(f"the output has dtype {out_t.dtype}, query {q.dtype}")
    if (_tensor(a, "q_proj_weight") if separate else _tensor(a, "in_proj_weight")) is None:
        raise NoMatch("the in-projection weight is missing")
    for name in ("key_padding_mask", "attn_mask"):
        t = _tensor(a, name)
        if t is not None and t.dtype != torch.bool and t.dtype != q.dtype:
            raise NoMatch(f"{name} has dtype {t.dtype}, query {q.dtype}")
    am, kpm = _tensor(a, "attn_mask"), _tensor(a, "key_padding_mask")
    if am is not None and am.dim() not in (2, 3):
        raise NoMatch(f"attn_mask is {am.dim()}-D")

    dropout_p = _dropout(a["dropout_p"]) if training else 0.0
    # PyTorch trusts the hint (and drops the mask) only on its SDPA path
    # without a key padding mask; elsewhere the mask it was given decides.
    causal = bool(is_causal and kpm is None and not need_weights)
    if is_causal and am is None:
        raise NoMatch("is_causal without attn_mask (PyTorch raises)")

    cand.output = output
    cand.replaced = [u for u in node.users] + [node]
    masks = []
    if am is not None and not causal:
        masks.append(f"attn_mask {am.dim()}-D {_mask_kind(a['attn_mask'])}")
    if kpm is not None:
        masks.append(f"key_padding_mask {_mask_kind(a['key_padding_mask'])}")
    extras = [name for name, on in (("bias_kv", a["bias_k"] is not None), ("zero_attn", add_zero_attn)) if on]
    cand.facts.update(
        scale=f"{1 / math.sqrt(head_dim):.6g}",
        mask=" + ".join(masks) or "none",
        causal="top-left" if causal else "",
        dropout=dropout_p,
        spelling="nn.MultiheadAttention" + (f" ({', '.join(extras)})" if extras else ""),
    )
    cand.plan = MhaPlan(args=a, num_heads=num_heads, head_dim=head_dim, batched=q.dim() == 3,
                        is_causal=causal, dropout_p=dropout_p, scale=math.sqrt(1.0 / head_dim), output=output)


def _mask_kind(node: torch.fx.Node) -> str:
    """"bool" for a bool mask, also once the module has made it float
    (``zeros_like(m, dtype=...).masked_fill_(m, -inf)``), else "float"."""
    if N.tensor_val(node).dtype == torch.bool:
        return "bool"
    if N.kind(node) in ("masked_fill", "masked_fill_") and len(node.args) >= 3 and node.args[2] == float("-inf"):
        base, cond = node.args[0], node.args[1]
        cv = N.tensor_val(cond)
        if N.kind(base) == "zeros_like" and base.args and base.args[0] is cond and cv is not None \
                and cv.dtype == torch.bool:
            return "bool"
    return "float"


# ---------------------------------------------------------------------------


def emit(gm: torch.fx.GraphModule, cand: Candidate, replaced: dict) -> torch.fx.Node:
    """Insert the replacement before the call and make ``result[0]``'s users
    read it; on failure, remove what was inserted and re-raise. ``replaced``
    maps earlier rewritten outputs to their replacements (an input may be
    one: the new projections must read the replacement, so that the earlier
    attention's original call dies)."""
    from .rewrite import _Emitter, _resolve

    node = cand.softmax
    cand.plan.args = {name: torch.fx.node.map_arg(x, lambda n: _resolve(n, replaced))
                      for name, x in cand.plan.args.items()}
    em = _Emitter(gm, node, node)
    try:
        out = _emit_plan(em, cand.plan)
        old = N.tensor_val(cand.plan.output)
        new = N.tensor_val(out)
        if new is None or tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
            raise RuntimeError("the replacement's example value does not match the call's output")
    except Exception:
        for created in reversed(em.created):
            if not created.users:
                gm.graph.erase_node(created)
        raise
    cand.plan.output.replace_all_uses_with(out)
    return out


def _emit_plan(em, plan: MhaPlan) -> torch.fx.Node:
    from .rewrite import CannotLaunch, _attention_op, _launch_problem

    a = plan.args
    H, hd = plan.num_heads, plan.head_dim
    E = H * hd
    fn = lambda target, *args, **kw: em.call("function", target, *args, **kw)  # noqa: E731
    meth = lambda name, *args, **kw: em.call("method", name, *args, **kw)  # noqa: E731

    query, key, value = a["query"], a["key"], a["value"]
    if not plan.batched:
        # As PyTorch: a batch of one at dim 1 (sequence first).
        query, key, value = (meth("unsqueeze", x, 1) if x is not None else x for x in (query, key, value))
        # Keep the identities the packed projection relies on.
        if a["key"] is a["query"]:
            key = query
        if a["value"] is a["key"]:
            value = key

    # In-projection, split as PyTorch splits it (same products, same values).
    bias = a["in_proj_bias"]
    if a["use_separate_proj_weight"]:
        bq = bk = bv = None
        if bias is not None:
            parts = meth("chunk", bias, 3)
            bq, bk, bv = (fn(operator.getitem, parts, i) for i in range(3))
        q = fn(F.linear, query, a["q_proj_weight"], bq)
        k = fn(F.linear, key, a["k_proj_weight"], bk)
        v = fn(F.linear, value, a["v_proj_weight"], bv)
    else:
        w = a["in_proj_weight"]

        def part(s, i):  # piece i of a split weight or bias (None stays None)
            return fn(operator.getitem, s, i) if s is not None else None

        if key is value and query is key:
            proj = meth("chunk", fn(F.linear, query, w, bias), 3, -1)
            q, k, v = (fn(operator.getitem, proj, i) for i in range(3))
        elif key is value:
            ws = meth("split", w, [E, 2 * E])
            bs = meth("split", bias, [E, 2 * E]) if bias is not None else None
            q = fn(F.linear, query, part(ws, 0), part(bs, 0))
            kv = meth("chunk", fn(F.linear, key, part(ws, 1), part(bs, 1)), 2, -1)
            k, v = fn(operator.getitem, kv, 0), fn(operator.getitem, kv, 1)
        else:
            ws = meth("chunk", w, 3)
            bs = meth("chunk", bias, 3) if bias is not None else None
            q, k, v = (fn(F.linear, x, part(ws, i), part(bs, i)) for i, x in enumerate((query, key, value)))

    # (L, B, E) -> (B, H, L, hd): head h of batch b is PyTorch's row b*H + h.
    def heads(x):
        return meth("permute", meth("unflatten", x, -1, (H, hd)), 1, 2, 0, 3)

    def append_zeros(x, dim, n=1):
        # torch.cat with zeros, not F.pad: pad specialises symbolic sizes.
        zeros = fn(torch.zeros_like, meth("narrow", x, dim, 0, 1))
        return fn(torch.cat, [x] + [zeros] * n, dim=dim)

    q, k, v = heads(q), heads(k), heads(v)
    extra_keys = 0
    if a["bias_k"] is not None:
        bsz = meth("size", q, 0)
        k = fn(torch.cat, [k, meth("expand", heads(a["bias_k"]), bsz, -1, -1, -1)], dim=2)
        v = fn(torch.cat, [v, meth("expand", heads(a["bias_v"]), bsz, -1, -1, -1)], dim=2)
        extra_keys += 1
    if a["add_zero_attn"]:
        k = append_zeros(k, 2)
        v = append_zeros(v, 2)
        extra_keys += 1

    mask = None
    if not plan.is_causal:
        qdtype = N.tensor_val(a["query"]).dtype

        def canonical(m):
            # Bool masks hide where True (F._canonical_mask); the padding
            # columns for the extra keys are 0 (they take part).
            if N.tensor_val(m).dtype == torch.bool:
                m = meth("masked_fill", fn(torch.zeros_like, m, dtype=qdtype), m, float("-inf"))
            if extra_keys:
                m = append_zeros(m, -1, extra_keys)
            return m

        am, kpm = a["attn_mask"], a["key_padding_mask"]
        if am is not None:
            am = canonical(am)
            if N.tensor_val(am).dim() == 3:
                am = meth("unflatten", am, 0, (-1, H))
        if kpm is not None:
            if not plan.batched:
                kpm = meth("unsqueeze", kpm, 0)
            kpm = meth("unsqueeze", meth("unsqueeze", canonical(kpm), 1), 1)
        if am is not None and kpm is not None:
            mask = fn(operator.add, am, kpm)
        else:
            mask = am if am is not None else kpm

    kwargs = dict(attn_mask=mask, dropout_p=float(plan.dropout_p), is_causal=plan.is_causal, scale=plan.scale)
    problem = _launch_problem(q, k, v, mask, kwargs)
    if problem is not None:
        raise CannotLaunch(problem)
    out = fn(_attention_op(), q, k, v, **kwargs)
    # (B, H, L, hd) -> (L, B, E), then the out-projection.
    out = meth("flatten", meth("permute", out, 2, 0, 1, 3), 2)
    out = fn(F.linear, out, a["out_proj_weight"], a["out_proj_bias"])
    if not plan.batched:
        out = meth("squeeze", out, 1)
    return out
