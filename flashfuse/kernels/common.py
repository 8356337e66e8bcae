"""Triton helpers shared by the forward and backward kernels.

Both passes must agree bit for bit on which (query, key) pairs are visible and
which probabilities dropout keeps, so those two rules live here and nowhere
else. ``flashfuse.reference`` re-implements the same rules in PyTorch.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from triton.runtime.errors import OutOfResources


def _autotune_enabled() -> bool:
    """Autotune on CUDA unless FLASHFUSE_AUTOTUNE=0.

    Autotuning benchmarks every candidate config once per (size bucket, head
    dims, flags): seconds on the first call of each, then the best config.
    With FLASHFUSE_AUTOTUNE=0 each kernel takes the first candidate that fits
    (the lists are ordered best-first from H200 measurements at D = 128, bf16,
    4k-16k tokens): one compile per kernel variant, for quick start-up and
    test suites, at some cost in speed elsewhere (see bench/NOTES.md).
    """
    return os.environ.get("FLASHFUSE_AUTOTUNE", "1") != "0"


class FixedConfigLauncher:
    """Launch a kernel with a fixed config (FLASHFUSE_AUTOTUNE=0): the first
    candidate that compiles within the GPU's resources, remembered per key.

    ``key`` must capture everything the candidate list and the compiled
    kernel depend on (dtype, head dims, flags, device). The candidates are
    computed, and a config that runs out of shared memory or registers is
    skipped, only on the first call of a key: later calls cost a dict lookup,
    which keeps the host time of a launch small.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.chosen: dict = {}

    def __call__(self, key, candidates, grid, *args, **kwargs):
        """``candidates()``: configs in preference order; ``grid(cfg)``: the
        launch grid for a config's meta-parameters (a dict)."""
        cfg = self.chosen.get(key)
        if cfg is not None:
            return self._launch(cfg, grid, args, kwargs)
        error = None
        for cfg in candidates():
            try:
                self._launch(cfg, grid, args, kwargs)
            except OutOfResources as exc:  # raised before anything runs
                error = exc
                continue
            self.chosen[key] = cfg
            return None
        raise error if error is not None else RuntimeError("flashfuse: no kernel config to launch")

    def _launch(self, cfg, grid, args, kwargs):
        g = grid(cfg.kwargs)
        return self.kernel[g](*args, **kwargs, **cfg.kwargs, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)


@functools.lru_cache(maxsize=None)
def max_shared_mem(device_index: int) -> int:
    """Shared memory per block on a CUDA device, in bytes, queried once per
    device (the query goes through the driver; launches must not pay it)."""
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # conservative Hopper-class default
        return 227 * 1024


def _interpreting(t: torch.Tensor) -> bool:
    """Launch through Triton's interpreter: CPU tensors cannot run compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1" or t.device.type != "cuda"


def _bucket(n: int, cap: int) -> int:
    """Sequence-length bucket for an autotuning key: the next power of two,
    capped, so tuning runs once per size class instead of once per length."""
    return min(triton.next_power_of_2(max(n, 1)), cap)


def _dot_precision(q: torch.Tensor) -> str:
    """tl.dot input precision for q's dtype.

    16-bit inputs use tensor cores whatever this says. For fp32 on CUDA,
    follow PyTorch's matmul setting: "tf32" when TF32 is allowed, else
    "tf32x3" (three TF32 products, fp32-level accuracy on tensor cores;
    plain IEEE dots run on CUDA cores about a hundred times slower).
    """
    if q.dtype != torch.float32 or q.device.type != "cuda":
        return "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"


@triton.jit
def _visible(
    offs_m,
    offs_n,
    N,
    M,
    DIAG_OFFSET,
    WINDOW_LEFT,
    WINDOW_RIGHT,
    HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) bool tile: query i may look at key j.

    Out-of-range rows and columns are invisible. With a window, key j is
    visible to query i when
    ``i + DIAG_OFFSET - WINDOW_LEFT <= j <= i + DIAG_OFFSET + WINDOW_RIGHT``
    (a causal mask is ``WINDOW_RIGHT = 0`` with no left bound).
    """
    i = offs_m[:, None]
    j = offs_n[None, :]
    vis = (i < N) & (j < M)
    if HAS_WINDOW_RIGHT:
        vis = vis & (j <= i + DIAG_OFFSET + WINDOW_RIGHT)
    if HAS_WINDOW_LEFT:
        vis = vis & (j >= i + DIAG_OFFSET - WINDOW_LEFT)
    return vis


@triton.jit
def _dropout_keep(seed, offs_m, offs_n, bh, threshold):
    """(BLOCK_M, BLOCK_N) bool tile: dropout keeps probability (i, j).

    One Philox4x32-10 call with counter ``(j >> 2, i, bh, 0)`` yields four
    words; key j takes word ``j & 3``. A word r keeps when
    ``(r >> 8) >= threshold`` with ``threshold = round(p * 2**24)``, so the
    keep rate is 1 - p to within 2**-24. The stream depends only on the seed
    and the element's coordinates, so the backward regenerates the forward's
    mask exactly, whatever the tiling.
    """
    return _dropout_keep_at(seed, offs_m[:, None], offs_n[None, :], bh, threshold)


@triton.jit
def _dropout_keep_at(seed, i, j, bh, threshold):
    """Dropout's keep rule for broadcastable 2-D index tiles ``i`` (queries)
    and ``j`` (keys), e.g. ``i = offs_m[None, :]``, ``j = offs_n[:, None]``
    for a transposed (BLOCK_N, BLOCK_M) tile. Same stream as ``_dropout_keep``,
    which is this with ``i = offs_m[:, None]``, ``j = offs_n[None, :]``.
    """
    c0 = (j >> 2).to(tl.uint32) + (i * 0).to(tl.uint32)
    c1 = i.to(tl.uint32) + (j * 0).to(tl.uint32)
    c2 = (c0 * 0) + bh.to(tl.uint32)
    c3 = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    lane = j & 3
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return (r >> 8).to(tl.int32) >= threshold


@triton.jit
def _dropout_keep_block(seed, offs_m, start_n, bh, threshold, BLOCK_N: tl.constexpr):
    """``_dropout_keep(seed, offs_m, start_n + arange(BLOCK_N), bh, threshold)``
    at a quarter of the cost: one Philox call per four keys instead of one per
    key, its four words interleaved back into key order. ``start_n`` must be a
    multiple of 4 (block starts are multiples of BLOCK_N >= 16)."""
    QUARTER: tl.constexpr = BLOCK_N // 4
    i = offs_m[:, None]
    g = (start_n >> 2) + tl.arange(0, QUARTER)[None, :]
    c0 = g.to(tl.uint32) + (i * 0).to(tl.uint32)
    c1 = i.to(tl.uint32) + (g * 0).to(tl.uint32)
    c2 = (c0 * 0) + bh.to(tl.uint32)
    c3 = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    # join(join(r0, r2), join(r1, r3))[m, g, y, x] is word 2y + x, which is
    # key 4g + 2y + x after the reshape: key order restored.
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    r = tl.reshape(words, (offs_m.shape[0], BLOCK_N))
    return (r >> 8).to(tl.int32) >= threshold
