"""Random attention programs for differential testing of the graph pass.

A :class:`Spec` describes one program: shapes, dtype, and one choice for
every place where eager code spells attention differently (the products, the
key transpose, the scale, the mask, the softmax, casts, dropout, grouped
heads, layouts) plus, optionally, one *hostile* feature that makes the
pattern something the op cannot compute (softmax over the wrong dim, scores
that are returned, a soft cap, ...).

:func:`render` turns a spec into the source of an ``nn.Module`` named
``Program``; :func:`build` executes that source. Because the program is real
source, a failure that hypothesis shrank is a minimal program that can be
pasted into ``test_regressions.py`` as it is (:func:`repro` prints the
module together with its inputs).

:func:`expected_rewrites` says what the pass must do with a spec: ``1``
(supported attention: it must be rewritten), ``0`` (must be left alone), or
``None`` (either is correct: the product is an attention with an unusual
key, e.g. ``q @ k`` without a transpose when the shapes happen to line up;
the pass may take ``b.mT`` as the key of ``a @ b``, so only the numbers are
checked).

Fully masked rows: the generated masks always leave every query row at least
one visible key. Eager softmax turns an all ``-inf`` row into NaN where the op
returns 0 (a documented difference, tested on its own in
``test_regressions.py``), and with finite fills eager averages the row
uniformly; neither is a rewrite bug, so the fuzzer does not produce them.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Optional

import torch
from hypothesis import strategies as st

# Head sizes inside the op's support (16..256) and two outside it.
SUPPORTED_D = (16, 24, 32, 40, 64)
UNSUPPORTED_D = (8, 12)

# Features the op cannot compute: the pass must refuse the whole pattern.
HOSTILE = (
    "return_scores",  # the scores are a second output
    "return_probs",  # the probabilities are a second output
    "reuse_probs",  # the probabilities feed another computation too
    "scores_times_tensor",  # a multiplicative (non-scalar) factor on the scores
    "softcap",  # a tanh of the logits that is not a soft-cap c * tanh(s / c) (the op's softcap)
    "fill_finite",  # masked_fill with a value that does not remove positions
    "softmax_dim",  # softmax over another dim than the keys' one
    "head_dim",  # head size outside 16..256
    "float64",  # a dtype the op does not support in compiled graphs
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One attention program. See the module docstring."""

    B: int
    H: int
    Hkv: int
    N: int
    M: int
    D: int
    Dv: int
    dtype: str  # "float32" | "bfloat16" | "float64"
    layout: str  # "bhnd" | "bnhd" (inputs as (B, N, H, D), transposed in the program)
    gqa: str  # "none" | "repeat_kv" | "repeat_interleave" | "broadcast"
    product: str  # "at" | "matmul" | "method" | "bmm" | "baddbmm" | "einsum"
    key: str  # "t-2-1" | "t23" | "t32" | "mT" | "permute" | wrong: "plain" | "permute_0231"
    scale: str  # "none" | "const" | "temperature" | "neg_temperature" | "sqrt_expr" | "pow_expr" | "buffer" | "full"
    scale_place: str  # "scores" | "q" | "split" | "after_mask"
    mask: str  # see MASKS
    mask_shape: str  # "nm" | "11nm" | "b1nm" | "bhnm" | "b11m" | float only: "b1n1" (row bias), "1nm"
    mask_form: int  # which spelling of the mask operation (0..2; 0..4 for float biases)
    softmax: str  # "F" | "torch" | "method" | "module" | "F_dtype"
    cast: str  # "none" | "float_type_as" | "to_float"
    dropout: str  # "none" | "functional" | "module"
    dropout_p: float
    out: str  # "plain" | "merge_reshape" | "merge_view"
    hostile: str  # "none" or one of HOSTILE
    train: bool  # inputs require grad, gradients are compared
    seed: int
    dynamic: bool = False  # compile with dynamic=True (symbolic sizes)
    twice: bool = False  # a second attention reads the first one's output as q
    shared: str = "none"  # "none" | "kv" (k is v) | "qk" (q is k): one tensor, two roles
    scale_form: int = 0  # 0: s = s * c, 1: in place (s *= c / s.mul_(c)), 2: torch.mul
    model: str = "none"  # a feature of real models the op computes: see MODEL_FEATURES

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def rank(self) -> int:
        """Rank of the score tensor: 3 for bmm/baddbmm, else 4."""
        return 3 if self.product in ("bmm", "baddbmm") else 4


MASKS = (
    "none",
    "add_float",  # random float bias (an input; a learned bias in train mode)
    "add_neg_inf",  # 0 / -inf float mask (an input)
    "bool",  # random bool mask, True = visible (an input)
    "padding",  # key padding, (B, M) 0/1 input turned into an additive -1e4 term
    "causal_tril",  # built in the graph from tril(ones)
    "causal_triu_add",  # triu(full(-inf), 1) added to the scores
    "causal_arange",  # arange comparisons in torch.where
    "causal_bottom_right",  # tril(ones(n, m), diagonal=m - n), decoding
    "window",  # causal sliding window from aranges
)
# Masks that are inputs of the program.
INPUT_MASKS = ("add_float", "add_neg_inf", "bool")

# Features of real models that the op computes (so the pass must rewrite):
MODEL_FEATURES = (
    "none",
    "softcap",  # Gemma 2: cap * tanh(s / cap) after the scale, before the mask (three spellings)
    "sinks",  # gpt-oss: a per-head logit (an input) concatenated to the scores, its column dropped
    "sinks_shift",  # the same, the concatenation shifted by its row max first
    "batch_views",  # fairseq / Bloom: bmm scores viewed to (B, H, N, M) for the mask and softmax, back for bmm
    "alibi",  # Bloom: batch views, and an ALiBi bias (an input) as baddbmm's input, beta=1
)


def expected_rewrites(spec: Spec, compiler: str = "aot_eager") -> Optional[int]:
    """1 if the pass must rewrite, 0 if it must refuse, None if either is
    right. ``compiler`` is the post-rewrite compiler the program goes through."""
    if spec.hostile != "none":
        return 0
    if spec.key in ("plain", "permute_0231"):
        return None
    if spec.dynamic and spec.scale_place == "after_mask" and _fills_finite(spec) and spec.scale in ("sqrt_expr", "pow_expr"):
        # finfo.min times a symbolic factor (sqrt of a symbolic head size):
        # the pass cannot bound the product, so it may keep the graph (a
        # missed rewrite, not a wrong answer; see test_regressions.py).
        return None
    if spec.model == "alibi" and _fills_finite(spec):
        # A finite fill beside an additive bias: the op takes the fill only
        # with a bool mask, so the pass rewrites only when it can prove the
        # fill a band every row keeps a key of (not always provable with
        # symbolic sizes); else it keeps the graph, as documented.
        return None
    if spec.dynamic and spec.train and spec.dropout == "module" and compiler == "eager":
        # Dynamo passes nn.Dropout's float p as a tensor under dynamic=True;
        # AOTAutograd and Inductor then restart the trace with p specialised
        # (and the pass rewrites), the plain "eager" compiler does not.
        return None
    return 2 if spec.twice else 1


def _fills_finite(spec: Spec) -> bool:
    """Whether the mask is applied with a finite fill value (finfo.min)."""
    return (spec.mask, spec.mask_form) in {
        ("bool", 1), ("causal_tril", 1), ("causal_arange", 1), ("causal_bottom_right", 2), ("window", 2),
    }


# ---------------------------------------------------------------------------
# Drawing specs


@st.composite
def specs(draw, hostile_rate: float = 0.2, allow_bf16: bool = True) -> Spec:
    """Draw a :class:`Spec`. ``hostile_rate`` is the share of programs with one
    feature the pass must refuse."""
    product = draw(st.sampled_from(["at", "matmul", "method", "bmm", "baddbmm", "einsum"]))
    hostile = "none"
    if draw(st.integers(0, 99)) < round(100 * hostile_rate):
        hostile = draw(st.sampled_from(HOSTILE))
    dtype = draw(st.sampled_from(["float32"] * 4 + (["bfloat16"] if allow_bf16 else [])))
    if hostile == "float64":
        dtype = "float64"
    B = draw(st.integers(1, 2))
    gqa = draw(st.sampled_from(["none", "none", "repeat_kv", "repeat_interleave", "broadcast"]))
    if gqa == "none":
        H = Hkv = draw(st.integers(1, 3))
    elif gqa == "broadcast":
        if product in ("bmm", "baddbmm", "einsum"):
            gqa = "none"  # 3-D products and einsum cannot broadcast heads
            H = Hkv = draw(st.integers(1, 3))
        else:
            H, Hkv = draw(st.integers(2, 4)), 1
    else:
        Hkv = draw(st.integers(1, 2))
        H = Hkv * draw(st.integers(2, 3))
    N = draw(st.integers(1, 24))
    M = draw(st.integers(1, 24))
    D = draw(st.sampled_from(SUPPORTED_D))
    Dv = draw(st.sampled_from([D, D, 16, 32]))
    if hostile == "head_dim":
        D = draw(st.sampled_from(UNSUPPORTED_D))
        Dv = draw(st.sampled_from([D, 16]))

    key = draw(st.sampled_from(["t-2-1", "t23", "t32", "mT", "permute", "plain", "permute_0231"]))
    if key == "permute_0231" and (product not in ("at", "matmul", "method") or gqa != "none"):
        key = "plain"
    if product == "einsum":
        key = "t-2-1"  # einsum subscripts do the transpose
    if key == "plain":
        M = D  # q @ k lines up only when M == D
    if key == "permute_0231":
        M = H  # k.permute(0, 2, 3, 1) is (B, M, D, H): lines up when M == H

    scale = draw(st.sampled_from(
        ["none", "const", "temperature", "neg_temperature", "sqrt_expr", "pow_expr", "buffer", "full"]))
    scale_place = draw(st.sampled_from(["scores", "scores", "q", "split", "after_mask"]))
    if scale == "none":
        scale_place = "scores"
    if scale_place == "split" and scale not in ("const", "pow_expr"):
        scale_place = "scores"
    if scale_place == "after_mask" and scale in ("buffer", "full"):
        # A tensor scale after a -inf fill has an unknown sign: refusing is
        # the pass's documented choice, so only number scales go there.
        scale = "const"

    mask = draw(st.sampled_from(MASKS))
    layout = draw(st.sampled_from(["bhnd", "bnhd"]))
    if mask in ("causal_bottom_right", "window"):
        M = max(M, N)  # keep every row with at least one visible key
        if key == "plain":
            N = min(N, M)
    if key == "plain" and M != D or key == "permute_0231" and M != H:
        key = "t-2-1"  # a mask forced M up: fall back to a plain transpose
    mask_shape = draw(st.sampled_from(["nm", "11nm", "b1nm", "bhnm", "b11m"]))

    softmax = draw(st.sampled_from(["F", "torch", "method", "module", "F_dtype"]))
    cast = draw(st.sampled_from(["none", "none", "float_type_as", "to_float"]))
    train = draw(st.booleans())
    dropout = draw(st.sampled_from(["none", "functional", "module"]))
    dropout_p = 0.0 if train else draw(st.sampled_from([0.0, 0.1, 0.5]))
    out = draw(st.sampled_from(["plain", "merge_reshape", "merge_view"]))
    if hostile == "fill_finite" and mask != "none":
        mask = "none"
    if scale == "neg_temperature" and scale_place == "after_mask":
        scale_place = "scores"  # -inf * negative = +inf: eager NaN
    if mask == "add_float":
        mask_shape = draw(st.sampled_from(["nm", "11nm", "b1nm", "bhnm", "b11m", "b1n1", "1nm"]))
    mask_form = draw(st.integers(0, 4 if mask == "add_float" else 2))
    scale_form = draw(st.integers(0, 2)) if scale_place in ("scores", "after_mask") else 0
    dynamic = draw(st.integers(0, 3)) == 0
    shared = draw(st.sampled_from(["none"] * 6 + ["kv", "qk"]))
    if shared == "kv" and (Dv != D or key in ("plain", "permute_0231")):
        shared = "none"
    if shared == "qk":
        if gqa != "none" or key in ("plain", "permute_0231") or mask in ("causal_bottom_right", "window"):
            shared = "none"
        else:
            M = N
    twice = (draw(st.integers(0, 5)) == 0 and layout == "bhnd" and out == "plain" and hostile == "none"
             and Dv == D and shared == "none")
    model = draw(st.sampled_from(["none"] * 7 + ["softcap", "sinks", "sinks_shift", "batch_views", "alibi"]))
    if hostile != "none":
        model = "none"
    if model == "softcap" and scale_place == "after_mask":
        model = "none"  # scaled again after the cap: left alone on purpose (a near miss, not this feature)
    if model.startswith("sinks") and (product in ("bmm", "baddbmm") or cast != "none"):
        model = "none"  # the sink spelling is on 4-D scores in their own dtype
    if model == "batch_views" and product not in ("bmm", "baddbmm"):
        model = "none"
    if model == "alibi" and product != "baddbmm":
        model = "none"
    return Spec(
        B=B, H=H, Hkv=Hkv, N=N, M=M, D=D, Dv=Dv, dtype=dtype, layout=layout, gqa=gqa,
        product=product, key=key, scale=scale, scale_place=scale_place, mask=mask,
        mask_shape=mask_shape, mask_form=mask_form, softmax=softmax, cast=cast,
        dropout=dropout, dropout_p=dropout_p, out=out, hostile=hostile, train=train,
        seed=draw(st.integers(0, 2**16)), dynamic=dynamic, twice=twice, shared=shared,
        scale_form=scale_form, model=model,
    )


# ---------------------------------------------------------------------------
# Rendering specs as source


def _factor(spec: Spec, x: str, half: bool = False) -> tuple[str, str]:
    """(operator, factor expression) of the spec's scale applied to ``x``
    (its square root when ``half``)."""
    D = spec.D
    if spec.scale == "const":
        return ("*", repr(D ** -0.25)) if half else ("*", repr(1 / math.sqrt(D)))
    if spec.scale == "temperature":
        return "*", "0.37"
    if spec.scale == "neg_temperature":
        return "*", "-0.37"
    if spec.scale == "sqrt_expr":
        return "/", "math.sqrt(q.size(-1))"
    if spec.scale == "pow_expr":
        return ("*", "q.shape[-1] ** -0.25") if half else ("*", "q.shape[-1] ** -0.5")
    if spec.scale == "buffer":
        return "*", "self.inv_scale"
    if spec.scale == "full":
        return "/", f"torch.full([], q.size(-1) ** 0.5, dtype={x}.dtype)"
    raise AssertionError(spec.scale)


def _scaled(spec: Spec, x: str, half: bool = False) -> str:
    """An expression: ``x`` times the spec's scale."""
    op, f = _factor(spec, x, half)
    return f"{x} {op} {f}"


def _scale_line(spec: Spec) -> str:
    """A statement scaling the scores ``s``, in one of three spellings."""
    op, f = _factor(spec, "s")
    if spec.scale_form == 1:
        return f"s {op}= {f}"
    if spec.scale_form == 2:
        return f"s = torch.{'mul' if op == '*' else 'div'}(s, {f})"
    return f"s = s {op} {f}"


def _key_t(spec: Spec, k: str) -> str:
    """The right operand of the score product."""
    if spec.key == "plain":
        return k
    if spec.key == "permute_0231":
        return f"{k}.permute(0, 2, 3, 1)"
    if spec.rank == 3:
        return {"t-2-1": f"{k}.transpose(-2, -1)", "t23": f"{k}.transpose(1, 2)",
                "t32": f"{k}.transpose(2, 1)", "mT": f"{k}.mT", "permute": f"{k}.permute(0, 2, 1)"}[spec.key]
    return {"t-2-1": f"{k}.transpose(-2, -1)", "t23": f"{k}.transpose(2, 3)", "t32": f"{k}.transpose(3, 2)",
            "mT": f"{k}.mT", "permute": f"{k}.permute(0, 1, 3, 2)"}[spec.key]


def _mask_lines(spec: Spec, rank: int) -> list[str]:
    """Lines applying the mask to the scores ``s`` of rank 3 or 4."""
    m, form = spec.mask, spec.mask_form
    inf = 'float("-inf")'
    lines: list[str] = []
    if m in INPUT_MASKS:
        if rank == 3:
            lines.append("mask = mask.expand(b, h, n, m).reshape(b * h, n, m)")
        if m == "bool":
            lines.append([f"s = s.masked_fill(~mask, {inf})",
                          "s = torch.where(mask, s, torch.finfo(s.dtype).min)",
                          f"s.masked_fill_(mask.logical_not(), {inf})"][form])
        else:
            lines.append(["s = s + mask", "s = mask + s", "s += mask", "s = s.add(mask, alpha=0.5)",
                          "s = s - mask"][form])
        return lines
    if m == "padding":
        # pad: (B, M) with 1 = keep; HF-style additive term of -1e4.
        if rank == 3:
            lines.append("pad = pad[:, None, :].expand(b, h, m).reshape(b * h, 1, m)")
        else:
            lines.append("pad = pad[:, None, None, :]")
        lines.append("s = s + (1.0 - pad.to(s.dtype)) * -10000.0")
        return lines
    if m == "causal_tril":
        lines.append("causal = torch.tril(torch.ones(n, m, device=s.device))")
        lines.append([f"s = s.masked_fill(causal == 0, {inf})",
                      "s = torch.where(causal.bool(), s, torch.finfo(s.dtype).min)",
                      f"s.masked_fill_(causal == 0, {inf})"][form])
    elif m == "causal_triu_add":
        # In the scores' dtype (a float32 mask would promote bf16 scores).
        if form < 2:
            lines.append(f"causal = torch.triu(torch.full((n, m), {inf}, dtype=s.dtype, device=s.device), diagonal=1)")
        else:
            lines.append(f"causal = torch.triu(torch.full((n, m), {inf}, device=s.device), diagonal=1)")
        lines.append(["s = s + causal", "s = causal + s", "s = s + causal.to(s.dtype)"][form])
    elif m == "causal_arange":
        lines.append("i = torch.arange(n, device=s.device)[:, None]")
        lines.append("j = torch.arange(m, device=s.device)[None, :]")
        lines.append([f"s = torch.where(j <= i, s, {inf})",
                      "s = s.masked_fill(j > i, torch.finfo(s.dtype).min)",
                      f"s = torch.where(i >= j, s, {inf})"][form])
    elif m == "causal_bottom_right":
        lines.append("keep = torch.ones(n, m, dtype=torch.bool, device=s.device).tril(diagonal=m - n)")
        lines.append([f"s = s.masked_fill(~keep, {inf})",
                      f"s = torch.where(keep, s, {inf})",
                      "s = s.masked_fill(keep.logical_not(), torch.finfo(s.dtype).min)"][form])
    elif m == "window":
        w = 1 + spec.seed % 4
        lines.append("i = torch.arange(n, device=s.device)[:, None]")
        lines.append("j = torch.arange(m, device=s.device)[None, :]")
        lines.append(f"keep = (j <= i) & (i - j < {w})")
        lines.append([f"s = s.masked_fill(~keep, {inf})",
                      f"s = torch.where(keep, s, {inf})",
                      "s = s.masked_fill(keep == 0, torch.finfo(s.dtype).min)"][form])
    return lines


def render(spec: Spec) -> str:
    """Source of ``class Program(nn.Module)`` for ``spec``."""
    init = ["super().__init__()"]
    args = ["q", "k", "v"]
    if spec.mask in INPUT_MASKS:
        args.append("mask")
    if spec.mask == "padding":
        args.append("pad")
    if spec.model.startswith("sinks"):
        args.append("sinks")
    if spec.model == "alibi":
        args.append("alibi")
    body: list[str] = []

    if spec.scale == "buffer":
        init.append(f"self.register_buffer(\"inv_scale\", torch.tensor({1 / math.sqrt(spec.D)!r}))")
    if spec.softmax == "module":
        init.append("self.softmax = nn.Softmax(dim=-1)")
    if spec.dropout == "module":
        init.append(f"self.drop = nn.Dropout({spec.dropout_p!r})")

    einsum_bnhd = spec.product == "einsum" and spec.layout == "bnhd"
    if spec.layout == "bnhd" and not einsum_bnhd:
        body.append("q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)")
    hd = 2 if einsum_bnhd else 1  # the heads dim of the program's tensors
    if spec.shared == "kv":
        body.append("v = k  # one tensor as keys and values")
    elif spec.shared == "qk":
        body.append("k = q  # one tensor as queries and keys")
    if spec.gqa == "repeat_kv":
        body.append("def repeat_kv(x, r):")
        if einsum_bnhd:
            body.append("    b_, s_, h_, d_ = x.shape")
            body.append("    return x[:, :, :, None, :].expand(b_, s_, h_, r, d_).reshape(b_, s_, h_ * r, d_)")
        else:
            body.append("    b_, h_, s_, d_ = x.shape")
            body.append("    return x[:, :, None, :, :].expand(b_, h_, r, s_, d_).reshape(b_, h_ * r, s_, d_)")
        body.append(f"k, v = repeat_kv(k, {spec.H // spec.Hkv}), repeat_kv(v, {spec.H // spec.Hkv})")
    elif spec.gqa == "repeat_interleave":
        r = spec.H // spec.Hkv
        body.append(f"k = k.repeat_interleave({r}, dim={hd})")
        body.append(f"v = torch.repeat_interleave(v, {r}, dim={hd})")
    core = len(body)  # the attention itself starts here
    if einsum_bnhd:
        body.append("b, n, h, d = q.shape")
        body.append("m = k.shape[1]")
    else:
        body.append("b, h, n, d = q.shape")
        body.append("m = k.shape[-2]")

    if spec.scale_place == "q":
        body.append(f"q = {_scaled(spec, 'q')}")
    elif spec.scale_place == "split":
        body.append(f"q, k = {_scaled(spec, 'q', half=True)}, {_scaled(spec, 'k', half=True)}")

    # The score product.
    p = spec.product
    if p in ("bmm", "baddbmm"):
        body.append("q3, k3, v3 = q.reshape(b * h, n, -1), k.reshape(b * h, m, -1), v.reshape(b * h, m, -1)")
        if p == "bmm":
            body.append(f"s = torch.bmm(q3, {_key_t(spec, 'k3')})")
        else:
            if spec.model == "alibi":
                body.append(f"s = alibi.baddbmm(batch1=q3, batch2={_key_t(spec, 'k3')}, beta=1.0, alpha=1.0)")
            else:
                body.append(f"s = torch.baddbmm(torch.zeros(b * h, n, m, dtype=q.dtype), q3, {_key_t(spec, 'k3')}, beta=0.0, alpha=1.0)")
    elif p == "einsum":
        eq = "bnhd,bmhd->bhnm" if einsum_bnhd else "bhnd,bhmd->bhnm"
        body.append(f"s = torch.einsum(\"{eq}\", q, k)")
    else:
        kt = _key_t(spec, "k")
        body.append({"at": f"s = q @ {kt}", "matmul": f"s = torch.matmul(q, {kt})", "method": f"s = q.matmul({kt})"}[p])

    if spec.scale_place == "scores":
        if spec.scale != "none":
            body.append(_scale_line(spec))
    if spec.model == "softcap":
        cap = (2.0, 5.0, 30.0)[spec.seed % 3]
        body.append([f"s = torch.tanh(s / {cap!r}) * {cap!r}",
                     f"s = {cap!r} * torch.tanh(s * (1.0 / {cap!r}))",
                     f"s = (s / {cap!r}).tanh().mul({cap!r})"][(spec.seed // 3) % 3])
    views = spec.model in ("batch_views", "alibi")
    if views:
        body.append("s = s.view(b, h, n, m)")
    body.extend(_mask_lines(spec, 4 if views else spec.rank))
    if spec.scale_place == "after_mask":
        body.append(_scale_line(spec))

    hostile = spec.hostile
    if hostile == "scores_times_tensor":
        body.append("s = s * torch.linspace(0.5, 1.5, m, dtype=s.dtype)")
    elif hostile == "softcap":
        # Not c * tanh(s / c): 5 * tanh(s / 5) is the op's softcap (when
        # no mask comes before it), so the hostile form scales unevenly.
        body.append("s = torch.tanh(s / 5.0) * 4.0")
    elif hostile == "fill_finite":
        body.append("s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), -5.0)")

    if spec.cast == "float_type_as":
        body.append("s = s.float()")
    elif spec.cast == "to_float":
        body.append("s = s.to(torch.float32)")

    if spec.model.startswith("sinks"):
        body.append("sink = sinks.reshape(1, -1, 1, 1).expand(b, -1, n, -1)")
        body.append("s = torch.cat([s, sink], dim=-1)")
        if spec.model == "sinks_shift":
            body.append("s = s - s.max(dim=-1, keepdim=True).values")

    # The query dim, the first batch dim, or the batch dim: never the keys.
    dim = ("-2", "1", "0")[spec.seed % 3] if hostile == "softmax_dim" else "-1"
    body.append({
        "F": f"a = F.softmax(s, dim={dim})",
        "torch": f"a = torch.softmax(s, {dim})",
        "method": f"a = s.softmax(dim={dim})",
        "module": "a = self.softmax(s)" if dim == "-1" else f"a = F.softmax(s, dim={dim})",
        "F_dtype": f"a = F.softmax(s, dim={dim}, dtype=torch.float32)",
    }[spec.softmax])
    if spec.model.startswith("sinks"):
        body.append("a = a[..., :-1]" if spec.seed % 2 else "a = a[:, :, :, :-1]")
    if spec.cast == "float_type_as":
        body.append("a = a.type_as(q)")
    elif spec.cast == "to_float" or spec.softmax == "F_dtype":
        body.append("a = a.to(q.dtype)")
    if spec.dropout == "functional":
        body.append(f"a = F.dropout(a, p={spec.dropout_p!r}, training=self.training)")
    elif spec.dropout == "module":
        body.append("a = self.drop(a)")

    if views:
        body.append("a = a.view(b * h, n, m)")

    # The value product.
    if p in ("bmm", "baddbmm"):
        body.append("o = torch.bmm(a, v3).reshape(b, h, n, -1)")
    elif p == "einsum":
        eq = "bhnm,bmhd->bnhd" if einsum_bnhd else "bhnm,bhmd->bhnd"
        body.append(f"o = torch.einsum(\"{eq}\", a, v)")
    else:
        body.append({"at": "o = a @ v", "matmul": "o = torch.matmul(a, v)", "method": "o = a.matmul(v)"}[p])
    if hostile == "reuse_probs":
        if einsum_bnhd:
            body.append("o = o + a.mean(dim=-1).transpose(1, 2)[..., None]")
        elif spec.rank == 3:
            body.append("o = o + a.mean(dim=-1, keepdim=True).reshape(b, h, n, 1)")
        else:
            body.append("o = o + a.mean(dim=-1, keepdim=True)")
    if spec.twice:
        # The attention as a local function, called twice: the second call
        # reads the first one's output as its queries.
        extra = "".join(", " + a for a in args[3:])
        inner = [f"def attend(q, k, v{extra}):"] + ["    " + line for line in body[core:]] + ["    return o"]
        body[core:] = inner + [f"o = attend(q, k, v{extra})", f"o = attend(o, k, v{extra})"]
    if spec.out != "plain":
        if not einsum_bnhd:
            body.append("o = o.transpose(1, 2)")
        body.append("o = o.reshape(b, n, -1)" if spec.out == "merge_reshape" else "o = o.contiguous().view(b, n, -1)")
    ret = {"return_scores": "return o, s", "return_probs": "return o, a"}.get(hostile, "return o")
    body.append(ret)

    ind = "        "
    src = "class Program(nn.Module):\n    def __init__(self):\n"
    src += "".join(f"{ind}{line}\n" for line in init)
    src += f"\n    def forward(self, {', '.join(args)}):\n"
    src += "".join(f"{ind}{line}\n" for line in body)
    return src


HEADER = "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


def build(spec: Spec) -> torch.nn.Module:
    """An instance of the rendered ``Program``, in train or eval mode."""
    scope: dict = {}
    exec(compile(HEADER + render(spec), f"<fuzz program {spec.seed}>", "exec"), scope)  # noqa: S102
    mod = scope["Program"]()
    return mod.train(spec.train)


def make_inputs(spec: Spec) -> list[torch.Tensor]:
    """Deterministic inputs for the program (seeded by ``spec.seed``)."""
    g = torch.Generator().manual_seed(spec.seed)
    dt = spec.torch_dtype
    B, H, Hkv, N, M = spec.B, spec.H, spec.Hkv, spec.N, spec.M

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dt)

    if spec.layout == "bnhd":
        q, k, v = t(B, N, H, spec.D), t(B, M, Hkv, spec.D), t(B, M, Hkv, spec.Dv)
    else:
        q, k, v = t(B, H, N, spec.D), t(B, Hkv, M, spec.D), t(B, Hkv, M, spec.Dv)
    inputs = [q, k, v]
    if spec.mask in INPUT_MASKS:
        shape = {"nm": (N, M), "11nm": (1, 1, N, M), "b1nm": (B, 1, N, M), "bhnm": (B, H, N, M),
                 "b11m": (B, 1, 1, M), "b1n1": (B, 1, N, 1), "1nm": (1, N, M)}[spec.mask_shape]
        keep = torch.rand(*shape, generator=g) > 0.4
        # At least one visible key per row: key i % M for query row i (or
        # key 0 for a key-padding mask), in every broadcast slice.
        if shape[-1] == 1:
            keep[:] = True
        elif shape[-2] == 1:
            keep[..., 0] = True
        else:
            rows = torch.arange(N)
            keep[..., rows, rows % M] = True
        if spec.mask == "bool":
            mask = keep
        elif spec.mask == "add_neg_inf":
            mask = torch.zeros(shape).masked_fill(~keep, float("-inf")).to(dt)
        else:
            mask = (torch.randn(*shape, generator=g) * 2).to(dt)
        inputs.append(mask)
    if spec.mask == "padding":
        pad = (torch.rand(B, M, generator=g) > 0.3).to(dt)
        pad[:, 0] = 1
        inputs.append(pad)
    if spec.model.startswith("sinks"):
        inputs.append(t(H))
    if spec.model == "alibi":  # slopes times key positions, one row per (batch, head)
        slopes = torch.rand(B * H, 1, 1, generator=g) * 0.5
        inputs.append((slopes * torch.arange(M, dtype=torch.float32)[None, None, :]).to(dt))
    if spec.train:
        for x in inputs:
            if x.dtype.is_floating_point and spec.mask != "add_neg_inf" and spec.mask != "padding":
                x.requires_grad_(True)
        for x in inputs[:3]:
            x.requires_grad_(True)
        if spec.model.startswith("sinks"):
            inputs[-1].requires_grad_(True)  # the sinks are learned
    return inputs


def repro(spec: Spec) -> str:
    """A self-contained snippet: imports, the program, and its inputs."""
    return (
        HEADER + "\n\n" + render(spec)
        + "\n\n# inputs: tests.fuzz.programs.make_inputs(spec) with\n"
        + textwrap.fill(f"spec = {spec!r}", width=100, subsequent_indent="    ") + "\n"
    )
