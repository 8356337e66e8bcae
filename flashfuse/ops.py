"""The flashfuse operators, registered with ``torch.library``.

Three ops live in the ``flashfuse`` namespace:

``flashfuse::attention``
    The public op, with the arguments of
    ``torch.nn.functional.scaled_dot_product_attention`` plus a window and a
    causal alignment. A composite: it checks and normalises its arguments,
    draws the dropout seed, and calls ``_attention_forward``. Being composite,
    it stays a single node in Dynamo graphs (which the graph pass emits) and is
    decomposed by AOTAutograd into the two private ops.
``flashfuse::_attention_forward`` / ``flashfuse::_attention_backward``
    The forward and backward, with fake implementations and autograd
    (``torch.library.triton_op``). On CUDA tensors they launch the Triton
    kernels; when AOTAutograd traces them for ``torch.compile``, those
    launches are recorded into the graph, so that Inductor launches the
    kernels from its generated code without calling back into Python. On CPU
    tensors they call ``_attention_forward_cpu`` / ``_attention_backward_cpu``,
    opaque ops that run the kernels in Triton's interpreter under
    ``TRITON_INTERPRET=1`` and the blockwise PyTorch implementation otherwise.

Everything that can be checked without the data is checked here, once, so the
kernels can assume valid input.
"""

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import config, reference

try:  # Triton is a dependency, but a CPU-only install without it should still run.
    import triton  # noqa: F401

    from . import kernels as _kernels
except ImportError:  # pragma: no cover - exercised only without triton
    _kernels = None

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# float64 runs on the blockwise CPU path only (it exists for gradcheck).
CPU_ONLY_DTYPES = (torch.float64,)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
ALIGNMENTS = ("top_left", "bottom_right")

_ATTENTION_SCHEMA = (
    "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
    "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
    "*, int? window_left=None, int? window_right=None, str alignment=\"top_left\", "
    "float? mask_fill=None, Tensor? mask_key_table=None, Tensor? mask_query_table=None, float? softcap=None, "
    "Tensor? sinks=None) -> Tensor"
)

_lib = torch.library.Library("flashfuse", "FRAGMENT")
_lib.define(_ATTENTION_SCHEMA)


# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------

def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensors(where: str, named: tuple, dims: str = "", fix: str = "") -> None:
    """The checks every op of flashfuse starts with, on its (name, tensor)
    pairs, first the query's: tensors, 4-D (``dims`` and ``fix`` say which
    dimensions and how to get them), dense, one dtype and device, a device and dtype the op
    runs on. Raises ``TypeError`` / ``ValueError`` prefixed by ``where``
    (the op's public name)."""
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{where}: {name} must be 4-D{dims}, got shape {tuple(t.shape)}{fix}")
    for name, t in named:
        if t.layout != torch.strided:
            raise ValueError(
                f"{where}: {name} has layout {t.layout}; only dense (strided) tensors "
                "are supported, convert with .to_dense()"
            )
    names = ", ".join(n for n, _ in named[:-1]) + f" and {named[-1][0]}"
    q = named[0][1]
    if any(t.dtype != q.dtype for _, t in named):
        raise ValueError(
            f"{where}: {names} must share a dtype, got "
            f"{', '.join(str(t.dtype) for _, t in named)}; cast them to one dtype first"
        )
    if any(t.device != q.device for _, t in named):
        raise ValueError(f"{where}: {names} must be on one device, got {', '.join(str(t.device) for _, t in named)}")
    device_type = q.device.type
    if device_type not in ("cuda", "cpu", "meta"):
        raise ValueError(f"{where}: tensors on {device_type!r} are not supported; use CUDA or CPU tensors")
    allowed = SUPPORTED_DTYPES + (CPU_ONLY_DTYPES if device_type != "cuda" else ())
    if q.dtype not in allowed:
        raise ValueError(
            f"{where}: dtype {q.dtype} is not supported on {device_type}; supported: {_dtype_names(allowed)}"
        )


def check_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    enable_gqa: bool,
    window_left: int | None,
    window_right: int | None,
    alignment: str,
) -> None:
    """Raise ``ValueError`` naming the problem and the fix for any input the
    op cannot compute exactly. Runs on real and fake tensors alike."""
    check_tensors("flashfuse.attention", (("query", query), ("key", key), ("value", value)),
                  dims=" (batch, heads, seq_len, head_dim)",
                  fix="; add a heads dimension with .unsqueeze(1) or reshape (B, N, H*D) inputs to (B, H, N, D)")
    B, Hq, N, D = query.shape
    Bk, Hkv, M, Dk = key.shape
    Bv, Hv, Mv, Dv = value.shape
    if Bk != B or Bv != B:
        raise ValueError(
            f"flashfuse.attention: batch sizes differ: query {B}, key {Bk}, value {Bv}"
        )
    if Hv != Hkv or Mv != M:
        raise ValueError(
            "flashfuse.attention: key and value must have the same heads and sequence length, "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if Dk != D:
        raise ValueError(
            f"flashfuse.attention: query and key head dims differ ({D} vs {Dk}); "
            "the scores q @ k^T need equal head dims"
        )
    for name, d in (("query/key", D), ("value", Dv)):
        if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM):
            raise ValueError(
                f"flashfuse.attention: {name} head dim {d} is not supported; "
                f"supported head dims are {MIN_HEAD_DIM} to {MAX_HEAD_DIM} (any value in between)"
            )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"flashfuse.attention: query heads ({Hq}) must be a multiple of key/value heads ({Hkv})"
        )
    if Hq != Hkv and not enable_gqa:
        raise ValueError(
            f"flashfuse.attention: query has {Hq} heads but key/value have {Hkv}; "
            "pass enable_gqa=True for grouped-query attention"
        )
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError("flashfuse.attention: attn_mask must be a Tensor or None")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(
                f"flashfuse.attention: attn_mask dtype {attn_mask.dtype} is not supported; "
                "use a bool mask (True takes part) or a floating mask added to the scores"
            )
        if attn_mask.device != query.device:
            raise ValueError(
                f"flashfuse.attention: attn_mask is on {attn_mask.device} but query is on {query.device}"
            )
        target = (B, Hq, N, M)
        shape = tuple(attn_mask.shape)
        if len(shape) > 4 or any(
            s != 1 and s != t for s, t in zip(reversed(shape), reversed(target))
        ):
            raise ValueError(
                f"flashfuse.attention: attn_mask of shape {shape} does not broadcast to "
                f"(batch, heads, query_len, key_len) = {target}"
            )
    if not (0.0 <= dropout_p <= 1.0) or math.isnan(dropout_p):
        raise ValueError(f"flashfuse.attention: dropout_p must be in [0, 1], got {dropout_p}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if w is not None and w < 0:
            raise ValueError(f"flashfuse.attention: {name} must be None or >= 0, got {w}")
    if alignment not in ALIGNMENTS:
        raise ValueError(
            f"flashfuse.attention: alignment must be one of {ALIGNMENTS}, got {alignment!r}"
        )


def check_softcap_sinks(query: Tensor, softcap: float | None, sinks: Tensor | None) -> float | None:
    """The soft-cap the kernels get (None or a positive finite float); raises
    ``ValueError`` for a cap that is not positive and finite, and for sinks
    that are not one value per query head on the query's device."""
    if softcap is not None:
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0.0):
            raise ValueError(
                f"flashfuse.attention: softcap must be a positive finite number (scores become "
                f"softcap * tanh(scores / softcap)) or None, got {softcap}"
            )
    if sinks is not None:
        if not isinstance(sinks, Tensor):
            raise TypeError(f"flashfuse.attention: sinks must be a Tensor or None, got {type(sinks).__name__}")
        Hq = query.shape[1]
        if sinks.dim() != 1 or sinks.shape[0] != Hq:
            raise ValueError(
                f"flashfuse.attention: sinks must have shape (query_heads,) = ({Hq},), got "
                f"{tuple(sinks.shape)}; one logit per query head, e.g. gpt-oss's module.sinks"
            )
        if sinks.device != query.device:
            raise ValueError(f"flashfuse.attention: sinks are on {sinks.device} but query is on {query.device}")
        if sinks.dtype not in (torch.float32, query.dtype):
            raise ValueError(
                f"flashfuse.attention: sinks dtype {sinks.dtype} is not supported with {query.dtype} inputs; "
                f"use float32 or {query.dtype}"
            )
    return softcap


def causal_window_right(is_causal: bool, window_right: int | None) -> int | None:
    """The right window bound with ``is_causal`` folded in (causal is
    ``window_right=0``; a tighter bound given with it stays)."""
    if not is_causal:
        return window_right
    return 0 if window_right is None else min(window_right, 0)


def check_mask_fill(attn_mask: Tensor | None, mask_fill: float | None) -> float | None:
    """The fill the kernels get: None (hidden pairs take no part) or a
    finite score for the pairs a bool mask hides. Raises ``ValueError`` for
    a fill with a float mask or a fill that is NaN or +inf."""
    if mask_fill is None:
        return None
    mask_fill = float(mask_fill)
    if math.isnan(mask_fill) or mask_fill == math.inf:
        raise ValueError(
            f"flashfuse.attention: mask_fill must be a finite number or -inf, got {mask_fill}"
        )
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError(
            "flashfuse.attention: mask_fill replaces the scores that a bool attn_mask hides, but attn_mask "
            f"is {attn_mask.dtype}; add a float mask to the scores without mask_fill, or pass a bool mask"
        )
    if attn_mask is None or mask_fill == -math.inf:
        return None  # nothing to fill, or the default meaning
    return mask_fill


# --------------------------------------------------------------------------
# The public composite op
# --------------------------------------------------------------------------

def _attention_composite(
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
    check_inputs(query, key, value, attn_mask, dropout_p, enable_gqa, window_left, window_right, alignment)
    return run_checked(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                       alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks)


def run_checked(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right, alignment,
                mask_fill, mask_key_table, mask_query_table, softcap, sinks, plain: bool | None = None) -> Tensor:
    """The composite past ``check_inputs``: the remaining checks, the
    normalised arguments, the forward. ``plain``: ``_plain_eager_call``'s
    answer when the caller knows it (``fastpath``), else asked here."""
    args = _args_past_checks(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                             alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks)
    if plain is None:
        plain = _plain_eager_call(query, key, value, attn_mask, sinks)
    if plain:
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or (attn_mask is not None and attn_mask.requires_grad)
                                        or (sinks is not None and sinks.requires_grad)):
            out = _EagerAttention.apply(*args)
        else:  # nothing to differentiate (inference, decoding): no autograd node to build
            out, _ = _attention_forward(*args)
    else:
        out, _ = torch.ops.flashfuse._attention_forward(*args)
    if dropout_p >= 1.0:
        # Everything dropped: zeros that still carry (zero) gradients.
        out = out * 0.0
    return out


def checked_forward_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window_left,
                         window_right, alignment, mask_fill, mask_key_table, mask_query_table, softcap,
                         sinks) -> "ForwardArgs":
    """The start of a public composite (``attention``,
    ``attention_with_lse``), with its arguments in order: every check, then
    ``_args_past_checks``."""
    check_inputs(query, key, value, attn_mask, dropout_p, enable_gqa, window_left, window_right, alignment)
    return _args_past_checks(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                             alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks)


def _args_past_checks(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                      alignment, mask_fill, mask_key_table, mask_query_table, softcap, sinks) -> "ForwardArgs":
    """Past ``check_inputs``: the block mask's tables checked, then
    ``_forward_args`` with a fresh seed. The seed is drawn from PyTorch's
    generator so torch.manual_seed reproduces a run; a device tensor so CUDA
    graphs and Inductor's RNG handling see it."""
    tables = _check_tables(query, key, attn_mask, mask_key_table, mask_query_table)
    return _forward_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                         alignment, mask_fill,
                         new_seed=lambda: torch.randint(2**62, (), dtype=torch.int64, device=query.device),
                         tables=tables, softcap=softcap, sinks=sinks)


class ForwardArgs(NamedTuple):
    """The inputs of ``_attention_forward`` (and of its op), in order: read
    them by name (autograd's ``needs_input_grad`` through ``input_index``)."""

    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Optional[Tensor]
    seed: Optional[Tensor]
    dropout_p: float
    scale: float
    window_left: Optional[int]
    window_right: Optional[int]
    bottom_right: bool
    mask_fill: Optional[float]
    mask_key_table: Optional[Tensor]
    mask_query_table: Optional[Tensor]
    softcap: Optional[float]
    sinks: Optional[Tensor]


def input_index(name: str) -> int:
    """Position of a forward input (``ForwardArgs``), for ``needs_input_grad``."""
    return ForwardArgs._fields.index(name)


def _forward_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                  alignment, mask_fill, new_seed, tables=(None, None), softcap=None, sinks=None) -> "ForwardArgs":
    """The arguments of ``_attention_forward`` for a public call whose
    inputs are checked: the default scale, ``is_causal`` as the window's
    right bound, the fill normalised, and a seed from ``new_seed()`` when
    dropout draws."""
    if mask_fill is not None:
        mask_fill = check_mask_fill(attn_mask, mask_fill)
    if softcap is not None or sinks is not None:
        softcap = check_softcap_sinks(query, softcap, sinks)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif not math.isfinite(scale):
        raise ValueError(f"flashfuse.attention: scale must be a finite number, got {scale}")
    window_right = causal_window_right(is_causal, window_right)
    seed = new_seed() if 0.0 < dropout_p < 1.0 else None
    return ForwardArgs(
        query, key, value, attn_mask, seed, dropout_p if seed is not None else 0.0, float(scale),
        window_left, window_right, alignment == "bottom_right", mask_fill, *tables, softcap, sinks,
    )


def kernel_problem(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, window_left=None, window_right=None, alignment="top_left",
                   mask_fill=None, softcap=None, sinks=None, backward=False) -> str | None:
    """Why the CUDA kernels could not run ``attention`` with these
    arguments (the public op's, on fake or real tensors), or None when they
    can or the tensors are not on CUDA. ``backward`` asks for the gradient
    kernels too. Nothing runs: see ``kernels.launch_problem``. The graph
    pass asks this before it emits an op call."""
    if _kernels is None or query.device.type != "cuda":
        return None
    args = _kernel_call_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                             alignment, mask_fill, softcap, sinks)
    return _kernels.launch_problem(*args, backward=backward)


def _kernel_call_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                      alignment, mask_fill, softcap, sinks) -> "ForwardArgs":
    """``_attention_forward``'s arguments for a public call that nothing
    runs (the kernels' dry run and naming): a stand-in seed."""
    return _forward_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                         alignment, mask_fill, new_seed=lambda: query.new_empty((), dtype=torch.int64),
                         softcap=softcap, sinks=sinks)


def forward_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, window_left=None, window_right=None, alignment="top_left",
                   mask_fill=None, softcap=None, sinks=None) -> str | None:
    """Which forward kernel ``attention`` with these arguments (the public
    op's, on fake or real tensors) takes on CUDA (``kernels.forward_kernel``),
    or None for tensors not on CUDA. ``explain`` reports it per candidate."""
    if _kernels is None or query.device.type != "cuda":
        return None
    return _kernels.forward_kernel(*_kernel_call_args(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                      window_left, window_right, alignment, mask_fill, softcap,
                                                      sinks))


def takes_decode_kernels(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, alignment,
                         softcap=None, sinks=None) -> bool:
    """Whether an eager call of ``attention`` with these arguments (no right
    window, fill or block-mask tables) runs its forward on the split-KV
    decode kernels: the kernels' own route rule (``decode.decode_suits``)
    on the arguments as the op hands them over, with nothing launched.
    False where the kernels do not run on these tensors, and for arguments
    the op would refuse (its checks have not run: the op raises then). The
    Hugging Face hook asks, to skip building a mask's block tables, which
    that route never reads."""
    if not _use_triton(query):
        return False
    try:
        # (a stand-in seed: with none, dropout would read as off)
        a = _forward_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, None, alignment,
                          None, new_seed=lambda: 0, softcap=softcap, sinks=sinks)
        decode = _kernels.modules().decode
        return decode.decode_suits(decode.DecodeCall(a.q, a.k, a.attn_mask, a.dropout_p, a.window_left,
                                                     a.window_right, a.bottom_right, a.mask_fill, a.softcap, a.sinks))
    except Exception:  # a bad argument: the op's checks name it
        return False


def backward_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, *, window_left=None, window_right=None, alignment="top_left",
                    mask_fill=None, softcap=None, sinks=None) -> str | None:
    """Which backward kernels ``attention`` with these arguments takes on
    CUDA (``kernels.backward_kernel``), or None for tensors not on CUDA. The
    output gradient's layout is known only when the backward runs: this
    answers for one the copy engine can read (a call given another takes
    the portable kernels). ``explain`` reports it for candidates that need
    gradients."""
    if _kernels is None or query.device.type != "cuda":
        return None
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    a = _kernel_call_args(query, key, value, attn_mask, dropout_p, is_causal, scale, window_left, window_right,
                          alignment, mask_fill, softcap, sinks)
    B, Hq, N = a.q.shape[:3]
    shape = (B, Hq, N, a.v.shape[-1])
    # Stand-ins with no memory behind them, in the inputs' fake mode when
    # they are fake (their sizes may be symbolic): the rule then answers as
    # for a traced backward, which checks the layout when it runs.
    mode = detect_fake_mode((a.q, a.k, a.v)) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        grad_out = torch.empty(shape, dtype=a.q.dtype, device=a.q.device)
        out = torch.empty(shape, dtype=a.q.dtype, device=a.q.device)
        lse = torch.empty((B, Hq, N), dtype=torch.float32, device=a.q.device)
        mask_grad = a.attn_mask is not None and a.attn_mask.is_floating_point() and a.attn_mask.requires_grad
        return _kernels.backward_kernel(
            grad_out, a.q, a.k, a.v, a.attn_mask, a.seed, out, lse, dropout_p=a.dropout_p, scale=a.scale,
            window_left=a.window_left, window_right=a.window_right, bottom_right=a.bottom_right,
            mask_grad=mask_grad, mask_fill=a.mask_fill, key_table=a.mask_key_table,
            query_table=a.mask_query_table, softcap=a.softcap)


def _plain_eager_call(*tensors: Tensor | None) -> bool:
    """True for an ordinary eager call: real tensors (parameters included), no
    compiler, tracer, dispatch mode or functorch transform watching. Only then
    may the op skip its private ops (see ``_EagerAttention``); anything that
    records or transforms the call must see the ops."""
    return not torch.compiler.is_compiling() and _plain_when_not_compiling(tensors)


def _plain_when_not_compiling(tensors: tuple) -> bool:
    """``_plain_eager_call`` for a caller that has read
    ``torch.compiler.is_compiling()`` as False itself."""
    for t in tensors:  # a loop, not all(...): this runs at every eager call
        if t is not None and type(t) is not Tensor and type(t) is not torch.nn.Parameter:
            return False
    return (
        torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.peek_interpreter_stack() is None
        and torch._C._get_tracing_state() is None
    )


def _check_tables(query, key, attn_mask, key_table, query_table):
    """The block mask's tables (see ``block_mask.check_tables``)."""
    if key_table is None and query_table is None:
        return None, None
    from .block_mask import check_tables

    return check_tables(query, key, attn_mask, key_table, query_table)


_lib.impl("attention", _attention_composite, "CompositeImplicitAutograd")


# --------------------------------------------------------------------------
# Private ops: forward and backward
# --------------------------------------------------------------------------

def _use_triton(t: Tensor) -> bool:
    if _kernels is None:
        return False
    if t.device.type == "cuda":
        return True
    # Kernels are built for the interpreter only if TRITON_INTERPRET=1 was set
    # when they were imported; the variable is re-read here so tests can switch
    # a process to the fast blockwise path by setting it to 0.
    return _kernels.BUILT_FOR_INTERPRETER and config.interpreter_on() and t.dtype in SUPPORTED_DTYPES


def _empty_out(q: Tensor, v: Tensor) -> Tensor:
    B, Hq, N, _ = q.shape
    Dv = v.shape[-1]
    # (B, N, H, Dv) in memory: the usual out.transpose(1, 2).reshape(B, N, H*Dv) is free.
    return q.new_empty_strided((B, Hq, N, Dv), (N * Hq * Dv, Dv, Hq * Dv, 1))


# The CPU ops are declared with ``Library.define`` and given one plain kernel,
# rather than through ``torch.library.custom_op``: the latter wraps every call
# in Python checks that cost host time. They have no autograd of their own:
# they are only called from the private ops, below autograd.
_FORWARD_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? seed, "
    "float dropout_p, float scale, SymInt? window_left, SymInt? window_right, bool bottom_right, "
    "float? mask_fill=None, Tensor? mask_key_table=None, Tensor? mask_query_table=None, float? softcap=None, "
    "Tensor? sinks=None"
)
_BACKWARD_ARGS = (
    "Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
    "Tensor? seed, Tensor out, Tensor lse, float dropout_p, float scale, SymInt? window_left, "
    "SymInt? window_right, bool bottom_right, bool mask_grad, float? mask_fill=None, "
    "Tensor? mask_key_table=None, Tensor? mask_query_table=None, float? softcap=None, Tensor? grad_lse=None"
)
_lib.define(f"_attention_forward_cpu({_FORWARD_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"_attention_backward_cpu({_BACKWARD_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")


def _attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    seed: Tensor | None,
    dropout_p: float,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    bottom_right: bool,
    mask_fill: float | None = None,
    mask_key_table: Tensor | None = None,
    mask_query_table: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Flash-attention forward. Returns ``out`` (B, Hq, N, Dv) and the per-row
    log-sum-exp ``lse`` (B, Hq, N) float32, natural log, +inf for rows that see
    no key, ``reference.lse_marker`` for rows that a finite value hides
    entirely. With ``sinks`` the lse includes the row's sink logit. Arguments
    are already checked by ``flashfuse::attention``."""
    B, Hq, N, _ = q.shape
    M = k.shape[2]
    if N == 0 or M == 0:
        out = _empty_out(q, v).zero_()
        lse = torch.full((B, Hq, N), math.inf, dtype=torch.float32, device=q.device)
        return out, lse
    # A block mask's tables (the forward reads the key table; the query
    # table is an input only so that autograd saves it for the backward).
    triton_ = _use_triton(q)
    tables = {"key_table": mask_key_table} if mask_key_table is not None and triton_ else {}
    impl = _kernels.attention_forward if triton_ else reference.blockwise_forward
    return impl(
        q, k, v, attn_mask, seed,
        dropout_p=dropout_p, scale=scale, window_left=window_left,
        window_right=window_right, bottom_right=bottom_right, mask_fill=mask_fill, **tables,
        softcap=softcap, sinks=sinks,
    )


def _attention_forward_fake(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right,
                            mask_fill=None, mask_key_table=None, mask_query_table=None, softcap=None, sinks=None):
    B, Hq, N, _ = q.shape
    return _empty_out(q, v), q.new_empty((B, Hq, N), dtype=torch.float32)


def _attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    seed: Tensor | None,
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    bottom_right: bool,
    mask_grad: bool,
    mask_fill: float | None = None,
    mask_key_table: Tensor | None = None,
    mask_query_table: Tensor | None = None,
    softcap: float | None = None,
    grad_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flash-attention backward: ``dq``, ``dk``, ``dv`` (``empty_like`` their
    inputs) and ``dmask`` (the mask's shape and dtype when ``mask_grad``, else
    an empty tensor). Probabilities are recomputed from ``lse``. ``grad_lse``:
    the gradient of lse where a caller returns it (``attention_with_lse``)."""
    N = q.shape[2]
    M = k.shape[2]
    if N == 0 or M == 0:
        dmask = _empty_dmask(attn_mask, q, mask_grad).zero_()
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask
    tables = {}
    if _use_triton(q):
        tables = {"key_table": mask_key_table, "query_table": mask_query_table}
    impl = _kernels.attention_backward if _use_triton(q) else reference.blockwise_backward
    dq, dk, dv, dmask = impl(
        grad_out, q, k, v, attn_mask, seed, out, lse,
        dropout_p=dropout_p, scale=scale, window_left=window_left,
        window_right=window_right, bottom_right=bottom_right, mask_grad=mask_grad, mask_fill=mask_fill,
        **tables,
        softcap=softcap,
        **({"grad_lse": grad_lse} if grad_lse is not None else {}),
    )
    if dmask is None:
        dmask = _empty_dmask(attn_mask, q, False)
    return dq, dk, dv, dmask


def _empty_dmask(attn_mask: Tensor | None, q: Tensor, mask_grad: bool) -> Tensor:
    if mask_grad and attn_mask is not None:
        return torch.empty(attn_mask.shape, dtype=attn_mask.dtype, device=attn_mask.device)
    return q.new_empty(0)


def _attention_backward_fake(grad_out, q, k, v, attn_mask, seed, out, lse, dropout_p, scale, window_left,
                             window_right, bottom_right, mask_grad, mask_fill=None, mask_key_table=None,
                             mask_query_table=None, softcap=None, grad_lse=None):
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        _empty_dmask(attn_mask, q, mask_grad),
    )


_lib.impl("_attention_forward_cpu", _attention_forward, "CPU")
_lib.impl("_attention_backward_cpu", _attention_backward, "CPU")
torch.library.register_fake("flashfuse::_attention_forward_cpu", _attention_forward_fake, lib=_lib)
torch.library.register_fake("flashfuse::_attention_backward_cpu", _attention_backward_fake, lib=_lib)


# The Hopper forward inside a traced graph: Inductor launches Triton kernels
# from its generated code but not Gluon ones, so a traced forward that the
# Hopper kernel suits (``hopper.traced_takes``) records this opaque op, whose
# CUDA kernel runs the eager launcher on the real tensors (the Hopper kernel,
# or the portable one where their layout does not suit the copy engine).
# A mask (bool without a fill, or float) comes with its key table when a
# block mask gave one (else the launcher builds it).
_lib.define("_hopper_forward(Tensor q, Tensor k, Tensor v, float scale, SymInt? window_left, "
            "SymInt? window_right, bool bottom_right, Tensor? attn_mask=None, Tensor? mask_key_table=None) "
            "-> (Tensor, Tensor)")


def _hopper_forward(q, k, v, scale, window_left, window_right, bottom_right, attn_mask=None, mask_key_table=None):
    return _kernels.attention_forward(q, k, v, attn_mask, None, dropout_p=0.0, scale=scale, window_left=window_left,
                                      window_right=window_right, bottom_right=bottom_right, key_table=mask_key_table)


def _hopper_forward_fake(q, k, v, scale, window_left, window_right, bottom_right, attn_mask=None,
                         mask_key_table=None):
    return _attention_forward_fake(q, k, v, attn_mask, None, 0.0, scale, window_left, window_right, bottom_right)


_lib.impl("_hopper_forward", _hopper_forward, "CUDA")
torch.library.register_fake("flashfuse::_hopper_forward", _hopper_forward_fake, lib=_lib)


# The Hopper backward inside a traced graph, for the same reason: a traced
# backward the Hopper kernels suit (``hopper.traced_backward_takes``) records
# this op, whose CUDA kernel runs the eager dispatch on the real tensors (the
# Hopper kernels, or the portable ones where the layout does not suit the
# copy engine).
_lib.define("_hopper_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
            "SymInt? window_left, SymInt? window_right, bool bottom_right, Tensor? grad_lse, "
            "Tensor? attn_mask=None, Tensor? mask_key_table=None, Tensor? mask_query_table=None) "
            "-> (Tensor, Tensor, Tensor)")


def _hopper_backward(grad_out, q, k, v, out, lse, scale, window_left, window_right, bottom_right, grad_lse,
                     attn_mask=None, mask_key_table=None, mask_query_table=None):
    dq, dk, dv, _ = _kernels.attention_backward(
        grad_out, q, k, v, attn_mask, None, out, lse, dropout_p=0.0, scale=scale, window_left=window_left,
        window_right=window_right, bottom_right=bottom_right, mask_grad=False, grad_lse=grad_lse,
        key_table=mask_key_table, query_table=mask_query_table)
    return dq, dk, dv


def _hopper_backward_fake(grad_out, q, k, v, out, lse, scale, window_left, window_right, bottom_right, grad_lse,
                          attn_mask=None, mask_key_table=None, mask_query_table=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_lib.impl("_hopper_backward", _hopper_backward, "CUDA")
torch.library.register_fake("flashfuse::_hopper_backward", _hopper_backward_fake, lib=_lib)


# Annotations, not strings: the schemas are inferred from them.
@torch.library.triton_op("flashfuse::_attention_forward", mutates_args=())
def _attention_forward_op(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], seed: Optional[Tensor],
    dropout_p: float, scale: float, window_left: Optional[int], window_right: Optional[int],
    bottom_right: bool, mask_fill: Optional[float] = None, mask_key_table: Optional[Tensor] = None,
    mask_query_table: Optional[Tensor] = None, softcap: Optional[float] = None, sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``_attention_forward`` as an op: see the module docstring."""
    return run_forward(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right,
                       mask_fill, mask_key_table, mask_query_table, softcap, sinks)


def run_forward(*args) -> tuple[Tensor, Tensor]:
    """``_attention_forward``'s work for a private op: the kernels on CUDA
    tensors, else the opaque CPU op (which a trace records as one node)."""
    if args[0].device.type == "cuda":
        return _attention_forward(*args)
    return torch.ops.flashfuse._attention_forward_cpu(*args)


@torch.library.triton_op("flashfuse::_attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], seed: Optional[Tensor],
    out: Tensor, lse: Tensor, dropout_p: float, scale: float, window_left: Optional[int],
    window_right: Optional[int], bottom_right: bool, mask_grad: bool, mask_fill: Optional[float] = None,
    mask_key_table: Optional[Tensor] = None, mask_query_table: Optional[Tensor] = None,
    softcap: Optional[float] = None, grad_lse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``_attention_backward`` as an op: see the module docstring.
    ``grad_lse``: the gradient of lse, for ``attention_with_lse``."""
    args = (grad_out, q, k, v, attn_mask, seed, out, lse, dropout_p, scale, window_left, window_right,
            bottom_right, mask_grad, mask_fill, mask_key_table, mask_query_table, softcap, grad_lse)
    if q.device.type == "cuda":
        return _attention_backward(*args)
    return torch.ops.flashfuse._attention_backward_cpu(*args)


# triton_op takes the implementation as the fake one; these skip its Python.
_attention_forward_op.register_fake(_attention_forward_fake)
_attention_backward_op.register_fake(_attention_backward_fake)


def _save(ctx, inputs, out, lse):
    a = ForwardArgs(*inputs)
    # A block mask's tables are kept for the backward, which then does not
    # scan the mask again.
    ctx.save_for_backward(a.q, a.k, a.v, a.attn_mask, a.seed, out, lse, a.mask_key_table, a.mask_query_table,
                          a.sinks)
    ctx.params = (a.dropout_p, a.scale, a.window_left, a.window_right, a.bottom_right)
    ctx.mask_fill = a.mask_fill
    ctx.softcap = a.softcap


def _gradients(ctx, grad_out, backward_impl, grad_lse=None):
    """The input gradients of a forward saved by ``_save``, computed by
    ``backward_impl`` (the private op, or its implementation); ``grad_lse``:
    the gradient of lse where the forward returns it (``attention_with_lse``)."""
    q, k, v, attn_mask, seed, out, lse, key_table, query_table, sinks = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    mask_grad = attn_mask is not None and ctx.needs_input_grad[input_index("attn_mask")]
    # grad_lse only when there is one: the plain op's graphs stay as they were.
    lse_arg = () if grad_lse is None else (grad_lse,)
    dq, dk, dv, dmask = backward_impl(grad_out, q, k, v, attn_mask, seed, out, lse, *ctx.params, mask_grad,
                                      ctx.mask_fill, key_table, query_table, ctx.softcap, *lse_arg)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[input_index("sinks")]:
        dsinks = sink_gradient(grad_out, out, lse, sinks, grad_lse)
    # One gradient per forward input; None for the non-differentiable ones.
    grads = dict(q=dq, k=dk, v=dv, attn_mask=dmask if mask_grad else None, sinks=dsinks)
    return tuple(grads.get(name) for name in ForwardArgs._fields)


def sink_gradient(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor,
                  grad_lse: Tensor | None = None) -> Tensor:
    """d loss / d sinks, (Hq,) in the sinks' dtype. A sink joins each row's
    softmax without a value, so its score gradient is ``p_sink * (0 -
    delta)`` with ``delta = rowsum(dO * O)`` (the same delta as the keys'),
    and ``p_sink = exp(sink - lse)`` from the stored lse, which includes the
    sink. Rows with no key and no sink (lse +inf) and marked rows (see
    ``reference.lse_marker``, only with a sink far below the row) give 0.
    A gradient of lse itself (``grad_lse``) adds ``p_sink * grad_lse``, as
    d lse / d sink = p_sink."""
    delta = (grad_out.to(torch.float32) * out.to(torch.float32)).sum(dim=-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(torch.float32)
    s = sinks.to(torch.float32).view(1, -1, 1)
    p_sink = torch.where(lse > reference.LSE_MARKED_BELOW, torch.exp(s - lse), torch.zeros_like(lse))
    return (-(p_sink * delta)).sum(dim=(0, 2)).to(sinks.dtype)


def _setup_context(ctx, inputs, output):
    out, lse = output
    _save(ctx, inputs, out, lse)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    return _gradients(ctx, grad_out, torch.ops.flashfuse._attention_backward)


_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """What ``_attention_forward`` and its registered autograd compute, for
    plain eager calls: the same implementations, called without the op
    dispatch and the generic autograd wrapper around them, which cost more host
    time than the kernels at small sizes. Graphs (Dynamo, AOTAutograd, export)
    always record the ops instead (``_plain_eager_call``)."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _attention_forward(*inputs)
        _save(ctx, inputs, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _gradients(ctx, grad_out, _attention_backward)


def attention(
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
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention ``softmax(query @ key^T * scale + mask) @ value``,
    computed by a flash kernel: the (N, M) score matrix never reaches memory.

    Arguments mean what they mean in
    ``torch.nn.functional.scaled_dot_product_attention``:

    Args:
        query: (B, Hq, N, D) queries. fp16, bf16 or fp32 (float64 on CPU);
            any strides. D between 16 and 256.
        key: (B, Hkv, M, D) keys; Hq must be a multiple of Hkv.
        value: (B, Hkv, M, Dv) values; Dv between 16 and 256, may differ from D.
        attn_mask: optional mask broadcastable to (B, Hq, N, M). Bool: True
            means the pair takes part. Floating: added to the scaled scores
            (a learned bias gets its gradient, summed over broadcast
            dimensions). Broadcast dimensions are never expanded in memory.
            Or a ``flashfuse.block_mask(mask, ...)`` built once for all the
            calls that use the mask: they then read its tables instead of
            scanning the mask, and take the band and fill it was built with.
        dropout_p: probability of dropping an attention weight, applied
            whenever it is > 0 (pass 0.0 in evaluation). The mask is drawn
            from PyTorch's generator (``torch.manual_seed`` reproduces it) and
            regenerated in the backward, never stored.
        is_causal: query i sees keys j <= i (top-left aligned, as in SDPA;
            see ``alignment``). Same as ``window_right=0``.
        scale: factor applied to ``query @ key^T``; default 1/sqrt(D).
        enable_gqa: must be True when Hq != Hkv (grouped-query attention:
            query head h uses key/value head h // (Hq // Hkv)).
        window_left: keyword-only; if given, query i sees no key before
            i + offset - window_left (sliding-window attention).
        window_right: keyword-only; if given, query i sees no key after
            i + offset + window_right.
        alignment: keyword-only; where the causal diagonal and the window
            sit when N != M. ``"top_left"`` (offset 0, SDPA's ``is_causal``)
            or ``"bottom_right"`` (offset M - N: the last query sees the last
            key, as when decoding with a KV cache).
        mask_fill: keyword-only, with a bool ``attn_mask`` only (a float
            mask raises ``ValueError``): the score that the pairs it hides
            take instead of taking no part, as
            ``scores.masked_fill(~attn_mask, mask_fill)`` gives them, e.g.
            ``torch.finfo(query.dtype).min`` or -1e4. A row the mask hides
            entirely then averages the values of the keys the causal /
            window band leaves it (keys outside the band still take no
            part), and filled pairs pass no gradient to query and key.
            None (the default) or -inf: hidden pairs take no part.
        softcap: keyword-only; soft-capping of the scores (Gemma 2): the
            scaled scores ``s`` become ``softcap * tanh(s / softcap)``
            before the mask is added or applied. A positive finite float,
            or None (no capping).
        sinks: keyword-only; a (Hq,) tensor (float32 or the inputs' dtype)
            of per-head logits that join each row's softmax denominator but
            carry no value (gpt-oss's attention sinks: the sink's column is
            dropped after the softmax). Gets its gradient.

    Returns:
        (B, Hq, N, Dv) tensor in the inputs' dtype. A row that sees no key at
        all (everything masked) is 0, where eager softmax would give NaN.
        A row whose every key a finite value hides (a float mask of
        ``finfo.min``, or ``mask_fill``) averages them, as eager softmax
        does, with eager's gradients.
    """
    if attn_mask is not None and type(attn_mask) is not Tensor and isinstance(attn_mask, _block_mask_type()):
        # The mask, its band and its tables, built once by flashfuse.block_mask.
        kw = attn_mask.attention_args(query, key, is_causal, window_left, window_right, alignment, mask_fill)
        if kw["attn_mask"] is not None:
            return torch.ops.flashfuse.attention(query, key, value, kw.pop("attn_mask"), dropout_p,
                                                 kw.pop("is_causal"), scale, enable_gqa, **kw, softcap=softcap,
                                                 sinks=sinks)
        # A band in disguise (BlockMask.band): called as that band, with no mask.
        attn_mask, is_causal, mask_fill = None, False, None
        window_left, window_right, alignment = kw["window_left"], kw["window_right"], kw["alignment"]
    # The op, or its eager fast path for a signature that passed it before.
    return _fastpath.attention_op(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        window_left=window_left, window_right=window_right, alignment=alignment, mask_fill=mask_fill,
        softcap=softcap, sinks=sinks,
    )


def _block_mask_type() -> type:
    from .block_mask import BlockMask  # imports this module

    return BlockMask


from . import fastpath as _fastpath  # noqa: E402  (it calls back into this module)
