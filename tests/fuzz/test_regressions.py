"""Programs the fuzzer found (shrunk by hypothesis and pasted here), and the
documented differences it must not report.

Each test names what was found. Programs are plain source, as the fuzzer
prints them, so they read as what a user could have written.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from .harness import CountingCompiler, assert_close, run_differential
from .programs import Spec

from flashfuse.backend import make_backend


pytestmark = pytest.mark.usefixtures("blockwise_cpu", "fresh_dynamo")


def _compile(fn, dynamic=False):
    counter = CountingCompiler("eager")
    backend = make_backend(compiler=counter, record=True)
    counter.backend = backend
    return torch.compile(fn, backend=backend, dynamic=dynamic), counter


def _qkv(B=1, H=2, N=5, M=5, D=16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, s, D, generator=g).requires_grad_(grad) for s in (N, M, M)]


# ---------------------------------------------------------------------------
# Found by the fuzzer


def finfo_min_then_symbolic_scale(q, k, v):
    # Shrunk from a long-profile failure (twice=True, repeat_kv, N = M = 1).
    n, m = q.size(-2), k.size(-2)
    s = q @ k.transpose(-2, -1)
    causal = torch.tril(torch.ones(n, m, device=s.device))
    s = torch.where(causal.bool(), s, torch.finfo(s.dtype).min)
    s = s / math.sqrt(q.size(-1))
    return F.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("dynamic", [False, True])
def test_finfo_min_fill_then_scale_by_symbolic_sqrt(dynamic):
    """Found: under ``dynamic=True`` the pass leaves this causal attention
    alone ("masked_fill with -3.4e38 does not remove positions"): the scale
    after the fill is ``1/sqrt(SymInt)``, which the pass cannot bound, so it
    cannot prove the fill still hides. A missed rewrite, never a wrong
    answer: the result must equal eager either way, and with static shapes
    the pattern is rewritten."""
    q, k, v = _qkv(N=6, M=6, grad=True)
    ref = finfo_min_then_symbolic_scale(*[t.detach().clone().requires_grad_() for t in (q, k, v)])
    fn, counter = _compile(finfo_min_then_symbolic_scale, dynamic=dynamic)
    out = fn(q, k, v)
    assert_close("output", out, ref, 1e-4)
    if not dynamic:
        assert counter.ops == 1, counter.reasons
    else:
        assert counter.ops in (0, 1)
        if counter.ops == 0:
            assert "does not remove positions" in counter.reasons[0]


def mask_first_after_cap_first_softcap(q, k, v, mask):
    # Shrunk from a CI-profile failure (model="softcap", mask_form=1).
    s = q @ k.transpose(-2, -1)
    s = 2.0 * torch.tanh(s * (1.0 / 2.0))
    s = mask + s
    return F.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("dynamic", [False, True])
def test_mask_added_first_to_a_cap_first_softcap(dynamic):
    """Found: ``mask + cap * tanh(s / cap)`` was left alone ("placeholder
    L_mask_ between the q·kᵀ product and the softmax is not understood"):
    to tell the scores from the mask in ``mask + x``, the pass looks back
    from each operand for a product, and that look-back stopped at ``cap *
    ...``, whose first argument is a number. A missed rewrite of Gemma 2's
    spelling, not a wrong answer."""
    q, k, v = _qkv(N=5, M=7, grad=True)
    mask = torch.randn(5, 7, generator=torch.Generator().manual_seed(1)).requires_grad_()
    args = [q, k, v, mask]
    ref_args = [t.detach().clone().requires_grad_() for t in args]
    ref = mask_first_after_cap_first_softcap(*ref_args)
    fn, counter = _compile(mask_first_after_cap_first_softcap, dynamic=dynamic)
    out = fn(*args)
    assert counter.ops == 1, counter.reasons
    assert_close("output", out, ref, 1e-4)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(g)
    ref.backward(g)
    for name, a, b in zip("qkv", args, ref_args):
        assert_close(f"grad of {name}", a.grad, b.grad, 1e-4)
    assert_close("grad of the mask", args[3].grad, ref_args[3].grad, 1e-4)


def test_dynamo_restart_is_not_counted_twice():
    """Harness regression: Dynamo traces this frame twice under
    ``dynamic=True`` + AOTAutograd (a dropout probability becomes a tensor,
    then is specialised and the analysis restarts). Only the graph that runs
    may be counted, else the fuzzer reports 2 rewrites for 1 attention."""
    spec = Spec(B=2, H=3, Hkv=3, N=18, M=21, D=64, Dv=32, dtype="float32", layout="bhnd", gqa="none",
                product="einsum", key="t-2-1", scale="sqrt_expr", scale_place="scores", mask="add_neg_inf",
                mask_shape="bhnm", mask_form=0, softmax="F_dtype", cast="to_float", dropout="module",
                dropout_p=0.5, out="plain", hostile="none", train=False, seed=2091, dynamic=True,
                scale_form=1)
    counter = run_differential(spec, "aot_eager")
    assert counter.ops == 1


# ---------------------------------------------------------------------------
# Keys the pass need not recognise as transposes: any answer must be eager's


class UntransposedKey(nn.Module):
    """``q @ k`` with M == D: the "key" of the product is ``k.mT``."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k * 0.25, dim=-1) @ v


class HeadsSwappedKey(nn.Module):
    """``k.permute(0, 2, 3, 1)`` is not a swap of the last two dims; with
    H == M the shapes still line up."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.permute(0, 2, 3, 1) * 0.25, dim=-1) @ v


@pytest.mark.parametrize(
    "model,H,N,M",
    [(UntransposedKey(), 2, 5, 16), (HeadsSwappedKey(), 3, 7, 3)],
    ids=["untransposed", "heads-swapped"],
)
def test_unusual_keys_give_eager_results(model, H, N, M):
    """Rewritten or not, outputs and gradients are eager's."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, s, 16, generator=g, requires_grad=True) for s in (N, M, M))
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = model(*refs)
    fn, _ = _compile(model)
    out = fn(q, k, v)
    assert_close("output", out, ref, 1e-4)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad)
    for a, b in zip((q, k, v), refs):
        assert_close("grad", a.grad, b.grad, 3e-4)


# ---------------------------------------------------------------------------
# The documented difference the fuzzer avoids generating


def decode_more_queries_than_keys(q, k, v):
    n, m = q.size(-2), k.size(-2)
    keep = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))
    return s.softmax(-1) @ v


def test_fully_masked_rows_are_zero_where_eager_is_nan():
    """Bottom-right causal with N > M: the first N - M queries see no key.
    Eager softmax gives NaN there; the rewritten graph gives 0 (documented
    in the op and in ``explain``). Every other row equals eager."""
    q, k, v = _qkv(N=7, M=4)
    ref = decode_more_queries_than_keys(q, k, v)
    fn, counter = _compile(decode_more_queries_than_keys)
    out = fn(q, k, v)
    assert counter.ops == 1, counter.reasons
    empty = torch.isnan(ref).all(dim=-1)
    assert empty[..., :3].all() and not empty[..., 3:].any()
    assert (out[empty] == 0).all()
    assert_close("visible rows", out[~empty], ref[~empty], 1e-4)


class TrainDropoutModule(nn.Module):
    """Shrunk from a long-profile failure (train mode, dynamic=True)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, q, k, v):
        a = F.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.drop(a) @ v


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_train_mode_dropout_module_under_dynamic_shapes(compiler):
    """Found: under ``dynamic=True`` Dynamo hands ``nn.Dropout``'s float p to
    the backend as a tensor, and the pass refuses ("dropout probability is
    not a compile-time constant"). AOTAutograd (hence Inductor) restarts the
    trace with p specialised and the second graph is rewritten; the plain
    ``compiler="eager"`` (and ``explain``, which traces the same way) keep
    the refusal. Never a wrong answer."""
    model = TrainDropoutModule().train()
    q, k, v = _qkv(N=1, M=17, grad=True)
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = model(*refs)
    counter = CountingCompiler(compiler)
    backend = make_backend(compiler=counter, record=True)
    counter.backend = backend
    out = torch.compile(model, backend=backend, dynamic=True)(q, k, v)
    assert_close("output", out, ref, 1e-4)
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip((q, k, v), refs):
        assert_close("grad", a.grad, b.grad, 3e-4)
    if compiler == "aot_eager":
        assert counter.ops == 1, counter.reasons
    elif counter.ops == 0:
        assert "dropout probability is not a compile-time constant" in counter.reasons[0]
