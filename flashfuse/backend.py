"""The ``torch.compile`` backend: rewrite attention, then compile the rest.

Usage::

    model = torch.compile(model, backend=flashfuse.backend)   # or backend="flashfuse"
    model = torch.compile(model, backend=flashfuse.make_backend(compiler="aot_eager"))

The backend receives the FX graph Dynamo traced, rewrites every attention it
can prove into ``torch.ops.flashfuse.attention`` (see :mod:`flashfuse.fx`),
and hands the graph to a compiler: Inductor by default. The rewrite runs
before AOTAutograd, so training uses the op's own flash backward. Inductor's
own attention rewrite (its ``fuse_attention`` patterns) is switched off under
this backend: flashfuse's pass takes its place (see
``inductor_attention_patterns_off``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx

from . import ddp as _ddp
from .fx.match import Candidate
from .fx.rewrite import FlashAttentionPass, copy_graph_module

log = logging.getLogger("flashfuse")

Compiler = Union[str, Callable[[torch.fx.GraphModule, list], Callable]]

# Set while Dynamo's DDP optimiser compiles the pieces of a graph that the
# backend rewrote whole (flashfuse/ddp.py): the pieces are compiled as given.
_split_pieces = threading.local()


def _is_inductor_attention_pattern(entry) -> bool:
    """Whether a joint-graph pattern entry is one of Inductor's attention
    rewrites: ``fuse_attention`` registers them through
    ``register_replacement``, whose check closes over that module's search
    and check functions."""
    for cell in getattr(getattr(entry, "extra_check", None), "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if (getattr(value, "__module__", "") or "").endswith("fx_passes.fuse_attention"):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _dynamo_control_flow() -> tuple:
    """Exceptions Dynamo raises through a backend to restart or skip its
    analysis (e.g. when a scalar becomes a tensor): they must reach Dynamo,
    not the backend's fallback."""
    try:
        from torch._dynamo import exc
    except ImportError:  # pragma: no cover - torch without Dynamo
        return ()
    return tuple(getattr(exc, name) for name in ("RestartAnalysis", "SkipFrame") if hasattr(exc, name))


def _inductor_patches(options: Optional[dict]) -> dict:
    """The user's Inductor options, plus a marker pass whose identity enters
    Inductor's cache key, so that a graph Inductor compiled and cached
    elsewhere with its attention patterns is never taken for one compiled
    here without them (``inductor_attention_patterns_off``)."""
    patches = dict(options or {})
    if "joint_custom_pre_pass" in patches:  # the user's own pass takes the slot: no cache then
        patches.setdefault("fx_graph_cache", False)
    else:
        patches["joint_custom_pre_pass"] = _marker_pass()
    return patches


@functools.lru_cache(maxsize=None)
def _marker_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class AttentionPatternsOff(CustomGraphPass):
        """Does nothing to the graph; its uuid tells Inductor's caches that
        this compile ran without Inductor's attention patterns."""

        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return "flashfuse.backend: Inductor's fuse_attention patterns off, v1"

    return AttentionPatternsOff()


@contextlib.contextmanager
def inductor_attention_patterns_off():
    """Run Inductor with its own attention rewrite (the ``fuse_attention``
    patterns among the joint-graph patterns) left out, every other pattern
    and pass as usual.

    flashfuse's pass replaces that rewrite: what it leaves alone it left
    alone on purpose, and Inductor's patterns then match programs they get
    wrong (a softmax over the queries) or cannot lower. Inductor has no
    switch for those patterns alone (``pattern_matcher`` and
    ``use_joint_graph_passes`` turn off far more, e.g. matmul padding), so
    while this context is active the joint-graph pattern pass applies a copy
    of its table without them. The table is filtered when the pass runs,
    after Inductor has registered its patterns for the graph's device.
    """
    try:
        from torch._inductor.fx_passes import joint_graph
    except ImportError:  # pragma: no cover - torch without Inductor
        yield
        return
    table = joint_graph.patterns
    had_own = "apply" in vars(table)
    previous = table.apply

    def apply(graph):
        full = table.patterns
        kept = type(full)(full.default_factory) if hasattr(full, "default_factory") else type(full)()
        for key, entries in full.items():
            rest = [e for e in entries if not _is_inductor_attention_pattern(e)]
            if rest:
                kept[key] = rest
        left_out = sum(map(len, full.values())) - sum(map(len, kept.values()))
        if left_out == 0 and "torch._inductor.fx_passes.fuse_attention" in sys.modules:
            # The patterns are registered but none was recognised (an Inductor
            # that registers them differently): skip this table rather than
            # let them run.
            log.warning("flashfuse: Inductor's attention patterns not recognised; its joint-graph "
                        "pattern table is skipped for this compile")
            return 0
        table.patterns = kept
        try:
            return previous(graph)
        finally:
            table.patterns = full

    table.apply = apply
    try:
        yield
    finally:
        if had_own:
            table.apply = previous
        else:
            del table.apply


def _compiler_fn(compiler: Compiler, options: Optional[dict]) -> Callable:
    if callable(compiler):
        return compiler
    if not isinstance(compiler, str):
        raise TypeError(f"flashfuse: compiler must be a name or a callable, got {type(compiler).__name__}")
    if compiler == "inductor":

        def inductor(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            with inductor_attention_patterns_off():
                return compile_fx(gm, example_inputs, config_patches=_inductor_patches(options))

        return inductor
    if compiler == "eager":
        if options:
            raise ValueError("flashfuse: options are only understood by the inductor compiler")
        return lambda gm, example_inputs: gm.forward
    if compiler == "flashfuse":
        raise ValueError("flashfuse: the compiler after the rewrite cannot be flashfuse itself")
    if options:
        raise ValueError("flashfuse: options are only understood by the inductor compiler")
    # Any other registered torch.compile backend ("aot_eager", "cudagraphs", ...).
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(compiler)


class Backend:
    """A ``torch.compile`` backend: the flashfuse rewrite, then ``compiler``.

    Instances are made by :func:`make_backend`; ``flashfuse.backend`` is the
    default one (Inductor).
    """

    def __init__(self, compiler: Compiler = "inductor", options: Optional[dict] = None, record: bool = False):
        self.compiler = compiler
        self.options = dict(options) if options else None
        self._compile = _compiler_fn(compiler, self.options)
        self.record = record
        # With record=True: the candidates of every graph compiled so far.
        self.candidates: list[Candidate] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if getattr(_split_pieces, "active", False):  # a piece of a graph rewritten whole
            return self._compile(gm, list(example_inputs))
        return self._rewrite_then(lambda graph: self._compile(graph, list(example_inputs)), gm, example_inputs)

    def compile_before_split(self, split_and_compile: Callable, gm: torch.fx.GraphModule,
                             example_inputs: Sequence[Any]) -> Callable:
        """Rewrite the whole of ``gm``, then ``split_and_compile(graph)``
        (Dynamo's DDP optimiser cutting it at bucket boundaries and calling
        this backend on each piece, which compiles the pieces unchanged): a
        boundary then cannot fall inside an attention (flashfuse/ddp.py)."""

        def split(graph):
            _split_pieces.active = True
            try:
                return split_and_compile(graph)
            finally:
                _split_pieces.active = False

        return self._rewrite_then(split, gm, example_inputs)

    def _rewrite_then(self, compile_graph: Callable, gm: torch.fx.GraphModule,
                      example_inputs: Sequence[Any]) -> Callable:
        original = copy_graph_module(gm)
        cands = FlashAttentionPass(example_inputs)(gm)
        n = sum(c.rewritten for c in cands)
        if cands:
            log.info("flashfuse: %d of %d attention candidates rewritten", n, len(cands))
        if self.record:
            self.candidates.extend(cands)
        try:
            return compile_graph(gm)
        except _dynamo_control_flow():  # Dynamo restarting its analysis: not a failure
            raise
        except Exception as exc:  # noqa: BLE001 - flashfuse must never fail a compile
            if n == 0:  # nothing was rewritten: the failure is not flashfuse's
                raise
            # Whatever failed, the graph as Dynamo traced it is what the user
            # would have compiled without flashfuse: compile that instead. If
            # the failure was not flashfuse's, it happens again and is raised.
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            reason = f"compiling the rewritten graph failed ({type(exc).__name__}: {first}); left unrewritten"
            log.warning("flashfuse: %s", reason, exc_info=log.isEnabledFor(logging.DEBUG))
            for cand in cands:
                if cand.rewritten:
                    cand.rewritten, cand.plan, cand.reason = False, None, reason
            return compile_graph(original)

    def __repr__(self) -> str:
        name = self.compiler if isinstance(self.compiler, str) else getattr(self.compiler, "__name__", "custom")
        return f"flashfuse.make_backend(compiler={name!r})"


def make_backend(compiler: Compiler = "inductor", *, options: Optional[dict] = None, record: bool = False) -> Backend:
    """Build a ``torch.compile`` backend that rewrites attention, then compiles.

    Args:
        compiler: what compiles the graph after the rewrite: ``"inductor"``
            (default), ``"eager"`` (run the rewritten graph as is, for
            debugging), ``"aot_eager"`` (AOTAutograd without code generation,
            for debugging training), any other registered ``torch.compile``
            backend name, or a callable ``(gm, example_inputs) -> callable``.
        options: Inductor config patches for this backend only (e.g.
            ``{"max_autotune": True}``); nothing global is changed.
        record: keep every candidate found in ``backend.candidates`` (what
            was rewritten and why not), for tests and debugging.
    """
    return Backend(compiler, options=options, record=record)


#: The default backend: rewrite attention, then Inductor.
backend = make_backend()


def _register() -> None:
    """Make ``torch.compile(..., backend="flashfuse")`` work once flashfuse is
    imported, and stay compatible with the ``torch_dynamo_backends`` entry
    point (which imports this module and registers ``backend`` itself)."""
    try:
        from torch._dynamo.backends import registry
    except ImportError:  # pragma: no cover - torch without dynamo
        return
    compiler_fns = getattr(registry, "_COMPILER_FNS", {})
    backends = getattr(registry, "_BACKENDS", {})
    if "flashfuse" in compiler_fns or backends.get("flashfuse") is not None:
        return  # registered already, or the entry point is about to do it
    try:
        registry.register_backend(compiler_fn=backend, name="flashfuse")
    except AssertionError:  # registered concurrently under the same name
        pass


_register()
# Attention kept whole when Dynamo's DDP optimiser splits graphs (flashfuse/ddp.py).
_ddp.install()
