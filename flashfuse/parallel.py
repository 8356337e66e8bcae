"""Context parallelism: attention over a sequence sharded across processes.

Each rank of a process group holds a slice of the sequence of q, k and v
(``(B, H, n, D)`` with ``n = N / world``). :func:`ring_attention` passes the
key/value slices around the ring with ``torch.distributed`` point-to-point
ops (``batch_isend_irecv``); each rank attends its queries to every block it
receives with the flash op's private forward, which also returns the
per-row log-sum-exp, and merges the partial outputs exactly through it. The
backward sends the key/value blocks around again, with their dK/dV
accumulators travelling along, and computes each block's gradients with the
op's backward from the GLOBAL output and log-sum-exp, so every block sees the
true probabilities.

Causal attention is load-balanced: the sequence is cut into ``2 * world``
chunks and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``
(:func:`shard` / :func:`unshard`), so every rank has the same number of
visible pairs. :func:`context_parallel` is the context-manager form, shaped
like ``torch.distributed.tensor.experimental.context_parallel``: it shards
the named buffers in place and sends ``F.scaled_dot_product_attention`` and
``flashfuse.attention`` calls through the ring while active.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["context_parallel", "ring_attention", "shard", "unshard"]


# --------------------------------------------------------------------------
# Sharding layout
# --------------------------------------------------------------------------

def _world_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("flashfuse.ring_attention: torch.distributed is not initialised; "
                         "call torch.distributed.init_process_group first")
    return dist.get_world_size(group), dist.get_rank(group)


def _chunks(world: int, rank: int, load_balanced: bool) -> list[int]:
    """The chunk indices rank ``rank`` holds, in order: of ``2 * world``
    chunks when load-balanced, else of ``world``."""
    return [rank, 2 * world - 1 - rank] if load_balanced else [rank]


def _check_divisible(length: int, world: int, load_balanced: bool, what: str) -> int:
    parts = 2 * world if load_balanced else world
    if length % parts:
        raise ValueError(
            f"flashfuse.context_parallel: {what} length {length} is not divisible by {parts} "
            f"({'2 x ' if load_balanced else ''}world size {world}); pad the sequence to a multiple of {parts}"
        )
    return length // parts


def shard(x: Tensor, group=None, *, seq_dim: int = 2, load_balanced: bool = True) -> Tensor:
    """This rank's slice of a full-sequence tensor ``x`` along ``seq_dim``
    (the layout :func:`ring_attention` expects). Raises ``ValueError`` when
    the length does not divide into ``world`` (``2 * world`` load-balanced)
    equal chunks."""
    world, rank = _world_rank(group)
    c = _check_divisible(x.shape[seq_dim], world, load_balanced, "sequence")
    parts = [x.narrow(seq_dim, i * c, c) for i in _chunks(world, rank, load_balanced)]
    return torch.cat(parts, dim=seq_dim) if len(parts) > 1 else parts[0].clone()


def unshard(x: Tensor, group=None, *, seq_dim: int = 2, load_balanced: bool = True) -> Tensor:
    """The full-sequence tensor from every rank's slice (an all-gather)."""
    world, _ = _world_rank(group)
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x.contiguous(), group=group)
    per = 2 if load_balanced else 1
    chunks = [None] * (per * world)
    for r, piece in enumerate(pieces):
        for idx, part in zip(_chunks(world, r, load_balanced), piece.chunk(per, dim=seq_dim)):
            chunks[idx] = part
    return torch.cat(chunks, dim=seq_dim)


# --------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------

def _segments(world, rank, n_local, load_balanced):
    """(global start, local start, length) of each contiguous run this rank holds."""
    per = 2 if load_balanced else 1
    c = n_local // per
    return [(idx * c, i * c, c) for i, idx in enumerate(_chunks(world, rank, load_balanced))]


def _block_visibility(qs, qn, ks, kn, off, causal):
    """How a query run [qs, qs+qn) sees a key run [ks, ks+kn) in global
    positions, with key j visible to query i when j <= i + off (causal):
    ("all", None), ("none", None), ("window", right) with the op's top-left
    window_right >= 0, or ("mask", bool mask)."""
    if not causal:
        return "all", None
    delta = qs + off - ks  # local key j' visible to local query i' when j' <= i' + delta
    if delta >= kn - 1:
        return "all", None
    if delta + qn - 1 < 0:
        return "none", None
    if delta >= 0:
        return "window", delta
    return "mask", None


def _mask(qn, kn, delta, device):
    i = torch.arange(qn, device=device)[:, None]
    j = torch.arange(kn, device=device)[None, :]
    return j <= i + delta


def _ring_plan(world, rank, n_local, m_local, off, causal, load_balanced):
    """The ring's per-step plan for this rank: for each step, the blocks its
    query runs compute against the key runs then held (they come from rank
    ``(rank - step) % world``), as ``(q start, q len, k start, k len,
    window_right or None, mask_delta or None)`` in local positions, where a
    block with ``mask_delta`` takes the bool mask ``_mask(q len, k len,
    mask_delta)``; blocks that see nothing are left out. Plain numbers: built
    once by the forward and kept for the backward, which walks the same
    blocks (the masks are made where they are used, so none stays alive
    between the two)."""
    q_segs = _segments(world, rank, n_local, load_balanced)
    plan = []
    for step in range(world):
        k_segs = _segments(world, (rank - step) % world, m_local, load_balanced)
        items = []
        for (qs, ql, qn) in q_segs:
            for (ks, kl, kn) in k_segs:
                kind, right = _block_visibility(qs, qn, ks, kn, off, causal)
                if kind == "none":
                    continue
                delta = qs + off - ks if kind == "mask" else None
                items.append((ql, qn, kl, kn, right if kind == "window" else None, delta))
        plan.append(items)
    return plan


def _forward_block(q, k, v, mask, scale, window_right):
    out, lse = torch.ops.flashfuse._attention_forward(q, k, v, mask, None, 0.0, scale, None, window_right, False, None)
    # Rows that see no key of this block: lse +inf by the op's convention,
    # no contribution to the merge.
    return out, torch.where(lse == math.inf, -math.inf, lse)


def _merge(acc, lse_acc, out, lse):
    """Exact softmax merge of two partial results through their log-sum-exps."""
    new = torch.logaddexp(lse_acc, lse)
    safe = torch.where(new == -math.inf, 0.0, new)
    a = torch.exp(lse_acc - safe).unsqueeze(-1)
    b = torch.exp(lse - safe).unsqueeze(-1)
    return acc * a + out.to(acc.dtype) * b, new


class _Ring:
    """Sends tensors to the next rank of the group and receives the previous rank's."""

    def __init__(self, group, world, rank):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world

    def start(self, tensors):
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def wait(pending):
        for req in pending[0]:
            req.wait()
        return pending[1]


def _acc_dtype(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, load_balanced, off):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ring = _Ring(group, world, rank)
        n, m = q.shape[2], k.shape[2]
        plan = _ring_plan(world, rank, n, m, off, causal, load_balanced)
        B, H, Dv = q.shape[0], q.shape[1], v.shape[-1]
        acc = q.new_zeros((B, H, n, Dv), dtype=_acc_dtype(q))
        lse = q.new_full((B, H, n), -math.inf, dtype=acc.dtype)
        kv = (k, v)
        for step in range(world):
            pending = ring.start(kv) if step < world - 1 else None
            for ql, qn, kl, kn, right, delta in plan[step]:
                mask = None if delta is None else _mask(qn, kn, delta, q.device)
                o, l = _forward_block(q[:, :, ql:ql + qn], kv[0][:, :, kl:kl + kn], kv[1][:, :, kl:kl + kn],
                                      mask, scale, right)
                acc[:, :, ql:ql + qn], lse[:, :, ql:ql + qn] = _merge(
                    acc[:, :, ql:ql + qn], lse[:, :, ql:ql + qn], o, l.to(acc.dtype))
            if pending is not None:
                kv = tuple(_Ring.wait(pending))
        out = acc.to(q.dtype)
        # The op's backward convention: +inf for rows that see no key at all.
        lse = torch.where(lse == -math.inf, math.inf, lse).to(torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (group, scale)
        ctx.plan = plan  # the backward walks the same blocks
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.params
        plan = ctx.plan
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ring = _Ring(group, world, rank)
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=_acc_dtype(q), device=q.device)
        dk = torch.zeros(k.shape, dtype=dq.dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=dq.dtype, device=q.device)
        kv = (k, v)
        for step in range(world):
            # The key/value block moves on while this one is used; its
            # gradient accumulators follow it, one step behind.
            pending_kv = ring.start(kv) if step < world - 1 else None
            for ql, qn, kl, kn, right, delta in plan[step]:
                mask = None if delta is None else _mask(qn, kn, delta, q.device)
                qsl, ksl = slice(ql, ql + qn), slice(kl, kl + kn)
                bdq, bdk, bdv, _ = torch.ops.flashfuse._attention_backward(
                    grad_out[:, :, qsl], q[:, :, qsl], kv[0][:, :, ksl], kv[1][:, :, ksl], mask, None,
                    out[:, :, qsl], lse[:, :, qsl], 0.0, scale, None, right, False, False, None)
                dq[:, :, qsl] += bdq
                dk[:, :, ksl] += bdk
                dv[:, :, ksl] += bdv
            # Every rank sends its accumulators on (after the last step they
            # reach the rank the block came from); a world of one keeps them.
            if world > 1:
                dk, dv = _Ring.wait(ring.start((dk, dv)))
            if pending_kv is not None:
                kv = tuple(_Ring.wait(pending_kv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(query: Tensor, key: Tensor, value: Tensor, *, group=None, is_causal: bool = False,
                   scale: Optional[float] = None, enable_gqa: bool = False, load_balanced: Optional[bool] = None,
                   alignment: str = "top_left", return_lse: bool = False):
    """Exact attention over a sequence sharded across ``group``.

    ``query`` (B, Hq, n, D), ``key`` (B, Hkv, m, D) and ``value`` (B, Hkv, m,
    Dv) are this rank's slices of the global (B, H, world * n, D) tensors,
    laid out as :func:`shard` cuts them (``load_balanced``, the default for
    causal attention: chunks ``r`` and ``2 * world - 1 - r`` of ``2 * world``;
    otherwise chunk ``r`` of ``world``). Returns this rank's slice of the
    output (and, with ``return_lse``, of the float32 log-sum-exp), equal to
    ``flashfuse.attention`` on the whole sequence. ``alignment="bottom_right"``
    places the causal diagonal at ``M - N`` when the global lengths differ.
    Masks, windows and dropout are not supported (``ValueError``).
    """
    from .ops import check_inputs

    check_inputs(query, key, value, None, 0.0, enable_gqa, None, None, alignment)
    world, rank = _world_rank(group)
    if load_balanced is None:
        load_balanced = is_causal
    n, m = query.shape[2], key.shape[2]
    # Every rank must hold the same lengths: compared across the group, so
    # that all ranks raise together rather than hang in the ring.
    lengths = torch.tensor([n, m, -n, -m], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        lengths = lengths.to(query.device)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    if lengths[0] != -lengths[2] or lengths[1] != -lengths[3]:
        raise ValueError(
            "flashfuse.ring_attention: ranks hold different sequence lengths (query "
            f"{-int(lengths[2])}..{int(lengths[0])}, key {-int(lengths[3])}..{int(lengths[1])}); "
            "shard the sequence into equal slices (flashfuse.parallel.shard), padding it to a multiple of the "
            "world size (twice the world size with load balancing)"
        )
    if load_balanced and (n % 2 or m % 2):
        raise ValueError(
            f"flashfuse.ring_attention: load-balanced slices hold two chunks each, but this rank holds {n} "
            f"queries and {m} keys; pad the global sequence to a multiple of {2 * world}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    off = world * (m - n) if alignment == "bottom_right" else 0
    out, lse = _RingAttention.apply(query, key, value, group, bool(is_causal), float(scale), bool(load_balanced), off)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------
# Context manager
# --------------------------------------------------------------------------

@contextlib.contextmanager
def context_parallel(group=None, *, buffers: Sequence[Tensor] = (), buffer_seq_dims: Sequence[int] = (),
                     no_restore_buffers: Sequence[Tensor] = (), load_balanced: bool = True):
    """Run attention over a sequence sharded across ``group``, as
    ``torch.distributed.tensor.experimental.context_parallel`` does for SDPA.

    On entry each tensor of ``buffers`` is replaced in place by this rank's
    slice along its dim in ``buffer_seq_dims`` (:func:`shard`); on exit the
    full tensors come back (an all-gather), except for those also named in
    ``no_restore_buffers``. While active, ``F.scaled_dot_product_attention``
    and ``flashfuse.attention`` called with (B, H, N, D) tensors on this
    rank's slices run :func:`ring_attention` (no mask, no dropout). Dynamo
    does not trace through the redirect: compile the model's blocks with
    ``flashfuse.ring_attention`` called directly instead.
    """
    import torch.nn.functional as F

    from . import ops

    if len(buffers) != len(buffer_seq_dims):
        raise ValueError("flashfuse.context_parallel: give one sequence dim per buffer")
    _world_rank(group)
    for buf, d in zip(buffers, buffer_seq_dims):
        local = shard(buf.detach(), group, seq_dim=d, load_balanced=load_balanced)
        buf.data = local

    def redirect(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, **kwargs):
        if attn_mask is not None or dropout_p or kwargs.get("window_left") is not None \
                or kwargs.get("window_right") is not None or kwargs.get("mask_fill") is not None:
            raise ValueError("flashfuse.context_parallel: attention under context parallelism takes no mask, "
                             "window or dropout; pass is_causal for causal attention")
        return ring_attention(query, key, value, group=group, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa,
                              load_balanced=load_balanced, alignment=kwargs.get("alignment", "top_left"))

    saved = (F.scaled_dot_product_attention, ops.attention)
    import flashfuse

    F.scaled_dot_product_attention = redirect
    ops.attention = flashfuse.attention = redirect
    try:
        yield
    finally:
        F.scaled_dot_product_attention, ops.attention = saved
        flashfuse.attention = saved[1]
        no_restore = {id(t) for t in no_restore_buffers}
        for buf, d in zip(buffers, buffer_seq_dims):
            if id(buf) not in no_restore:
                buf.data = unshard(buf.detach(), group, seq_dim=d, load_balanced=load_balanced)
