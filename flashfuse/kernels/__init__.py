"""Triton flash-attention kernels and their launchers.

The kernel modules are imported on first use: importing flashfuse stays cheap,
and the Triton interpreter decision (made by Triton when a kernel is defined)
is recorded here so the ops layer knows which tensors the kernels can take.
"""

import contextlib
import os
from typing import Any, NamedTuple

import torch

from .. import config

# Triton decides when a kernel is *defined* whether it runs compiled or in the
# interpreter, so CPU tensors can use the kernels only if this was set then.
BUILT_FOR_INTERPRETER = config.interpreter_on()


@contextlib.contextmanager
def _defining_kernels():
    """Import the kernel modules inside this: their kernels are then defined
    as this package recorded at import (``BUILT_FOR_INTERPRETER``), also
    when TRITON_INTERPRET says otherwise at that moment (a caller switched
    it off for a while to take the blockwise CPU path). Otherwise kernels
    first defined then would be compiled kernels that later interpreter
    calls cannot launch."""
    if config.interpreter_on() == BUILT_FOR_INTERPRETER:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if BUILT_FOR_INTERPRETER else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


class _Modules(NamedTuple):
    """The kernel modules the dispatch and the ops' other paths call."""

    hopper: Any
    decode: Any
    AttentionProblem: type
    forward: Any
    backward: Any
    mask_ranges: Any
    launch: Any


_MODULES: tuple = ()  # a _Modules, imported at the first call


class Route(NamedTuple):
    """Which kernels take a call (``_route``, ``_backward_route``).

    ``kernel``: ``"decode"`` (the split-KV kernels; forward only, no
    problem built), ``"hopper"`` (the Gluon kernels, eager), ``"hopper-op"``
    (a traced call they suit: the trace records the opaque op, whose layout
    is checked when it runs) or ``"portable"``; ``problem``: the call's
    ``AttentionProblem``; ``why``: for the portable kernels, why not the
    Hopper ones (None otherwise)."""

    kernel: str
    problem: Any
    why: str | None


def modules() -> _Modules:
    """The kernel modules, imported at the first call (they import Triton;
    a call then pays no import statement), their kernels defined as this
    package recorded the interpreter (``_defining_kernels``). Every lazy
    use of a kernel module goes through here."""
    global _MODULES
    if not _MODULES:
        with _defining_kernels():
            from . import backward, decode, forward, hopper, launch, mask_ranges
            from .problem import AttentionProblem

        _MODULES = _Modules(hopper, decode, AttentionProblem, forward, backward, mask_ranges, launch)
    return _MODULES


def _route(q, k, v, attn_mask, kwargs) -> Route:
    """The one rule for which forward kernel takes a call, asked both to run
    it (``attention_forward``) and to name it (``forward_kernel``); few
    queries against many keys take the split-KV decoding kernels."""
    hopper, decode = modules()[:2]
    if decode.decode_suits(decode.DecodeCall(q, k, attn_mask, kwargs["dropout_p"], kwargs["window_left"],
                                             kwargs["window_right"], kwargs["bottom_right"], kwargs.get("mask_fill"),
                                             kwargs.get("softcap"), kwargs.get("sinks"))):
        return Route("decode", None, None)
    p = _problem(q, k, v, attn_mask, kwargs, backward=False)
    rule = dict(dropout_p=kwargs["dropout_p"], softcap=kwargs.get("softcap"), sinks=kwargs.get("sinks"))
    return _hopper_or_portable(p, lambda: hopper.traced_takes(p, q, k, v, **rule),
                               lambda: hopper.hopper_refusal(p, q, k, v, **rule))


def _problem(q, k, v, attn_mask, kwargs, backward: bool):
    """The call's ``AttentionProblem`` from the launchers' keyword arguments."""
    AttentionProblem = modules().AttentionProblem
    return AttentionProblem.build(q, k, v, attn_mask, dropout_p=kwargs["dropout_p"], scale=kwargs["scale"],
                                  window_left=kwargs["window_left"], window_right=kwargs["window_right"],
                                  bottom_right=kwargs["bottom_right"], mask_fill=kwargs.get("mask_fill"),
                                  softcap=kwargs.get("softcap"), backward=backward)


def _hopper_or_portable(p, traced_takes, refusal) -> Route:
    """The part of ``_route`` and ``_backward_route`` past the problem:
    the CPU case before any other check, then a trace the Hopper kernels
    suit (``traced_takes()``), then ``refusal()`` (None: the Hopper kernels)."""
    if p.interpret or p.device.type != "cuda":
        return Route("portable", p, "not a CUDA tensor (Gluon kernels do not run in Triton's interpreter)")
    if traced_takes():
        return Route("hopper-op", p, None)
    why = refusal()
    return Route("hopper" if why is None else "portable", p, why)


def attention_forward(q, k, v, attn_mask, seed, **kwargs):
    """See :func:`flashfuse.kernels.forward.attention_forward`. Few queries
    against many keys take the split-KV decoding kernels instead
    (:func:`flashfuse.kernels.decode.decode_suits`), and calls the Hopper
    kernel suits take it (``hopper.hopper_refusal``); their ``out`` and
    ``lse`` have the same layout and meaning."""
    route, p, _ = _route(q, k, v, attn_mask, kwargs)
    if route == "decode":
        return _MODULES.decode.decode_forward(q, k, v, scale=kwargs["scale"], window_left=kwargs["window_left"],
                                          window_right=kwargs["window_right"], bottom_right=kwargs["bottom_right"],
                                          attn_mask=attn_mask)
    if route == "hopper":
        return _MODULES.hopper.hopper_forward(p, q, k, v, key_table=kwargs.get("key_table"))
    if route == "hopper-op":
        # Inductor cannot launch a Gluon kernel from its generated code: the
        # trace records the opaque op (ops.py) that runs this function again
        # on the real tensors.
        return torch.ops.flashfuse._hopper_forward(q, k, v, kwargs["scale"], kwargs["window_left"],
                                                   kwargs["window_right"], kwargs["bottom_right"], attn_mask,
                                                   kwargs.get("key_table"))
    return _MODULES.forward.attention_forward(q, k, v, attn_mask, seed, **kwargs, problem=p)


def forward_kernel(q, k, v, attn_mask, seed, dropout_p: float, scale: float, window_left, window_right,
                   bottom_right: bool, mask_fill=None, mask_key_table=None, mask_query_table=None, softcap=None,
                   sinks=None) -> str:
    """Which forward kernel a CUDA call with these arguments (``_attention_forward``'s,
    on fake or real tensors) takes (``_route``): ``"split-KV decode"``,
    ``"hopper"`` or ``"portable: <why not the Hopper kernel>"``. On fake
    tensors the Hopper kernel's layout rule is checked when a call runs (a
    call whose layout the copy engine cannot read takes the portable kernel)."""
    kwargs = dict(dropout_p=dropout_p, scale=scale, window_left=window_left, window_right=window_right,
                  bottom_right=bottom_right, mask_fill=mask_fill, softcap=softcap, sinks=sinks)
    route, _, why = _route(q, k, v, attn_mask, kwargs)
    return {"decode": "split-KV decode", "hopper": "hopper", "hopper-op": "hopper"}.get(route, f"portable: {why}")


def _backward_route(grad_out, q, k, v, attn_mask, kwargs) -> Route:
    """The one rule for which backward kernels take a call, asked both to
    run it (``attention_backward``) and to name it (``backward_kernel``):
    a ``Route`` other than ``"decode"``. The arguments are
    ``backward.attention_backward``'s."""
    hopper = modules().hopper
    p = _problem(q, k, v, attn_mask, kwargs, backward=True)
    rule = dict(dropout_p=kwargs["dropout_p"], softcap=kwargs.get("softcap"),
                mask_grad=bool(kwargs.get("mask_grad")) and attn_mask is not None)
    return _hopper_or_portable(p, lambda: hopper.traced_backward_takes(p, grad_out, q, k, v, **rule),
                               lambda: hopper.backward_refusal(p, grad_out, q, k, v, **rule))


def attention_backward(grad_out, q, k, v, attn_mask, seed, out, lse, **kwargs):
    """See :func:`flashfuse.kernels.backward.attention_backward`. Calls the
    Hopper backward kernels suit take them (``hopper.backward_refusal``);
    their gradients have the same meaning."""
    backward = modules().backward
    route, p, _ = _backward_route(grad_out, q, k, v, attn_mask, kwargs)
    if route == "hopper":
        with torch.cuda.device(q.device):
            delta, _ = backward.row_delta(p, out, grad_out, lse, kwargs.get("grad_lse"))
        dq, dk, dv = _MODULES.hopper.hopper_backward(p, grad_out, q, k, v, lse, delta, kwargs.get("key_table"),
                                                     kwargs.get("query_table"))
        return dq, dk, dv, None
    if route == "hopper-op":
        # As the forward's hopper-op: Inductor cannot launch Gluon kernels,
        # so the trace records an opaque op that runs this function again.
        dq, dk, dv = torch.ops.flashfuse._hopper_backward(
            grad_out, q, k, v, out, lse, kwargs["scale"], kwargs["window_left"], kwargs["window_right"],
            kwargs["bottom_right"], kwargs.get("grad_lse"), attn_mask, kwargs.get("key_table"),
            kwargs.get("query_table"))
        return dq, dk, dv, None
    return backward.attention_backward(grad_out, q, k, v, attn_mask, seed, out, lse, **kwargs, problem=p)


def backward_kernel(grad_out, q, k, v, attn_mask, seed, out, lse, **kwargs) -> str:
    """Which backward kernels a CUDA call with ``attention_backward``'s
    arguments (fake or real tensors) takes (``_backward_route``):
    ``"hopper"`` or ``"portable: <why not the Hopper kernels>"``."""
    route, _, why = _backward_route(grad_out, q, k, v, attn_mask, kwargs)
    return "hopper" if route in ("hopper", "hopper-op") else f"portable: {why}"


def launch_problem(q, k, v, attn_mask, seed, dropout_p: float, scale: float, window_left, window_right,
                   bottom_right: bool, mask_fill, mask_key_table=None, mask_query_table=None, softcap=None,
                   sinks=None, *, backward: bool) -> str | None:
    """Why the CUDA kernels cannot run attention on tensors like these, or
    None when they can.

    The arguments are ``_attention_forward``'s (see ``ops.kernel_problem``,
    which makes them from the public op's), on fake or real CUDA tensors;
    ``backward`` also asks for the gradient kernels (``mask_grad`` when the
    mask requires grad). The launchers run on fresh fake tensors of the
    same sizes (symbolic ones at their example values, without guards) with
    nothing launched, each finding the config it would take
    (``launch.dry_run``); the answer is the first launcher that finds none
    fitting the GPU. A block mask's tables change no config (the dry run
    builds its own).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .launch import NoKernelConfig, dry_run, hint

    def like(t):
        return None if t is None else torch.empty([hint(s) for s in t.shape], dtype=t.dtype, device=t.device)

    band = dict(dropout_p=dropout_p, scale=scale, window_left=window_left, window_right=window_right,
                bottom_right=bottom_right, mask_fill=mask_fill)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), dry_run():
            qf, kf, vf, mf, sf, skf = (like(t) for t in (q, k, v, attn_mask, seed, sinks))
            out, lse = attention_forward(qf, kf, vf, mf, sf, **band, softcap=softcap, sinks=skf)
            if backward:
                mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
                attention_backward(torch.empty_like(out), qf, kf, vf, mf, sf, out, lse, **band, mask_grad=mask_grad,
                                   softcap=softcap)
    except NoKernelConfig as exc:
        return str(exc)
    return None
