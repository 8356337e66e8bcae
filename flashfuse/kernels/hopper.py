"""Hopper (sm_90) kernels in Gluon: their launchers and the rules that select them.

The portable kernels (``forward.py``, ``backward.py``) leave Triton to
schedule their loops: one group of warps loads, multiplies and takes the
softmax in turn. The Hopper kernels (``hopper_gluon.py``) schedule them
themselves, as FlashAttention-3 does:

* Warp-specialised: a copy warp streams tiles into shared-memory slots
  through the copy engine (TMA), each slot with a ready and an empty
  mbarrier; two consumer warp groups (240 registers; the copy warp's group
  24) release a slot as soon as their product that reads it has finished.
  The groups never wait for each other.
* Forward: per tile of 128 query rows, q's two 64-row halves are loaded
  once and K/V blocks of 128 keys stream. Within a consumer, iteration j
  issues S_j = q·K_jᵀ and O += P_{j-1}·V_{j-1} as asynchronous warp-group
  products, waits for S_j only, and computes the softmax of S_j while the
  tensor cores still work on P_{j-1}·V_{j-1}. A program takes one tile per
  round: on a persistent grid (``forward_persistent``, ``forward_programs``:
  at most one program per SM, rounds handed out in alternating order), the
  copy warp loads the next tile's q as soon as each consumer has issued its
  last product that reads the current one, and the output leaves through
  its own staging tile, so a tile's fill and drain overlap its neighbours'
  work (bench/NOTES.md run 24). (The same loop in one group of 8 warps that
  issued its own copies measured slower than the portable kernel: run 17.)
* Backward, two kernels, no atomics (deterministic): dK/dV per 128-key tile
  (each consumer 64 keys, K and V loaded once; q and dO stream in 64-row
  blocks over every query head of the group and every query block of the
  band) computing Sᵀ, dPᵀ, dV and dK; then dQ per 128-query tile (q and dO
  loaded once, K and V streamed) computing S, dP and dQ. Both read the
  forward's lse and the portable preprocess kernel's delta. Seven products
  per (query block, key block).
* Backward, fused (five products): the dK/dV kernel's schedule, and from the
  same dS the tile's dS·K added into a zeroed float32 (B, Hq, N, D) buffer;
  then a plain Triton kernel writes dq = scale * buffer. A plain Triton
  prologue zeroes the buffer and turns lse and delta into the loop's
  per-row inputs once (``RowInputs``), so its iterations do no per-row
  arithmetic. Each consumer
  stores its dSᵀ half (64 keys x 64 queries) to shared memory; after an
  mbarrier handshake each forms dQ for half the head dim over all 128 keys,
  so every dQ element is added once per key tile. The adds: relaxed float32
  atomics from registers, or the copy engine's reduce-add from a float32
  staging tile in shared memory. dQ's last bits then depend on the order
  the adds land in, so deterministic algorithms take the two kernels.
  ``backward_path`` says which schedule runs (``BWD_FUSED_DQ``,
  FLASHFUSE_HOPPER_DQ); bench/NOTES.md has their measured speeds.

Scope (``hopper_refusal`` and ``backward_refusal`` name the first reason a
call is not taken): fp16/bf16, head dims 64 or 128 (q, k and v alike), any
band (causal, windows, bottom-right), grouped heads; no dropout or soft-cap
(the forward also no sinks; the backward takes them, since the forward's
lse includes them); mask tensors, bool without a ``mask_fill`` or float,
read through the mask's tables as the portable kernels read them: the
forward skips the key blocks the key table says the mask hides from every
row of a tile, the fused backward the query blocks the query table says it
hides from every key of a tile, and a consumer reads the mask only in
blocks its rows (keys) do not all see as neutral (``mask_refusal``: the
backward also not a mask that differs between the query heads of one
key/value head, nor under deterministic algorithms); enough keys per query row that the
kernels' fixed cost per tile pays (``MIN_KEYS``, ``BWD_MIN_KEYS``, from the
measured crossovers with the portable kernels). Either direction may run on
the Hopper kernel while the other runs on the portable one: their lse
follows the same conventions (natural log, +inf for a row with no visible
key, whose output is 0).

Inside ``torch.compile`` the op records ``flashfuse::_hopper_forward`` and
``flashfuse::_hopper_backward`` (``ops.py``), opaque ops whose CUDA kernels
call these launchers on the real tensors (and the portable kernels if their
layout does not suit the copy engine), since Inductor cannot launch Gluon
kernels itself.

Written for Gluon as shipped with Triton 3.6 (its API changed from 3.5);
other Triton versions take the portable kernels. Gluon kernels do not run
in Triton's interpreter: they are tested on the GPU
(``tests/kernels/test_hopper.py``, marker ``gpu``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import FLT_MAX, MASK_FLOAT, _lse_base2, _lse_cap
from .launch import (DirectLaunch, _capability, _traced, cdiv, copy_engine_layout, ensure_scratch_allocator,
                     multiprocessors)
from .problem import AttentionProblem
from .. import config

__all__ = ["hopper_forward", "hopper_refusal", "problem_refusal", "traced_takes", "gluon_available",
           "mean_visible_keys", "hopper_backward", "backward_refusal", "backward_problem_refusal",
           "traced_backward_takes", "backward_path", "hopper_backward_separate", "hopper_backward_fused",
           "forward_persistent", "forward_programs", "forward_consumers", "forward_block_m", "forward_split_tail",
           "backward_persistent", "backward_programs", "fused_tile"]

# Triton versions whose Gluon API this module is written for and was run on.
SUPPORTED_TRITON = ("3.6",)

# Tile: 128 query rows (two warp groups of 64) by 128 keys; the forward's
# rows per tile for a call are ``forward_block_m``'s (192 with three groups).
BLOCK_M = 128
BLOCK_N = 128
# The forward's consumer warp groups per head dim, 64 query rows each, for
# calls without a mask (a masked call keeps two: the mask tables' row groups
# assume a power-of-two tile) whose queries and keys both number at least
# FWD_THREE_CONSUMERS_MIN. Three make a 192-row tile: K and V are read once
# per 192 rows instead of 128, and three softmaxes overlap the tensor cores'
# products instead of two, at 160 registers a thread instead of 240
# (FlashAttention-3's choice at D = 64). On an H100 at D = 64 (bench/NOTES.md
# run 41, ``bench/hopper_schedules.py --consumers``, against SDPA in the same
# rounds) three were 2-14 % faster at 4k and 16k and 11-27 % slower at 1k,
# where a 192-row tile leaves more of its last tile idle and the fixed cost
# per tile weighs more.
FWD_CONSUMERS = {64: 3, 128: 2}
FWD_THREE_CONSUMERS_MIN = 4096
# With three consumers a head's last query block holds one part of rows
# where N % 192 is 1-64 (4096 = 21 x 192 + 64): run as a normal tile, the
# other two parts compute on rows past N and the tile costs about a full
# one (bench/NOTES.md run 42), which at 4k rounds the busiest program up to
# 22 tiles where the rows are worth 20.7. A split tail gives every consumer
# those rows and a third of the key blocks, merged at the end
# (``hopper_gluon._fwd_tail_part``); tails run last, where the hand-out
# gives them to the programs with fewer full tiles. On an H100 (run 43,
# ``bench/hopper_schedules.py --tails``) the forward at 4k ran 7.5 % faster
# without a band and 2.5-4 % faster causal, 16k unchanged within noise, so
# every such call takes them. FWD_SPLIT_TAIL: the head dims that do (at
# D = 128 three consumers' shared memory has no room for the 32 KiB of
# partials). FWD_TAIL_COST: a split tail's cost in full tiles of as many
# key blocks, for the grid plan (a guess; the plan is not fitted to it).
FWD_SPLIT_TAIL = (64, )
FWD_TAIL_COST = 0.4
# K/V slots per head dim (shared memory at D = 128: q 32 KiB + 2 x 2 x 32 KiB).
WS_STAGES = {64: 3, 128: 2}

# The forward's grid (``forward_persistent``, ``forward_programs``): one
# program per tile, or a persistent grid of at most one program per SM, each
# taking a tile per round, so that one tile's output store and the next
# one's q load overlap the work around them. The plan compares the two with
# a cost model in units of one key block's work: a tile costs its key blocks
# plus a fixed part, FWD_FIXED_BLOCKS["tiles"] as its own program (the
# pipeline's fill and drain exposed) and FWD_FIXED_BLOCKS["persistent"] in a
# persistent program after its first tile. Under a band the tiles differ in
# length and a static hand-out can leave some programs far more work
# (bench/NOTES.md run 24: 1.55x the mean at causal 16k with 16 heads), so
# the plan sums each program's blocks for each grid of SM count down to SM
# count - GRIDS_TRIED + 1 programs and keeps the one that ends first (the
# backward's plan tries the same grids).
# Fitted on an H100 (run 24's schedules benchmark): causal 1k at D = 128 ran
# 1.24x faster persistent with a round-robin hand-out 1.34x the mean.
FWD_PERSISTENT = True
FWD_FIXED_BLOCKS = {"tiles": 3.8, "persistent": 0.5}
GRIDS_TRIED = 8

# The forward's softmax per head dim (``hopper_gluon._row_max``, ``_exp2``):
# "row_max_folds", how many times a block's column halves are folded before
# the row maximum (0: one dependent chain per row, which the exponentials
# wait for); "exp_poly", how many of each eight exponentials run as a cubic
# on the FMA units instead of the special-function unit. At D = 64 each
# 128 x 128 block asks the special-function unit for as many cycles as the
# tensor cores' products take (16 exponentials per cycle and SM against
# 4096 flops). Timed against the default in seven alternating rounds on an
# H100 (bench/NOTES.md run 36, ``bench/hopper_schedules.py --softmax``):
# three folds at D = 128 were 1.3-2.1 % faster in all four rows; at D = 64
# the folds were slower and one FMA exponential in eight -2.4 to +3.0 %,
# so D = 64 keeps neither.
FWD_SOFTMAX = {64: dict(row_max_folds=0, exp_poly=0), 128: dict(row_max_folds=3, exp_poly=0)}

# A masked forward tile's blocks in three loops (before its rows' neutral
# keys, inside them without the mask code, after), or one loop in which each
# block branches on whether it reads the mask. The split keeps the mask code
# out of the hot loop, but its loops' bounds are known only at run time, and
# with them opaque the masked forward's whole fixed cost over is_causal
# returns (bench/NOTES.md run 35). The one loop spills less and was faster
# at both head dims on an H100 (run 36, ``bench/mask_cost_probe.py
# --mask-runs``): GPT-2's float causal mask 63.4-64.0 against 71.8 us, D =
# 128 at 4k keys 472-474 against 495.
FWD_MASK_SPLIT_RUNS = False

# Fewest visible keys per query row (mean over the rows) for which the
# Hopper kernel is taken. Each tile has a fixed cost (the pipeline's fill and
# drain, the output store), which the persistent grid mostly hides: on an
# H100 the Hopper forward was faster than the portable one at every measured
# shape down to causal 512 (256 keys on average: 1.45x at D = 128, 1.10x at
# D = 64; bench/results/hopper_schedules.csv, bench/NOTES.md run 24). Shorter
# rows were not measured and keep the portable kernel.
MIN_KEYS = {128: 256, 64: 256}

# The backward's tiles: dK/dV per 128 keys (two consumers of 64 keys)
# streaming q/dO blocks (the deterministic kernel's 64 rows, the fused
# kernel's BWD_FUSED_TILES); dQ per 128 queries (two of 64) streaming K/V
# blocks of BWD_DQ_BLOCK_N keys. Slots: shared memory at D = 128 is
# 2 x 2 x 16 KiB of q/dO plus 64 KiB of K/V for dK/dV.
BWD_BLOCK_M = 64
BWD_BLOCK_N = 128
BWD_DQ_BLOCK_M = 128
BWD_DQ_BLOCK_N = {64: 128, 128: 64}
BWD_STAGES = {64: 3, 128: 2}
BWD_DQ_STAGES = 2
# Fewest visible keys per query row (mean over the rows) for which the
# Hopper backward is taken; its own crossover with the portable backward
# (bench/results/hopper_backward_crossover.csv, bench/NOTES.md run 19, the
# two deterministic kernels): D = 128 slower at 256 keys on average, faster
# from 512. D = 64 from run 25 (bench/NOTES.md): at causal 1k (512 keys on
# average) the persistent fused backward took 0.71 ms given lse and delta
# (bench/results/hopper_backward_schedules.csv) where the op's portable
# backward took 0.92 ms with them (attention_run25.csv, mode bwd); shorter
# rows were not measured on the fused kernel.
BWD_MIN_KEYS = {128: 384, 64: 512}
# With a mask tensor the fused backward's consumers also load the mask where
# their keys do not all see it as neutral, and its loop spills (bytes
# stored: D = 64 64 with a bool mask, 140 with a float one; D = 128 832 and
# 1,016; Triton 3.6, bench/results/hopper_kernel_report_run26.txt). Measured against the portable
# backward (bench/NOTES.md run 26): at 4k keys, forward+backward 1.13-1.43x
# faster with a bool padding mask or at D = 64 (bench/hopper_mask_probe.py,
# both forwards on Hopper), no faster with a float mask at D = 128; at
# 512-1024 keys no faster in kernel time (bench/block_mask_times.py: GPT-2's
# layer even, a BERT-style one 0.88x), where eager steps are host-bound.
# Since run 30 the masked variants run a tile's neutral blocks in a loop of
# their own, without the mask code: at GPT-2's layer (D = 64, causal 1k,
# 512 keys per row on average, bf16 float mask) the fused backward took 199
# µs against the portable backward's 240 (H100, mask_cost_probe_run30.txt,
# block_mask_times_run30.csv), so at D = 64 the masked crossover is the
# unmasked one. D = 128 was not measured against the portable kernels below
# 4k keys on that code.
BWD_MASK_MIN_KEYS = {128: 2048, 64: 512}
BWD_FLOAT_MASK_DIMS = (64,)
# Inside a compiled graph the masked backward runs through the opaque
# flashfuse::_hopper_backward with the mask and a block mask's tables: run
# compiled on a GPU in run 27 (the op compiled whole and an eager spelling
# the backend rewrote, bool and float masks, D = 64 and 128: the gradients
# of the eager op and of float64; gpu_tests_run27_compiled_masked.log).
# False sends traced masked backwards to the portable kernels.
TRACED_MASKED_BACKWARD = True
# How the fused backward's consumers read a mask tile into their transposed
# scores (keys by queries, adjacent threads on adjacent queries, which lie
# a mask row apart): "coalesced", 16-byte loads along the keys moved into
# that layout through shared memory, or "direct", one load per element in
# it (64 scattered 1-2 byte loads per thread and block). Per head dim, from
# kernel times on an H100 (bench/NOTES.md run 29): coalesced 8-14 % faster
# at D = 64, 2-4 % slower at D = 128.
BWD_MASK_LOADS = {64: "coalesced", 128: "direct"}
# The fused backward's masked key tile in three loops over each query
# head's blocks or in one, per head dim, as FWD_MASK_SPLIT_RUNS for the
# forward. On an H100 (bench/NOTES.md run 36) the one loop was faster at
# D = 64 (GPT-2's float causal mask 168.7-168.8 against 176.3 us) and
# slower at D = 128 (4k keys: 1931-1936 against 1803), where the split's
# mask-free middle loop outweighs its spills.
BWD_MASK_SPLIT_RUNS = {64: False, 128: True}
# The fused backward (``hopper_gluon._hopper_attn_bwd_fused``): the dK/dV
# kernel's tiles and slots, and dQ from the same dS added into a zeroed
# float32 (B, Hq, N, D) buffer, then scaled and rounded by a convert kernel.
# How dQ reaches the buffer: "tma" (the copy engine's reduce-add from a
# float32 staging tile in shared memory, one instruction per q/dO block and
# D/2 columns; how many tiles: the query side's, ``fused_tile``) or
# "atomic" (relaxed float32 adds from the consumers' registers). Measured
# (bench/results/hopper_backward_schedules_run23.csv, bench/NOTES.md run 23,
# an H100): "tma" is the fastest schedule at every timed shape, 1.02-1.18x
# the two kernels at D = 128 and 1.12-1.28x at D = 64; "atomic" the slowest.
# FLASHFUSE_HOPPER_DQ overrides the mode; "separate" takes the two
# deterministic kernels, as torch.use_deterministic_algorithms(True) does.
BWD_FUSED_DQ = "tma"
# The fused backward's grid (``backward_persistent``, ``backward_programs``):
# a persistent grid of at most one program per SM whenever there are more
# key tiles than SMs, each program taking a tile per round as the forward's
# do; there the next tile's first q/dO blocks load under the last products
# of the one before, and K and V once both consumers are done with the old
# ones. Measured on an H100 (bench/NOTES.md run 25, the twelve shapes of
# bench/hopper_backward_schedules.py): faster than one program per tile at
# eleven shapes (up to 1.27x at 1k, 1.11x causal at 4k), 1 % slower at the
# twelfth. The plan (``_balanced_grid``, in units of one 64-row q/dO block)
# picks the program count that balances the tiles under a band; a tile
# after a program's first costs BWD_FIXED_BLOCKS more, an estimate (the
# K/V load, exposed).
BWD_PERSISTENT = True
BWD_FIXED_BLOCKS = 1.0
BWD_DQ_CHOICES = ("separate", "atomic", "tma")


class FusedTile(NamedTuple):
    """The query side of a fused-backward launch (``fused_tile``)."""

    block_m: int  # query rows per q/dO block (the Sᵀ and dPᵀ products' N)
    stages: int  # q/dO ring slots
    dq_buffers: int  # dQ staging tiles per consumer, for the copy engine's reduce


# The fused backward's query side per head dim (``fused_tile``): 64-row q/dO
# blocks make every product of a consumer 64 x 64 x D at D = 64; 128-row
# blocks (FlashAttention-3's tile at D = 64) give Sᵀ and dPᵀ 64 x 128
# products, half the q/dO iterations and barrier round trips per key tile,
# and 128-row dQ reduces, for 64 more registers per consumer thread (Sᵀ and
# dPᵀ: 192 of 240 beside dK and dV; ptxas spills 188 bytes, 292 under a
# causal band, Triton 3.6) and 16 KiB q/dO slots, so two slots and one
# staging tile (192 KiB). Staging tiles: with two, a reduce may still be
# reading one while the next is written; that paid at D = 64 on 64-row
# blocks (up to 5 %) and lost at D = 128, where the 32 KiB more shared
# memory (226 of the 227 KiB a block may have) came with more spills
# (bench/NOTES.md run 23). BWD_LONG_ROW_TILES holds the head dims whose
# unmasked calls take another query side when their rows see at least
# BWD_LONG_ROW_KEYS keys on average. Measured on an H100 against SDPA in
# the same alternating rounds (bench/NOTES.md run 42,
# bench/hopper_backward_schedules.py --schedules q64,q128): 128-row blocks
# 1.05x / 1.03x at 4k (64-row: 0.96x / 0.99x), 1.08x / 1.02x at 16k (0.99x /
# 0.96x), 0.98x / 1.03x at 2k (0.91x / 1.02x), 0.97x at 1k (0.96x), but
# 1.02x at causal 1k (512 keys a row on average) against 1.06x.
BWD_FUSED_TILES = {64: FusedTile(64, 3, 2), 128: FusedTile(64, 2, 1)}
BWD_LONG_ROW_TILES = {64: FusedTile(128, 2, 1)}
BWD_LONG_ROW_KEYS = 1024
# Rows of dQ per program of the convert kernel, and of the fused backward's
# prologue (``fused_row_inputs``).
BWD_CONVERT_ROWS = 64
# The fused backward's per-row inputs are padded to a multiple of this many
# rows: a multiple of every query block, so that no block the kernel
# streams reaches past the padding.
BWD_ROW_PAD = 128
assert all(BWD_ROW_PAD % t.block_m == 0 and BWD_ROW_PAD % BWD_CONVERT_ROWS == 0
           for t in (*BWD_FUSED_TILES.values(), *BWD_LONG_ROW_TILES.values()))


def fused_tile(p: AttentionProblem) -> FusedTile:
    """The fused backward's query side for ``p``: ``BWD_LONG_ROW_TILES`` for
    a call without a mask tensor whose rows see at least
    ``BWD_LONG_ROW_KEYS`` keys on average, where its head dim has one;
    ``BWD_FUSED_TILES`` otherwise."""
    if p.mask is None and p.D in BWD_LONG_ROW_TILES and _mean_keys(p) >= BWD_LONG_ROW_KEYS:
        return BWD_LONG_ROW_TILES[p.D]
    return BWD_FUSED_TILES[p.D]


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this Triton ships the Gluon Hopper API this module targets."""
    import triton

    if not triton.__version__.startswith(SUPPORTED_TRITON):
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def mean_visible_keys(N: int, M: int, diag_off: int, window_left: int, window_right: int,
                      has_window_left: bool, has_window_right: bool) -> float:
    """The mean number of keys a query row sees under the band
    (``common._visible``), over 32 evenly spaced rows."""
    rows = [min(N - 1, (2 * j + 1) * N // 64) for j in range(32)]
    total = 0
    for i in rows:
        lo = max(0, i + diag_off - window_left) if has_window_left else 0
        hi = min(M - 1, i + diag_off + window_right) if has_window_right else M - 1
        total += max(0, hi - lo + 1)
    return total / len(rows)


def problem_refusal(p: AttentionProblem, dropout_p: float, softcap, sinks, backward: bool = False) -> str | None:
    """The reasons that depend on the problem alone (also known in a trace,
    where the tensors have no address to check the layout on), for the
    forward or the ``backward`` kernels: each has its own crossover with the
    portable kernels (``MIN_KEYS``, ``BWD_MIN_KEYS``; with a mask the
    backward's is ``BWD_MASK_MIN_KEYS``) and mask rule (``mask_refusal``)."""
    if config.hopper() == "0":
        return "FLASHFUSE_HOPPER=0"
    if p.interpret or p.device.type != "cuda":
        return "not a CUDA tensor (Gluon kernels do not run in Triton's interpreter)"
    if p.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {p.dtype} (fp16 and bf16 only)"
    if p.D != p.Dv or p.D not in MIN_KEYS:
        return f"head dims {p.D}/{p.Dv} (64 or 128, q/k and v alike)"
    try:
        major = _capability(p.device.index)[0]
    except (AssertionError, RuntimeError):  # fake CUDA tensors on a machine without CUDA
        return "no CUDA runtime to ask the GPU's compute capability"
    if major != 9:
        return "not a Hopper GPU (compute capability 9.x)"
    if not gluon_available():
        return f"Triton {_triton_version()} is not one of {SUPPORTED_TRITON}"
    if p.mask is not None:
        why = mask_refusal(p, backward)
        if why is not None:
            return why
    if dropout_p > 0.0:
        return "dropout"
    if softcap is not None or sinks is not None:
        return "soft-cap or sinks"
    if not p.scale > 0.0:
        # The kernels hide scores with -inf before they scale them (inside
        # exp2): a scale of 0 would turn those into NaN, a negative one into
        # +inf. Legal, rare, and the portable kernels scale first.
        return f"scale {p.scale} (the Hopper kernels take scales above 0)"
    if not all(isinstance(x, int) for x in (p.N, p.M, p.diag_off)):
        return "symbolic sequence lengths (a graph traced with dynamic shapes)"
    if p.N == 0 or p.M == 0:
        return "an empty sequence"
    keys = _mean_keys(p)
    min_keys = BWD_MIN_KEYS if backward else MIN_KEYS
    if keys < min_keys[p.D]:
        return f"{keys:.0f} visible keys per query row on average (fewer than {min_keys[p.D]} at D = {p.D})"
    if backward and p.mask is not None and keys < BWD_MASK_MIN_KEYS[p.D]:
        return (f"a mask tensor with {keys:.0f} visible keys per query row on average (the Hopper backward "
                f"reads masks from {BWD_MASK_MIN_KEYS[p.D]} at D = {p.D})")
    return None


def _mean_keys(p: AttentionProblem) -> float:
    """``mean_visible_keys`` under ``p``'s band."""
    return mean_visible_keys(p.N, p.M, p.diag_off, p.window_left, p.window_right, p.has_window_left,
                             p.has_window_right)


def mask_refusal(p: AttentionProblem, backward: bool = False) -> str | None:
    """Why the Hopper kernels do not read this call's mask (None: they do,
    the forward through the mask's key table, the fused backward through
    its query table): a bool mask with a ``mask_fill`` (hidden pairs that
    take part), or the tables switched off; for the backward also a mask
    that differs between the query heads of one key/value head (its tiles
    stream them all over one range of query rows), deterministic
    algorithms (the two-kernel schedule reads no mask), and a float mask at
    D = 128, where the portable backward measured as fast
    (``BWD_FLOAT_MASK_DIMS``). The masked backward's crossover,
    ``BWD_MASK_MIN_KEYS``, is ``problem_refusal``'s."""
    from . import backward as portable_backward
    from . import forward as portable_forward

    if p.fill != 0:
        return "a bool mask with a mask_fill"
    skip = portable_backward.SKIP_HIDDEN_BLOCKS if backward else portable_forward.SKIP_HIDDEN_BLOCKS
    if not (skip and p.tables_apply()):
        return "a mask without its tables (SKIP_HIDDEN_BLOCKS off)"
    if not backward:
        return None
    if p.mask_strides[1] != 0 and p.Hq != p.Hkv:
        return "a mask that differs between the query heads of a key/value head"
    if backward_path() == "separate":
        return "a mask tensor under the deterministic backward (its two kernels read no mask)"
    if p.mask_kind == MASK_FLOAT and p.D not in BWD_FLOAT_MASK_DIMS:
        return f"a float mask at D = {p.D} (measured no faster than the portable backward: BWD_FLOAT_MASK_DIMS)"
    return None


def hopper_refusal(p: AttentionProblem, q, k, v, *, dropout_p: float, softcap, sinks) -> str | None:
    """Why the Hopper kernel does not run this forward (None: it does).

    The one selection rule: the kernels' dispatch (``kernels._route``) asks
    it, and so do the benchmarks and tests that name the kernel a call takes."""
    return _tensor_refusal(problem_refusal(p, dropout_p, softcap, sinks), (q, k, v),
                           "the forward records flashfuse::_hopper_forward instead: traced_takes")


def traced_takes(p: AttentionProblem, q, k, v, *, dropout_p: float, softcap, sinks) -> bool:
    """Whether a traced forward records ``flashfuse::_hopper_forward``: the
    problem suits the kernel (the layout is checked when it runs)."""
    return _traced_suits(p, (q, k, v), lambda: problem_refusal(p, dropout_p, softcap, sinks))


def _tensor_refusal(why: str | None, tensors, traced_note: str) -> str | None:
    """``why`` (the problem's refusal), else what the tensors themselves
    refuse: a trace (which records the opaque op instead; ``traced_note``
    says which) or a layout the copy engine cannot read."""
    if why is None and _traced(tensors):
        return f"traced graph ({traced_note})"
    if why is None:
        for t in tensors:
            if not copy_engine_layout(t):
                return "a layout the copy engine cannot read (unit last stride, 16-byte aligned base and strides)"
    return why


def _traced_suits(p: AttentionProblem, tensors, problem_why) -> bool:
    """A traced CUDA call whose problem the kernels suit (``problem_why()``
    is None); the layout is checked when the recorded op runs."""
    if p.interpret or p.device.type != "cuda" or not _traced(tensors):
        return False
    return problem_why() is None


def _triton_version() -> str:
    import triton

    return triton.__version__


# SMs assumed for plans made off the GPU (offline compiles, CPU tests): an H100 SXM's.
_OFF_GPU_SMS = 132


def _device_sms(p: AttentionProblem) -> int:
    if p.device.type != "cuda":
        return _OFF_GPU_SMS
    try:
        return multiprocessors(p.device.index if p.device.index is not None else torch.cuda.current_device())
    except (AssertionError, RuntimeError):  # fake CUDA tensors on a machine without CUDA
        return _OFF_GPU_SMS


def forward_persistent(p: AttentionProblem) -> bool:
    """Whether the op's forward runs ``p`` on a persistent grid (at most one
    program per SM, each taking a tile per round) rather than one program
    per tile: where the plan (``forward_programs``) finds it faster."""
    return FWD_PERSISTENT and _plan(p)[1]


def forward_consumers(p: AttentionProblem) -> int:
    """The forward's consumer warp groups for ``p`` (``FWD_CONSUMERS``)."""
    if p.mask is None and min(p.N, p.M) >= FWD_THREE_CONSUMERS_MIN:
        return FWD_CONSUMERS[p.D]
    return 2


def forward_block_m(p: AttentionProblem) -> int:
    """The forward's query rows per tile for ``p``: 64 per consumer."""
    return 64 * forward_consumers(p)


def forward_split_tail(p: AttentionProblem) -> bool:
    """Whether the forward runs each head's last query block of ``p`` as a
    split tail: three consumers (192-row tiles), a head dim in
    ``FWD_SPLIT_TAIL`` and one part of rows (64, one consumer's) in that block."""
    return p.D in FWD_SPLIT_TAIL and forward_consumers(p) == 3 and 0 < p.N % forward_block_m(p) <= 64


def forward_programs(p: AttentionProblem, persistent: bool) -> int:
    """The program count of the forward's grid: the tile count, or the
    persistent grid the plan chose."""
    tiles = cdiv(p.N, forward_block_m(p)) * p.Hq * p.B
    if not persistent:
        return tiles
    return _plan(p)[0]


def _plan(p: AttentionProblem) -> tuple[int, bool]:
    """``_grid_plan`` for ``p`` on its device."""
    return _grid_plan(p.B * p.Hq, p.N, p.M, p.diag_off, p.window_left, p.window_right, p.has_window_left,
                      p.has_window_right, _device_sms(p), forward_block_m(p), forward_split_tail(p))


@functools.lru_cache(maxsize=1024)
def _grid_plan(heads: int, N: int, M: int, diag_off: int, window_left: int, window_right: int,
               has_window_left: bool, has_window_right: bool, sms: int, block_m: int = BLOCK_M,
               split_tail: bool = False) -> tuple[int, bool]:
    """``(programs, faster)``: the persistent grid that ends first under the
    cost model (``FWD_FIXED_BLOCKS``), and whether it beats one program per
    tile. Tile t of program p in round r is ``_fwd_tile``'s (round r hands
    tiles r·P .. r·P + P - 1 out in program order, reversed in odd rounds;
    with ``split_tail``, each head's last tile comes after all full tiles,
    at FWD_TAIL_COST of its blocks). Plain CPU arithmetic, also when a
    dispatch mode (a fake-tensor trace, a profiler's mode) is active around
    the launch."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        per_head = _query_tile_blocks(N, M, diag_off, window_left, window_right, has_window_left,
                                      has_window_right, block_m)
        per_tile = _tiles_in_order(per_head, heads, split_tail)
        if per_tile.numel() <= sms:
            return per_tile.numel(), False
        fixed_t, fixed_p = FWD_FIXED_BLOCKS["tiles"], FWD_FIXED_BLOCKS["persistent"]
        programs, busiest = _balanced_grid(per_tile, sms, fixed_p)
        one_each = max(float((per_tile + fixed_t).sum()) / sms, float(per_tile.max()) + fixed_t)
        # Each persistent program's first tile pays the full fixed part.
        return programs, busiest + fixed_t - fixed_p < one_each


def _tiles_in_order(per_head: torch.Tensor, heads: int, split_tail: bool) -> torch.Tensor:
    """Every forward tile's work in the kernel's numbering: ``heads`` heads
    of ``per_head`` (one head's tiles, last query block first), with
    ``split_tail`` each head's first entry (its last block) moved after all
    full tiles at FWD_TAIL_COST."""
    if not split_tail:
        return per_head.repeat(heads)
    return torch.cat([per_head[1:].repeat(heads), per_head[:1].repeat(heads) * FWD_TAIL_COST])


def _query_tile_blocks(N: int, M: int, diag_off: int, window_left: int, window_right: int,
                       has_window_left: bool, has_window_right: bool, block_m: int = BLOCK_M) -> torch.Tensor:
    """The key blocks of each of one head's forward tiles of ``block_m``
    rows, in the order the kernel numbers them (``hopper_gluon._fwd_tile``:
    last query block first); at least 1, as the kernel streams one block for
    a tile that sees no key."""
    rows = torch.arange(cdiv(N, block_m), dtype=torch.int64) * block_m
    last_row = torch.clamp(rows + block_m, max=N) - 1
    lo = torch.zeros_like(rows)
    hi = torch.full_like(rows, M)
    if has_window_right:
        hi = torch.minimum(hi, torch.clamp(last_row + diag_off + window_right + 1, min=0))
    if has_window_left:
        lo = torch.clamp(rows + diag_off - window_left, min=0) // BLOCK_N * BLOCK_N
    return torch.clamp((hi - lo + BLOCK_N - 1).div(BLOCK_N, rounding_mode="floor"), min=1).double().flip(0)


def _key_tile_blocks(N: int, M: int, diag_off: int, window_left: int, window_right: int, has_window_left: bool,
                     has_window_right: bool, block_m: int = BWD_BLOCK_M) -> torch.Tensor:
    """The ``block_m``-row q/dO blocks of one query head that each of one
    key/value head's fused-backward tiles streams, in the order the kernel
    numbers them (``hopper_gluon._bwd_tile``: first key block first), as
    ``hopper_gluon._query_range`` counts them."""
    n0 = torch.arange(cdiv(M, BWD_BLOCK_N), dtype=torch.int64) * BWD_BLOCK_N
    lo = torch.zeros_like(n0)
    hi = torch.full_like(n0, N)
    if has_window_right:
        lo = torch.clamp(n0 - diag_off - window_right, min=0) // block_m * block_m
    if has_window_left:
        hi = torch.clamp(n0 + BWD_BLOCK_N - diag_off + window_left, max=N)
    return torch.clamp(hi - lo, min=0).add(block_m - 1).div(block_m, rounding_mode="floor").double()


def _balanced_grid(per_tile: torch.Tensor, sms: int, fixed: float) -> tuple[int, float]:
    """``(programs, work)``: of the grids of ``sms`` down to ``sms -
    GRIDS_TRIED + 1`` programs taking tiles of ``per_tile`` work each, in
    tile order, as ``hopper_gluon._round_tile`` hands them out, the one
    whose busiest program ends first, and that program's work (its tiles
    plus ``fixed`` each)."""
    t = torch.arange(per_tile.numel(), dtype=torch.int64)
    best, best_work = sms, float("inf")
    for programs in range(sms, max(1, sms - GRIDS_TRIED + 1) - 1, -1):
        r, pos = t // programs, t % programs
        prog = torch.where(r % 2 == 0, pos, programs - 1 - pos)
        work = float(torch.bincount(prog, weights=per_tile + fixed, minlength=programs).max())
        if work < best_work:
            best, best_work = programs, work
    return best, best_work


_DIRECT: dict = {}  # id(kernel) -> (kernel, its DirectLaunch)


def _direct(name: str) -> DirectLaunch:
    """The direct launcher of a Hopper kernel (``hopper_gluon.<name>``) or
    of one of this module's Triton kernels (``"_dq_convert"``,
    ``"_fused_bwd_prologue"``), one per kernel object (tests stand kernels
    in)."""
    if name in ("_dq_convert", "_fused_bwd_prologue"):
        fn = globals()[name]
    else:
        from . import hopper_gluon

        fn = getattr(hopper_gluon, name)
    entry = _DIRECT.get(id(fn))
    if entry is None or entry[0] is not fn:
        entry = _DIRECT[id(fn)] = (fn, DirectLaunch(fn))
    return entry[1]


def _descriptor_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The batch, head and row strides of a (B, H, L, D) tensor for a
    descriptor over all of it (the forward) or over one batch's stacked
    heads (the dK/dV kernels): a dimension of one element may have any
    stride in PyTorch, while the copy engine wants a positive multiple of 16
    bytes, so such a dimension gets the stride of the dimensions after it
    laid out densely (its index is always 0, so the value is never used)."""
    B, H, L, D = t.shape
    sb, sh, sl = t.stride()[:3]
    return (sb if B > 1 else max(1, H) * max(1, L) * D, sh if H > 1 else max(1, L) * D, sl if L > 1 else D)


def _mask_operands(p: AttentionProblem, table, unread: tuple) -> tuple:
    """``(mask, table, strides)`` as both Hopper kernels take them: the
    mask as the kernels read it and its table (the key table for the
    forward, the query table for the backward), then the mask's four
    strides and the table's batch and head strides; without a mask,
    ``unread`` (two tensors never read) and zero strides."""
    if p.mask is None:
        return (*unread, (0, ) * 6)
    from .mask_ranges import table_strides

    return p.mask, table, (*p.mask_strides, *table_strides(table))


def kernel_args(p: AttentionProblem, q, k, v, out, lse, persistent: bool | None = None,
                key_table: torch.Tensor | None = None) -> tuple[tuple, dict, int]:
    """The kernel's positional arguments, launch options and program count
    (``persistent``: ``forward_persistent(p)`` unless given). With a mask,
    ``key_table`` is its key table (``mask_ranges.mask_key_table`` for
    ``p``'s band, no fill)."""
    from .mask_ranges import ROW_GROUP

    if persistent is None:
        persistent = forward_persistent(p)
    mask, table, mask_strides = _mask_operands(p, key_table, (q, lse))
    args = (
        q, k, v, out, lse, mask, table,
        *_descriptor_strides(q), *_descriptor_strides(k), *_descriptor_strides(v), *_descriptor_strides(out),
        *mask_strides,
        p.B, p.Hq, p.Hkv, p.N, p.M,
        p.qk_scale, p.diag_off, p.window_left, p.window_right,
    )
    # Two consumer warp groups at 240 registers and the copy warp at 24 (its
    # warp group's share): 168 per thread at launch over 12 warps. Three
    # consumers: 160 each and 24, 128 per thread at launch over 16 warps
    # (the register file's 64k).
    consumers = forward_consumers(p)
    meta = dict(HAS_WINDOW_LEFT=p.has_window_left, HAS_WINDOW_RIGHT=p.has_window_right,
                HEAD_DIM=p.D, BLOCK_M=forward_block_m(p), BLOCK_N=BLOCK_N, STAGES=WS_STAGES[p.D], MASK_KIND=p.mask_kind,
                GROUP=ROW_GROUP, ROW_MAX_FOLDS=FWD_SOFTMAX[p.D]["row_max_folds"],
                EXP_POLY=FWD_SOFTMAX[p.D]["exp_poly"], SPLIT_RUNS=FWD_MASK_SPLIT_RUNS, CONSUMERS=consumers,
                SPLIT_TAIL=forward_split_tail(p), num_warps=4, maxnreg=168 if consumers == 2 else 128)
    return args, meta, forward_programs(p, persistent)


def hopper_forward(p: AttentionProblem, q, k, v, persistent: bool | None = None,
                   key_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward on the Hopper kernel; ``(out, lse)`` as ``forward.attention_forward``
    returns them (out laid out as ``empty(B, N, Hq, D).transpose(1, 2)``).
    ``persistent``: the grid, ``forward_persistent(p)`` unless given (the
    benchmarks and tests). With a mask, ``key_table`` is a block mask's key
    table for it (built here when None, as the portable forward builds it)."""
    B, Hq, N = p.B, p.Hq, p.N
    out = torch.empty_strided((B, Hq, N, p.Dv), (N * Hq * p.Dv, p.Dv, Hq * p.Dv, 1), dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    if p.mask is not None:  # a block mask's key table, else built here
        from .mask_ranges import mask_tables

        key_table, _ = mask_tables(p.mask, p.N, p.M, p.band(), fills=False, key_table=key_table, queries=False)
    args, meta, programs = kernel_args(p, q, k, v, out, lse, persistent, key_table)
    ensure_scratch_allocator()
    with torch.cuda.device(q.device):
        _direct("_hopper_attn_fwd")((programs, ), args, meta)
    return out, lse


# ---------------------------------------------------------------------------
# The backward: dK/dV per key tile, then dQ per query tile
# ---------------------------------------------------------------------------

def backward_problem_refusal(p: AttentionProblem, grad_out, *, dropout_p: float, softcap,
                             mask_grad: bool, traced: bool = False) -> str | None:
    """Why the Hopper backward does not suit this problem, from what a
    trace knows too (None: it does). The forward's reasons (sinks need
    nothing here: the forward's lse includes them) with the backward's
    crossover and mask rule (``mask_refusal``), plus a mask's gradient,
    a mask in a ``traced`` graph (``TRACED_MASKED_BACKWARD``) and dO's
    dtype."""
    if mask_grad:
        return "a mask gradient"
    if traced and p.mask is not None and not TRACED_MASKED_BACKWARD:
        return "a mask tensor in a traced graph (hopper.TRACED_MASKED_BACKWARD is off)"
    why = problem_refusal(p, dropout_p, softcap, None, backward=True)
    if why is None and grad_out.dtype != p.dtype:
        return f"grad_out dtype {grad_out.dtype} differs from the inputs' {p.dtype}"
    return why


def backward_refusal(p: AttentionProblem, grad_out, q, k, v, *, dropout_p: float, softcap,
                     mask_grad: bool = False) -> str | None:
    """Why the Hopper backward kernels do not run this backward (None: they
    do): ``backward_problem_refusal``, then the copy engine's layout rule
    for q, k, v and dO (the gradients are allocated in a layout it takes).
    The one rule the dispatch (``kernels._backward_route``), ``explain``
    and the benchmarks ask."""
    why = backward_problem_refusal(p, grad_out, dropout_p=dropout_p, softcap=softcap, mask_grad=mask_grad,
                                   traced=_traced((q, k, v, grad_out)))
    return _tensor_refusal(why, (q, k, v, grad_out),
                           "the backward records flashfuse::_hopper_backward instead: traced_backward_takes")


def traced_backward_takes(p: AttentionProblem, grad_out, q, k, v, *, dropout_p: float, softcap,
                          mask_grad: bool = False) -> bool:
    """Whether a traced backward records ``flashfuse::_hopper_backward``: the
    problem suits the kernels (the layout is checked when it runs)."""
    return _traced_suits(p, (q, k, v, grad_out), lambda: backward_problem_refusal(
        p, grad_out, dropout_p=dropout_p, softcap=softcap, mask_grad=mask_grad, traced=True))


def _dkdv_args(p: AttentionProblem, grad_out, q, k, v, rows: tuple, dk, dv, dq_acc=None) -> tuple[tuple, dict]:
    """``(args, meta)`` of a dK/dV kernel: the deterministic one, or with
    ``dq_acc`` (float32 (B, Hq, N, D), unit stride along D) the fused one,
    whose arguments add it, its strides and the batch size; ``meta``
    without the fused kernel's dQ options. ``rows``: the per-row inputs,
    ``(lse, delta)`` for the deterministic kernel, a ``RowInputs`` for the
    fused one, sharing their (B, Hq, rows) strides, unit along the rows."""
    fused = dq_acc is not None
    acc, acc_st = ((dq_acc,), _descriptor_strides(dq_acc)) if fused else ((), ())
    args = (q, k, v, grad_out, dk, dv, *acc, *rows, *_descriptor_strides(q), *_descriptor_strides(k),
            *_descriptor_strides(v), *_descriptor_strides(grad_out), *dk.stride()[:3], *dv.stride()[:3], *acc_st,
            *rows[0].stride()[:2], *((p.B,) if fused else ()), *_band(p))
    return args, dict(_flags(p), BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, STAGES=BWD_STAGES[p.D])


def backward_persistent(p: AttentionProblem) -> bool:
    """Whether the fused backward runs ``p`` on a persistent grid rather
    than one program per key tile: when there are more tiles than SMs."""
    return BWD_PERSISTENT and _backward_plan(p)[1]


def backward_programs(p: AttentionProblem, persistent: bool) -> int:
    """The fused backward's program count: the key-tile count, or the
    persistent grid the plan chose."""
    if not persistent:
        return cdiv(p.M, BWD_BLOCK_N) * p.Hkv * p.B
    return _backward_plan(p)[0]


def _backward_plan(p: AttentionProblem) -> tuple[int, bool]:
    """``_backward_grid_plan`` for ``p`` on its device."""
    return _backward_grid_plan(p.B * p.Hkv, p.Hq // p.Hkv, p.N, p.M, p.diag_off, p.window_left, p.window_right,
                               p.has_window_left, p.has_window_right, _device_sms(p), fused_tile(p).block_m)


@functools.lru_cache(maxsize=1024)
def _backward_grid_plan(heads: int, group: int, N: int, M: int, diag_off: int, window_left: int,
                        window_right: int, has_window_left: bool, has_window_right: bool,
                        sms: int, block_m: int = BWD_BLOCK_M) -> tuple[int, bool]:
    """``(programs, persistent)`` for the fused backward's key tiles
    (``heads``: batch times key/value heads; ``group``: query heads per
    key/value head; ``block_m``: rows per q/dO block): one program per tile
    when they are at most ``sms``, else the persistent grid
    ``_balanced_grid`` finds, a tile's work being its q/dO blocks
    (``_key_tile_blocks``) counted in blocks of ``BWD_BLOCK_M`` rows, the
    unit of ``BWD_FIXED_BLOCKS``. Unlike the forward's plan this one does not weigh
    the two grids: the persistent one measured faster wherever it applies
    (bench/NOTES.md run 25)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        per_tile = (_key_tile_blocks(N, M, diag_off, window_left, window_right, has_window_left, has_window_right,
                                     block_m) * (group * block_m / BWD_BLOCK_M)).repeat(heads)
        if per_tile.numel() <= sms:
            return per_tile.numel(), False
        return _balanced_grid(per_tile, sms, BWD_FIXED_BLOCKS)[0], True


def _band(p: AttentionProblem) -> tuple:
    """The sizes, scales and band every backward kernel takes last."""
    return p.Hq, p.Hkv, p.N, p.M, p.qk_scale, p.scale, p.diag_off, p.window_left, p.window_right


def _flags(p: AttentionProblem) -> dict:
    """The backward kernels' band flags and head dim, and their launch
    options (4 + 4 + 1 warps; ``maxnreg`` as the forward's)."""
    return dict(HAS_WINDOW_LEFT=p.has_window_left, HAS_WINDOW_RIGHT=p.has_window_right, HEAD_DIM=p.D,
                num_warps=4, maxnreg=168)


def backward_kernel_args(p: AttentionProblem, grad_out, q, k, v, lse, delta, dq, dk, dv) -> tuple:
    """``(dkdv_args, dkdv_meta, dq_args, dq_meta)``: the two deterministic
    kernels' positional arguments and launch options. ``lse`` and ``delta``
    share their (B, Hq, N) strides, unit along N."""
    dkdv_args, dkdv_meta = _dkdv_args(p, grad_out, q, k, v, (lse, delta), dk, dv)
    dq_args = (q, k, v, grad_out, dq, lse, delta, *p.q_strides[:3], *p.k_strides[:3], *p.v_strides[:3],
               *grad_out.stride()[:3], *dq.stride()[:3], *lse.stride()[:2], *_band(p))
    dq_meta = dict(_flags(p), BLOCK_M=BWD_DQ_BLOCK_M, BLOCK_N=BWD_DQ_BLOCK_N[p.D], STAGES=BWD_DQ_STAGES)
    return dkdv_args, dkdv_meta, dq_args, dq_meta


def fused_kernel_args(p: AttentionProblem, grad_out, q, k, v, rows: RowInputs, dq_acc, dk, dv, how: str,
                      persistent: bool | None = None, query_table: torch.Tensor | None = None) -> tuple:
    """``(args, meta, programs)`` of ``_hopper_attn_bwd_fused``; ``rows``
    its per-row inputs (``fused_row_inputs``); ``dq_acc``
    float32 (B, Hq, N, D), unit stride along D; ``how``: "atomic" or "tma";
    ``persistent``: the grid, ``backward_persistent(p)`` unless given. With
    a mask, ``query_table`` is its query table (``mask_ranges``, for ``p``'s
    band, no fill)."""
    from .mask_ranges import COL_GROUP

    if persistent is None:
        persistent = backward_persistent(p)
    args, meta = _dkdv_args(p, grad_out, q, k, v, rows, dk, dv, dq_acc)
    mask, table, mask_strides = _mask_operands(p, query_table, (q, rows.shift))
    tile = fused_tile(p)
    meta = dict(meta, BLOCK_M=tile.block_m, STAGES=tile.stages, DQ_TMA=how == "tma",
                DQ_BUFFERS=tile.dq_buffers if how == "tma" else 1,
                MASK_KIND=p.mask_kind, COL_GROUP=COL_GROUP, COALESCED_MASK=BWD_MASK_LOADS[p.D] == "coalesced",
                SPLIT_RUNS=BWD_MASK_SPLIT_RUNS[p.D])
    return (*args, mask, table, *mask_strides), meta, backward_programs(p, persistent)


class RowInputs(NamedTuple):
    """The fused backward's per-row inputs, each (B, Hq, rows) float32 with
    the same strides, unit along the rows, ``rows`` N rounded up to
    ``BWD_ROW_PAD``: rows past N have shift +inf (probabilities 0) and
    delta 0, so the kernel's blocks need no row test.

    * ``shift``: what the kernel subtracts from a base-2 score to recompute
      a probability: lse * log2(e); +inf for a row that saw no key; with a
      float mask, -FLT_MAX for a row whose lse is the marker (it averages l
      keys hidden by a finite value: every score then exceeds 1, capped).
    * ``delta``: rowsum(dO * O) (less ``grad_lse``), as the caller gave it.
    * ``cap``: with a float mask, 1 / l for a marked row and 1 elsewhere
      (``common._lse_cap``); else ``shift`` again, never read."""

    shift: torch.Tensor
    delta: torch.Tensor
    cap: torch.Tensor


def fused_row_buffers(p: AttentionProblem, device) -> RowInputs:
    """Unfilled ``RowInputs`` for ``p``: one (B, Hq, 2 or 3, rows) tensor."""
    rows = cdiv(p.N, BWD_ROW_PAD) * BWD_ROW_PAD
    n = 3 if p.mask_kind == MASK_FLOAT else 2
    buf = torch.empty((p.B, p.Hq, n, rows), dtype=torch.float32, device=device)
    return RowInputs(buf[:, :, 0], buf[:, :, 1], buf[:, :, 2] if n == 3 else buf[:, :, 0])


@triton.jit(do_not_specialize=["N"])
def _fused_bwd_prologue(Lse, DeltaIn, Shift, Delta, Cap, Acc, stride_l_b, stride_l_h, stride_l_n, stride_di_b,
                        stride_di_h, stride_di_n, stride_r_b, stride_r_h, stride_a_b, stride_a_h, stride_a_n, N,
                        FLOAT_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """``RowInputs`` from lse and delta (rows ``BLOCK`` at a time, those
    past N padded), and the same rows of dQ's float32 accumulator zeroed,
    for its adds: one launch where a fill and a conversion would take two."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    real = rows < N
    r64 = rows.to(tl.int64)
    lse = tl.load(Lse + b * stride_l_b + h * stride_l_h + r64 * stride_l_n, mask=real, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # no key seen, as some producers write it
    delta = tl.load(DeltaIn + b * stride_di_b + h * stride_di_h + r64 * stride_di_n, mask=real, other=0.0)
    shift = _lse_base2(lse)
    out = b * stride_r_b + h * stride_r_h + r64
    if FLOAT_MASK:
        shift = tl.where(lse <= -1.0e38, -FLT_MAX, shift)
        tl.store(Cap + out, _lse_cap(lse))
    tl.store(Shift + out, shift)
    tl.store(Delta + out, delta)
    cols = tl.arange(0, HEAD_DIM)
    tl.store(Acc + b * stride_a_b + h * stride_a_h + r64[:, None] * stride_a_n + cols[None, :],
             tl.zeros((BLOCK, HEAD_DIM), tl.float32), mask=real[:, None])


def fused_row_inputs(p: AttentionProblem, lse: torch.Tensor, delta: torch.Tensor,
                     dq_acc: torch.Tensor) -> RowInputs:
    """The fused backward's ``RowInputs`` from the forward's lse and delta
    (both (B, Hq, N) float32), with ``dq_acc`` (float32 (B, Hq, N, D), unit
    stride along D) zeroed by the same launch."""
    rows = fused_row_buffers(p, lse.device)
    _direct("_fused_bwd_prologue")(
        (rows.shift.shape[-1] // BWD_CONVERT_ROWS, p.Hq, p.B),
        (lse, delta, *rows, dq_acc, *lse.stride()[:3], *delta.stride()[:3], *rows.shift.stride()[:2],
         *dq_acc.stride()[:3], p.N),
        dict(FLOAT_MASK=p.mask_kind == MASK_FLOAT, HEAD_DIM=p.D, BLOCK=BWD_CONVERT_ROWS))
    return rows


@triton.jit(do_not_specialize=["N"])
def _dq_convert(Acc, DQ, stride_a_b, stride_a_h, stride_a_n, stride_q_b, stride_q_h, stride_q_n, N, scale,
                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """dq = scale * acc in dq's dtype, both with unit stride along D. Plain
    Triton: an elementwise pass needs nothing of Gluon."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    ok = (rows < N)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    acc = tl.load(Acc + b * stride_a_b + h * stride_a_h + r64 * stride_a_n + cols[None, :], mask=ok, other=0.0)
    out = (acc * scale).to(DQ.dtype.element_ty)
    tl.store(DQ + b * stride_q_b + h * stride_q_h + r64 * stride_q_n + cols[None, :], out, mask=ok)


def convert_dq(p: AttentionProblem, dq_acc: torch.Tensor, dq: torch.Tensor) -> None:
    """``dq[...] = p.scale * dq_acc`` rounded to dq's dtype (both (B, Hq, N,
    D), unit stride along D)."""
    _direct("_dq_convert")((cdiv(p.N, BWD_CONVERT_ROWS), p.Hq, p.B),
                           (dq_acc, dq, *dq_acc.stride()[:3], *dq.stride()[:3], p.N, p.scale),
                           dict(HEAD_DIM=p.D, BLOCK=BWD_CONVERT_ROWS))


def backward_path() -> str:
    """Which Hopper backward runs: "separate" (the two deterministic
    kernels) under ``torch.use_deterministic_algorithms(True)``, else
    FLASHFUSE_HOPPER_DQ if set, else ``BWD_FUSED_DQ``."""
    if torch.are_deterministic_algorithms_enabled():
        return "separate"
    forced = config.hopper_dq()
    if forced:
        if forced not in BWD_DQ_CHOICES:
            raise ValueError(f"FLASHFUSE_HOPPER_DQ={forced!r}: expected one of {', '.join(BWD_DQ_CHOICES)}")
        return forced
    return BWD_FUSED_DQ


def _backward_inputs(lse, delta):
    if lse.stride() != delta.stride():
        lse = lse.contiguous()
        delta = delta.contiguous()
    return lse, delta


def hopper_backward(p: AttentionProblem, grad_out, q, k, v, lse, delta, key_table=None,
                    query_table=None) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` on the Hopper kernels, from the forward's ``lse``
    and ``delta = rowsum(dO * O)`` (minus ``grad_lse`` where lse has a
    gradient), both (B, Hq, N) float32: the schedule ``backward_path``
    names. With a mask (the fused schedule), a block mask's tables for it
    when it has them."""
    how = backward_path()
    if how == "separate":
        return hopper_backward_separate(p, grad_out, q, k, v, lse, delta)
    return hopper_backward_fused(p, grad_out, q, k, v, lse, delta, how=how, key_table=key_table,
                                 query_table=query_table)


def hopper_backward_separate(p: AttentionProblem, grad_out, q, k, v, lse, delta) -> tuple[torch.Tensor, ...]:
    """The two kernels, dK/dV then dQ. Deterministic: each gradient element
    is written by one program, no atomics."""
    lse, delta = _backward_inputs(lse, delta)
    # empty_like, as the portable backward and the traced op's fake give:
    # strides of a dense input (multiples of its 128- or 256-byte rows) or
    # contiguous ones, which the copy engine writes either way.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dkdv_args, dkdv_meta, dq_args, dq_meta = backward_kernel_args(p, grad_out, q, k, v, lse, delta, dq, dk, dv)
    ensure_scratch_allocator()
    with torch.cuda.device(q.device):
        _direct("_hopper_attn_bwd_dkdv")((cdiv(p.M, BWD_BLOCK_N), p.Hkv, p.B), dkdv_args, dkdv_meta)
        _direct("_hopper_attn_bwd_dq")((cdiv(p.N, BWD_DQ_BLOCK_M), p.Hq, p.B), dq_args, dq_meta)
    return dq, dk, dv


def hopper_backward_fused(p: AttentionProblem, grad_out, q, k, v, lse, delta, *,
                          how: str = "tma", persistent: bool | None = None, key_table=None,
                          query_table=None) -> tuple[torch.Tensor, ...]:
    """The fused kernel (dK, dV and the float32 sum of dS·K; ``how``:
    "atomic" or "tma"), then the convert kernel (dq = scale * sum), with the
    gradients laid out as ``hopper_backward_separate`` lays them out. dQ's
    last bits depend on the order the adds land in. ``persistent``: the
    grid, ``backward_persistent(p)`` unless given (the benchmarks and tests).
    With a mask, its query table is a block mask's (``query_table``) or
    built here as the portable backward builds it (from the key table for a
    float mask, whose averaging rows it marks)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.empty((p.B, p.Hq, p.N, p.D), dtype=torch.float32, device=q.device)
    if p.mask is not None and query_table is None:
        from .mask_ranges import mask_tables

        _, query_table = mask_tables(p.mask, p.N, p.M, p.band(), fills=False, key_table=key_table,
                                     keys=p.mask_kind == MASK_FLOAT, unread=lse)
    ensure_scratch_allocator()
    with torch.cuda.device(q.device):
        rows = fused_row_inputs(p, lse, delta, dq_acc)
        args, meta, programs = fused_kernel_args(p, grad_out, q, k, v, rows, dq_acc, dk, dv, how, persistent,
                                                 query_table)
        _direct("_hopper_attn_bwd_fused")((programs, ), args, meta)
        convert_dq(p, dq_acc, dq)
    return dq, dk, dv
