"""Tests of the mask block-range table (``flashfuse.kernels.mask_ranges``)
against a brute-force computation of the same rule in PyTorch."""

from __future__ import annotations

import pytest
import torch

from flashfuse import reference as ref
from flashfuse.kernels.mask_ranges import GROUP, mask_block_ranges, mask_hidden_at

from .masks import hiding_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(mask, N, M, band):
    """Key range per group of rows and (N - lo, hi) query range per chunk of
    keys, by the rule mask_ranges documents, over the mask's own (B, H)."""
    vis = ref.visibility_mask(N, M, **band)
    vis = torch.ones(N, M, dtype=torch.bool) if vis is None else vis.cpu()
    m = mask.cpu()
    if m.dtype == torch.bool:
        part = m & vis
        needs_all = torch.zeros(m.shape[:3], dtype=torch.bool)
    else:
        x = m.float()
        part = ((x > mask_hidden_at(m.dtype == torch.float16)) | x.isnan()) & vis
        finite = ((x > float("-inf")) & vis).any(-1)
        needs_all = ~part.any(-1) & finite
    part = part | (needs_all[..., None] & vis)
    B, H = m.shape[:2]
    groups, chunks = -(-N // GROUP), -(-M // GROUP)
    keys = torch.zeros(B, H, groups, 2, dtype=torch.int32)
    queries = torch.zeros(B, H, chunks, 2, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for g in range(groups):
                cols = part[b, h, g * GROUP:(g + 1) * GROUP].any(0).nonzero().flatten()
                keys[b, h, g] = torch.tensor([cols.min(), cols.max() + 1] if len(cols) else [M, 0])
            for c in range(chunks):
                rows = part[b, h, :, c * GROUP:(c + 1) * GROUP].any(1).nonzero().flatten()
                if len(rows):
                    lo, hi = (rows.min() // GROUP) * GROUP, (rows.max() // GROUP + 1) * GROUP
                    queries[b, h, c] = torch.tensor([N - lo, hi])
    return keys, queries


def _mask(kind, B, H, N, M, gen):
    i, j = torch.arange(N)[:, None], torch.arange(M)[None, :]
    hidden = (j > i + 5).expand(B, H, N, M).clone()  # causal-like, with some hidden blocks
    hidden[0, :, :, M - 40:] = True  # key padding in batch 0
    hidden[..., 7, :] = True  # a row that sees nothing
    return hiding_mask(hidden, kind, gen)


@pytest.mark.parametrize("kind", ["bool", "float32-min", "float32-inf", "bfloat16-min", "float16-min"])
@pytest.mark.parametrize("N, M", [(37, 150), (16, 16), (70, 33)])
@pytest.mark.parametrize("band", [{}, {"window_right": 0}, {"window_left": 9, "window_right": 3, "bottom_right": True}],
                         ids=["none", "causal", "window"])
def test_ranges_match_brute_force(kind, N, M, band):
    gen = torch.Generator().manual_seed(N * 1000 + M)
    mask = _mask(kind, 2, 1, N, M, gen)
    band = {"window_left": None, "window_right": None, "bottom_right": False, **band}
    want_keys, want_queries = _expected(mask, N, M, band)
    limit = N + M
    arg = mask.to(DEVICE)
    arg = arg.view(torch.uint8) if arg.dtype == torch.bool else arg
    keys, queries = mask_block_ranges(
        arg, N, M, diag_off=(M - N) if band["bottom_right"] else 0,
        window_left=max(-limit, min(band["window_left"] or 0, limit)),
        window_right=max(-limit, min(band["window_right"] or 0, limit)),
        has_window_left=band["window_left"] is not None, has_window_right=band["window_right"] is not None)
    # Empty key ranges may be any lo >= hi; compare them as empty.
    keys = keys.cpu()
    empty = keys[..., 0] >= keys[..., 1]
    assert torch.equal(empty, want_keys[..., 0] >= want_keys[..., 1])
    assert torch.equal(keys[~empty], want_keys[~empty])
    assert torch.equal(queries.cpu(), want_queries)


def test_broadcast_dimensions_are_computed_once():
    # A (1, 1, N, M) mask expanded over batch and heads gives one table.
    N, M = 20, 40
    mask = (torch.rand(N, M, generator=torch.Generator().manual_seed(0)) > 0.5).to(DEVICE)
    arg = mask.expand(3, 4, N, M).view(torch.uint8)
    keys, queries = mask_block_ranges(arg, N, M, diag_off=0, window_left=0, window_right=0,
                                      has_window_left=False, has_window_right=False)
    assert keys.shape[:2] == (1, 1) and queries.shape[:2] == (1, 1)
    want_keys, want_queries = _expected(mask[None, None], N, M,
                                        {"window_left": None, "window_right": None, "bottom_right": False})
    assert torch.equal(keys.cpu(), want_keys) and torch.equal(queries.cpu(), want_queries)
