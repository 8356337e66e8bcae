"""Run a fuzz program eagerly and compiled with the flashfuse backend, and
compare: rewrite count, outputs, and gradients."""

from __future__ import annotations

import copy
from typing import Optional

import torch

import flashfuse.ops  # noqa: F401  (registers the op)
from flashfuse.backend import make_backend

from .programs import Spec, build, expected_rewrites, make_inputs

OP = torch.ops.flashfuse.attention.default

# Relative tolerances (on the norm of the difference, and per element scaled
# by the largest magnitude of the eager result). bf16 programs round the
# scores, probabilities and outputs to 8 bits of mantissa in a different
# order than the flash algorithm does.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2}
GRAD_TOLERANCE = {torch.float32: 3e-4, torch.float64: 1e-10, torch.bfloat16: 6e-2}


class CountingCompiler:
    """The post-rewrite compiler: counts flashfuse attention nodes in the
    graphs it receives, then hands them to ``then``.

    Only graphs whose compiled code actually runs are counted: Dynamo may
    trace a frame twice (it restarts the analysis, e.g. to specialise a float
    such as a dropout probability under ``dynamic=True``) and throw the first
    graph away.
    """

    def __init__(self, then: str):
        self.then = then
        self.backend = None  # the flashfuse Backend, for its candidates
        self.graphs: list[dict] = []
        self._seen = 0

    @property
    def ops(self) -> int:
        return sum(g["ops"] for g in self.graphs if g["ran"])

    @property
    def rewritten(self) -> int:
        return sum(g["rewritten"] for g in self.graphs if g["ran"])

    @property
    def reasons(self) -> list:
        return [r for g in self.graphs if g["ran"] for r in g["reasons"]]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        cands = self.backend.candidates[self._seen:] if self.backend is not None else []
        self._seen += len(cands)
        info = {
            "ops": sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is OP),
            "rewritten": sum(c.rewritten for c in cands),
            "reasons": [c.reason for c in cands if not c.rewritten],
            "code": gm.code,
            "ran": False,
        }
        self.graphs.append(info)
        if self.then == "eager":
            fn = gm.forward
        elif self.then == "inductor":
            from torch._inductor.compile_fx import compile_fx

            fn = compile_fx(gm, example_inputs)
        else:
            from torch._dynamo.backends.registry import lookup_backend

            fn = lookup_backend(self.then)(gm, example_inputs)

        def run(*args):
            info["ran"] = True
            return fn(*args)

        # Keep the calling convention (a boxed callable takes one list).
        run._boxed_call = getattr(fn, "_boxed_call", False)
        return run


def _clone(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(x.requires_grad)


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm of the difference relative to the reference's norm, floored at
    the norm of an all-ones tensor: a gradient that is 0 up to rounding (a
    single visible key) must not turn rounding into a huge relative error."""
    x, ref = x.double(), ref.double()
    floor = max(ref.numel(), 1) ** 0.5
    return ((x - ref).norm() / max(ref.norm().item(), floor)).item()


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Relative-norm and per-element agreement, with a message a human can act on."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != eager {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != eager {ref.dtype}"
    # Returned scores may hold the -inf of a mask: those entries must match
    # exactly; the rest is compared numerically.
    finite = torch.isfinite(ref)
    same = (got == ref) | (torch.isnan(got) & torch.isnan(ref))
    bad = (~finite & ~same).sum().item() + (finite & ~torch.isfinite(got)).sum().item()
    assert bad == 0, f"{name}: {bad} non-finite entries differ from eager"
    got, ref = got[finite], ref[finite]
    err = rel_error(got, ref)
    worst = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    bound = tol * max(ref.double().abs().max().item() if ref.numel() else 0.0, 1.0)
    assert err <= tol and worst <= 4 * bound, f"{name}: relative error {err:.3g}, max abs error {worst:.3g} (tolerance {tol:g})"


def run_differential(spec: Spec, compiler: str = "eager") -> CountingCompiler:
    """Compile ``spec``'s program with the flashfuse backend and check it
    against eager. Raises AssertionError describing the first difference."""
    torch._dynamo.reset()
    model = build(spec)
    ref_model = copy.deepcopy(model)
    inputs = make_inputs(spec)
    ref_inputs = [_clone(x) for x in inputs]

    counter = CountingCompiler(compiler)
    backend = make_backend(compiler=counter, record=True)
    counter.backend = backend
    compiled = torch.compile(model, backend=backend, dynamic=spec.dynamic)

    # Dropout in eval mode is the identity; in train mode p is 0: no RNG
    # draws, so eager and compiled see the same function.
    ref = ref_model(*ref_inputs)
    got = compiled(*inputs)

    expected: Optional[int] = expected_rewrites(spec, compiler)
    if expected is not None:
        assert counter.ops == expected, (
            f"expected {expected} flashfuse attention node(s), found {counter.ops}; "
            f"reasons given by the pass: {counter.reasons}"
        )
    assert counter.ops == counter.rewritten, "the pass's report disagrees with the graph"

    refs = ref if isinstance(ref, tuple) else (ref,)
    gots = got if isinstance(got, tuple) else (got,)
    assert len(refs) == len(gots)
    tol = TOLERANCE[spec.torch_dtype]
    for i, (a, b) in enumerate(zip(gots, refs)):
        assert_close(f"output {i}", a, b, tol)

    if spec.train:
        g = torch.Generator().manual_seed(spec.seed + 1)
        grads = [torch.randn(r.shape, generator=g, dtype=torch.float32).to(r.dtype) for r in refs]
        torch.autograd.backward([r for r in refs], grads)
        torch.autograd.backward([o for o in gots], grads)
        gtol = GRAD_TOLERANCE[spec.torch_dtype]
        for i, (x, y) in enumerate(zip(inputs, ref_inputs)):
            if y.requires_grad:
                assert (x.grad is None) == (y.grad is None), f"input {i}: gradient presence differs"
                if y.grad is not None:
                    assert_close(f"grad of input {i}", x.grad, y.grad, gtol)
    return counter
