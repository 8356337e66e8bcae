"""``explain``: which attentions of a model the pass finds, and why not.

``explain(model, *args, **kwargs)`` traces the model with Dynamo exactly as
``torch.compile`` would, runs the finder on every graph (without changing
anything: the model runs eagerly) and reports each softmax candidate: where
it is in the model, whether it would be rewritten, and what was recognised.
(A compile can still fall back: the backend compiles the unrewritten graph
when the rewritten one fails to compile, and logs why.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .match import Candidate, module_path, source_line
from .rewrite import FlashAttentionPass, copy_graph_module


@dataclasses.dataclass
class ExplainRow:
    """One candidate of :func:`explain`'s report."""

    index: int
    module: str
    source: str
    rewritten: bool
    reason: str
    scale: str
    mask: str
    causal: str
    window: str
    gqa: str
    dropout_p: float
    # How a layout other than (batch, heads, query, key) was brought to the
    # op's (e.g. "batch dims folded: (2, 4)"), with what it copies.
    layout: str = ""
    # On CUDA, the forward kernel the op call takes ("hopper", "portable:
    # <why not>", "split-KV decode"; kernels.forward_kernel).
    kernel: str = ""
    # The backward kernels, for candidates that need gradients
    # (kernels.backward_kernel).
    backward_kernel: str = ""


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found; ``str()`` gives the table."""

    rows: list[ExplainRow]
    graphs: int

    @property
    def rewritten(self) -> int:
        return sum(r.rewritten for r in self.rows)

    def table(self) -> str:
        from tabulate import tabulate

        headers = ["#", "module", "source", "rewrite", "scale", "mask", "causal", "window", "gqa", "dropout"]
        # The layout column only when some candidate needed one.
        layouts = any(r.layout for r in self.rows)
        if layouts:
            headers.append("layout")
        kernels = any(r.kernel for r in self.rows)  # only for CUDA inputs
        if kernels:
            headers.append("forward kernel")
        backward = any(r.backward_kernel for r in self.rows)
        if backward:
            headers.append("backward kernel")
        data = []
        for r in self.rows:
            data.append([
                r.index, r.module or "(root)", _clip(r.source, 60),
                "yes" if r.rewritten else f"no: {_clip(r.reason, 70)}",
                r.scale or "-", r.mask or "-", r.causal or "-", r.window or "-",
                r.gqa or "-", f"{r.dropout_p:g}" if r.rewritten else "-",
            ] + ([r.layout or "-"] if layouts else []) + ([_clip(r.kernel, 60) or "-"] if kernels else [])
              + ([_clip(r.backward_kernel, 60) or "-"] if backward else []))
        summary = f"{self.rewritten} of {len(self.rows)} attention candidates rewritten in {self.graphs} graph(s)"
        if not data:
            return summary
        return tabulate(data, headers=headers) + "\n" + summary

    def __str__(self) -> str:
        return self.table()


def _clip(s: str, n: int) -> str:
    s = s or ""
    return s if len(s) <= n else s[: n - 1] + "…"


def _row(index: int, cand: Candidate) -> ExplainRow:
    f = cand.facts
    return ExplainRow(
        index=index,
        module=module_path(cand.softmax),
        source=source_line(cand.softmax),
        rewritten=cand.ok,
        reason=cand.reason or "",
        scale=str(f.get("scale", "")) if cand.ok else "",
        mask=str(f.get("mask", "")) if cand.ok else "",
        causal=str(f.get("causal", "")) if cand.ok else "",
        window=str(f.get("window", "")) if cand.ok else "",
        gqa=str(f.get("gqa", "")) if cand.ok else "",
        dropout_p=float(f.get("dropout", 0.0)) if cand.ok else 0.0,
        layout=str(f.get("layout", "")) if cand.ok else "",
        kernel=str(f.get("kernel", "")) if cand.ok else "",
        backward_kernel=str(f.get("backward_kernel", "") or "") if cand.ok else "",
    )


def explain(model: Callable, *args: Any, print_table: bool = True, dynamic: Any = None, **kwargs: Any) -> Explanation:
    """Report every attention candidate in ``model`` (an ``nn.Module`` or a
    function) when called with ``*args, **kwargs``.

    The model is traced by Dynamo as under ``torch.compile``, the pass runs
    on a copy of each graph, and the model then runs eagerly, unchanged. Candidates that would be rewritten show
    what was recognised (scale, mask kind, causal alignment, window, grouped
    heads, dropout); the others say why the graph is left as it is. Rows
    with every key masked by -inf differ in one documented way once
    rewritten: the op returns 0 there, where eager softmax gives NaN. Finite
    fills are passed as the op's ``mask_fill`` (eager's uniform average).

    Args:
        print_table: print the table (returned as data either way).
        dynamic: passed to ``torch.compile``.
    Returns:
        an :class:`Explanation` with one :class:`ExplainRow` per candidate.
    """
    rows: list[ExplainRow] = []
    graphs = 0

    def recorder(gm: torch.fx.GraphModule, example_inputs):
        nonlocal graphs
        graphs += 1
        # The pass itself, on a copy: what the backend would rewrite, refusals
        # made while emitting the op (a shape the GPU kernels cannot run) included.
        for cand in FlashAttentionPass(example_inputs)(copy_graph_module(gm)):
            rows.append(_row(len(rows), cand))
        return gm.forward

    compiled = torch.compile(model, backend=recorder, dynamic=dynamic)
    with torch.no_grad():
        compiled(*args, **kwargs)
    result = Explanation(rows, graphs)
    if print_table:
        print(result.table())
    return result
