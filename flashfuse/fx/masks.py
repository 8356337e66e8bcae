"""Proving that a mask built in the graph is a causal mask or a sliding window.

A mask is recognised by *evaluating it symbolically*, not by comparing it with
known spellings: each node is given an abstract value that describes the
tensor for every size at once:

* :class:`Affine` - an integer tensor whose element at index ``(..., i, j)``
  is ``sum(coef[d] * idx[d]) + const`` (what ``arange`` and its views,
  offsets and broadcasts produce, and gathering such a tensor at such
  indices, as in ``position_ids[batch_idx, q_idx]``);
* :class:`Band` - a tensor whose element is ``inside`` when
  ``lo <= j - i <= hi`` over its last two dims and ``outside`` elsewhere
  (``tril``/``triu`` of ones, comparisons of aranges, their negations,
  conjunctions, casts and ``where``/``masked_fill`` of constants). A constant
  tensor is a band with no bounds.

Anything else evaluates to None, and the caller keeps the mask as a tensor,
which is always correct. Slices shift the band, so ``bias[:, :, M-N:M, :M]`` of
a lower-triangular buffer is causal with bottom-right alignment.

Buffers are the one place where values, not structure, are read: a registered
buffer's contents at compile time are inspected (a model's tril buffer is a
constant by construction). Parameters and user inputs are never inspected.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.fx

from .nodes import arg, const_int, kind, known_eq, known_le, number, shape, tensor_val, val

Size = Union[int, torch.SymInt]

# Buffers larger than this are not inspected (the check reads every element).
MAX_INSPECTED_NUMEL = 1 << 24


@dataclasses.dataclass(frozen=True)
class Band:
    """Value ``inside`` where ``lo <= j - i <= hi`` (None: unbounded), else
    ``outside``; over the tensor's last two dims, the same for every leading
    index."""

    lo: Optional[Size]
    hi: Optional[Size]
    inside: Any
    outside: Any
    ndim: int

    @property
    def trivial(self) -> bool:
        return self.lo is None and self.hi is None

    def map(self, fn) -> Optional["Band"]:
        try:
            inside = fn(self.inside)
            outside = inside if self.trivial else fn(self.outside)
        except Exception:  # noqa: BLE001 - e.g. an unsupported value
            return None
        if _is_nan(inside) or _is_nan(outside):
            return None
        return dataclasses.replace(self, inside=inside, outside=outside)

    def normalized(self) -> "Band":
        """A boolean band that reads False inside a half-plane is the band
        reading True inside the complementary half-plane; say it that way."""
        if self.trivial:
            return dataclasses.replace(self, outside=self.inside)
        if self.inside is False and self.outside is True:
            if self.lo is not None and self.hi is None:
                return Band(None, self.lo - 1, True, False, self.ndim)
            if self.hi is not None and self.lo is None:
                return Band(self.hi + 1, None, True, False, self.ndim)
        return self


@dataclasses.dataclass(frozen=True)
class Affine:
    """Integer tensor: ``sum(coef[d] * idx[d]) + const``; ``coef`` keys are
    dims counted from the right (-1 is the last)."""

    coef: tuple  # tuple of (dim_from_right, coefficient), sorted
    const: Size
    ndim: int

    def coefs(self) -> dict:
        return dict(self.coef)


Value = Union[Band, Affine]


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _mk_affine(coefs: dict, const: Size, ndim: int) -> Affine:
    return Affine(tuple(sorted((d, c) for d, c in coefs.items() if c != 0)), const, ndim)


def _intersect(a: Optional[Size], b: Optional[Size], pick_max: bool) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    ia, ib = const_int(a), const_int(b)
    if ia is not None and ib is not None:
        return max(ia, ib) if pick_max else min(ia, ib)
    if known_eq(a, b):
        return a
    raise _Unknown


class _Unknown(Exception):
    pass


def conjoin(a: Band, b: Band) -> Optional[Band]:
    """``a & b`` of two boolean bands, when it is again a band."""
    a, b = a.normalized(), b.normalized()
    for band in (a, b):
        if not band.trivial and not (band.inside is True and band.outside is False):
            return None
    if a.trivial and a.inside is False or b.trivial and b.inside is False:
        return Band(None, None, False, False, max(a.ndim, b.ndim))
    try:
        lo = _intersect(a.lo, b.lo, True)
        hi = _intersect(a.hi, b.hi, False)
    except _Unknown:
        return None
    trivial = lo is None and hi is None
    return Band(lo, hi, True, True if trivial else False, max(a.ndim, b.ndim))


class MaskEvaluator:
    """Evaluates mask nodes to :data:`Value` s (None when not provable)."""

    def __init__(self, constants: dict[torch.fx.Node, torch.Tensor]):
        # Nodes whose concrete value may be read: buffers and graph constants.
        self.constants = constants
        self.cache: dict[torch.fx.Node, Optional[Value]] = {}

    def __call__(self, x: Any) -> Optional[Value]:
        if not isinstance(x, torch.fx.Node):
            n = number(x) if not isinstance(x, bool) else None
            if isinstance(x, bool):
                return Band(None, None, x, x, 0)
            return Band(None, None, n, n, 0) if n is not None else None
        if x not in self.cache:
            try:
                v = self._eval(x)
            except _Unknown:
                v = None
            self.cache[x] = v if not isinstance(v, Affine) or _affine_fits(v, x) else None
        return self.cache[x]

    # -- helpers ---------------------------------------------------------
    def _ndim(self, node: torch.fx.Node) -> int:
        t = tensor_val(node)
        if t is None:
            raise _Unknown
        return t.dim()

    def _eval(self, node: torch.fx.Node) -> Optional[Value]:
        k = kind(node)
        if node in self.constants:
            return band_of_tensor(self.constants[node])
        n = number(node)
        if n is not None and tensor_val(node) is None:
            return Band(None, None, n, n, 0)
        if tensor_val(node) is None:
            return None
        nd = self._ndim(node)
        if k in ("ones", "zeros", "full", "ones_like", "zeros_like", "full_like", "tensor",
                 "new_ones", "new_zeros", "new_full"):
            c = {"ones": 1, "zeros": 0, "ones_like": 1, "zeros_like": 0, "new_ones": 1, "new_zeros": 0}.get(k)
            if k in ("full", "full_like"):
                c = number(arg(node, 1, "fill_value"))
            elif k == "new_full":
                c = number(arg(node, 2, "fill_value"))
            elif k == "tensor":
                c = number(node.args[0]) if node.args and not isinstance(node.args[0], (list, tuple)) else None
            if c is None:
                return None
            return _in_dtype(Band(None, None, c, c, nd), tensor_val(node).dtype)
        if k == "arange":
            args = [val(a) for a in node.args]
            if "start" in node.kwargs or "end" in node.kwargs or "step" in node.kwargs:
                return None
            start, step = 0, 1
            if len(args) == 2:
                start = args[0]
            elif len(args) == 3:
                start, step = args[0], args[2]
            elif len(args) != 1:
                return None
            if const_int(step) is None or not isinstance(start, (int, torch.SymInt)):
                return None
            return _mk_affine({-1: const_int(step)}, start, 1)
        if k in ("contiguous", "clone", "detach"):
            return self(node.args[0])
        if k == "diff":
            return self._diff(node, nd)
        if k == "cumsum":
            return self._cumsum(node, nd)
        if k in ("to", "type", "type_as", "float", "half", "bfloat16", "double", "bool", "long", "int"):
            return self._cast(node)
        if k in ("unsqueeze", "view", "reshape", "getitem", "expand"):
            return self._view(node, k)
        if k in ("tril", "triu"):
            inner = self(node.args[0])
            d = val(arg(node, 1, "diagonal", 0))
            if not isinstance(d, (int, torch.SymInt)) or isinstance(d, bool):
                return None
            if not isinstance(inner, Band) or nd < 2:
                return None
            if not inner.trivial and inner.outside != 0:
                return None
            zero = False if isinstance(inner.inside, bool) else 0
            cut = Band(None, d, True, False, nd) if k == "tril" else Band(d, None, True, False, nd)
            both = conjoin(dataclasses.replace(inner, inside=True, outside=False if not inner.trivial else True), cut)
            if both is None:
                return None
            return Band(both.lo, both.hi, inner.inside, zero, nd)
        if k in ("eq", "ne", "ge", "gt", "le", "lt"):
            return self._compare(node, k)
        if k == "not":
            v = self(node.args[0])
            if isinstance(v, Band) and isinstance(v.inside, bool):
                return v.map(operator.not_)
            return None
        if k in ("and", "or"):
            a, b = self(node.args[0]), self(node.args[1])
            if not isinstance(a, Band) or not isinstance(b, Band):
                return None
            if not all(isinstance(v, bool) for v in (a.inside, a.outside, b.inside, b.outside)):
                return None
            if not self._no_band_broadcast(node):
                return None
            if k == "and":
                return conjoin(a, b)
            # a | b == ~(~a & ~b)
            both = conjoin(a.map(operator.not_), b.map(operator.not_))
            return both.map(operator.not_) if both is not None else None
        if k in ("add", "sub", "mul", "neg"):
            return self._arith(node, k)
        if k == "where":
            cond = self(node.args[0])
            an, bn = self._constant(node.args[1]), self._constant(node.args[2])
            if not isinstance(cond, Band) or an is None or bn is None:
                return None
            if not self._no_band_broadcast(node):
                return None
            c = cond.map(lambda v: an if v else bn)
            return _in_dtype(dataclasses.replace(c, ndim=nd), tensor_val(node).dtype) if c else None
        if k in ("masked_fill",):
            base, cond = self(node.args[0]), self(node.args[1])
            fill = self._constant(arg(node, 2, "value"))
            if not (isinstance(base, Band) and base.trivial and isinstance(cond, Band)) or fill is None:
                return None
            if not self._no_band_broadcast(node):
                return None
            c = cond.map(lambda v: fill if v else base.inside)
            return _in_dtype(dataclasses.replace(c, ndim=nd), tensor_val(node).dtype) if c else None
        return None

    def _constant(self, x: Any) -> Any:
        """The one value of an operand that is the same everywhere: a Python
        number or a node holding a constant (``torch.tensor(0.0)`` and
        ``torch.zeros(())`` alike); None otherwise."""
        n = number(x)
        if n is not None:
            return n
        v = self(x) if isinstance(x, torch.fx.Node) else None
        if isinstance(v, Band) and v.trivial and not _is_nan(v.inside):
            return v.inside
        return None

    def _no_band_broadcast(self, node: torch.fx.Node) -> bool:
        """A band over a size-1 dim cannot be broadcast to a larger one."""
        out = shape(node)
        for a in node.args:
            v = self(a) if isinstance(a, torch.fx.Node) else None
            if isinstance(v, Band) and not v.trivial:
                s = shape(a)
                if s is None or out is None or len(s) < 2:
                    return False
                for d in (-1, -2):
                    if not known_eq(s[d], out[d]):
                        return False
        return True

    # Hugging Face's masks for training without a cache AND the causal mask
    # with "same packed sequence" (ids = cumsum(diff(position_ids) != 1),
    # compared at [batch, q] and [batch, kv]). With position ids from an
    # arange the ids are all 0 and the term is True everywhere; the three
    # rules below (diff, cumsum, gathering from a constant) prove that.
    def _diff(self, node: torch.fx.Node, nd: int) -> Optional[Value]:
        """``diff`` of an arange-like tensor: a constant (its step), when the
        ``prepend`` value continues the same step."""
        x = node.args[0]
        n, dim = arg(node, 1, "n", 1), arg(node, 2, "dim", -1)
        prepend, append = arg(node, 3, "prepend"), arg(node, 4, "append")
        s_in = shape(x)
        if const_int(n) != 1 or append is not None or s_in is None or const_int(dim) is None:
            return None
        d = const_int(dim)
        d = d - len(s_in) if d >= 0 else d
        if not -len(s_in) <= d < 0:
            return None
        step = _step_along(self(x), d)
        if step is None:
            return None
        if prepend is not None:
            s_p = shape(prepend)
            a, p = _as_affine(self(x)), _as_affine(self(prepend))
            if s_p is None or len(s_p) != len(s_in) or not known_eq(s_p[d], 1) or a is None or p is None:
                return None
            # prepend holds one element along d, so its coefficient there is
            # irrelevant; elsewhere it must vary exactly as x does.
            others = lambda v: {e: c for e, c in v.coef if e != d}  # noqa: E731
            if others(a) != others(p) or not known_eq(a.const - p.const, step):
                return None
        return Band(None, None, step, step, nd)

    def _cumsum(self, node: torch.fx.Node, nd: int) -> Optional[Value]:
        """``cumsum`` of a constant ``c``: ``c * (index + 1)`` along the dim."""
        v, dim, t = self(node.args[0]), const_int(arg(node, 1, "dim")), tensor_val(node)
        if not isinstance(v, Band) or not v.trivial or dim is None or t is None or t.dtype == torch.bool:
            return None
        c = v.inside
        if isinstance(c, bool):
            c = int(c)
        if not isinstance(c, (int, float)) or _is_nan(c):
            return None
        if c == 0:
            zero = 0.0 if t.dtype.is_floating_point else 0
            return Band(None, None, zero, zero, nd)
        if t.dtype.is_floating_point or not float(c).is_integer():
            return None
        d = dim - nd if dim >= 0 else dim
        if not -nd <= d < 0:
            return None
        return _mk_affine({d: int(c)}, int(c), nd)

    def _gather(self, node: torch.fx.Node, v: Value, idx: tuple, s_in: tuple) -> Optional[Value]:
        """Indexing with index tensors. Every index must provably lie inside
        the tensor (otherwise eager raises, and a rewrite must not hide that).
        A constant gathered anywhere is the constant; an affine tensor
        gathered at affine indices is affine (:meth:`_gather_affine`)."""
        if not (isinstance(v, Band) and v.trivial) and not isinstance(v, Affine):
            return None
        d_in = 0
        for item in idx:
            if item is None:
                continue
            if d_in >= len(s_in):
                return None
            if isinstance(item, torch.fx.Node):
                t = tensor_val(item)
                # bool and uint8 index tensors select by mask, not by position.
                if t is None or t.dtype in (torch.bool, torch.uint8) or t.dtype.is_floating_point:
                    return None
                bounds = _index_range(self(item), shape(item))
                if bounds is None:
                    return None
                if not (known_le(0, bounds.lo) and known_le(bounds.hi + 1, s_in[d_in])):
                    return None
            elif not isinstance(item, slice):
                i = val(item)
                if not isinstance(i, (int, torch.SymInt)) or isinstance(i, bool):
                    return None
                if not (known_le(-s_in[d_in], i) and known_le(i + 1, s_in[d_in])):
                    return None
            d_in += 1
        if isinstance(v, Band):
            return Band(None, None, v.inside, v.inside, self._ndim(node))
        return self._gather_affine(node, v, idx, s_in)

    def _gather_affine(self, node: torch.fx.Node, v: Affine, idx: tuple, s_in: tuple) -> Optional[Affine]:
        """``x[i0, i1, ...]`` of an affine ``x`` at affine index tensors (and
        plain slices): substituting each index's expression for its input
        coordinate gives the result's expression. (How transformers reads
        position ids at ``[batch, q]`` and ``[batch, kv]``.)

        Output layout follows advanced indexing: the broadcast index dims
        replace the indexed dims when these are adjacent, else they come
        first. Bounds were checked by :meth:`_gather`; only non-negative
        indices are accepted there, so no index wraps around."""
        s_out = shape(node)
        if s_out is None or any(item is None or not isinstance(item, (torch.fx.Node, slice)) for item in idx):
            return None
        adv = [p for p, item in enumerate(idx) if isinstance(item, torch.fx.Node)]
        n_in, n_out = len(s_in), len(s_out)
        if any(shape(idx[p]) is None for p in adv):
            return None
        nb = max(len(shape(idx[p])) for p in adv)
        if n_out != n_in - len(adv) + nb or len(idx) != n_in:
            return None
        adjacent = adv == list(range(adv[0], adv[-1] + 1))
        block = adv[0] if adjacent else 0
        coefs: dict[int, int] = {}
        const = v.const
        by_dim = dict((d + n_in, c) for d, c in v.coef)  # input dim (from left) -> coefficient
        n_slices_seen = 0
        for d_in, item in enumerate(idx):
            c = by_dim.get(d_in, 0)
            if isinstance(item, slice):
                o = (d_in if d_in < block else d_in - len(adv) + nb) if adjacent else nb + n_slices_seen
                n_slices_seen += 1
                if item.step not in (None, 1):
                    return None
                start = val(item.start) if item.start is not None else 0
                if not isinstance(start, (int, torch.SymInt)) or isinstance(start, bool):
                    return None
                if const_int(start) is None or const_int(start) < 0:
                    return None
                if c:
                    coefs[o - n_out] = coefs.get(o - n_out, 0) + c
                    const = const + c * start
                continue
            if not c:
                continue
            a = _as_affine(self(item))
            s_idx = shape(item)
            if a is None or s_idx is None or (a.coef and a.ndim != len(s_idx)):
                return None
            for e, ce in a.coef:
                if not -len(s_idx) <= e < 0:
                    return None
                o = block + nb + e
                if not known_eq(s_idx[e], s_out[o]):
                    if known_eq(s_idx[e], 1):
                        continue  # a size-1 index dim holds one value however it broadcasts
                    return None
                coefs[o - n_out] = coefs.get(o - n_out, 0) + c * ce
            const = const + c * a.const
        return _mk_affine(coefs, const, n_out)

    def _cast(self, node: torch.fx.Node) -> Optional[Value]:
        v = self(node.args[0])
        t = tensor_val(node)
        if v is None or t is None:
            return None
        if isinstance(v, Affine):
            if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
                return None
            return v  # a narrower integer type that wraps is caught by _affine_fits
        return _in_dtype(v, t.dtype)

    def _compare(self, node: torch.fx.Node, k: str) -> Optional[Value]:
        a, b = node.args[0], node.args[1]
        va, vb = self(a), self(b)
        ops = {"eq": operator.eq, "ne": operator.ne, "ge": operator.ge, "gt": operator.gt,
               "le": operator.le, "lt": operator.lt}
        if isinstance(va, Band) and isinstance(vb, Band) and (va.trivial or vb.trivial):
            if not self._no_band_broadcast(node):
                return None
            other = vb.inside if vb.trivial else va.inside
            band = va if vb.trivial else vb
            if not (va.trivial and vb.trivial) and band is vb:
                fn = lambda x: ops[k](other, x)  # noqa: E731
            else:
                fn = lambda x: ops[k](x, other)  # noqa: E731
            out = band.map(lambda x: bool(fn(x)))
            return dataclasses.replace(out, ndim=self._ndim(node)) if out else None
        # Integer affine comparisons: a - b = c_j * j + c_i * i + const.
        va, vb = _as_affine(va), _as_affine(vb)
        if va is None or vb is None:
            return None
        ca, cb = va.coefs(), vb.coefs()
        diff = {d: ca.get(d, 0) - cb.get(d, 0) for d in set(ca) | set(cb)}
        diff = {d: c for d, c in diff.items() if c != 0}
        const = va.const - vb.const
        nd = self._ndim(node)
        out = shape(node)
        if set(diff) != {-1, -2} or out is None:
            return None
        if k in ("eq", "ne"):
            return None
        # diff is c * (j - i) + const with c = +-1: express as a bound on d = j - i.
        if diff == {-1: 1, -2: -1}:
            sign = 1
        elif diff == {-1: -1, -2: 1}:
            sign = -1
        else:
            return None
        # sign * d + const  OP  0   ->   d OP' -sign * const
        rhs = -const if sign == 1 else const
        op = k if sign == 1 else {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt"}[k]
        if op == "ge":
            return Band(rhs, None, True, False, nd)
        if op == "gt":
            return Band(rhs + 1, None, True, False, nd)
        if op == "le":
            return Band(None, rhs, True, False, nd)
        return Band(None, rhs - 1, True, False, nd)

    def _arith(self, node: torch.fx.Node, k: str) -> Optional[Value]:
        if k == "neg":
            v = self(node.args[0])
            if isinstance(v, Band):
                return v.map(operator.neg)
            if isinstance(v, Affine):
                return _mk_affine({d: -c for d, c in v.coef}, -v.const, v.ndim)
            return None
        a, b = self(node.args[0]), self(node.args[1])
        alpha = number(node.kwargs.get("alpha", 1))
        if alpha is None or a is None or b is None:
            return None
        fn = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}[k]
        nd = self._ndim(node)
        if isinstance(a, Band) and isinstance(b, Band):
            if not (a.trivial or b.trivial) or not self._no_band_broadcast(node):
                return None
            if any(isinstance(x, bool) for x in (a.inside, b.inside)):
                return None
            if b.trivial:
                bv = b.inside * alpha if k != "mul" else b.inside
                out = a.map(lambda x: fn(x, bv))
            else:
                av = a.inside
                out = b.map(lambda x: fn(av, x * alpha if k != "mul" else x))
            return dataclasses.replace(out, ndim=nd) if out else None
        # Affine arithmetic (integer index expressions).
        fa, fb = _as_affine(a), _as_affine(b)
        if fa is None or fb is None:
            return None
        if k == "mul":
            if fb.coef and fa.coef:
                return None
            scalar, aff = (fb.const, fa) if not fb.coef else (fa.const, fb)
            if const_int(scalar) is None:
                return None
            s = const_int(scalar)
            return _mk_affine({d: c * s for d, c in aff.coef}, aff.const * s, nd)
        if const_int(alpha) is None and alpha != int(alpha):
            return None
        al = int(alpha)
        sgn = 1 if k == "add" else -1
        coefs = dict(fa.coef)
        for d, c in fb.coef:
            coefs[d] = coefs.get(d, 0) + sgn * al * c
        return _mk_affine(coefs, fa.const + sgn * al * fb.const, nd)

    def _view(self, node: torch.fx.Node, k: str) -> Optional[Value]:
        src = node.args[0]
        v = self(src)
        if v is None:
            return None
        s_in, s_out = shape(src), shape(node)
        if s_in is None or s_out is None:
            return None
        if k == "expand":
            # Only size-1 dims grow; a band's last two dims must keep their size.
            if isinstance(v, Band) and not v.trivial:
                if len(s_in) < 2 or not (known_eq(s_in[-1], s_out[-1]) and known_eq(s_in[-2], s_out[-2])):
                    return None
            if isinstance(v, Affine):
                for d, _ in v.coef:
                    if not known_eq(s_in[d], s_out[d]):
                        return None
            return dataclasses.replace(v, ndim=len(s_out))
        if k == "getitem":
            return self._index(node, v, s_in, s_out)
        # unsqueeze / view / reshape: only size-1 dims may appear or vanish.
        mapping = _unit_dim_mapping(s_in, s_out)
        if mapping is None:
            return None
        return _remap(v, mapping, len(s_in), len(s_out))

    def _index(self, node, v, s_in, s_out) -> Optional[Value]:
        idx = node.args[1]
        if not isinstance(idx, tuple):
            idx = (idx,)
        if any(i is Ellipsis for i in idx):
            pos = idx.index(Ellipsis)
            n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
            idx = idx[:pos] + (slice(None),) * (len(s_in) - n_real) + idx[pos + 1 :]
        idx = idx + (slice(None),) * (len(s_in) - sum(1 for i in idx if i is not None))
        if any(isinstance(i, torch.fx.Node) for i in idx):
            return self._gather(node, v, idx, s_in)
        out_of_in: dict[int, int] = {}  # input dim (from left) -> output dim (from left)
        shifts: dict[int, Size] = {}
        d_in = d_out = 0
        for item in idx:
            if item is None:
                d_out += 1
                continue
            if isinstance(item, slice):
                if item.step not in (None, 1):
                    return None
                start = val(item.start) if item.start is not None else 0
                if not isinstance(start, (int, torch.SymInt)):
                    return None
                if const_int(start) is not None and const_int(start) < 0:
                    return None
                shifts[d_in] = start
                out_of_in[d_in] = d_out
                d_in += 1
                d_out += 1
                continue
            # An integer index drops the dim; allowed on dims the value does not vary along.
            if isinstance(v, Band) and not v.trivial and d_in >= len(s_in) - 2:
                return None
            if isinstance(v, Affine):
                pos = d_in - len(s_in)
                if dict(v.coef).get(pos):
                    return None
            d_in += 1
        if d_out != len(s_out):
            return None
        n_in, n_out = len(s_in), len(s_out)
        if isinstance(v, Affine):
            coefs, const = {}, v.const
            for d, c in v.coef:
                left = d + n_in
                if left not in out_of_in:
                    return None
                const = const + c * shifts[left]
                coefs[out_of_in[left] - n_out] = c
            return _mk_affine(coefs, const, n_out)
        if v.trivial:
            return dataclasses.replace(v, ndim=n_out)
        # Band: its two dims must stay the last two; a slice start shifts it.
        r, c = n_in - 2, n_in - 1
        if out_of_in.get(r) != n_out - 2 or out_of_in.get(c) != n_out - 1:
            return None
        delta = shifts[r] - shifts[c]
        lo = v.lo + delta if v.lo is not None else None
        hi = v.hi + delta if v.hi is not None else None
        return Band(lo, hi, v.inside, v.outside, n_out)


def _in_dtype(v: Band, dtype: torch.dtype) -> Optional[Band]:
    """The band's values as a tensor of ``dtype`` holds them (rounded to a
    float type, truncated to an integer type), so what is proven about the
    values is what the tensor holds."""
    if dtype == torch.bool:
        return v.map(bool)
    if dtype.is_floating_point:
        return v.map(lambda x: float(torch.tensor(float(x), dtype=dtype).item()))
    if dtype.is_complex:
        return None
    info = torch.iinfo(dtype)

    def to_int(x: Any) -> int:
        if not info.min <= x <= info.max:  # would wrap around
            raise OverflowError(x)
        return int(x)

    return v.map(to_int)


def _affine_fits(v: Affine, node: torch.fx.Node) -> bool:
    """Affine arithmetic has no overflow; the node's integer type does. Keep
    the affine form only when every value provably fits. For int64 the
    coefficients and constant are bounded instead (symbolic sizes have no
    proven upper bound; with sizes below 2**40 the values stay below 2**61)."""
    t = tensor_val(node)
    if t is None or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        return False
    if t.dtype == torch.int64:
        c = const_int(v.const)
        small_coefs = all(abs(k) < 1 << 16 for _, k in v.coef)
        return small_coefs and (c is None or abs(c) < 1 << 60)
    bounds = _index_range(v, shape(node))
    info = torch.iinfo(t.dtype)
    return bounds is not None and known_le(info.min, bounds.lo) and known_le(bounds.hi, info.max)


def _as_affine(v: Optional[Value]) -> Optional[Affine]:
    """An integer value as an :class:`Affine` (a constant has no coefficients)."""
    if isinstance(v, Affine):
        return v
    if isinstance(v, Band) and v.trivial and isinstance(v.inside, (int, float)) and not isinstance(v.inside, bool):
        if float(v.inside).is_integer():
            return _mk_affine({}, int(v.inside), v.ndim)
    return None


def _step_along(v: Optional[Value], d: int) -> Optional[int]:
    """The constant difference between neighbours along dim ``d``, if any."""
    a = _as_affine(v)
    return None if a is None else dict(a.coef).get(d, 0)


class IndexRange(NamedTuple):
    """Smallest and largest value of an integer tensor (inclusive)."""

    lo: Size
    hi: Size


def _index_range(v: Optional[Value], s: Optional[tuple]) -> Optional[IndexRange]:
    """The range of an integer tensor's values, from its affine form."""
    a = _as_affine(v)
    if a is None or s is None:
        return None
    lo = hi = a.const
    for d, c in a.coef:
        if not -len(s) <= d < 0 or not isinstance(c, int):
            return None
        span = c * (s[d] - 1)
        if c > 0:
            hi = hi + span
        else:
            lo = lo + span
    return IndexRange(lo, hi)


def _unit_dim_mapping(s_in: tuple, s_out: tuple) -> Optional[dict]:
    """Map input dims to output dims when ``s_out`` only adds/removes size-1
    dims; None otherwise."""
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(s_in) or j < len(s_out):
        if i < len(s_in) and j < len(s_out) and known_eq(s_in[i], s_out[j]):
            if not known_eq(s_in[i], 1) or (
                # Pair size-1 dims only when the counts of the remaining ones agree.
                len(s_in) - i == len(s_out) - j
            ):
                mapping[i] = j
                i += 1
                j += 1
                continue
        if i < len(s_in) and known_eq(s_in[i], 1):
            i += 1
            continue
        if j < len(s_out) and known_eq(s_out[j], 1):
            j += 1
            continue
        return None
    return mapping


def _remap(v: Value, mapping: dict, n_in: int, n_out: int) -> Optional[Value]:
    if isinstance(v, Affine):
        coefs = {}
        for d, c in v.coef:
            left = d + n_in
            if left not in mapping:
                return None
            coefs[mapping[left] - n_out] = c
        return _mk_affine(coefs, v.const, n_out)
    if v.trivial:
        return dataclasses.replace(v, ndim=n_out)
    if mapping.get(n_in - 2) != n_out - 2 or mapping.get(n_in - 1) != n_out - 1:
        return None
    return dataclasses.replace(v, ndim=n_out)


def band_of_tensor(t: torch.Tensor) -> Optional[Band]:
    """The band a concrete tensor (a buffer) holds, if it is one."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.numel() > MAX_INSPECTED_NUMEL:
        return None
    if t.numel() == 0 or t.is_complex():
        return None
    try:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return None
    except ImportError:  # pragma: no cover - very old torch
        pass
    with torch.no_grad():
        x = t.detach().reshape(-1, t.shape[-2], t.shape[-1])
        if not bool((x == x[:1]).all()):
            return None
        x = x[0].cpu()
        rows, cols = x.shape
        inside = x[rows - 1, 0].item()
        if isinstance(inside, float) and math.isnan(inside):
            return None
        sel = x == inside
        other = x[~sel]
        if other.numel() and not bool((other == other[0]).all()):
            return None
        outside = other[0].item() if other.numel() else inside
        if other.numel() == 0:
            return Band(None, None, inside, inside, t.dim())
        i = torch.arange(rows).view(-1, 1)
        j = torch.arange(cols).view(1, -1)
        d = j - i
        lo, hi = int(d[sel].min()), int(d[sel].max())
        if not bool((sel == ((d >= lo) & (d <= hi))).all()):
            return None
    return Band(None if lo == -(rows - 1) else lo, None if hi == cols - 1 else hi, inside, outside, t.dim())
