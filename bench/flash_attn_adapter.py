"""flash-attn's Python interface, served by ``flashfuse.attention``.

So that test cases written for flash-attn (its soft-capping, window, causal,
ALiBi and grouped-head cases) can run against the op unchanged::

    from bench.flash_attn_adapter import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True, softcap=50.0)   # (B, N, H, D) in and out

or, for a test file that imports ``flash_attn`` itself, ``install()`` first
(puts a ``flash_attn`` module holding these functions into ``sys.modules``).

What flash-attn means, as mapped here:

* layout (batch, seqlen, heads, head_dim) for q, k, v and the output; k/v may
  have fewer heads (grouped-query attention);
* ``causal`` and ``window_size=(left, right)`` (-1: unbounded) aligned to the
  bottom-right corner (query i sees key j when ``j <= i + M - N``);
* ``softcap`` > 0: ``softcap * tanh(scale * q.k / softcap)`` before the
  masks and the bias (0: none);
* ``alibi_slopes`` (heads,) or (batch, heads): the bias
  ``-slope * |i + M - N - j|`` added to the capped scores, passed to the op
  as a float mask (it gets no gradient, as in flash-attn);
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the op
  never materialises the probabilities, so flash-attn's cases that read
  ``S_dmask`` (the dropout pattern) cannot run; with ``dropout_p > 0`` the op
  draws its own dropout mask.

Not served: the varlen (packed), KV-cache and rotary entry points.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

import flashfuse


def _alibi_bias(slopes: torch.Tensor, B: int, H: int, N: int, M: int, device) -> torch.Tensor:
    """(B or 1, H, N, M) float32 bias ``-slope * |i + M - N - j|``."""
    s = slopes.to(torch.float32)
    s = s.view(1, H, 1, 1) if s.dim() == 1 else s.view(B, H, 1, 1)
    i = torch.arange(N, device=device).view(N, 1)
    j = torch.arange(M, device=device).view(1, M)
    return -s * (i + (M - N) - j).abs().to(torch.float32)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn.flash_attn_func`` on ``flashfuse.attention`` (see the
    module docstring for the mapping)."""
    B, N, H, _ = q.shape
    M = k.shape[1]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    left, right = window_size
    window_left = None if left is None or left < 0 else int(left)
    window_right = None if right is None or right < 0 else int(right)
    if causal:
        window_right = 0
    mask = None
    if alibi_slopes is not None:
        mask = _alibi_bias(alibi_slopes, B, H, N, M, q.device)
        if q.dtype != torch.float32:
            mask = mask.to(q.dtype)
    ctx = _deterministic() if deterministic else contextlib.nullcontext()
    with ctx:
        out = flashfuse.attention(
            qt, kt, vt, mask, dropout_p=dropout_p, scale=softmax_scale, enable_gqa=H != k.shape[2],
            window_left=window_left, window_right=window_right, alignment="bottom_right",
            softcap=float(softcap) if softcap and softcap > 0 else None,
        )
    out = out.transpose(1, 2)
    if not return_attn_probs:
        return out
    from flashfuse import reference

    # From the float64 reference (materialises the scores: for tests).
    lse = reference.reference_lse(
        qt.detach(), kt.detach(), mask, scale=softmax_scale, window_left=window_left, window_right=window_right,
        bottom_right=True, softcap=float(softcap) if softcap and softcap > 0 else None,
    ).float()
    return out, lse, None


class _deterministic:
    """torch.use_deterministic_algorithms(True) for the call (the op then
    takes the two-pass backward, as flash-attn's ``deterministic``)."""

    def __enter__(self):
        self.prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.prev)


def flash_attn_kvpacked_func(q, kv, *args, **kwargs):
    """kv: (batch, seqlen, 2, heads_kv, head_dim)."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], *args, **kwargs)


def flash_attn_qkvpacked_func(qkv, *args, **kwargs):
    """qkv: (batch, seqlen, 3, heads, head_dim)."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *args, **kwargs)


def install() -> types.ModuleType:
    """Make ``import flash_attn`` give these functions (for a test file
    written against flash-attn). Returns the module."""
    mod = types.ModuleType("flash_attn")
    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_kvpacked_func = flash_attn_kvpacked_func
    mod.flash_attn_qkvpacked_func = flash_attn_qkvpacked_func
    mod.__doc__ = "flashfuse's stand-in for flash-attn (bench/flash_attn_adapter.py)"
    sys.modules["flash_attn"] = mod
    return mod
