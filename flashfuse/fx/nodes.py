"""Reading a Dynamo FX graph: which operation a node performs, and its values.

Dynamo records the same operation in several spellings (``operator.matmul``,
``torch.matmul``, ``Tensor.matmul`` as a method, ``nn.Softmax`` as a module
call when modules are not inlined, ...). :func:`kind` maps every spelling to
one canonical name so the finder reasons about operations, not spellings.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true


def _functions() -> dict[Any, str]:
    table: dict[Any, str] = {}

    def add(name: str, *objs: Any) -> None:
        for obj in objs:
            if obj is not None:
                table[obj] = name

    T = torch.Tensor
    g = getattr
    add("matmul", operator.matmul, torch.matmul, T.matmul, g(T, "__matmul__", None))
    add("bmm", torch.bmm, T.bmm)
    add("baddbmm", torch.baddbmm, T.baddbmm)
    add("einsum", torch.einsum, g(torch.functional, "einsum", None))
    add("softmax", torch.softmax, F.softmax, T.softmax, g(torch.special, "softmax", None))
    add("mul", operator.mul, torch.mul, T.mul, torch.multiply)
    add("div", operator.truediv, torch.div, T.div, torch.true_divide, torch.divide)
    add("add", operator.add, torch.add, T.add)
    add("sub", operator.sub, torch.sub, T.sub, torch.subtract)
    add("mul_", operator.imul, T.mul_)
    add("div_", operator.itruediv, T.div_)
    add("add_", operator.iadd, T.add_)
    add("sub_", operator.isub, T.sub_)
    add("neg", operator.neg, torch.neg, T.neg)
    add("where", torch.where)
    add("masked_fill", torch.masked_fill, T.masked_fill)
    add("masked_fill_", T.masked_fill_)
    add("dropout", F.dropout, torch.dropout, g(torch.nn.functional, "dropout", None))
    add("transpose", torch.transpose, T.transpose, torch.swapaxes, torch.swapdims)
    add("permute", torch.permute, T.permute)
    add("reshape", torch.reshape, T.reshape)
    add("view", T.view)
    add("expand", T.expand)
    add("unsqueeze", torch.unsqueeze, T.unsqueeze)
    add("repeat_interleave", torch.repeat_interleave, T.repeat_interleave)
    add("contiguous", T.contiguous)
    add("clone", torch.clone, T.clone)
    add("detach", torch.detach, T.detach)
    add("getitem", operator.getitem)
    add("eq", operator.eq, torch.eq, T.eq)
    add("ne", operator.ne, torch.ne, T.ne)
    add("ge", operator.ge, torch.ge, T.ge)
    add("gt", operator.gt, torch.gt, T.gt)
    add("le", operator.le, torch.le, T.le)
    add("lt", operator.lt, torch.lt, T.lt)
    add("and", operator.and_, torch.logical_and, torch.bitwise_and, T.logical_and)
    add("or", operator.or_, torch.logical_or, torch.bitwise_or, T.logical_or)
    add("not", operator.invert, torch.logical_not, torch.bitwise_not, T.logical_not)
    add("tril", torch.tril, T.tril)
    add("triu", torch.triu, T.triu)
    add("ones", torch.ones)
    add("zeros", torch.zeros)
    add("full", torch.full)
    add("ones_like", torch.ones_like)
    add("zeros_like", torch.zeros_like)
    add("full_like", torch.full_like)
    add("arange", torch.arange)
    add("new_ones", T.new_ones)
    add("new_zeros", T.new_zeros)
    add("new_full", T.new_full)
    add("diff", torch.diff, T.diff)
    add("cumsum", torch.cumsum, T.cumsum)
    add("tensor", torch.tensor, torch.scalar_tensor, torch.as_tensor)
    add("to", T.to)
    add("type_as", T.type_as)
    add("float", T.float)
    add("half", T.half)
    add("bfloat16", T.bfloat16)
    add("double", T.double)
    add("bool", T.bool)
    add("long", T.long)
    add("int", T.int)
    add("size", T.size)
    # Soft-capping and sinks (flashfuse.fx.capsink).
    add("tanh", torch.tanh, T.tanh)
    add("cat", torch.cat, g(torch, "concat", None), g(torch, "concatenate", None))
    add("max", torch.max, T.max)
    add("amax", torch.amax, T.amax)
    return table


_FUNCTIONS = _functions()

# Method names Dynamo records as call_method, mapped to canonical kinds.
_METHODS = {
    "matmul": "matmul", "__matmul__": "matmul", "bmm": "bmm", "baddbmm": "baddbmm",
    "softmax": "softmax", "mul": "mul", "div": "div", "true_divide": "div",
    "add": "add", "sub": "sub", "mul_": "mul_", "div_": "div_", "add_": "add_",
    "sub_": "sub_", "neg": "neg", "masked_fill": "masked_fill",
    "masked_fill_": "masked_fill_", "transpose": "transpose", "swapaxes": "transpose",
    "swapdims": "transpose", "permute": "permute", "reshape": "reshape", "view": "view",
    "expand": "expand", "unsqueeze": "unsqueeze", "repeat_interleave": "repeat_interleave",
    "contiguous": "contiguous", "clone": "clone", "detach": "detach", "eq": "eq", "ne": "ne",
    "ge": "ge", "gt": "gt", "le": "le", "lt": "lt", "logical_and": "and",
    "logical_or": "or", "logical_not": "not", "bitwise_not": "not", "__invert__": "not",
    "__and__": "and", "__or__": "or", "tril": "tril", "triu": "triu", "to": "to",
    "type": "type", "type_as": "type_as", "float": "float", "half": "half",
    "bfloat16": "bfloat16", "double": "double", "bool": "bool", "long": "long",
    "int": "int", "size": "size", "dim": "dim", "stride": "stride", "numel": "numel",
    "dropout": "dropout", "new_ones": "new_ones", "new_zeros": "new_zeros", "new_full": "new_full",
    "diff": "diff", "cumsum": "cumsum",
    "tanh": "tanh", "max": "max", "amax": "amax",
    # Some torch versions record tensor comparisons as dunder methods.
    "__eq__": "eq", "__ne__": "ne", "__ge__": "ge", "__gt__": "gt", "__le__": "le", "__lt__": "lt",
}

CAST_KINDS = {"to", "type", "type_as", "float", "half", "bfloat16", "double"}
PRODUCT_KINDS = {"matmul", "bmm", "baddbmm", "einsum"}
# Users that only read a tensor's metadata, never its values.
_META_KINDS = {"size", "dim", "stride", "numel"}


def kind(node: Any, gm: Optional[torch.fx.GraphModule] = None) -> Optional[str]:
    """Canonical name of the operation ``node`` performs, or None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_method":
        return _METHODS.get(node.target)
    if node.op == "call_function":
        if node.target is builtins.getattr and len(node.args) >= 2:
            attr = node.args[1]
            if attr in ("mT", "T"):
                return attr
            if attr in ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"):
                return "size"
            return None
        try:
            name = _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            name = None
        if name is not None:
            return name
        if getattr(node.target, "__name__", "") == "sym_size" or str(node.target).startswith(
            "aten.sym_size"
        ):
            return "size"
        return None
    if node.op == "call_module" and gm is not None:
        mod = gm.get_submodule(node.target)
        if isinstance(mod, torch.nn.Softmax):
            return "softmax"
        if isinstance(mod, torch.nn.Dropout):
            return "dropout"
    return None


def val(x: Any) -> Any:
    """The example value Dynamo recorded for a node (a FakeTensor, SymInt, ...);
    non-node arguments are returned as they are."""
    if isinstance(x, torch.fx.Node):
        if "example_value" in x.meta:
            return x.meta["example_value"]
        return x.meta.get("val")
    return x


def tensor_val(x: Any) -> Optional[torch.Tensor]:
    v = val(x)
    return v if isinstance(v, torch.Tensor) else None


def arg(node: torch.fx.Node, idx: int, name: str, default: Any = None) -> Any:
    """Argument ``idx`` (counting ``self``/input as 0) or keyword ``name``."""
    if idx < len(node.args):
        return node.args[idx]
    return node.kwargs.get(name, default)


def known_eq(a: Any, b: Any) -> bool:
    """True when sizes ``a`` and ``b`` are provably equal (no guard added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - an unprovable relation is "not known"
        return False


def known_le(a: Any, b: Any) -> bool:
    """True when ``a <= b`` is provable for sizes or index bounds (no guard added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a <= b
    try:
        return bool(statically_known_true(a <= b))
    except Exception:  # noqa: BLE001 - an unprovable relation is "not known"
        return False


def const_int(x: Any) -> Optional[int]:
    """``x`` as a Python int when it is one or a SymInt with a constant value."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        expr = x.node.expr
        if getattr(expr, "is_number", False):
            return int(expr)
    return None


def shape(x: Any) -> Optional[tuple]:
    t = tensor_val(x)
    return tuple(t.shape) if t is not None else None


def real_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Users that read the node's values (metadata reads such as ``.size()``
    or the dtype argument of ``type_as`` are left out: they stay valid
    whatever computes the tensor)."""
    out = []
    for user in node.users:
        k = kind(user)
        if k in _META_KINDS:
            continue
        if k == "type_as" and len(user.args) > 1 and user.args[1] is node and user.args[0] is not node:
            continue
        if k == "to" and len(user.args) > 1 and user.args[1] is node and user.args[0] is not node:
            continue
        out.append(user)
    return out


# operator's in-place functions (``x += y`` and friends) and item assignment.
_OPERATOR_INPLACE = {
    getattr(operator, name)
    for name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                 "ixor", "ilshift", "irshift", "imatmul", "setitem", "delitem")
}
_DUNDER_INPLACE = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                   "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                   "__irshift__", "__imatmul__"}


def mutated_args(node: torch.fx.Node) -> Optional[list]:
    """The arguments ``node`` writes to in place, or None when it writes none.

    Broad on purpose (a missed mutation is a wrong result, an extra one only a
    refused rewrite): in-place methods and functions (a name ending in ``_``:
    ``mul_``, ``torch.index_put_``, ``Tensor.copy_``), ``operator`` in-place
    functions and ``setitem``, ``out=`` arguments, ``inplace=True`` flags,
    ATen overloads whose schema writes an argument, modules with
    ``inplace=True``.
    """
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_method", "call_function", "call_module"):
        return None
    out: list = []
    first = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    target = node.target
    if node.op == "call_method" and isinstance(target, str):
        if (target.endswith("_") and not target.endswith("__")) or target in _DUNDER_INPLACE:
            out.append(first)
    elif node.op == "call_function":
        schema = getattr(target, "_schema", None)
        if isinstance(target, torch._ops.OpOverload) and schema is not None:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    out.append(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
        else:
            try:
                op_inplace = target in _OPERATOR_INPLACE
            except TypeError:  # unhashable target
                op_inplace = False
            name = getattr(target, "__name__", "") or ""
            # operator.and_/or_/not_ are not in place: for operator's
            # functions only the set above counts.
            if getattr(target, "__module__", None) in ("operator", "_operator"):
                name = ""
            if op_inplace or (name.endswith("_") and not name.startswith("__")):
                out.append(first)
            elif kind(node) == "dropout" and arg(node, 3, "inplace", False) is True:
                out.append(first)
    elif getattr(getattr(node.graph, "owning_module", None), "get_submodule", None) is not None:
        try:
            mod = node.graph.owning_module.get_submodule(target)
        except AttributeError:
            mod = None
        if getattr(mod, "inplace", False) is True:
            out.append(first)
    if node.kwargs.get("inplace", False) is True and first not in out:
        out.append(first)
    dest = node.kwargs.get("out")
    if dest is not None:
        out.extend(dest if isinstance(dest, (list, tuple)) else [dest])
    return out or None


def is_inplace(node: torch.fx.Node) -> bool:
    """True for operations that write a tensor in place (``add_``,
    ``masked_fill_``, ``+=``, ``x[i] = y``, ``out=``): see :func:`mutated_args`."""
    return mutated_args(node) is not None


def guarded_number(x: Any) -> Optional[float]:
    """``number(x)``, or a symbolic float (e.g. a float attribute under
    ``dynamic=True``) specialised to its value with a guard, so that another
    value recompiles; None when neither is known."""
    n = number(x)
    v = val(x)
    if n is None and isinstance(v, torch.SymFloat):
        try:
            n = float(v)
        except Exception:  # noqa: BLE001 - no hint to guard on
            n = None
    return n


def number(x: Any) -> Optional[float]:
    """``x`` as a Python float when it is a compile-time constant number."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, torch.fx.Node):
        v = val(x)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, torch.SymInt):
            c = const_int(v)
            return float(c) if c is not None else None
        if isinstance(v, torch.SymFloat):
            # Dynamo may keep a float it already specialised as a SymFloat
            # with a constant expression (e.g. ``nn.Dropout.p`` via .item()).
            expr = v.node.expr
            return float(expr) if getattr(expr, "is_number", False) else None
        # A 0-d tensor built in the graph from a constant (torch.full([], c),
        # torch.tensor(c)): its value is that constant rounded to its dtype.
        k = kind(x)
        if isinstance(v, torch.Tensor) and v.dim() == 0 and k in ("full", "tensor"):
            c = number(x.args[1] if k == "full" else x.args[0]) if x.args else None
            if k == "full" and len(x.args) > 0 and tuple(x.args[0] or ()) != ():
                return None
            if c is not None:
                return float(torch.tensor(c, dtype=v.dtype).item())
        if k in ("float", "to", "type") and x.args and isinstance(v, torch.Tensor) and v.dim() == 0:
            inner = number(x.args[0])
            if inner is not None:
                return float(torch.tensor(inner, dtype=v.dtype).item())
    return None


def is_scalar_like(x: Any) -> bool:
    """A Python number, a symbolic number node, or a node holding a 0-d tensor."""
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    v = val(x)
    if isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool):
        return True
    return isinstance(v, torch.Tensor) and v.dim() == 0


def describe(node: Any) -> str:
    """A short human name of a node's operation, for 'why not' messages."""
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        t = node.target
        if t is builtins.getattr and len(node.args) > 1:
            return f".{node.args[1]}"
        mod = getattr(t, "__module__", "") or ""
        name = getattr(t, "__name__", str(t))
        if mod in ("_operator", "operator"):
            return f"operator.{name}"
        return f"{mod}.{name}" if mod else name
    if node.op == "call_module":
        return f"module {node.target}"
    return f"{node.op} {node.target}"
