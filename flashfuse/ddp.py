"""Keep attention whole under ``DistributedDataParallel`` + ``torch.compile``.

With a DDP-wrapped model, Dynamo's DDP optimiser
(``torch._dynamo.backends.distributed.DDPOptimizer``) splits each traced
graph at gradient-bucket boundaries and calls the backend once per piece. A
boundary falls just before a node that reads a parameter, so a parameter used
inside an attention chain (a learned temperature or score bias, a value
projection computed after the softmax) can cut the chain in two, and neither
piece then holds a whole matmul-softmax-matmul to rewrite.

The fix: when the DDP optimiser is about to split a graph for a flashfuse
backend, the backend rewrites the whole graph first (each attention becomes
one op node, which no split can cut), then lets the optimiser split and
compile the pieces without rewriting them again. Installed when
:mod:`flashfuse.backend` is imported; graphs for other backends, and
torch versions without the optimiser, are left as they are.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("flashfuse")


def flashfuse_backend(compiler_fn):
    """The flashfuse ``Backend`` that ``compiler_fn`` wraps, or None. Dynamo
    wraps backends in layers: its debug wrapper names the next in
    ``_torchdynamo_orig_backend``, ``torch.compile``'s wrapper in
    ``compiler_fn``, a ``functools.partial`` in ``func``."""
    from .backend import Backend

    seen = set()
    fn = compiler_fn
    while fn is not None and id(fn) not in seen:
        if isinstance(fn, Backend):
            return fn
        seen.add(id(fn))
        fn = next((getattr(fn, a) for a in ("_torchdynamo_orig_backend", "compiler_fn", "func")
                   if getattr(fn, a, None) is not None), None)
    return None


def install() -> bool:
    """Wrap ``DDPOptimizer.compile_fn`` once; True when it is wrapped."""
    try:
        from torch._dynamo.backends import distributed
    except ImportError:  # pragma: no cover - torch without Dynamo or distributed
        return False
    cls = getattr(distributed, "DDPOptimizer", None)
    original = getattr(cls, "compile_fn", None)
    if original is None:  # pragma: no cover - an optimiser of another shape
        return False
    if getattr(original, "_flashfuse_whole_graph", False):
        return True

    @functools.wraps(original)
    def compile_fn(self, gm, example_inputs, **kwargs):
        backend = flashfuse_backend(getattr(self, "backend_compile_fn", None))
        if backend is None:
            return original(self, gm, example_inputs, **kwargs)
        return backend.compile_before_split(
            lambda graph: original(self, graph, example_inputs, **kwargs), gm, example_inputs
        )

    compile_fn._flashfuse_whole_graph = True
    cls.compile_fn = compile_fn
    return True
