"""Hugging Face ``transformers`` integration: flashfuse as an attention implementation.

Importing this module registers flashfuse with ``transformers``' attention
registries, after which any model whose attention goes through
``ALL_ATTENTION_FUNCTIONS`` (all current decoder, encoder and encoder-decoder
models) can run on ``torch.ops.flashfuse.attention``::

    import flashfuse.hf  # registers "ffuse"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ffuse")
    # or: SomeConfig(..., attn_implementation="ffuse"), model.set_attn_implementation("ffuse")

Why the name is ``"ffuse"`` and not ``"flashfuse"``: ``transformers`` treats
every implementation name that contains the substring ``"flash"`` as a
flash-attention flavour (``utils.generic.is_flash_attention_requested`` is a
plain substring test). For such a name, even one registered here,
``PreTrainedModel._check_and_adjust_attn_implementation`` (run by
``__init__``, ``from_pretrained`` and ``set_attn_implementation``) calls
``lazy_import_flash_attention``, which tries to load a flash-attention kernel
of that name and raises ``ValueError`` ("Could not find the currently
requested flash attention implementation"), so the model cannot be built. Past
that, several models change what they pass to the attention function for flash
names (no mask plus ``cu_seq_lens_q``/``position_ids`` in vision encoders, a
2D padding mask for GPT-BigCode cross-attention), and models with
``_compatible_flash_implementations`` replace the name with their own kernel.
A name without "flash" avoids all of this. :data:`ATTN_IMPLEMENTATION` holds
the name.

Two functions are registered under the name:

* :func:`flashfuse_mask` (``AttentionMaskInterface``) builds the mask each layer
  receives. Wherever the pattern is exactly "causal, optionally a sliding
  window, no padding" (or "everything visible") it returns ``None``, so the
  kernel gets ``is_causal`` / a window and skips masked key blocks instead of
  reading a mask. Otherwise (padding, packed sequences, chunked attention,
  custom mask functions, static caches) it returns transformers' compact
  boolean mask, broadcastable to (batch, 1, q_len, kv_len).
* :func:`flashfuse_attention_forward` (``AttentionInterface``) turns a layer's
  ``(query, key, value, mask, **kwargs)`` into one call of the op and returns
  ``(output, None)`` with the output in (batch, q_len, heads, head_dim) layout.

This module imports ``transformers``; ``import flashfuse`` alone never does.
"""

from __future__ import annotations

import operator
import weakref
from typing import NamedTuple

import torch
from torch import Tensor

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
    from transformers.utils.import_utils import is_tracing
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flashfuse.hf needs the `transformers` package (version 5 or newer, for its "
        "AttentionInterface / AttentionMaskInterface registries): pip install 'transformers>=5'"
    ) from exc

from . import fastpath as _fastpath
from . import ops as _ops  # noqa: F401  (importing registers torch.ops.flashfuse.attention)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "flashfuse_attention_forward",
    "flashfuse_mask",
    "register",
]

#: The ``attn_implementation`` value that selects flashfuse. It must not contain
#: "flash" (see the module docstring).
ATTN_IMPLEMENTATION = "ffuse"

# The op (through its eager fast path, ``flashfuse.fastpath``), and the same
# for a call the hook knows is not compiled; module attributes so tests can
# wrap them to observe calls.
_attention_op = _fastpath.attention_op
_attention_op_not_compiling = _fastpath.attention_op_not_compiling
_lane_call_at = _fastpath.lane_call_at
_LANE_HITS = _fastpath.LANE_HITS

_MIN_HEAD_DIM, _MAX_HEAD_DIM = _ops.MIN_HEAD_DIM, _ops.MAX_HEAD_DIM


# --------------------------------------------------------------------------
# Mask construction
# --------------------------------------------------------------------------

def _is_exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting()) if is_exporting is not None else False


def _keys_all_valid(attention_mask: Tensor | None, kv_length: int, kv_offset) -> bool:
    """True when the 2D padding mask marks every key of this layer as a real token.

    Reading the mask's values is data-dependent, so under tracing (compile,
    export, jit, fx) the answer is a conservative False, as in transformers.
    """
    if attention_mask is None:
        return True
    if isinstance(kv_offset, Tensor) or is_tracing(attention_mask):
        return False
    keys = attention_mask[:, kv_offset : kv_offset + kv_length]
    # Positions beyond the 2D mask count as padding, as transformers pads them with False.
    return keys.shape[-1] == kv_length and bool(keys.all())


def _window_is_sliding(config, local_size: int | None) -> bool:
    """Whether ``local_size`` is the config's sliding window (which the kernel
    can express) rather than a chunk size (Llama 4's chunked attention, which
    it cannot)."""
    if local_size is None:
        return True
    if config is None:
        return False
    return (
        getattr(config, "sliding_window", None) == local_size
        and getattr(config, "attention_chunk_size", None) != local_size
    )


def flashfuse_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    config=None,
    **kwargs,
) -> Tensor | None:
    """The ``AttentionMaskInterface`` entry for flashfuse.

    Returns ``None`` when :func:`flashfuse_attention_forward` can rebuild the
    pattern from its own arguments, which lets the kernel skip whole key blocks:

    * causal (``allow_is_causal_skip``: transformers vouches that the pattern is
      the plain causal or sliding-window one), no padding among the keys, and
      the queries are the last ``q_length`` positions of the keys (the usual
      prefill and KV-cache decoding). The attention function then uses a
      bottom-right aligned causal diagonal and, for a sliding layer, the window.
    * bidirectional (``allow_is_bidirectional_skip``), no padding, and no
      window that cuts anything off.

    Everything else gets transformers' boolean mask (True takes part) from
    ``sdpa_mask``, which broadcasts over heads and, without padding, over the
    batch too.
    """
    keys_valid = None
    if allow_is_causal_skip and not _is_exporting() and not isinstance(q_offset, Tensor):
        # Query i sits at absolute position q_offset + i and key j at kv_offset + j;
        # bottom-right alignment (query i sees keys j <= i + kv_length - q_length)
        # is right exactly when these two offsets agree.
        aligned = q_offset - kv_offset == kv_length - q_length
        window_ok = local_size is None or kv_length < local_size or _window_is_sliding(config, local_size)
        if aligned and window_ok:
            keys_valid = _keys_all_valid(attention_mask, kv_length, kv_offset)
            if keys_valid:
                return None
    if allow_is_bidirectional_skip and not _is_exporting() and (local_size is None or kv_length < local_size):
        if keys_valid is None:
            keys_valid = _keys_all_valid(attention_mask, kv_length, kv_offset)
        if keys_valid:
            return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        config=config,
        **kwargs,
    )


# --------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------

def _config_attr(config, name: str, compiling: bool):
    """``getattr(config, name, None)`` at about half the cost for a
    transformers config, whose ``__getattribute__`` is Python that only maps
    the class's ``attribute_map`` aliases: the alias is applied here, then
    the ordinary lookup runs (this is read per layer per token).
    ``compiling``: ``torch.compiler.is_compiling()``, read once per call by
    the caller."""
    if config is None:
        return None
    if compiling:
        # Dynamo cannot trace object.__getattribute__ (a graph break per
        # layer); there the read is free anyway, done once at trace time.
        return getattr(config, name, None)
    aliases = getattr(type(config), "attribute_map", None)
    if aliases:
        name = aliases.get(name, name)
    try:
        return object.__getattribute__(config, name)
    except AttributeError:
        return None


def _module_attr(module, name: str, compiling: bool):
    """``getattr(module, name, None)`` without ``nn.Module.__getattr__``
    raising, and formatting, an AttributeError for a name the module lacks
    (about 1 us, per layer per token): a plain ``nn.Module`` keeps its
    attributes in its ``__dict__`` and its parameters, buffers and
    submodules in three dicts there, which that ``__getattr__`` reads."""
    cls = type(module)
    if (compiling or not isinstance(module, torch.nn.Module) or cls.__getattr__ is not torch.nn.Module.__getattr__
            or hasattr(cls, name)):
        return getattr(module, name, None)
    d = module.__dict__
    if name in d:
        return d[name]
    for store in (d.get("_parameters"), d.get("_buffers"), d.get("_modules")):
        if store and name in store:
            return store[name]
    return None


def _sliding_window(module, kwargs: dict, config, compiling: bool) -> int | None:
    """The sliding window of this layer, or None for full attention.

    Most models pass it as the ``sliding_window`` argument (as flash-attention-2
    needs it; ``None`` there means a full-attention layer). For the few that only
    encode it in the mask, fall back to the layer's type in the config, the
    module's own attribute, then the config's window.
    """
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    layer_types = _config_attr(config, "layer_types", compiling)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_types is not None and layer_idx is not None and 0 <= layer_idx < len(layer_types):
        if layer_types[layer_idx] != "sliding_attention":
            return None
        return _config_attr(config, "sliding_window", compiling)
    window = _module_attr(module, "sliding_window", compiling)
    if window is not None:
        return window
    return _config_attr(config, "sliding_window", compiling)


def _check_supported(module, query: Tensor, key: Tensor, value: Tensor, kwargs: dict, config,
                     compiling: bool) -> None:
    """Raise for features a fused kernel cannot serve, naming the way out."""
    if kwargs.get("output_attentions") or _config_attr(config, "output_attentions", compiling):
        raise ValueError(
            "flashfuse: output_attentions=True cannot be served by a fused attention kernel, "
            "which never materialises the attention probabilities. Load the model with "
            "attn_implementation='eager' (or call model.set_attn_implementation('eager')) "
            "to get attention weights."
        )
    _check_shapes(query, key, value)


def _check_shapes(query: Tensor, key: Tensor, value: Tensor) -> None:
    """The part of ``_check_supported`` that the tensors decide."""
    d, dv = query.shape[-1], value.shape[-1]
    if not (_MIN_HEAD_DIM <= d <= _MAX_HEAD_DIM and _MIN_HEAD_DIM <= dv <= _MAX_HEAD_DIM):
        raise ValueError(
            f"flashfuse: head dim {d} (values: {dv}) is outside the supported range "
            f"{_MIN_HEAD_DIM}..{_MAX_HEAD_DIM}; use attn_implementation='sdpa' for this model."
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(
            f"flashfuse: {query.shape[1]} query heads are not a multiple of "
            f"{key.shape[1]} key/value heads"
        )


def _softcap_and_sinks(query: Tensor, kwargs: dict) -> tuple:
    """The op's ``softcap`` and ``sinks`` from the layer's arguments: Gemma 2
    passes ``softcap=config.attn_logit_softcapping``, gpt-oss
    ``s_aux=module.sinks`` (one logit per query head, in the model's dtype;
    the op takes float32 or the query's dtype)."""
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None and sinks.dtype not in (torch.float32, query.dtype):
        sinks = sinks.float()
    return (float(softcap) if softcap is not None else None), sinks


def _with_position_bias(position_bias: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Fold a relative-position bias (T5 style) and the mask into one additive mask.

    The op adds a floating mask to the scores, so the bias keeps its gradient;
    causality still comes from ``is_causal``, so no causal mask is built here.
    """
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, float("-inf"))
    return position_bias + attention_mask


def flashfuse_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The ``AttentionInterface`` entry for flashfuse.

    Args:
        module: the calling attention layer (read for ``training``,
            ``is_causal``, ``sliding_window``, ``layer_idx`` and ``config``).
        query: (batch, q_heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim); grouped heads are
            passed to the kernel as they are, never repeated.
        attention_mask: ``None`` (see :func:`flashfuse_mask`), a boolean mask
            (True takes part) or an additive floating mask, broadcastable to
            (batch, q_heads, q_len, kv_len). A given mask is taken to hold the
            whole pattern: no causal diagonal or window is added to it.
        dropout: attention dropout probability, applied only while
            ``module.training`` (as eager attention does).
        scaling: score scale; default ``head_dim ** -0.5``.
        is_causal: overrides ``module.is_causal`` (default True).
        position_bias: optional additive bias (T5-style relative positions).
        **kwargs: ``sliding_window`` (a key at distance >= sliding_window behind
            the query is not seen, as in transformers' masks), ``softcap``
            (Gemma 2's ``attn_logit_softcapping``: the scaled scores are capped
            before the mask), ``s_aux`` (gpt-oss's per-head attention sinks),
            and flags that are checked (``output_attentions``).

    Returns:
        ``(output, None)``, output of shape (batch, q_len, q_heads, head_dim).
    """
    # Read once: the helpers below take them (this runs per layer per token).
    compiling = torch.compiler.is_compiling()
    reads = None
    if attention_mask is None and position_bias is None and not compiling:
        reads = _LAYER_READS.get(id(module))
        if reads is not None and not reads.hold(module, dropout, scaling, is_causal, kwargs):
            reads = None
    if reads is None:
        config = getattr(module, "config", None)
        _check_supported(module, query, key, value, kwargs, config, compiling)

    qs, ks = query.shape, key.shape  # read once: this runs per layer per token
    if qs[0] != ks[0] and qs[0] == 1:
        # Learned queries shared across the batch (SDPA broadcasts them).
        query = query.expand(ks[0], *qs[1:])

    if reads is None:
        decision = _decide(module, query, key, value, attention_mask, dropout, is_causal, position_bias, kwargs,
                           config, compiling)
        out = _attention_op(query, key, value, decision.attention_mask, decision.dropout_p, decision.causal, scaling,
                            qs[1] != ks[1], window_left=decision.window_left, alignment="bottom_right",
                            **decision.extra)
    else:  # the layer's reads are what they were: so is what they decided (not compiling, no keywords)
        site = reads.site
        if site is not None:
            # The layer's decode lane, for tensors like its last call's
            # (whose shapes passed _check_shapes): (B, N, H, Dv) as it comes.
            out = _lane_call_at(site, query, key, value)
            if out is not None:
                return out, None
        _check_shapes(query, key, value)
        decision = reads.decision
        lane_hits = _LANE_HITS[0]
        out = _attention_op_not_compiling(query, key, value, decision.attention_mask, decision.dropout_p,
                                          decision.causal, scaling, qs[1] != ks[1], window_left=decision.window_left,
                                          alignment="bottom_right", transpose_out=True)
        if _LANE_HITS[0] != lane_hits:  # it took a decode lane: the next call may, from this call's site
            reads.site = _fastpath.lane_site(query, key, value, decision.dropout_p, decision.causal, scaling,
                                             qs[1] != ks[1], decision.window_left, "bottom_right", True)
        return out, None  # (B, N, H, Dv) as it comes: made in that order, without a view
    if attention_mask is None and position_bias is None and not decision.extra and not compiling:
        _LayerReads.record(module, config, dropout, scaling, is_causal, kwargs, decision)
    # The op lays its output out as (B, N, H, Dv) in memory, so this is a view;
    # contiguous() is then free and gives callers the layout they expect.
    return out.transpose(1, 2).contiguous(), None


class _Decision(NamedTuple):
    """What the hook hands the op besides the tensors, the scale and the
    grouped-heads flag (``_decide``)."""

    attention_mask: Tensor | None
    dropout_p: float
    causal: bool
    window_left: int | None
    extra: dict  # the op's keywords that apply: block-mask tables, softcap, sinks


def _decide(module, query, key, value, attention_mask, dropout, is_causal, position_bias, kwargs, config,
            compiling: bool) -> _Decision:
    """The op's mask, dropout, band and keywords from the layer, its config
    and its arguments (the hook's reads; ``query`` already expanded)."""
    kv_length = key.shape[2]
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] > kv_length:
        # Some callers hand over a mask sized for a longer cache; its first
        # kv_length columns are the keys, as in eager attention.
        attention_mask = attention_mask[..., :kv_length]

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window_left = None
    if attention_mask is None and causal:
        # No mask means flashfuse_mask vouched for the plain pattern: causal with
        # the queries at the end of the keys (prefill or KV-cache decoding), plus
        # the layer's sliding window if it has one.
        sliding_window = _sliding_window(module, kwargs, config, compiling)
        if sliding_window is not None and sliding_window > 0:
            window_left = sliding_window - 1  # transformers: kv > q - sliding_window
    else:
        # A mask from transformers already holds the causal diagonal and window
        # at the right offsets (static caches included); adding ours could only
        # disagree with it.
        causal = False

    if position_bias is not None:
        attention_mask = _with_position_bias(position_bias, attention_mask)

    training = getattr(module, "training", True)
    dropout_p = float(dropout) if training else 0.0
    softcap, sinks = _softcap_and_sinks(query, kwargs)

    extra = {}  # only the keywords that apply (tests read which were passed)
    if attention_mask is not None and position_bias is None:
        # transformers hands every layer the same mask object: its tables
        # are built by the first layer and read by the others.
        extra = _shared_tables(attention_mask, query, key, value,
                               dict(dropout_p=dropout_p, is_causal=causal, window_left=window_left, softcap=softcap,
                                    sinks=sinks))
    if softcap is not None:
        extra["softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = sinks
    return _Decision(attention_mask, dropout_p, bool(causal), window_left, extra)


# --------------------------------------------------------------------------
# A layer's reads, kept
# --------------------------------------------------------------------------

_MISSING = object()
# id(layer) -> its _LayerReads; started afresh when full.
_LAYER_READS: dict = {}
_LAYER_READS_SIZE = 1024
# The names the hook reads of a layer's kwargs, and of the layer (``hold``).
_READ_KWARGS = ("output_attentions", "sliding_window", "softcap", "s_aux", "sinks")
# (``hold`` compares these five one by one, in this order.)
_READ_ATTRIBUTES = ("training", "is_causal", "config", "layer_idx", "sliding_window")
_READ_ATTRIBUTE_SET = frozenset(_READ_ATTRIBUTES)


_object_getattr = object.__getattribute__


def _instance_dict(obj):
    """``obj.__dict__`` without its class's ``__getattribute__`` (a
    transformers config's is Python); None when it has none."""
    try:
        return _object_getattr(obj, "__dict__")
    except AttributeError:
        return None


def _forget_reads(key: int, ref) -> None:
    """A layer died: its kept reads go (unless another layer's replaced them)."""
    reads = _LAYER_READS.get(key)
    if reads is not None and reads.module is ref:
        del _LAYER_READS[key]


class _LayerReads:
    """What the hook read of a layer, its config and its arguments for a call
    without a mask, and what that decided (``decision``), kept so that the
    layer's next such call skips the reads when nothing they read has
    changed.

    Why: inside ``generate()`` the hook's reads of the config (its
    ``output_attentions`` property, ``layer_types``, ``sliding_window``,
    each through Python) cost about 8 of the hook's 55 µs a decode call on
    a CPU, most of what the hook adds to the op (bench/NOTES.md run 37).

    What ``hold`` compares, all in C (no Python call): the arguments and the
    kwargs the hook reads, by identity; the layer's instance attributes the
    hook reads (``training``, ``is_causal``, ``config``, ``layer_idx``,
    ``sliding_window``, present or not), by identity, and that none of
    them has become a parameter, buffer or submodule (where
    ``nn.Module.__getattr__`` finds a name missing from the instance); the
    config's whole instance ``__dict__`` (its ``output_attentions`` is a
    property, which may read anything there): the same dict, equal to a copy
    taken when the reads were kept (dict comparison: the same keys, each
    value the same object or equal to it; a value replaced by an equal one
    reads the same, and one that cannot be compared counts as changed);
    and the entries of ``config.layer_types``, which can change in place.
    Not covered: a class attribute or property of the layer's or the
    config's class changed between two calls, and a value of the config
    changed in place (a list's entry, say) other than ``layer_types``'.
    (The dict comparison costs a fifth of comparing every key and value by
    identity: 0.34 against 1.57 µs for a LLaMA config on a CPU, run 38.)"""

    __slots__ = ("module", "args", "kw", "module_values", "config_dict", "config_copy", "layer_types_entries",
                 "stores", "decision", "site")

    @classmethod
    def record(cls, module, config, dropout, scaling, is_causal, kwargs, decision: _Decision) -> None:
        """Keep the reads of a call that took the full path (mask, bias,
        soft-capping and sinks all absent), where they can be compared."""
        md = getattr(module, "__dict__", None)
        if md is None or md.get("config", _MISSING) is not config or not type(module).__weakrefoffset__:
            return  # no instance dict, a config found elsewhere, or no weak reference (a SimpleNamespace)
        r = cls()
        key = id(module)
        # The entry goes when the layer does: it holds the layer's parameter
        # dicts (``stores``), which must not keep its weights alive.
        r.module = weakref.ref(module, lambda ref: _forget_reads(key, ref))
        r.args = (dropout, scaling, is_causal)
        r.kw = tuple(kwargs.get(name, _MISSING) for name in _READ_KWARGS)
        r.module_values = tuple(md.get(name, _MISSING) for name in _READ_ATTRIBUTES)
        r.config_dict = r.config_copy = r.layer_types_entries = None
        if config is not None:
            cd = _instance_dict(config)
            if cd is None:
                return
            r.config_dict, r.config_copy = cd, dict(cd)
            types = cd.get("layer_types")
            if types is not None:
                if not isinstance(types, (list, tuple)):
                    return
                r.layer_types_entries = tuple(types)
        r.stores = tuple(md.get(name) for name in ("_parameters", "_buffers", "_modules")
                         if isinstance(md.get(name), dict))
        if not all(map(_READ_ATTRIBUTE_SET.isdisjoint, r.stores)):
            return  # a parameter, buffer or submodule of a name read: leave it to the full path
        r.decision = decision
        r.site = None  # the layer's decode lane (``fastpath.LaneSite``), once a call has taken one
        if len(_LAYER_READS) >= _LAYER_READS_SIZE:
            _LAYER_READS.clear()
        _LAYER_READS[key] = r

    def hold(self, module, dropout, scaling, is_causal, kwargs) -> bool:
        """Whether the reads kept are still what the full path would read."""
        if self.module() is not module:
            return False  # another layer at a dead one's address
        args = self.args
        if dropout is not args[0] or scaling is not args[1] or is_causal is not args[2]:
            return False
        kw = self.kw
        get = kwargs.get
        if (get("output_attentions", _MISSING) is not kw[0] or get("sliding_window", _MISSING) is not kw[1]
                or get("softcap", _MISSING) is not kw[2] or get("s_aux", _MISSING) is not kw[3]
                or get("sinks", _MISSING) is not kw[4]):
            return False
        get = module.__dict__.get
        values = self.module_values  # in _READ_ATTRIBUTES' order
        if (get("training", _MISSING) is not values[0] or get("is_causal", _MISSING) is not values[1]
                or get("config", _MISSING) is not values[2] or get("layer_idx", _MISSING) is not values[3]
                or get("sliding_window", _MISSING) is not values[4]):
            return False
        cd = self.config_dict
        if cd is not None:
            if _object_getattr(values[2], "__dict__") is not cd:
                return False
            try:
                if cd != self.config_copy:
                    return False
            except Exception:  # a value whose comparison raises: taken as changed
                return False
            entries = self.layer_types_entries
            if entries is not None:  # the list the config holds now, equal to the one kept: changed in place?
                types = cd["layer_types"]
                if len(types) != len(entries) or not all(map(operator.is_, types, entries)):
                    return False
        return all(map(_READ_ATTRIBUTE_SET.isdisjoint, self.stores))


# --------------------------------------------------------------------------
# One block mask per mask
# --------------------------------------------------------------------------

# Recent masks and their tables: (weak reference to the mask, what the
# tables were built from, (key table, query table)). A few entries: models
# alternating sliding and full layers pass two masks per forward.
_TABLE_CACHE: list = []
_TABLE_CACHE_SIZE = 4


def _drop_dead_tables(ref) -> None:
    """A mask is gone: its tables go with it, at once. Kept until the next
    masked call instead, they held device memory through a whole generate()
    and moved what the allocator handed out next: a static cache's new
    tensors, and with them the CUDA graphs recorded against their addresses
    (three recordings in four generate() calls against SDPA's one;
    bench/NOTES.md run 36)."""
    _TABLE_CACHE[:] = [e for e in _TABLE_CACHE if e[0] is not ref]


# The table op, a module attribute so tests can count its calls.
_block_mask_op = None


def _table_key(mask: Tensor, query: Tensor, key: Tensor, queries: bool) -> tuple:
    """Everything the tables depend on that the mask object alone does not
    fix: its contents (version counter: any in-place write, through any view,
    bumps it), memory, layout, and the lengths; the band is always the
    hook's (no causal diagonal or window with a mask, bottom-right)."""
    return (mask._version, mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, mask.device,
            query.shape[2], key.shape[2], queries, torch.is_inference_mode_enabled())


def _shared_tables(mask: Tensor, query: Tensor, key: Tensor, value: Tensor, call: dict) -> dict:
    """The op's ``mask_key_table`` / ``mask_query_table`` for this mask,
    built once and reused while the same mask object, unchanged, comes back
    (the other layers of the forward); {} (the op builds its own) when that
    cannot be told safely: under tracing (the graph pass shares tables
    there), or for tensor subclasses. Also {} for a call whose forward the
    split-KV decode kernels run with no gradient to come (a static cache's
    decode step, ``ops.takes_decode_kernels`` on the op's other arguments,
    ``call``): they never read the tables, whose build would only cost, and
    a call with tables stays off the fast path's decode lane."""
    global _block_mask_op
    # The mask lives on the query's device, so the kernels' test on the query
    # says whether they run (CUDA, or the interpreter on the CPU).
    if type(mask) is not Tensor or is_tracing(mask) or torch.compiler.is_compiling() or not _ops._use_triton(query):
        return {}
    queries = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, mask))
    if not queries and _ops.takes_decode_kernels(query, key, value, mask, scale=None, alignment="bottom_right",
                                                 **call):
        return {}  # (the scale decides no route: the default stands in)
    want = _table_key(mask, query, key, queries)
    # A dead mask's entry is already gone (_drop_dead_tables); the copy
    # because that callback may run at any point.
    found = next((tables for ref, k, tables in list(_TABLE_CACHE) if ref() is mask and k == want), None)
    if found is None:
        if _block_mask_op is None:
            from . import block_mask as _bm  # noqa: F401  (registers the op)

            _block_mask_op = torch.ops.flashfuse.block_mask
        found = _block_mask_op(mask, query.shape[2], key.shape[2], bottom_right=True, queries=queries)
        # A stale entry for this object (changed since) is replaced.
        _TABLE_CACHE[:] = [e for e in _TABLE_CACHE if e[0]() is not mask][-(_TABLE_CACHE_SIZE - 1):]
        _TABLE_CACHE.append((weakref.ref(mask, _drop_dead_tables), want, found))
    return {"mask_key_table": found[0], "mask_query_table": found[1]}


# --------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------

def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register flashfuse's attention and mask functions under ``name``.

    Done once on import under :data:`ATTN_IMPLEMENTATION`; call again to add
    another name. The name must not contain "flash", which transformers
    reserves for flash-attention kernels. Returns ``name``.
    """
    if "flash" in name:
        raise ValueError(
            f"attn_implementation name {name!r} contains 'flash', which transformers takes to "
            "mean a flash-attention-2/3/4 kernel and tries to import; pick another name, "
            f"e.g. {ATTN_IMPLEMENTATION!r}"
        )
    AttentionInterface.register(name, flashfuse_attention_forward)
    AttentionMaskInterface.register(name, flashfuse_mask)
    return name


register()
