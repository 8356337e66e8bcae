"""Hostile and bad input to every public entry point.

The op must refuse what it cannot compute with an error that names the
argument and the fix; the backend must compile and run, unchanged, any model
whose attention the pass cannot prove; ``explain`` must report rather than
fail; the Hugging Face hook must refuse what a fused kernel cannot serve.
(tests/test_ops.py covers the basic op checks: ranks, shapes, dtypes, mask
shape and dtype, dropout range, windows, alignment; they are not repeated.)
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import flashfuse
import flashfuse.fx
from flashfuse.backend import make_backend

OP = torch.ops.flashfuse.attention.default


pytestmark = pytest.mark.usefixtures("blockwise_cpu", "fresh_dynamo")


def _qkv(B=1, H=2, N=4, M=5, D=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, H, N, D, generator=g), torch.randn(B, H, M, D, generator=g), torch.randn(B, H, M, D, generator=g)


def _explain():
    """The public ``explain`` (``flashfuse.explain`` once exported)."""
    return getattr(flashfuse, "explain", None) or flashfuse.fx.explain


# ---------------------------------------------------------------------------
# The op: arguments of the wrong type or value
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(query=[[1.0]]), "query"),
        (dict(key="k"), "key"),
        (dict(value=3.0), "value"),
        (dict(attn_mask=[[True]]), "attn_mask"),
        (dict(scale="0.5"), "scale"),
        (dict(dropout_p="0.1"), "dropout_p"),
        (dict(is_causal="yes"), "is_causal"),
        (dict(window_left=2.5), "window_left"),
        (dict(window_right="0"), "window_right"),
        (dict(alignment=1), "alignment"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_arguments_of_the_wrong_type_name_the_argument(kwargs, argument):
    q, k, v = _qkv()
    args = dict(query=q, key=k, value=v)
    args.update(kwargs)
    with pytest.raises((TypeError, RuntimeError), match=f"argument '{argument}'"):
        flashfuse.attention(**args)


def test_numpy_input_is_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises((TypeError, RuntimeError), match="argument 'query'.*ndarray"):
        flashfuse.attention(q.numpy(), k, v)


@pytest.mark.parametrize("p", [float("nan"), float("inf"), -float("inf"), 1.0 + 1e-9])
def test_dropout_outside_unit_interval_is_refused(p):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        flashfuse.attention(q, k, v, dropout_p=p)


def test_mask_on_another_device_is_refused():
    q, k, v = _qkv()
    mask = torch.ones(4, 5, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="attn_mask is on meta but query is on cpu"):
        flashfuse.attention(q, k, v, mask)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.uint8])
def test_non_float_inputs_are_refused_listing_supported_dtypes(dtype):
    q, k, v = (t.to(dtype) for t in _qkv())
    with pytest.raises(ValueError, match="not supported.*float16, bfloat16, float32"):
        flashfuse.attention(q, k, v)


def test_zero_key_heads_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"multiple of key/value heads \(0\)"):
        flashfuse.attention(q, k[:, :0], v[:, :0], enable_gqa=True)


@pytest.mark.parametrize("shape", [(4, 1, 5), (3, 4, 5), (1, 1, 1, 4, 5)])
def test_mask_that_does_not_broadcast_names_the_target_shape(shape):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"does not broadcast to .* = \(1, 2, 4, 5\)"):
        flashfuse.attention(q, k, v, torch.zeros(shape))


@pytest.mark.parametrize("D", [0, 1, 15, 257, 512])
def test_unsupported_head_dims_say_the_supported_range(D):
    q = torch.randn(1, 1, 3, D)
    with pytest.raises(ValueError, match=f"head dim {D} is not supported.*16 to 256"):
        flashfuse.attention(q, q, q)


def test_scalar_tensors_for_number_arguments_are_read_as_numbers():
    """A 0-d tensor for scale or dropout_p is a number, as with SDPA."""
    q, k, v = _qkv()
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.5)
    torch.testing.assert_close(flashfuse.attention(q, k, v, scale=torch.tensor(0.5)), ref)
    torch.testing.assert_close(flashfuse.attention(q, k, v, dropout_p=torch.tensor(0.0)),
                               F.scaled_dot_product_attention(q, k, v))


def test_empty_batch_and_empty_queries_give_empty_results():
    q, k, v = _qkv()
    assert flashfuse.attention(q[:0], k[:0], v[:0]).shape == (0, 2, 4, 16)
    assert flashfuse.attention(q[:, :, :0], k, v).shape == (1, 2, 0, 16)


def test_stride_zero_queries_are_read_correctly():
    q, k, v = _qkv()
    q0 = q[:, :, :1].expand(1, 2, 4, 16)  # every query row aliases row 0
    torch.testing.assert_close(flashfuse.attention(q0, k, v), F.scaled_dot_product_attention(q0, k, v))


def test_sparse_input_is_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sparse"):
        flashfuse.attention(q.to_sparse(), k, v)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_non_finite_scale_is_refused(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale"):
        flashfuse.attention(q, k, v, scale=scale)


# ---------------------------------------------------------------------------
# The backend and the pass: models the pass cannot handle run unchanged
# ---------------------------------------------------------------------------


def softmax_of_an_input(x, v):
    return torch.softmax(x, dim=-1) @ v


def softmax_over_implicit_dim(q, k, v):
    return F.softmax(q @ k.mT, dim=None) @ v  # noqa: deprecated implicit dim, picks dim 1


def probabilities_mutated_in_place(q, k, v):
    p = torch.softmax(q @ k.mT * 0.25, dim=-1)
    p.mul_(2.0)
    return p @ v


def query_mutated_between_products(q, k, v):
    q = q.clone()
    s = q @ k.mT * 0.25
    q.add_(1.0)  # the op would read the mutated q
    return torch.softmax(s, dim=-1) @ v + q.sum()


def data_dependent_branch(q, k, v):
    s = q @ k.mT * 0.25
    if s.sum() > 0:  # a graph break between the products
        s = s * 2.0
    return torch.softmax(s, dim=-1) @ v


def head_dim_too_large(q, k, v):
    q, k, v = (torch.cat([t] * 20, dim=-1) for t in (q, k, v))  # D = 320
    return torch.softmax(q @ k.mT, dim=-1) @ v


def value_first_product(q, k, v):
    p = torch.softmax(q @ k.mT * 0.25, dim=-1)
    return (v.mT @ p.mT).mT  # the same result, probabilities on the right


def float64_attention(q, k, v):
    q, k, v = q.double(), k.double(), v.double()
    return (torch.softmax(q @ k.mT * 0.25, dim=-1) @ v).float()


def two_softmaxes_share_scores(q, k, v):
    s = q @ k.mT * 0.25
    return torch.softmax(s, dim=-1) @ v + torch.softmax(s * 2.0, dim=-1) @ v


HOSTILE_MODELS = [
    (softmax_of_an_input, 0),
    (softmax_over_implicit_dim, 0),
    (probabilities_mutated_in_place, 0),
    (query_mutated_between_products, 0),
    (data_dependent_branch, None),  # graph breaks: either graph may hold the pattern
    (head_dim_too_large, 0),
    (value_first_product, 0),
    (float64_attention, 0),
    (two_softmaxes_share_scores, 0),
]


def _inputs_for(fn):
    q, k, v = _qkv()
    if fn is softmax_of_an_input:
        return [torch.randn(1, 2, 4, 5), v]
    return [q, k, v]


class _Counter:
    def __init__(self):
        self.ops = 0

    def __call__(self, gm, example_inputs):
        self.ops += sum(n.target is OP for n in gm.graph.nodes)
        return gm.forward


@pytest.mark.parametrize("fn,expected", HOSTILE_MODELS, ids=[f.__name__ for f, _ in HOSTILE_MODELS])
def test_models_the_pass_cannot_handle_run_unchanged(fn, expected):
    inputs = _inputs_for(fn)
    ref = fn(*[t.clone() for t in inputs])
    counter = _Counter()
    backend = make_backend(compiler=counter, record=True)
    out = torch.compile(fn, backend=backend)(*[t.clone() for t in inputs])
    torch.testing.assert_close(out, ref)
    if expected is not None:
        assert counter.ops == expected, [c.reason for c in backend.candidates]
    for cand in backend.candidates:
        if not cand.rewritten:
            assert cand.reason, "a refused candidate must say why"


def test_default_backend_compiles_a_model_it_cannot_rewrite():
    """The default (Inductor) backend: a refused pattern still compiles and
    gives eager's result."""
    from flashfuse.backend import backend

    q, k, v = _qkv()
    out = torch.compile(softmax_over_implicit_dim, backend=backend)(q, k, v)
    torch.testing.assert_close(out, softmax_over_implicit_dim(q, k, v))


def test_backend_by_name_is_registered():
    q, k, v = _qkv()
    fn = lambda q, k, v: torch.softmax(q @ k.mT * 0.25, -1) @ v  # noqa: E731
    out = torch.compile(fn, backend=make_backend(compiler="eager"))(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v))
    assert "flashfuse" in torch._dynamo.list_backends()


def test_model_errors_surface_unchanged_through_the_backend():
    """A shape error in the user's model is the model's error, not ours."""
    q, k, v = _qkv()
    fn = lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v  # noqa: E731
    with pytest.raises(Exception, match="size|shape"):
        torch.compile(fn, backend=make_backend(compiler="eager"))(q, k[..., :8], v)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(compiler=42), TypeError, "compiler must be a name or a callable, got int"),
        (dict(compiler="flashfuse"), ValueError, "cannot be flashfuse itself"),
        (dict(compiler="eager", options={"max_autotune": True}), ValueError, "only understood by the inductor"),
        (dict(compiler="aot_eager", options={"max_autotune": True}), ValueError, "only understood by the inductor"),
        (dict(compiler="no-such-compiler"), Exception, "no-such-compiler"),
    ],
    ids=["not-callable", "itself", "eager-options", "aot-options", "unknown-name"],
)
def test_make_backend_refuses_bad_compilers(kwargs, error, message):
    with pytest.raises(error, match=message):
        make_backend(**kwargs)


# ---------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------


def test_explain_reports_refusals_with_reasons_and_runs_the_model_unchanged():
    explain = _explain()
    q, k, v = _qkv()
    result = explain(softmax_over_implicit_dim, q, k, v, print_table=False)
    assert result.rewritten == 0 and len(result.rows) == 1
    assert "dim" in result.rows[0].reason
    assert "0 of 1" in result.table()


def test_explain_of_a_model_without_attention_says_so():
    explain = _explain()
    result = explain(lambda x: torch.relu(x) * 2, torch.randn(3), print_table=False)
    assert result.rows == [] and "0 of 0" in str(result)


def test_explain_of_a_non_callable_names_the_problem():
    explain = _explain()
    with pytest.raises((TypeError, AssertionError), match="callable"):
        explain(42, torch.randn(3), print_table=False)


def test_explain_surfaces_the_models_own_error():
    explain = _explain()
    q, k, v = _qkv()
    with pytest.raises(Exception, match="size|shape"):
        explain(lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v, q, k[..., :8], v, print_table=False)


# ---------------------------------------------------------------------------
# The Hugging Face hook (only when transformers is installed)
# ---------------------------------------------------------------------------


class _Layer(torch.nn.Module):
    """The attributes the hook reads from an attention layer."""

    is_causal = True
    config = None


def _hf():
    return pytest.importorskip("flashfuse.hf", reason="transformers is not installed")


def test_hf_hook_refuses_heads_that_do_not_group():
    hf = _hf()
    q = torch.randn(1, 3, 4, 16)
    k = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        hf.flashfuse_attention_forward(_Layer(), q, k, k, None)


@pytest.mark.parametrize("flag", ["s_aux", "sinks"])
def test_hf_hook_checks_attention_sinks(flag):
    """Sinks are served (tests/test_hf_capsink.py); sinks that are not one
    per query head get the op's error naming the shape."""
    hf = _hf()
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"sinks must have shape \(query_heads,\) = \(2,\)"):
        hf.flashfuse_attention_forward(_Layer(), q, q, q, None, **{flag: torch.zeros(3)})


def test_hf_hook_refuses_bad_value_head_dim():
    hf = _hf()
    q = torch.randn(1, 2, 4, 16)
    v = torch.randn(1, 2, 4, 300)
    with pytest.raises(ValueError, match="values: 300.*attn_implementation='sdpa'"):
        hf.flashfuse_attention_forward(_Layer(), q, q, v, None)


def test_hf_hook_passes_bad_masks_to_the_op_checks():
    """A mask of the wrong shape reaches the op, whose error names it."""
    hf = _hf()
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="attn_mask of shape"):
        hf.flashfuse_attention_forward(_Layer(), q, q, q, torch.ones(3, 3, dtype=torch.bool))
