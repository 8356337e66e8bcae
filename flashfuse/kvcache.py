"""Inference-side ops: attention with its log-sum-exp, and attention over a
key/value cache as serving code holds it.

``flashfuse::attention_with_lse``
    ``flashfuse::attention``'s arguments, returning ``(out, lse)``; the
    gradient flows into lse too. A composite over the private op
    ``_attention_forward_lse`` (the same forward as ``_attention_forward``,
    with lse differentiable), whose autograd calls the shared
    ``_attention_backward`` with its last argument, ``grad_lse`` (folded
    into ``delta``). The public ``attention`` op and its graph pass are left
    as they are.
``flashfuse::attention_with_kvcache``
    few (or many) new queries against a contiguous cache with per-row
    lengths or a paged cache with a block table, on the split-KV decoding
    kernels (``kernels/decode.py``). Inference only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import config, fastpath, ops, reference

__all__ = ["attention_with_lse", "attention_with_kvcache"]

_lib = torch.library.Library("flashfuse", "FRAGMENT")

# --------------------------------------------------------------------------
# attention_with_lse
# --------------------------------------------------------------------------

_lib.define(ops._ATTENTION_SCHEMA.replace("attention(", "attention_with_lse(", 1).replace(
    "-> Tensor", "-> (Tensor, Tensor)"))


# The same arguments as ops._attention_forward, in their order; only the
# autograd differs (lse is differentiable).
@torch.library.triton_op("flashfuse::_attention_forward_lse", mutates_args=())
def _forward_lse_op(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], seed: Optional[Tensor],
    dropout_p: float, scale: float, window_left: Optional[int], window_right: Optional[int],
    bottom_right: bool, mask_fill: Optional[float] = None, mask_key_table: Optional[Tensor] = None,
    mask_query_table: Optional[Tensor] = None, softcap: Optional[float] = None, sinks: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """``_attention_forward``, with a differentiable lse."""
    return ops.run_forward(q, k, v, attn_mask, seed, dropout_p, scale, window_left, window_right, bottom_right,
                           mask_fill, mask_key_table, mask_query_table, softcap, sinks)


_forward_lse_op.register_fake(ops._attention_forward_fake)


def _lse_setup_context(ctx, inputs, output):
    out, lse = output
    ops._save(ctx, inputs, out, lse)


def _lse_backward(ctx, grad_out, grad_lse):
    # The shared backward op, with lse's gradient folded into its delta.
    return ops._gradients(ctx, grad_out, torch.ops.flashfuse._attention_backward, grad_lse)


_forward_lse_op.register_autograd(_lse_backward, setup_context=_lse_setup_context)


def _attention_with_lse_composite(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False, *, window_left=None, window_right=None, alignment="top_left",
                                  mask_fill=None, mask_key_table=None, mask_query_table=None, softcap=None,
                                  sinks=None):
    args = ops.checked_forward_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                    window_left, window_right, alignment, mask_fill, mask_key_table,
                                    mask_query_table, softcap, sinks)
    out, lse = torch.ops.flashfuse._attention_forward_lse(*args)
    fill = args.mask_fill  # normalised
    if fill is not None and fill <= reference.FILL_MARKS_AT:
        # Rows the fill hides entirely store a marker of their key count l
        # (see reference.lse_marker); their true lse is fill + log(l).
        marked, count = reference.lse_marked_keys(lse.detach())
        lse = torch.where(marked, fill + torch.log(count), lse)
    if dropout_p >= 1.0:
        out = out * 0.0
    return out, lse


_lib.impl("attention_with_lse", _attention_with_lse_composite, "CompositeImplicitAutograd")


def attention_with_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, *, window_left=None, window_right=None, alignment="top_left",
                       mask_fill=None, softcap=None, sinks=None) -> tuple[Tensor, Tensor]:
    """:func:`flashfuse.attention`, also returning each row's log-sum-exp.

    Arguments are those of :func:`flashfuse.attention`.

    Returns:
        ``(out, lse)``: ``out`` as :func:`flashfuse.attention` returns it;
        ``lse`` float32 (B, Hq, N), natural log:
        ``lse[b, h, i] = log sum_j exp(s_ij)`` over the keys row i sees,
        with ``s = scale * q.k`` (soft-capped, plus a float mask) and, with
        ``sinks``, the row's sink logit inside the sum; ``+inf`` for a row
        that sees no key (its output is 0). For a row that a float mask hides
        entirely with values at or below -1e38 (``finfo.min``) lse is within
        float32 rounding of the true value (about -3.4e38). Both results are
        differentiable: the gradient of lse is the row's softmax (d lse /
        d s_ij = p_ij), added to the gradient through ``out``. Merging two
        partial attentions (split keys, ring attention): with weights
        ``w = exp(lse_1 - lse)``, ``lse = logaddexp(lse_1, lse_2)``,
        ``out = w_1 out_1 + w_2 out_2``.
    """
    from .block_mask import BlockMask

    if isinstance(attn_mask, BlockMask):
        kw = attn_mask.attention_args(query, key, is_causal, window_left, window_right, alignment, mask_fill)
        return torch.ops.flashfuse.attention_with_lse(query, key, value, kw.pop("attn_mask"), dropout_p,
                                                      kw.pop("is_causal"), scale, enable_gqa, **kw,
                                                      softcap=softcap, sinks=sinks)
    return torch.ops.flashfuse.attention_with_lse(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        window_left=window_left, window_right=window_right, alignment=alignment, mask_fill=mask_fill,
        softcap=softcap, sinks=sinks,
    )


# --------------------------------------------------------------------------
# attention_with_kvcache
# --------------------------------------------------------------------------

# Host checks of the values in cache_seqlens / block_table (they synchronise
# with the device); FLASHFUSE_KVCACHE_CHECKS=0 skips them (the kernels clamp
# every index either way, so bad values give wrong numbers, not bad reads).
def _value_checks_enabled() -> bool:
    return config.kvcache_checks()


def _err(msg: str) -> ValueError:
    return ValueError(f"flashfuse.attention_with_kvcache: {msg}")


def check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, window_left, num_splits) -> None:
    """Raise ``ValueError`` for anything checkable without reading the
    tensors' values. Runs on real and fake tensors."""
    ops.check_tensors("flashfuse.attention_with_kvcache", (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
    B, Hq, N, D = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise _err(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in all but "
                   "the last dimension")
    Hkv, Dk, Dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    if Dk != D:
        raise _err(f"q's head dim {D} differs from k_cache's {Dk}")
    for name, d in (("q/k_cache", D), ("v_cache", Dv)):
        if not (ops.MIN_HEAD_DIM <= d <= ops.MAX_HEAD_DIM):
            raise _err(f"{name} head dim {d} is not supported; supported head dims are "
                       f"{ops.MIN_HEAD_DIM} to {ops.MAX_HEAD_DIM}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise _err(f"q's heads ({Hq}) must be a multiple of the cache's key/value heads ({Hkv}) "
                   "(k_cache is (batch, seq, heads, dim), or (pages, page_size, heads, dim) with a block_table)")
    for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"flashfuse.attention_with_kvcache: {name} must be a Tensor or None")
        if t.dtype != torch.int32:
            raise _err(f"{name} must be int32, got {t.dtype}; convert with .to(torch.int32)")
        if t.device != q.device:
            raise _err(f"{name} is on {t.device} but q is on {q.device}")
    if cache_seqlens is not None and tuple(cache_seqlens.shape) != (B,):
        raise _err(f"cache_seqlens must have shape (batch,) = ({B},), got {tuple(cache_seqlens.shape)}")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise _err(f"k_cache holds {k_cache.shape[0]} sequences but q has batch {B} (without a block_table "
                       "k_cache is (batch, seq, heads, dim))")
    else:
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise _err(f"block_table must have shape (batch, max_pages) with batch {B}, got "
                       f"{tuple(block_table.shape)}")
        if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
            raise _err(f"a paged k_cache needs at least one page of at least one slot, got {tuple(k_cache.shape)}")
    if window_left is not None and window_left < 0:
        raise _err(f"window_left must be None or >= 0, got {window_left}")
    if num_splits is not None and num_splits < 1:
        raise _err(f"num_splits must be None or >= 1, got {num_splits}")


def check_kvcache_values(k_cache, cache_seqlens, block_table) -> None:
    """Raise ``ValueError`` for lengths past the cache and table entries out
    of range (reads the values: call only on real tensors)."""
    if block_table is not None:
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        capacity = block_table.shape[1] * page_size
    else:
        capacity = k_cache.shape[1]
    B = block_table.shape[0] if block_table is not None else k_cache.shape[0]
    if cache_seqlens is not None:
        lens = cache_seqlens.cpu()
        bad = (lens < 0) | (lens > capacity)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise _err(f"cache_seqlens[{b}] = {int(lens[b])} is outside [0, {capacity}], the keys the cache "
                       "holds per sequence")
    else:
        lens = torch.full((B,), capacity, dtype=torch.int32)
    if block_table is not None:
        table = block_table.cpu()
        used = torch.arange(table.shape[1]).unsqueeze(0) < ((lens.to(torch.int64) + page_size - 1) // page_size
                                                             ).unsqueeze(1)
        bad = used & ((table < 0) | (table >= num_pages))
        if bool(bad.any()):
            b, p = (int(x) for x in bad.nonzero()[0])
            raise _err(f"block_table[{b}, {p}] = {int(table[b, p])} is not a page of k_cache (0 to {num_pages - 1}); "
                       f"row {b} uses its first {int(used[b].sum())} entries")


def _kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, scale, is_causal, window_left, num_splits):
    band = dict(window_left=window_left, window_right=0 if is_causal else None, bottom_right=True)
    B, Hq, N, _ = q.shape
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    if N == 0 or capacity == 0 or B == 0:
        return (ops._empty_out(q, v_cache).zero_(),
                torch.full((B, Hq, N), math.inf, dtype=torch.float32, device=q.device))
    if ops._use_triton(q):
        decode = ops._kernels.modules().decode
        return decode.decode_forward(q, k_cache, v_cache, scale=scale, cache_seqlens=cache_seqlens,
                                     block_table=block_table, layout="bshd", num_splits=num_splits, **band)
    return _kvcache_blockwise(q, k_cache, v_cache, cache_seqlens, block_table, scale, **band)


def _kvcache_blockwise(q, k_cache, v_cache, cache_seqlens, block_table, scale, *, window_left, window_right,
                       bottom_right):
    """The CPU path without the interpreter: gather the cache, then the
    blockwise forward with each row's band as a bool mask."""
    B, Hq, N, _ = q.shape
    if block_table is not None:
        pages = block_table.long().clamp(0, k_cache.shape[0] - 1)
        k = k_cache[pages].flatten(1, 2)
        v = v_cache[pages].flatten(1, 2)
    else:
        k, v = k_cache, v_cache
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, M, D)
    M = k.shape[2]
    lens = (torch.full((B,), M, dtype=torch.int64, device=q.device) if cache_seqlens is None
            else cache_seqlens.long().clamp(0, M))
    j = torch.arange(M, device=q.device)
    i = torch.arange(N, device=q.device)
    diag = (lens - N).view(B, 1, 1) + i.view(1, N, 1)  # (B, N, 1): key index of the diagonal
    mask = j.view(1, 1, M) < lens.view(B, 1, 1)
    if window_right is not None:
        mask = mask & (j.view(1, 1, M) <= diag + window_right)
    if window_left is not None:
        mask = mask & (j.view(1, 1, M) >= diag - window_left)
    return reference.blockwise_forward(q, k, v, mask.unsqueeze(1), None, dropout_p=0.0, scale=scale,
                                       window_left=None, window_right=None, bottom_right=False)


def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, block_table, scale, is_causal, window_left, num_splits):
    B, Hq, N, _ = q.shape
    out = q.new_empty_strided((B, Hq, N, v_cache.shape[-1]), (N * Hq * v_cache.shape[-1], v_cache.shape[-1],
                                                              Hq * v_cache.shape[-1], 1))
    return out, q.new_empty((B, Hq, N), dtype=torch.float32)


_lib.define("_attention_with_kvcache_cpu(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens, "
            "Tensor? block_table, float scale, bool is_causal, SymInt? window_left, SymInt? num_splits) "
            "-> (Tensor, Tensor)")
_lib.impl("_attention_with_kvcache_cpu", _kvcache_forward, "CPU")
torch.library.register_fake("flashfuse::_attention_with_kvcache_cpu", _kvcache_fake, lib=_lib)


def _kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, scale, is_causal, window_left, num_splits):
    """What the op runs on real tensors once dispatched (see ``_kvcache_op``)."""
    args = (q, k_cache, v_cache, cache_seqlens, block_table, scale, is_causal, window_left, num_splits)
    if q.device.type == "cuda":
        return _kvcache_forward(*args)
    return torch.ops.flashfuse._attention_with_kvcache_cpu(*args)


@torch.library.triton_op("flashfuse::attention_with_kvcache", mutates_args=())
def _kvcache_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor], block_table: Optional[Tensor],
    scale: float, is_causal: bool, window_left: Optional[int], num_splits: Optional[int],
) -> tuple[Tensor, Tensor]:
    """See :func:`attention_with_kvcache` (arguments checked there; scale given)."""
    return _kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, scale, is_causal, window_left,
                         num_splits)


_kvcache_op.register_fake(_kvcache_fake)


def _kvcache_no_grad(ctx, grad_out, grad_lse):
    raise RuntimeError("flashfuse.attention_with_kvcache is inference only: it has no gradient; "
                       "use flashfuse.attention (or attention_with_lse) to train")


def _kvcache_setup(ctx, inputs, output):
    pass


_kvcache_op.register_autograd(_kvcache_no_grad, setup_context=_kvcache_setup)


def _may_skip_dispatch(q, k_cache, v_cache, cache_seqlens, block_table) -> bool:
    """Whether an eager call may run ``_kvcache_impl`` itself instead of the
    op. The op's dispatch of a plain eager call (``fastpath.may_skip_dispatch``:
    real tensors, no mode, tracer, compiler, functorch transform or profiler)
    reaches exactly that function: its autograd kernel runs the forward
    without recording anything when no input needs a gradient, and its
    backend kernel calls the function. The Python of that dispatch cost
    about half of an eager decode call's host time (bench/NOTES.md run 23).
    A call whose inputs need a gradient takes the op, whose autograd node
    raises the "inference only" error at the backward."""
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        return False
    return fastpath.may_skip_dispatch(q, k_cache, v_cache, cache_seqlens, block_table)


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor | None = None,
    block_table: Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    window_left: int | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """Attention of new queries over a key/value cache, as decoding runs it.

    Each sequence ``b`` of the batch sees its own filled prefix of the
    cache, ``L_b`` keys, and its ``N`` queries are the last N positions
    (bottom-right alignment): with ``is_causal``, query ``i`` sees keys
    ``j <= L_b - N + i`` (the cache already holds the new tokens' own keys,
    appended by the caller). Rows that see no key (``L_b = 0``, or
    ``L_b < N`` for the first queries) give output 0 and lse ``+inf``.
    Few queries (decoding, N <= 16) run at the cache's read speed: keys are
    split over many programs and the query heads of a group share one read
    of their key/value head. Inference only (no gradient).

    Args:
        q: (B, Hq, N, D) new queries, as :func:`flashfuse.attention` takes
            them (a (B, N, Hq, D) tensor passes as ``q.transpose(1, 2)``);
            fp16, bf16 or fp32 (float64 on CPU); any strides; D 16 to 256.
        k_cache: the keys, in flash-attn's ``flash_attn_with_kvcache``
            layouts, any strides. Without ``block_table``: (B, S_cache, Hkv,
            D), row b's keys at ``k_cache[b, :L_b]`` (a Hugging Face cache
            (B, Hkv, S_cache, D) passes as ``.transpose(1, 2)``, no copy).
            With ``block_table``: (num_pages, page_size, Hkv, D), a pool of
            pages shared by all sequences; any page size (16 to 256 tested).
            Hq must be a multiple of Hkv (query head h reads key/value head
            ``h // (Hq // Hkv)``).
        v_cache: the values, as ``k_cache`` with head dim Dv (16 to 256).
        cache_seqlens: None, or int32 (B,) on q's device: ``L_b``, the
            filled length of row b, 0 to the capacity (S_cache, or
            ``max_pages * page_size``). None: every row is full.
        block_table: None, or int32 (B, max_pages) on q's device: key ``j``
            of row b is at ``k_cache[block_table[b, j // page_size],
            j % page_size]``. Only the first ``ceil(L_b / page_size)``
            entries of a row are read; they must be pages of k_cache.
        scale: multiplier of q.k; default 1/sqrt(D).
        is_causal: query i sees only keys up to its own position (above).
            False: every query sees all L_b keys.
        window_left: None, or sliding-window attention: query i also sees
            no key before ``L_b - N + i - window_left``.
        num_splits: force how many programs share a row's keys (testing,
            tuning); default chosen from the shape and the GPU's SM count
            (``FLASHFUSE_DECODE_SPLITS`` forces it too).
        return_lse: also return lse.

    Returns:
        ``out`` (B, Hq, N, Dv) in q's dtype (laid out as (B, N, Hq, Dv) in
        memory), or ``(out, lse)`` with lse float32 (B, Hq, N), natural
        log, as :func:`flashfuse.attention_with_lse` defines it.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit; and, on real
        tensors outside tracing, lengths outside [0, capacity] and table
        entries in use that are not pages of k_cache (this reads the values,
        a device synchronisation; ``FLASHFUSE_KVCACHE_CHECKS=0`` skips it).
        Unchecked bad values never read outside the tensors: the kernels
        clamp lengths to the capacity and page numbers into the pool.
    """
    check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, window_left, num_splits)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif not math.isfinite(scale):
        raise _err(f"scale must be a finite number, got {scale}")
    if (_value_checks_enabled() and ops._plain_eager_call(q, k_cache, cache_seqlens, block_table)
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        check_kvcache_values(k_cache, cache_seqlens, block_table)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, float(scale), bool(is_causal), window_left, num_splits)
    if _may_skip_dispatch(q, k_cache, v_cache, cache_seqlens, block_table):
        out, lse = _kvcache_impl(*args)
    else:
        out, lse = torch.ops.flashfuse.attention_with_kvcache(*args)
    return (out, lse) if return_lse else out
