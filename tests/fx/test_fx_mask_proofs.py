"""Masks spelled the way recent transformers releases build them, without
transformers: position ids gathered at ``[batch, q]`` and ``[batch, kv]``,
compared, ANDed with a "same packed sequence" term, turned additive with a
``torch.zeros(())`` node. The proof must follow what each mask computes: the
causal and sliding-window ones become op arguments (no mask tensor), and the
near misses stay mask tensors with outputs equal to eager."""

from __future__ import annotations

import pytest
import torch

from fxutil import compile_and_compare, qkv

SCALE = 0.25
WINDOW = 3


def _indices(b, n):
    bi = torch.arange(b)[:, None, None, None]
    qi = torch.arange(n)[None, None, :, None]
    ki = torch.arange(n)[None, None, None, :]
    return bi, qi, ki


def _segments(pos):
    start = pos[:, :1] - 1
    return (torch.diff(pos, prepend=start, dim=-1) != 1).cumsum(-1)


def _additive(keep, s):
    # As transformers turns a boolean mask additive: where(keep, 0, min).
    zero = torch.zeros((), dtype=s.dtype)
    return s + torch.where(keep, zero, torch.finfo(s.dtype).min)


def _positions(q):
    return torch.arange(q.size(-2)).unsqueeze(0).expand(q.size(0), -1)


def _attend(keep, q, k, v):
    s = q @ k.transpose(-2, -1) * SCALE
    return _additive(keep, s).softmax(-1) @ v


def causal_gathered_positions(q, k, v):
    b, n = q.size(0), q.size(-2)
    pos = _positions(q)
    bi, qi, ki = _indices(b, n)
    seg = _segments(pos)
    keep = qi.new_ones((), dtype=torch.bool) & (pos[bi, ki] <= pos[bi, qi])
    keep = keep & (seg[bi, qi] == seg[bi, ki])
    return _attend(keep.expand(b, -1, n, n), q, k, v)


def window_gathered_positions(q, k, v):
    b, n = q.size(0), q.size(-2)
    pos = _positions(q)
    bi, qi, ki = _indices(b, n)
    p_q, p_k = pos[bi, qi], pos[bi, ki]
    keep = p_q.new_ones((), dtype=torch.bool) & (p_k > p_q - WINDOW)
    keep = keep & (p_k <= p_q)
    return _attend(keep, q, k, v)


# -- near misses: each looks like the above but is not causal ---------------

def sees_one_future_key(q, k, v):
    # Off-by-one diagonal: each query also sees the next key.
    b, n = q.size(0), q.size(-2)
    pos = _positions(q)
    bi, qi, ki = _indices(b, n)
    return _attend(pos[bi, ki] <= pos[bi, qi] + 1, q, k, v)


def query_positions_shifted(q, k, v):
    # The query positions are read from a tensor one ahead of the keys'.
    b, n = q.size(0), q.size(-2)
    pos = _positions(q)
    bi, qi, ki = _indices(b, n)
    return _attend(pos[bi, ki] <= (pos + 1)[bi, qi], q, k, v)


def negative_index_wraps(q, k, v):
    # pos[bi, qi - 1] + 1 reads like the query's own position, but at q = 0
    # the index -1 wraps to the last position: that row sees every key.
    b, n = q.size(0), q.size(-2)
    pos = _positions(q)
    bi, qi, ki = _indices(b, n)
    return _attend(pos[bi, ki] <= pos[bi, qi - 1] + 1, q, k, v)


def positions_wrap_in_uint8(q, k, v):
    # Positions 250, 251, ... cast to uint8 wrap to 0 after 255: a later
    # query then has a smaller position than the earlier keys.
    n = q.size(-2)
    pos = (torch.arange(n) + 250).to(torch.uint8)
    s = q @ k.transpose(-2, -1) * SCALE
    return s.masked_fill(pos[None, :] > pos[:, None], float("-inf")).softmax(-1) @ v


def positions_wrap_in_int32(q, k, v):
    # int32 arithmetic wraps past 2**31 - 1, where the affine form would not.
    n = q.size(-2)
    pos = torch.arange(n, dtype=torch.int32) + (2**31 - 5)
    s = q @ k.transpose(-2, -1) * SCALE
    return s.masked_fill(pos[None, :] > pos[:, None], float("-inf")).softmax(-1) @ v


def padding_term_used(q, k, v, pad):
    # A padding term from the input: its values are unknown at compile time.
    b, n = q.size(0), q.size(-2)
    pos = _positions(q)
    bi, qi, ki = _indices(b, n)
    keep = (pos[bi, ki] <= pos[bi, qi]) & pad[bi, ki]
    return _attend(keep, q, k, v)


def positions_from_input(q, k, v, pos):
    # Position ids passed in (here two packed sequences): not provable.
    b, n = q.size(0), q.size(-2)
    bi, qi, ki = _indices(b, n)
    seg = _segments(pos)
    keep = (pos[bi, ki] <= pos[bi, qi]) & (seg[bi, qi] == seg[bi, ki])
    return _attend(keep, q, k, v)


@pytest.mark.parametrize(
    "fn,facts",
    [
        (causal_gathered_positions, {"causal": "top-left", "mask": "none"}),
        (window_gathered_positions, {"causal": None, "window": f"({WINDOW - 1}, 0) top_left", "mask": "none"}),
        # Off by one: still a band, so a window, but the exact one (one key
        # to the right of the diagonal), never "causal".
        (sees_one_future_key, {"causal": None, "window": "(-, 1) top_left", "mask": "none"}),
        (query_positions_shifted, {"causal": None, "window": "(-, 1) top_left", "mask": "none"}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_gathered_positions_proven(fn, facts):
    """What the mask computes becomes op arguments, with no mask tensor."""
    _, backend = compile_and_compare(fn, *qkv(n=9), expect=1)
    (cand,) = backend.candidates
    for key, value in facts.items():
        assert cand.facts.get(key) == value, (key, cand.facts)


def _packed_positions(b, n):
    half = n // 2
    row = torch.cat([torch.arange(half), torch.arange(n - half)])
    return row.expand(b, -1).contiguous()


def _padding(b, n):
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[1, -3:] = False
    return pad


@pytest.mark.parametrize(
    "fn,extra",
    [
        (negative_index_wraps, None),
        (positions_wrap_in_uint8, None),
        (positions_wrap_in_int32, None),
        (padding_term_used, _padding),
        (positions_from_input, _packed_positions),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_near_misses_stay_masks(fn, extra):
    """Not a band (or not provably one): the mask stays a tensor."""
    q, k, v = qkv(n=9)
    inputs = [q, k, v] + ([extra(q.size(0), q.size(-2))] if extra else [])
    _, backend = compile_and_compare(fn, *inputs, expect=1)
    (cand,) = backend.candidates
    assert cand.facts.get("causal") is None and cand.facts.get("window") is None, cand.facts
    assert cand.facts.get("mask") != "none", cand.facts
