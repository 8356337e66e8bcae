"""Tests of the mask tables (``flashfuse.kernels.mask_ranges``) against a
brute-force computation of the same rules in PyTorch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from flashfuse import reference as ref
from flashfuse.kernels.mask_ranges import COL_GROUP, ROW_GROUP, mask_hidden_at, mask_key_table, mask_query_table

from tests.kernels.masks import hiding_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _first_at_or_after(flags: torch.Tensor, start: torch.Tensor, none: int) -> torch.Tensor:
    """Per row of ``flags`` (..., L): the first index >= start where it is
    True, else ``none``."""
    idx = torch.arange(flags.shape[-1])
    hit = flags & (idx >= start[..., None])
    return torch.where(hit.any(-1), torch.where(hit, idx, flags.shape[-1]).amin(-1), torch.tensor(none))


def _expected(mask, N, M, band, fills=False):
    """The key table (lo, hi, free_lo, free_hi, averages) per group of rows
    and the query table (lo, hi, free_lo, free_hi) per group of keys, by the
    rules mask_ranges documents, over the mask's own (B, H)."""
    vis = ref.visibility_mask(N, M, **band)
    vis = torch.ones(N, M, dtype=torch.bool) if vis is None else vis.cpu()
    m = mask.cpu()
    if m.dtype == torch.bool:
        part = m & vis
        neutral = m
        # With a finite fill every band pair is finite: rows hidden entirely
        # average their band keys.
        averages = ~part.any(-1) & vis.any(-1) if fills else torch.zeros(m.shape[:3], dtype=torch.bool)
    else:
        x = m.float()
        part = ((x > mask_hidden_at(m.dtype == torch.float16)) | x.isnan()) & vis
        neutral = x == 0
        finite = ((x > float("-inf")) & vis).any(-1)
        averages = ~part.any(-1) & finite
    part = part | (averages[..., None] & vis)
    cut = vis & ~neutral
    idx_n = torch.arange(M)
    first = torch.where(part.any(-1), torch.where(part, idx_n, M).amin(-1), torch.tensor(M))
    last = torch.where(part.any(-1), torch.where(part, idx_n, -1).amax(-1), torch.tensor(-1))
    z = _first_at_or_after(cut, first, M)
    B, H = m.shape[:2]
    groups, chunks = -(-N // ROW_GROUP), -(-M // COL_GROUP)
    keys = torch.zeros(B, H, groups, 5, dtype=torch.int32)
    for g in range(groups):
        r = slice(g * ROW_GROUP, (g + 1) * ROW_GROUP)
        keys[:, :, g] = torch.stack([first[..., r].amin(-1), (last[..., r] + 1).amax(-1), first[..., r].amax(-1),
                                     z[..., r].amin(-1), averages[..., r].any(-1).int()], -1).int()
    # Columns: rows of a group that averages take part wherever visible.
    group_avg = keys[..., 4].bool().repeat_interleave(ROW_GROUP, -1)[..., :N]
    part_c = (part | (group_avg[..., None] & vis)).transpose(-1, -2)  # (B, H, M, N)
    cut_c = cut.expand(B, H, N, M).transpose(-1, -2)
    idx_m = torch.arange(N)
    first_c = torch.where(part_c.any(-1), torch.where(part_c, idx_m, N).amin(-1), torch.tensor(N))
    last_c = torch.where(part_c.any(-1), torch.where(part_c, idx_m, -1).amax(-1), torch.tensor(-1))
    z_c = _first_at_or_after(cut_c, first_c, N)
    queries = torch.zeros(B, H, chunks, 4, dtype=torch.int32)
    for c in range(chunks):
        r = slice(c * COL_GROUP, (c + 1) * COL_GROUP)
        queries[:, :, c] = torch.stack([first_c[..., r].amin(-1), (last_c[..., r] + 1).amax(-1),
                                        first_c[..., r].amax(-1), z_c[..., r].amin(-1)], -1).int()
    return keys, queries


def _mask(kind, B, H, N, M, gen, values):
    i, j = torch.arange(N)[:, None], torch.arange(M)[None, :]
    hidden = (j > i + 5).expand(B, H, N, M).clone()  # causal-like, with some hidden blocks
    hidden[0, :, :, M - 40:] = True  # key padding in batch 0
    hidden[..., 7, :] = True  # a row that sees nothing
    mask = hiding_mask(hidden, kind, gen)
    if values == "zeros" and mask.dtype != torch.bool:
        # Neutral where visible (as models build masks), with a few biases.
        bias = torch.rand(hidden.shape, generator=gen) < 0.02
        mask = torch.where(hidden | bias, mask, torch.zeros((), dtype=mask.dtype))
    return mask


def _tables(mask, N, M, band, fills=False):
    limit = N + M
    arg = mask.to(DEVICE)
    arg = arg.view(torch.uint8) if arg.dtype == torch.bool else arg
    kw = dict(diag_off=(M - N) if band["bottom_right"] else 0,
              window_left=max(-limit, min(band["window_left"] or 0, limit)),
              window_right=max(-limit, min(band["window_right"] or 0, limit)),
              has_window_left=band["window_left"] is not None, has_window_right=band["window_right"] is not None)
    keys = mask_key_table(arg, N, M, **kw, fills=fills)
    return keys, mask_query_table(arg, keys, N, M, **kw, fills=fills)


@pytest.mark.parametrize("kind, values", [("bool", "bias"), ("float32-min", "bias"), ("float32-inf", "bias"),
                                          ("bfloat16-min", "bias"), ("float16-min", "bias"), ("float32-min", "zeros"),
                                          ("float32-inf", "zeros"), ("bfloat16-min", "zeros"), ("float16-min", "zeros")])
@pytest.mark.parametrize("N, M", [(37, 150), (16, 16), (70, 33)])
@pytest.mark.parametrize("band", [{}, {"window_right": 0}, {"window_left": 9, "window_right": 3, "bottom_right": True}],
                         ids=["none", "causal", "window"])
def test_tables_match_brute_force(kind, values, N, M, band):
    gen = torch.Generator().manual_seed(N * 1000 + M)
    mask = _mask(kind, 2, 1, N, M, gen, values)
    band = {"window_left": None, "window_right": None, "bottom_right": False, **band}
    want_keys, want_queries = _expected(mask, N, M, band)
    keys, queries = _tables(mask, N, M, band)
    assert torch.equal(keys.cpu(), want_keys)
    assert torch.equal(queries.cpu(), want_queries)


@pytest.mark.parametrize("N, M", [(37, 150), (70, 33)])
@pytest.mark.parametrize("band", [{}, {"window_right": 0}, {"window_left": 9, "window_right": 3, "bottom_right": True}],
                         ids=["none", "causal", "window"])
def test_tables_with_a_fill_match_brute_force(N, M, band):
    # A bool mask whose hidden pairs score a finite fill: rows it hides
    # entirely (row 7, and rows the band leaves only hidden keys) average
    # their band keys, so all of those take part.
    gen = torch.Generator().manual_seed(N * 1000 + M)
    mask = _mask("bool", 2, 1, N, M, gen, "bias")
    band = {"window_left": None, "window_right": None, "bottom_right": False, **band}
    want_keys, want_queries = _expected(mask, N, M, band, fills=True)
    assert want_keys[..., 4].any() or band["bottom_right"]  # there, row 7 has no band key
    keys, queries = _tables(mask, N, M, band, fills=True)
    assert torch.equal(keys.cpu(), want_keys)
    assert torch.equal(queries.cpu(), want_queries)


def test_causal_mask_leaves_everything_below_the_diagonal_free():
    # What Hugging Face passes: 0 where visible, the dtype's lowest above the
    # diagonal. Every row group may skip the mask up to its first row.
    N = M = 100
    hidden = torch.ones(N, M, dtype=torch.bool).triu(1)
    mask = torch.zeros(N, M).masked_fill(hidden, torch.finfo(torch.float32).min)[None, None]
    band = {"window_left": None, "window_right": None, "bottom_right": False}
    keys, queries = _tables(mask, N, M, band)
    keys, queries = keys.cpu()[0, 0], queries.cpu()[0, 0]
    g = torch.arange(keys.shape[0])
    assert torch.equal(keys[:, 2], torch.zeros_like(g, dtype=torch.int32))  # free from key 0 ...
    assert torch.equal(keys[:, 3], (g * ROW_GROUP + 1).int())  # ... to the group's first row's diagonal
    c = torch.arange(queries.shape[0])
    assert torch.equal(queries[:, 2], torch.clamp(c * COL_GROUP + COL_GROUP - 1, max=M - 1).int())
    assert torch.equal(queries[:, 3], torch.full_like(c, N, dtype=torch.int32))


def test_broadcast_dimensions_are_computed_once():
    # A (1, 1, N, M) mask expanded over batch and heads gives one table.
    N, M = 20, 40
    mask = (torch.rand(N, M, generator=torch.Generator().manual_seed(0)) > 0.5).to(DEVICE)
    arg = mask.expand(3, 4, N, M).view(torch.uint8)
    kw = dict(diag_off=0, window_left=0, window_right=0, has_window_left=False, has_window_right=False)
    keys = mask_key_table(arg, N, M, **kw)
    queries = mask_query_table(arg, keys, N, M, **kw)
    assert keys.shape[:2] == (1, 1) and queries.shape[:2] == (1, 1)
    want_keys, want_queries = _expected(mask[None, None], N, M,
                                        {"window_left": None, "window_right": None, "bottom_right": False})
    assert torch.equal(keys.cpu(), want_keys) and torch.equal(queries.cpu(), want_queries)


@st.composite
def _random_masks(draw):
    """Masks with random block structure, visible values random or mostly
    zero, hidden rows, bands and broadcast shapes (as in the kernels'
    property test)."""
    N, M = draw(st.integers(1, 70)), draw(st.integers(1, 90))
    kind = draw(st.sampled_from(["bool", "float32-min", "float32-inf", "bfloat16-min", "float16-min"]))
    values = draw(st.sampled_from(["bias", "zeros"]))
    rows = draw(st.sampled_from([N, 1]))  # 1: a key-padding mask broadcast over rows
    blk = draw(st.sampled_from([8, 16, 32]))
    band = draw(st.sampled_from([{}, {"window_right": 0}, {"window_right": 0, "bottom_right": True},
                                 {"window_left": 12, "window_right": 5}]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    blocks = torch.rand(2, 1, -(-rows // blk), -(-M // blk), generator=gen) < draw(st.sampled_from([0.2, 0.6]))
    hidden = blocks.repeat_interleave(blk, 2)[:, :, :rows].repeat_interleave(blk, 3)[..., :M]
    hidden = hidden | (torch.rand(hidden.shape, generator=gen) < 0.05)
    if rows == N and N > 2 and draw(st.booleans()):
        hidden[:, :, N // 2] = True  # a row that sees nothing
    mask = hiding_mask(hidden, kind, gen, values).expand(2, 1, N, M)
    return mask, N, M, {"window_left": None, "window_right": None, "bottom_right": False, **band}


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=_random_masks())
def test_tables_of_random_masks_match_brute_force(case):
    mask, N, M, band = case
    note(f"N={N} M={M} dtype={mask.dtype} band={band} strides={mask.stride()}")
    want_keys, want_queries = _expected(mask.contiguous(), N, M, band)
    keys, queries = _tables(mask, N, M, band)
    assert torch.equal(keys.cpu(), want_keys)
    assert torch.equal(queries.cpu(), want_queries)
