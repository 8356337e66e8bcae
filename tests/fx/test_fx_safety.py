"""The pass must never change what a model computes: graphs it cannot prove
are left exactly as they are (no op inserted, same outputs as eager)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fxutil import compile_and_compare, qkv

SCALE = 0.25


def softmax_over_queries(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-2) @ v


def probs_returned(q, k, v):
    p = F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1)
    return p @ v, p


def scores_reused(q, k, v):
    s = q @ k.transpose(-2, -1) * SCALE
    return F.softmax(s, dim=-1) @ v + s.mean()


def probs_masked_after_softmax(q, k, v):
    p = F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1)
    p = p.masked_fill(torch.ones_like(p, dtype=torch.bool).triu(1), 0.0)
    return p @ v


def fill_with_zero(q, k, v):
    n = q.size(-2)
    s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), 0.0)
    return s.softmax(-1) @ v


def fill_with_small_negative(q, k, v):
    n = q.size(-2)
    s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -5.0)
    return s.softmax(-1) @ v


def scores_times_tensor(q, k, v):
    s = q @ k.transpose(-2, -1) * SCALE
    w = torch.linspace(0.5, 1.5, s.shape[-1])
    return F.softmax(s * w, dim=-1) @ v


def mask_enlarges_scores(q, k, v):
    # q has one batch row; the mask broadcasts the scores to two.
    s = q[:1] @ k[:1].transpose(-2, -1) * SCALE
    bias = torch.zeros(2, 1, 1, s.shape[-1])
    return F.softmax(s + bias, dim=-1) @ v[:1]


def probs_right_operand(q, k, v):
    p = F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1)
    return v.transpose(-2, -1) @ p


def inplace_between_products(q, k, v):
    q = q.clone()
    p = F.softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1)
    q.mul_(2.0)
    return p @ v + q


def five_dim_batch(q, k, v):
    q5, k5, v5 = (t.unsqueeze(0) for t in (q, k, v))
    return F.softmax(q5 @ k5.transpose(-2, -1) * SCALE, dim=-1) @ v5


def log_softmax_not_softmax(q, k, v):
    return F.log_softmax(q @ k.transpose(-2, -1) * SCALE, dim=-1).exp() @ v


def _packed_segments(pos):
    b, n = pos.shape
    segment = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    bi = torch.arange(b)[:, None, None, None]
    qi = torch.arange(n)[None, None, :, None]
    ki = torch.arange(n)[None, None, None, :]
    return (ki <= qi) & (segment[bi, qi] == segment[bi, ki])


def packed_segments_of_one(q, k, v):
    # Positions step by 2: every token starts a segment, so each query sees
    # only itself. Not causal; must stay a mask.
    pos = (torch.arange(q.size(-2)) * 2).expand(q.size(0), -1)
    s = q @ k.transpose(-2, -1) * SCALE
    return torch.where(_packed_segments(pos), s, float("-inf")).softmax(-1) @ v


def packed_segments_prepend_off_by_one(q, k, v):
    # The prepended value breaks the step: the first diff is 0, not 1.
    n = q.size(-2)
    pos = torch.arange(n).expand(q.size(0), -1)
    segment = (torch.diff(pos, prepend=pos[:, :1], dim=-1) != 1).cumsum(-1)
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = (ki <= qi) & (segment[:, None, :, None] == segment[:, None, None, :])
    s = q @ k.transpose(-2, -1) * SCALE
    return torch.where(keep, s, float("-inf")).softmax(-1) @ v


NEGATIVE_MASKS = [packed_segments_of_one, packed_segments_prepend_off_by_one]


@pytest.mark.parametrize("fn", NEGATIVE_MASKS, ids=lambda f: f.__name__)
def test_unproven_masks_stay_tensors(fn):
    """Rewritten, but with the mask passed as a tensor: outputs match eager."""
    _, backend = compile_and_compare(fn, *qkv(d=16), expect=1)
    assert backend.candidates[0].facts.get("causal") is None, backend.candidates[0].facts


def test_out_of_bounds_gather_still_raises():
    """Gathering from a constant with an index past its end is an error in
    eager; the mask proof must not make that error disappear."""

    def fn(q, k, v):
        n = q.size(-2)
        zeros = torch.zeros(q.size(0), n, dtype=torch.long)
        qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = (ki <= qi) & (zeros[:, None, qi + 1, None] == 0)[..., 0]
        s = q @ k.transpose(-2, -1) * SCALE
        return torch.where(keep, s, float("-inf")).softmax(-1) @ v

    q, k, v = qkv(d=16, grad=False)
    with pytest.raises(IndexError):
        fn(q, k, v)
    from flashfuse.backend import make_backend

    with pytest.raises(Exception, match="out of bounds|index"):
        torch.compile(fn, backend=make_backend(compiler="eager"))(q, k, v)


NEGATIVE = [
    softmax_over_queries, probs_returned, scores_reused, probs_masked_after_softmax,
    fill_with_zero, fill_with_small_negative, scores_times_tensor,
    mask_enlarges_scores, probs_right_operand, inplace_between_products,
    log_softmax_not_softmax,
]


def test_five_dim_batch_folded():
    # A third batch dim is folded into the op's batch, exactly (see
    # test_fx_batch_fold.py), where it used to be left alone.
    compile_and_compare(five_dim_batch, *qkv(d=16), expect=1, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", NEGATIVE, ids=lambda f: f.__name__)
def test_left_unchanged(fn):
    # Eager cannot differentiate through the in-place case; compare forward only.
    grad = fn is not inplace_between_products
    compile_and_compare(fn, *qkv(d=16, grad=grad), expect=0)


@pytest.mark.parametrize(
    "kwargs,why",
    [
        (dict(d=8), "head size 8"),
        (dict(d=512), "head size 512"),
        (dict(d=16, dtype=torch.float64), "dtype torch.float64"),
    ],
    ids=["head_dim_8", "head_dim_512", "float64"],
)
def test_unsupported_shapes_and_dtypes(kwargs, why):
    def fn(q, k, v):
        return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v

    _, backend = compile_and_compare(fn, *qkv(**kwargs), expect=0)
    assert why in backend.candidates[0].reason


def test_non_transpose_permutation_is_still_exact():
    """A key permuted some other way is never mistaken for a transposed key:
    the op's key is always the right operand transposed back, so the result
    is eager's whatever the permutation."""

    def fn(q, k, v):
        # k is (B, H, D, M) already; swap batch and heads as well.
        return F.softmax(q @ k.permute(1, 0, 3, 2).transpose(-2, -1).transpose(-2, -1).permute(1, 0, 2, 3)
                         * SCALE, dim=-1) @ v

    q, k, v = qkv(d=16)
    kt = k.detach().transpose(-2, -1).contiguous().requires_grad_()
    compile_and_compare(fn, q, kt.transpose(-2, -1).detach().clone().requires_grad_(), v, expect=1)


def test_fully_masked_rows_documented_difference():
    """Rows with every key masked are the one documented difference: eager
    gives NaN for -inf masks, the op gives 0. Other rows are equal."""

    def fn(q, k, v, keep):
        s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(~keep, float("-inf"))
        return s.softmax(-1) @ v

    q, k, v = qkv(d=16, grad=False)
    keep = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    keep[0, :, 3] = False  # query row 3 of batch 0 sees nothing
    from flashfuse.backend import make_backend

    out = torch.compile(fn, backend=make_backend(compiler="eager"))(q, k, v, keep)
    ref = fn(q, k, v, keep)
    assert torch.isnan(ref[0, :, 3]).all() and (out[0, :, 3] == 0).all()
    rows = torch.ones(8, dtype=torch.bool)
    rows[3] = False
    torch.testing.assert_close(out[0][:, rows], ref[0][:, rows])
    torch.testing.assert_close(out[1], ref[1])


# ---------------------------------------------------------------------------
# In-place ops on the pattern's inputs. Inputs arrive as (B, N, H, D) leaves,
# so every function works on views or copies that may be written in place.


def _heads(x):
    return x.transpose(1, 2)


def contiguous_then_mul_(x, k, v):
    q = _heads(x).contiguous()  # a copy: writing it leaves x alone
    q.mul_(SCALE)
    return F.softmax(q @ _heads(k).transpose(-2, -1), dim=-1) @ _heads(v)


def contiguous_mul_chained(x, k, v):
    q = _heads(x).contiguous().mul_(SCALE)
    return F.softmax(q @ _heads(k).transpose(-2, -1), dim=-1) @ _heads(v)


def scaled_then_mul_(x, k, v):
    q = _heads(x) * SCALE
    q.mul_(2.0)
    return F.softmax(q @ _heads(k).transpose(-2, -1), dim=-1) @ _heads(v)


def operator_imul(x, k, v):
    q = _heads(x).contiguous()
    q *= SCALE
    return F.softmax(q @ _heads(k).transpose(-2, -1), dim=-1) @ _heads(v)


def tensor_mul_function(x, k, v):
    q = _heads(x).contiguous()
    torch.Tensor.mul_(q, SCALE)
    return F.softmax(q @ _heads(k).transpose(-2, -1), dim=-1) @ _heads(v)


def k_add_v_div(x, k, v):
    k, v = _heads(k).contiguous(), _heads(v).contiguous()
    k.add_(0.5)
    v.div_(3.0)
    return F.softmax(_heads(x) @ k.transpose(-2, -1) * SCALE, dim=-1) @ v


def q_copy_(x, k, v):
    q = _heads(x).contiguous()
    q.copy_(_heads(x) * 2.0)
    return F.softmax(q @ _heads(k).transpose(-2, -1) * SCALE, dim=-1) @ _heads(v)


def q_setitem(x, k, v):
    q = _heads(x).clone()
    q[:, :, 0] = 0.0
    return F.softmax(q @ _heads(k).transpose(-2, -1) * SCALE, dim=-1) @ _heads(v)


def q_index_put_(x, k, v):
    q = _heads(x).contiguous()
    q.index_put_((torch.tensor([1]),), torch.zeros(()))
    return F.softmax(q @ _heads(k).transpose(-2, -1) * SCALE, dim=-1) @ _heads(v)


def scale_tensor_mul_(x, k, v):
    scale = torch.tensor(SCALE)
    scale.mul_(2.0)
    return F.softmax(_heads(x) @ _heads(k).transpose(-2, -1) * scale, dim=-1) @ _heads(v)


def scores_masked_fill_(x, k, v):
    # The recognised spelling: the in-place fill is part of the pattern.
    n = x.size(1)
    s = _heads(x) @ _heads(k).transpose(-2, -1) * SCALE
    s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ _heads(v)


def causal_mask_edited_in_place(x, k, v):
    # Built as a causal mask, then every query is allowed key 0 as well: not
    # causal any more, so it must stay a tensor.
    n = x.size(1)
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    keep[:, 0] = True
    keep[1:, 1] = False
    s = _heads(x) @ _heads(k).transpose(-2, -1) * SCALE
    return s.masked_fill(~keep, float("-inf")).softmax(-1) @ _heads(v)


def q_mutated_after_the_chain(x, k, v):
    q = _heads(x).clone()
    out = F.softmax(q @ _heads(k).transpose(-2, -1) * SCALE, dim=-1) @ _heads(v)
    q.mul_(3.0)  # after the op has read q
    return out, q


MUTATED_BEFORE = [
    contiguous_then_mul_, contiguous_mul_chained, scaled_then_mul_, operator_imul, tensor_mul_function,
    k_add_v_div, q_copy_, q_setitem, q_index_put_, scale_tensor_mul_, scores_masked_fill_,
    causal_mask_edited_in_place, q_mutated_after_the_chain,
]


def _bnhd(n=8, h=4, d=16, seed=0, grad=True):
    q, k, v = qkv(h=h, n=n, d=d, seed=seed, grad=False)
    return [t.transpose(1, 2).contiguous().requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("fn", MUTATED_BEFORE, ids=lambda f: f.__name__)
def test_mutation_before_the_chain_is_read_after_it(fn):
    """An in-place op that runs before the pattern reads a tensor is just a
    new value: the op is fed the written tensor, forward and gradients
    match eager."""
    # Eager cannot differentiate through q written after the product read it.
    grad = fn is not q_mutated_after_the_chain
    _, backend = compile_and_compare(fn, *_bnhd(n=7, grad=grad), expect=1, grad=grad)
    if fn is causal_mask_edited_in_place:
        assert backend.candidates[0].facts.get("causal") is None, backend.candidates[0].facts


def product_then_k_mutated(x, k, v):
    k = _heads(k).contiguous()
    s = _heads(x) @ k.transpose(-2, -1) * SCALE
    k.mul_(2.0)  # after the product read k, before the softmax
    return F.softmax(s, dim=-1) @ _heads(v)


def k_mutated_through_a_view(x, k, v):
    k = _heads(k).clone()
    kt = k.transpose(-2, -1)
    k[:, :, :, 0].mul_(0.0)  # writes kt's memory through another view
    return F.softmax(_heads(x) @ kt * SCALE, dim=-1) @ _heads(v)


def scaled_q_then_q_mutated(x, k, v):
    q = _heads(x).clone()
    qs = q * SCALE  # peeled: the op would read q itself
    q.mul_(3.0)
    return F.softmax(qs @ _heads(k).transpose(-2, -1), dim=-1) @ _heads(v)


def scaled_q_then_view_mutated(x, k, v):
    q = _heads(x).clone()
    qs = q * SCALE
    q[:, :, 1:].zero_()
    return F.softmax(qs @ _heads(k).transpose(-2, -1), dim=-1) @ _heads(v)


MUTATION_TRAPS = [product_then_k_mutated, k_mutated_through_a_view, scaled_q_then_q_mutated,
                  scaled_q_then_view_mutated]


@pytest.mark.parametrize("fn", MUTATION_TRAPS, ids=lambda f: f.__name__)
def test_subtle_mutations_are_left_alone(fn):
    """Writes the op cannot reproduce by reading its inputs later are refused,
    with a reason naming the in-place op. (Forward only: eager cannot
    differentiate through most of these.)"""
    _, backend = compile_and_compare(fn, *_bnhd(n=7, grad=False), expect=0)
    reason = backend.candidates[0].reason
    assert "in place" in reason or "in-place" in reason, reason
    assert "left alone" in reason, reason


def test_explain_names_the_mutation():
    from flashfuse.fx import explain

    rows = explain(scaled_q_then_q_mutated, *_bnhd(n=7, grad=False), print_table=False).rows
    assert len(rows) == 1 and not rows[0].rewritten
    assert "mutated in place by .mul_()" in rows[0].reason and "q.mul_(3.0)" in rows[0].reason, rows[0].reason


# ---------------------------------------------------------------------------
# Finite fills: rows a finite value hides entirely. Eager averages such a row
# over all its keys and passes q and k no gradient through the filled
# entries; the op does that only when given mask_fill (its bool mask's
# hidden scores replaced by that value). The end-to-end tests below expect a
# rewrite once the op takes mask_fill, and are left alone (still matching
# eager) before.

MIN = torch.finfo(torch.float32).min


def _left_padded_keep(b=2, n=7, pads=(0, 3)):
    """Causal and left padding (as Hugging Face builds it for MPT-like
    models): the first pads[b] rows of batch b see no key."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = torch.stack([(j <= i) & (j >= p) for p in pads])[:, None]
    assert not keep[1, 0, 0].any()  # a fully hidden row
    return keep


def fill_finfo_min(q, k, v, keep):
    s = q @ k.transpose(-2, -1) * SCALE
    return s.masked_fill(~keep, torch.finfo(s.dtype).min).softmax(-1) @ v


def where_finfo_min(q, k, v, keep):
    s = q @ k.transpose(-2, -1) * SCALE
    return torch.where(keep, s, torch.finfo(s.dtype).min).softmax(-1) @ v


def fill_minus_1e4(q, k, v, keep):
    return (q @ k.transpose(-2, -1) * SCALE).masked_fill(~keep, -1e4).softmax(-1) @ v


def strict_causal_finfo_min(q, k, v, keep):
    # j < i: the first row sees nothing; a band, but not a window to convert.
    n = q.size(-2)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    s = q @ k.transpose(-2, -1) * SCALE
    return s.masked_fill(j >= i, torch.finfo(s.dtype).min).softmax(-1) @ v


FINITE_FILLS = [fill_finfo_min, where_finfo_min, fill_minus_1e4, strict_causal_finfo_min]


@pytest.mark.parametrize("fn", FINITE_FILLS, ids=lambda f: f.__name__)
def test_finite_fill_fully_hidden_rows(fn):
    """Forward and gradients match eager on rows the fill hides entirely.
    Rewritten, with the fill as the op's mask_fill."""
    q, k, v = qkv(n=7, d=16)
    keep = _left_padded_keep()
    _, backend = compile_and_compare(fn, q, k, v, keep, expect=1)
    cand = backend.candidates[0]
    assert cand.facts.get("causal") is None and cand.facts.get("window") is None, cand.facts
    assert cand.facts["mask"] == "bool" and math.isfinite(cand.facts["mask_fill"]), cand.facts


def _captured(fn, *inputs):
    """The Dynamo graph of ``fn`` and its example inputs, not compiled."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=capture)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


@pytest.mark.parametrize(
    "fn,fill",
    [(fill_finfo_min, MIN), (where_finfo_min, MIN), (fill_minus_1e4, -1e4), (strict_causal_finfo_min, MIN)],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_finite_fill_emits_mask_fill(fn, fill):
    """The op call the pass emits for a finite fill: a bool mask, mask_fill
    in the op's score units, no is_causal or window; nothing is run."""
    from flashfuse.fx import FlashAttentionPass

    gm, example_inputs = _captured(fn, *qkv(n=7, d=16, grad=False), _left_padded_keep())
    cands = FlashAttentionPass(example_inputs)(gm)
    assert [c.rewritten for c in cands] == [True], [c.reason for c in cands]
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.flashfuse.attention.default]
    assert call.kwargs["mask_fill"] == fill
    assert call.kwargs["is_causal"] is False and call.kwargs["window_right"] is None
    assert call.kwargs["window_left"] is None
    mask = call.kwargs["attn_mask"]
    assert mask is not None and mask.meta["example_value"].dtype == torch.bool


def causal_finfo_min(q, k, v):
    # j <= i: every row keeps its diagonal, so the fill never decides a row.
    n = q.size(-2)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    s = q @ k.transpose(-2, -1) * SCALE
    return s.masked_fill(j > i, torch.finfo(s.dtype).min).softmax(-1) @ v


def test_finite_fill_with_rows_kept_becomes_causal():
    _, backend = compile_and_compare(causal_finfo_min, *qkv(n=7, d=16), expect=1)
    assert backend.candidates[0].facts.get("causal") == "top-left"
    assert "mask_fill" not in backend.candidates[0].facts


def strict_causal_additive_finfo_min(q, k, v):
    n = q.size(-2)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    bias = torch.zeros(n, n).masked_fill(j >= i, torch.finfo(torch.float32).min)
    return (q @ k.transpose(-2, -1) * SCALE + bias).softmax(-1) @ v


def test_finite_additive_band_with_an_empty_row_stays_a_mask():
    """An additive finfo.min band whose first row is empty is not a window:
    it stays a float mask (eager averages that row). Forward only here: the
    op's backward for such rows is fixed with the kernels."""
    _, backend = compile_and_compare(strict_causal_additive_finfo_min, *qkv(n=7, d=16, grad=False), expect=1)
    facts = backend.candidates[0].facts
    assert facts.get("causal") is None and facts.get("window") is None and facts["mask"] == "additive", facts


def bias_then_finite_fill(q, k, v, keep, bias):
    s = q @ k.transpose(-2, -1) * SCALE + bias  # e.g. ALiBi, then the padding fill
    return s.masked_fill(~keep, torch.finfo(s.dtype).min).softmax(-1) @ v


def test_finite_fill_with_additive_bias_is_left_alone():
    q, k, v = qkv(n=7, d=16)
    bias = torch.randn(1, 4, 7, 7)
    _, backend = compile_and_compare(bias_then_finite_fill, q, k, v, _left_padded_keep(), bias, expect=0)
    assert "additive mask" in backend.candidates[0].reason


class UnbindQKVWithInplaceBias(torch.nn.Module):
    """timm's Swin-v2 spelling: q, k, v from one ``unbind`` (a node whose value
    is a tuple, not a tensor) and a bias MLP with an in-place ReLU between the
    two products."""

    def __init__(self, h=2, n=7, d=16):
        super().__init__()
        self.h, self.d = h, d
        self.qkv = torch.nn.Linear(h * d, 3 * h * d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, h))
        self.register_buffer("coords", torch.randn(n, n, 2))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        s = q @ k.transpose(-2, -1) * SCALE
        s = s + self.mlp(self.coords).permute(2, 0, 1)
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)


def test_inplace_private_write_after_a_tuple_node():
    """A non-tensor node (the unbind's tuple) before the in-place write must
    not break the private-write check: rewritten, gradients match."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, requires_grad=True)
    _, backend = compile_and_compare(UnbindQKVWithInplaceBias(), x, expect=1)
    assert all(c.rewritten for c in backend.candidates), [c.reason for c in backend.candidates]
