"""Helpers for the graph-pass tests.

``compile_and_compare`` compiles a function or module with the flashfuse
backend, checks how many attentions were rewritten, and compares outputs and
gradients with eager.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

import flashfuse.ops  # noqa: F401  (registers the op)
from flashfuse.backend import make_backend

OP = torch.ops.flashfuse.attention.default


def count_ops(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is OP)


class Recorder:
    """A compiler for make_backend that keeps the rewritten graphs."""

    def __init__(self, then: str = "aot_eager"):
        self.graphs: list[torch.fx.GraphModule] = []
        self.then = then

    def __call__(self, gm, example_inputs):
        self.graphs.append(copy.copy(gm))
        self.code = gm.code
        if self.then == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.then)(gm, example_inputs)

    @property
    def ops(self) -> int:
        return sum(count_ops(g) for g in self.graphs)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        y.requires_grad_(x.requires_grad)
        return y
    return x


def compile_and_compare(
    fn: Callable,
    *inputs: Any,
    expect: int,
    compiler: str = "aot_eager",
    dynamic: Any = False,
    grad: bool = True,
    atol: float = 2e-5,
    rtol: float = 2e-5,
):
    """Compile ``fn`` with the backend; check ``expect`` rewrites and that
    outputs (and input/parameter gradients) match eager. Returns the recorder
    and the backend."""
    rec = Recorder(compiler)
    backend = make_backend(compiler=rec, record=True)
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    ref_inputs = [_clone(x) for x in inputs]
    ref_fn = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    ref = ref_fn(*ref_inputs)
    out = compiled(*inputs)
    reasons = [c.reason for c in backend.candidates if not c.rewritten]
    assert rec.ops == expect, f"expected {expect} rewrites, got {rec.ops}; reasons: {reasons}"
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for a, b in zip(outs, refs):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    if grad and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        g = [torch.randn_like(o) for o in outs]
        torch.autograd.backward([o for o in outs], g)
        torch.autograd.backward([o for o in refs], g)
        for x, y in zip(inputs, ref_inputs):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                torch.testing.assert_close(x.grad, y.grad, atol=atol * 10, rtol=rtol * 10)
        if isinstance(fn, torch.nn.Module):
            for (name, p), (_, p_ref) in zip(fn.named_parameters(), ref_fn.named_parameters()):
                if p.grad is not None or p_ref.grad is not None:
                    torch.testing.assert_close(p.grad, p_ref.grad, atol=atol * 10, rtol=rtol * 10, msg=name)
    return rec, backend


def left_alone_reasons(fn, *args, dynamic=False) -> list:
    """Compile ``fn``: it must match eager with nothing rewritten; the
    candidates' reasons for leaving it alone."""
    backend = make_backend(compiler="eager", record=True)
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    torch.testing.assert_close(out, fn(*args))
    assert not any(c.rewritten for c in backend.candidates)
    return [c.reason for c in backend.candidates]


def qkv(b=2, h=4, n=8, m=None, d=16, dv=None, hkv=None, dtype=torch.float32, grad=True, seed=0):
    """Random q (b,h,n,d), k (b,hkv,m,d), v (b,hkv,m,dv)."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    dv = d if dv is None else dv
    hkv = h if hkv is None else hkv
    q = torch.randn(b, h, n, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, m, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, m, dv, generator=g).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]
