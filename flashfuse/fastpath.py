"""The eager fast path of ``flashfuse::attention``.

Decoding calls the op once per layer per token, eagerly, with arguments that
repeat: the same shapes, dtypes and flags at every layer. Through
``torch.ops.flashfuse.attention`` each such call pays the dispatcher's trip
into the Python composite (arguments boxed and unboxed against the schema)
and every argument check again, which together cost more host time than the
decode kernels' launches.

:func:`attention_op` takes the op's arguments. A call that is not a plain
eager call (``may_skip_dispatch``) goes to the op. A plain eager call whose
*signature* (``_signature``) has passed the op before runs the composite's
work past its checks (``ops.run_checked``) directly; any other call goes to
the op, and its signature is remembered once the op returns. So every call
with a signature not yet seen to pass, every bad input included, takes the
op's full path and raises what it always raised.

Why skipping the dispatcher is legal, when ``may_skip_dispatch`` holds:
``flashfuse::attention`` has one kernel, the CompositeImplicitAutograd
composite, and nothing else is registered for it. With only real tensors
(no subclass, so no ``__torch_function__`` / ``__torch_dispatch__`` of
theirs), no torch-function or dispatch mode (fake tensors, ``make_fx``,
functionalization, flop counters), no functorch transform, no Dynamo and no
JIT tracer, the dispatcher would run exactly that composite, which is a
Python function: calling it ourselves computes the same thing. Autograd is
unaffected: the composite builds its own node (``ops._EagerAttention``)
either way. Anything that records or transforms the call sees the op.

Why a signature that passed may skip the checks: the checks read only the
properties the signature holds (tensor types, shapes, dtypes, devices,
layouts; every scalar argument, with its type, which the dispatcher's schema
conversion also looks at), so an input with the signature of one that passed
passes too. Strides are no part of it: no check reads them (the kernels keep
their own launch plans per stride signature). Neither is the key length of a
call without block-mask tables: the checks only compare it (key against
value, mask against keys), so the signature holds those comparisons, and a
dynamic cache, one key longer at every token, keeps one signature for all
its tokens.

Decoding goes one step further (``_DecodeLane``). A passing signature whose
call the split-KV decode kernels take on their arguments alone (no
gradients, no dropout, soft-capping, sinks, fill or block-mask tables, a
bool mask or none, a bottom-right band or none:
``decode.argument_refusal``) keeps its normalised arguments (scale, band),
and each later call of it asks only what can move between calls (the
``FLASHFUSE_DECODE`` setting, the key count against ``decode.size_refusal``,
whether the kernels run on the tensors' device) before calling
``decode.lane_forward``: ``decode_forward`` with the same arguments that
the op's forward reaches through ``run_checked``, ``_attention_forward`` and
the kernels' route (and ``need_lse=False``: the lse is dropped), so the
result is bitwise the op's. (``lane_forward`` keeps the lane's calls under
the lane's own object and what its signature leaves free, so a repeated
call builds a shorter key than ``decode_forward``'s; each is the call
``decode_forward``'s key keeps.) Anything else takes ``run_checked``.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor

from . import config, ops

__all__ = ["attention_op", "attention_op_not_compiling", "may_skip_dispatch", "forget_signatures",
           "decode_lane_off", "LaneSite", "lane_site", "lane_call_at"]

# Signatures that passed the op's checks (``_signature``) -> their
# ``_DecodeLane``, or None (not a decode call); cleared when full. One dict,
# so that a call hashes its signature once.
_LANES: dict = {}
_MAX_SIGNATURES = 1024
_UNSEEN = object()
# Calls that took the fast path (tests count them), and of those the decode lane.
HITS = [0]
LANE_HITS = [0]
_decode = None  # flashfuse.kernels.decode, imported with the first lane


class _DecodeLane(NamedTuple):
    """A passing signature's call as ``decode_forward`` takes it (see the
    module docstring): the normalised scale and band, the sizes that
    ``decode.size_refusal`` reads besides the key count, the device type, and
    an object of this signature's own, under which ``decode.lane_forward``
    keeps its calls."""

    scale: float
    window_left: int | None
    window_right: int | None
    bottom_right: bool
    N: int  # queries per head
    G: int  # query heads per key/value head
    on_cuda: bool
    token: object


def forget_signatures() -> None:
    """Forget every signature (the next call of each takes the op)."""
    _clear_lanes()


# Times ``_LANES`` was cleared: a ``LaneSite`` made before then is stale.
_LANES_EPOCH = [0]


def _clear_lanes() -> None:
    _LANES.clear()
    _LANES_EPOCH[0] += 1


_LANE_ON = [True]


@contextlib.contextmanager
def decode_lane_off():
    """Within the block no signature gets a decode lane (its calls take
    ``run_checked``), and every signature is forgotten on entry and exit:
    for benchmarks that time the lane against the path without it
    (``bench/decode_host.py``)."""
    forget_signatures()
    _LANE_ON[0] = False
    try:
        yield
    finally:
        _LANE_ON[0] = True
        forget_signatures()


def may_skip_dispatch(*tensors: Tensor | None) -> bool:
    """The fast path's rule (see the module docstring): a plain eager call,
    ``ops._plain_eager_call``, with no torch-function mode either (the
    dispatcher hands the op to one; the private ops skipped by the
    composite's own eager path have no such hop), and no profiler running
    (its traces name the op only when the dispatcher runs it)."""
    return not torch.compiler.is_compiling() and _may_skip_when_not_compiling(tensors)


def _may_skip_when_not_compiling(tensors: tuple) -> bool:
    """``may_skip_dispatch`` for a caller that has read
    ``torch.compiler.is_compiling()`` as False itself."""
    return (ops._plain_when_not_compiling(tensors) and not torch._C._is_torch_function_mode_enabled()
            and not torch.autograd.profiler._is_profiler_enabled)


def _tensor(t) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.dtype, t.device, t.layout, t.requires_grad)


def _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left, window_right,
               alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks) -> tuple:
    """What the op's checks read of a call (see the module docstring)."""
    ks, vs = key.shape, value.shape
    M = ks[2] if len(ks) == 4 else None
    tables = mask_key_table is not None or mask_query_table is not None
    if M is not None and not tables:
        # The key length only as the checks compare it; None can equal no
        # size, so a 4-D shape never meets another rank's.
        ks = (ks[0], ks[1], None, ks[3])
        vs = (vs[0], vs[1], vs[2] == M, vs[3]) if len(vs) == 4 else vs
    mask = None
    if attn_mask is not None:
        mask = _tensor(attn_mask)
        ms = mask[1]
        if M is not None and not tables and len(ms) >= 1 and ms[-1] == M:
            mask = (mask[0], (*ms[:-1], None), *mask[2:])
    return (
        type(query), query.shape, query.dtype, query.device, query.layout, query.requires_grad,
        type(key), ks, key.dtype, key.device, key.layout, key.requires_grad,
        type(value), vs, value.dtype, value.device, value.layout, value.requires_grad,
        mask, None if sinks is None else _tensor(sinks),
        None if mask_key_table is None else _tensor(mask_key_table),
        None if mask_query_table is None else _tensor(mask_query_table),
        dropout_p, is_causal, scale, enable_gqa, window_left, window_right, alignment, mask_fill, softcap,
        type(dropout_p), type(is_causal), type(scale), type(enable_gqa), type(window_left), type(window_right),
        type(alignment), type(mask_fill), type(softcap),
    )


def attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_left: int | None = None,
    window_right: int | None = None,
    alignment: str = "top_left",
    mask_fill: float | None = None,
    mask_key_table: Tensor | None = None,
    mask_query_table: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """``torch.ops.flashfuse.attention`` with the same arguments and
    results, minus the dispatcher and the checks for a plain eager call
    whose signature passed them before (see the module docstring)."""
    if may_skip_dispatch(query, key, value, attn_mask, sinks, mask_key_table, mask_query_table):
        return _plain_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left,
                           window_right, alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks,
                           False)
    return torch.ops.flashfuse.attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left=window_left,
        window_right=window_right, alignment=alignment, mask_fill=mask_fill, mask_key_table=mask_key_table,
        mask_query_table=mask_query_table, softcap=softcap, sinks=sinks)


def attention_op_not_compiling(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_left: int | None = None,
    alignment: str = "top_left",
    transpose_out: bool = False,
) -> Tensor:
    """:func:`attention_op` (without the block-mask tables, soft-capping,
    sinks, a right window or a mask fill) for a caller that has just read
    ``torch.compiler.is_compiling()`` as False: the Hugging Face hook's
    decode calls (``flashfuse.hf``). ``may_skip_dispatch`` less that read:
    two Python calls fewer per layer per token than ``attention_op``.

    ``transpose_out``: return ``out.transpose(1, 2).contiguous()``, of shape
    (B, N, Hq, Dv), as the hook does; the decode lane allocates it in that
    order (the op's output lies in memory so), without the view."""
    if _may_skip_when_not_compiling((query, key, value, attn_mask)):
        return _plain_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left, None,
                           alignment, None, None, None, None, None, transpose_out)
    return _as_asked(attention_op(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                  window_left=window_left, alignment=alignment), transpose_out)


def _lane_knobs(lane: _DecodeLane, query: Tensor, M: int) -> tuple | None:
    """The decode settings (``config.decode_knobs()``) when a call of
    ``lane``'s signature with ``M`` keys takes the decode kernels, as the
    op's route would decide now (``FLASHFUSE_DECODE``, the key count
    against ``decode.size_refusal``, the kernels running on the device);
    None when it does not."""
    mode, knobs = config.decode_settings()
    if (mode != "0" and M != 0 and (mode == "1" or _decode.size_refusal(lane.N, lane.G, M) is None)
            and (lane.on_cuda or ops._use_triton(query))):
        return knobs
    return None


def _as_asked(out: Tensor, transpose_out: bool) -> Tensor:
    """The op's output, or with ``transpose_out`` (B, N, Hq, Dv) contiguous."""
    return out.transpose(1, 2).contiguous() if transpose_out else out


def _plain_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left, window_right,
                alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks, transpose_out) -> Tensor:
    """A plain eager call (``may_skip_dispatch``): its decode lane or
    ``run_checked`` when its signature passed before, else the op, whose
    signature is then remembered. ``transpose_out``: see
    ``attention_op_not_compiling``."""
    sig = _signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left,
                     window_right, alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks)
    lane = _LANES.get(sig, _UNSEEN)
    if lane is not _UNSEEN:
        HITS[0] += 1
        if lane is not None:
            # ``decode_forward``'s output when this call takes the decode
            # kernels; what is asked is what ``run_checked`` would ask.
            knobs = _lane_knobs(lane, query, key.shape[2])
            if knobs is not None:
                LANE_HITS[0] += 1
                return _decode.lane_forward(lane.token, query, key, value, attn_mask, lane.scale,
                                            lane.window_left, lane.window_right, lane.bottom_right, knobs,
                                            transpose_out)
        return _as_asked(ops.run_checked(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left,
                                         window_right, alignment, mask_fill, mask_key_table, mask_query_table,
                                         softcap, sinks, plain=True), transpose_out)
    out = torch.ops.flashfuse.attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left=window_left,
        window_right=window_right, alignment=alignment, mask_fill=mask_fill, mask_key_table=mask_key_table,
        mask_query_table=mask_query_table, softcap=softcap, sinks=sinks)
    # Reached only when the op's checks passed (a bad input raised above).
    if len(_LANES) >= _MAX_SIGNATURES:
        _clear_lanes()
    _LANES[sig] = _decode_lane(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left,
                               window_right, alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks)
    return _as_asked(out, transpose_out)


_STRIDED = torch.strided


class LaneSite:
    """One caller's decode lane, kept where it calls from: the Hugging Face
    hook keeps one per layer, with the layer's kept reads (``flashfuse.hf``).
    A site stands for the calls of ``attention_op_not_compiling`` without a
    mask whose scalar arguments are the ones it was made with (the caller
    vouches for that) and whose tensors have what the lane's signature
    holds of them: the same types, dtypes, devices and layouts, no
    gradients, q's shape, and k's and v's sizes but the key length (equal
    to each other). Such a call has the lane's signature, so
    ``lane_call_at`` takes the lane without building and hashing the
    signature (about 40 values), and without ``decode.lane_forward``'s
    checks of what the signature fixes. ``epoch``: ``_LANES_EPOCH`` when
    made (a site of forgotten signatures is stale)."""

    __slots__ = ("epoch", "lane", "types", "dtypes", "device", "q_shape", "k_sizes", "v_sizes", "transpose_out")


def lane_site(query: Tensor, key: Tensor, value: Tensor, dropout_p: float, is_causal: bool, scale, enable_gqa: bool,
              window_left, alignment: str, transpose_out: bool) -> LaneSite | None:
    """The site of ``attention_op_not_compiling(query, key, value, None,
    dropout_p, is_causal, scale, enable_gqa, window_left=window_left,
    alignment=alignment, transpose_out=transpose_out)``, a call that has just
    run, when its signature has a decode lane; else None."""
    sig = _signature(query, key, value, None, dropout_p, is_causal, scale, enable_gqa, window_left, None, alignment,
                     None, None, None, None, None)
    lane = _LANES.get(sig)
    ks, vs = key.shape, value.shape
    devices = {query.device, key.device, value.device}
    if (lane is None or len(ks) != 4 or len(vs) != 4 or len(devices) != 1
            or not (query.layout is _STRIDED and key.layout is _STRIDED and value.layout is _STRIDED)):
        return None
    site = LaneSite()
    site.epoch, site.lane, site.transpose_out = _LANES_EPOCH[0], lane, transpose_out
    site.types = (type(query), type(key), type(value))
    site.dtypes = (query.dtype, key.dtype, value.dtype)
    (site.device,) = devices
    site.q_shape, site.k_sizes, site.v_sizes = query.shape, (ks[0], ks[1], ks[3]), (vs[0], vs[1], vs[3])
    return site


def lane_call_at(site: LaneSite, query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
    """``attention_op_not_compiling``'s result for a call of ``site`` (see
    ``LaneSite``) that takes the site's lane, as ``_plain_call`` would send
    it there: a plain eager call (``may_skip_dispatch``), the lane's
    signature, the decode kernels on (``FLASHFUSE_DECODE``, the key count),
    and the lane's kept step serving it (``decode.lane_step_forward``).
    None, with nothing run, for any other call: the caller then takes
    ``attention_op_not_compiling``."""
    if site.epoch != _LANES_EPOCH[0]:
        return None
    qs, ks, vs = query.shape, key.shape, value.shape
    types, dtypes, device = site.types, site.dtypes, site.device
    k_sizes, v_sizes = site.k_sizes, site.v_sizes
    if not (qs == site.q_shape and len(ks) == 4 and len(vs) == 4 and ks[2] == vs[2]
            and ks[0] == k_sizes[0] and ks[1] == k_sizes[1] and ks[3] == k_sizes[2]
            and vs[0] == v_sizes[0] and vs[1] == v_sizes[1] and vs[3] == v_sizes[2]
            and type(query) is types[0] and type(key) is types[1] and type(value) is types[2]
            and query.dtype is dtypes[0] and key.dtype is dtypes[1] and value.dtype is dtypes[2]
            and not (query.requires_grad or key.requires_grad or value.requires_grad)
            and query.layout is _STRIDED and key.layout is _STRIDED and value.layout is _STRIDED
            and query.device == device and key.device == device and value.device == device):
        return None
    # The fast path's rule; the tensors' types are the site's, which passed
    # it (so no tensor is handed over to be checked again).
    if not _may_skip_when_not_compiling(()):
        return None
    lane = site.lane
    knobs = _lane_knobs(lane, query, ks[2])
    if knobs is None:
        return None
    out = _decode.lane_step_forward(lane.token, query, key, value, ks[2], knobs, lane.scale, lane.window_left,
                                    lane.window_right, site.transpose_out)
    if out is not None:
        HITS[0] += 1
        LANE_HITS[0] += 1
    return out


def _decode_lane(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right, alignment,
                 mask_fill, mask_key_table, mask_query_table, softcap, sinks) -> _DecodeLane | None:
    """The lane of a signature that just passed the op, or None when its
    calls must take ``run_checked`` (see the module docstring)."""
    global _decode
    # dropout_p >= 1 leaves no seed and reaches the kernels as 0, but
    # run_checked zeroes its output: only dropout-free calls take the lane.
    if (not _LANE_ON[0] or dropout_p != 0.0 or mask_key_table is not None or mask_query_table is not None
            or query.requires_grad or key.requires_grad or value.requires_grad
            or (attn_mask is not None and attn_mask.requires_grad)
            or query.shape[2] == 0 or ops._kernels is None):
        return None
    if _decode is None:
        _decode = ops._kernels.modules().decode
    # The arguments exactly as run_checked hands them to the kernels' route.
    a = ops._forward_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                          alignment, mask_fill, new_seed=lambda: None, softcap=softcap, sinks=sinks)
    call = _decode.DecodeCall(a.q, a.k, a.attn_mask, a.dropout_p, a.window_left, a.window_right, a.bottom_right,
                              a.mask_fill, a.softcap, a.sinks)
    if _decode.argument_refusal(call) is not None:
        return None
    return _DecodeLane(a.scale, a.window_left, a.window_right, a.bottom_right, query.shape[2],
                       query.shape[1] // key.shape[1], query.device.type == "cuda", object())

