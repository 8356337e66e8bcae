"""Hopper (sm_90) forward in Gluon: the launcher and the rule that selects it.

The portable forward (``forward.py``) leaves Triton to schedule its loop:
one group of warps loads, multiplies and takes the softmax in turn. The
Hopper kernel (``hopper_gluon.py``) schedules it itself, as FlashAttention-3
does:

* Warp-specialised: a copy warp streams q's two 64-row halves once and
  K/V blocks of 128 keys into shared-memory slots through the copy engine
  (TMA), each slot with a ready and an empty mbarrier; two consumer warp
  groups (64 query rows each, 240 registers; the copy warp's group 24)
  release a slot as soon as their product that reads it has finished. The
  groups never wait for each other.
* Within a consumer, iteration j issues S_j = q·K_jᵀ and O += P_{j-1}·V_{j-1}
  as asynchronous warp-group products, waits for S_j only, and computes the
  softmax of S_j while the tensor cores still work on P_{j-1}·V_{j-1}.
* The same loop in one group of 8 warps that issued its own copies (a
  thread barrier before each refill) measured slower than the portable
  kernel and was removed (bench/NOTES.md run 17).

Scope (``hopper_refusal`` names the first reason a call is not taken):
fp16/bf16, head dims 64 or 128 (q, k and v alike), any band (causal,
windows, bottom-right), grouped heads; no mask tensor, dropout, soft-cap or
sinks; enough keys per query row that the kernel's fixed cost per tile pays
(``MIN_KEYS``, from the measured crossover with the portable kernel). The
backward is the portable one; it reads this kernel's lse, which follows the
same conventions (natural log, +inf for a row with no visible key, whose
output is 0).

Inside ``torch.compile`` the forward op records ``flashfuse::_hopper_forward``
(``ops.py``), an opaque op whose CUDA kernel calls this launcher on the real
tensors (and the portable kernel if their layout does not suit the copy
engine), since Inductor cannot launch Gluon kernels itself.

Written for Gluon as shipped with Triton 3.6 (its API changed from 3.5);
other Triton versions take the portable kernels. Gluon kernels do not run
in Triton's interpreter: they are tested on the GPU
(``tests/kernels/test_hopper.py``, marker ``gpu``).
"""

from __future__ import annotations

import functools

import torch

from .launch import _capability, _traced, cdiv, copy_engine_layout, ensure_scratch_allocator
from .problem import AttentionProblem
from .. import config

__all__ = ["hopper_forward", "hopper_refusal", "problem_refusal", "traced_takes", "gluon_available",
           "mean_visible_keys"]

# Triton versions whose Gluon API this module is written for and was run on.
SUPPORTED_TRITON = ("3.6",)

# Tile: 128 query rows (two warp groups of 64) by 128 keys.
BLOCK_M = 128
BLOCK_N = 128
# K/V slots per head dim (shared memory at D = 128: q 32 KiB + 2 x 2 x 32 KiB).
WS_STAGES = {64: 3, 128: 2}

# Fewest visible keys per query row (mean over the rows) for which the
# Hopper kernel is taken. Its fixed cost per query tile (descriptors, the
# pipeline's fill and drain, the output store) is about three key blocks'
# work, so short rows run faster on the portable kernel. Measured on an
# H200 (bench/results/hopper_schedules.csv, bench/NOTES.md run 17): D = 128
# faster from 1k keys (causal 1k, 512 keys on average, slower); D = 64 only
# at 16k (4k slower, causal 16k, 8k on average, faster).
MIN_KEYS = {128: 768, 64: 6144}


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


def problem_refusal(p: AttentionProblem, dropout_p: float, softcap, sinks) -> str | None:
    """The reasons that depend on the problem alone (also known in a trace,
    where the tensors have no address to check the layout on)."""
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
        return "a mask tensor"
    if dropout_p > 0.0:
        return "dropout"
    if softcap is not None or sinks is not None:
        return "soft-cap or sinks"
    if not all(isinstance(x, int) for x in (p.N, p.M, p.diag_off)):
        return "symbolic sequence lengths (a graph traced with dynamic shapes)"
    if p.N == 0 or p.M == 0:
        return "an empty sequence"
    keys = mean_visible_keys(p.N, p.M, p.diag_off, p.window_left, p.window_right, p.has_window_left,
                             p.has_window_right)
    if keys < MIN_KEYS[p.D]:
        return f"{keys:.0f} visible keys per query row on average (fewer than {MIN_KEYS[p.D]} at D = {p.D})"
    return None


def hopper_refusal(p: AttentionProblem, q, k, v, *, dropout_p: float, softcap, sinks) -> str | None:
    """Why the Hopper kernel does not run this forward (None: it does).

    The one selection rule: the kernels' dispatch (``kernels._route``) asks
    it, and so do the benchmarks and tests that name the kernel a call takes."""
    why = problem_refusal(p, dropout_p, softcap, sinks)
    if why is None and _traced((q, k, v)):
        return "traced graph (the forward records flashfuse::_hopper_forward instead: traced_takes)"
    if why is None:
        for t in (q, k, v):
            if not copy_engine_layout(t):
                return "a layout the copy engine cannot read (unit last stride, 16-byte aligned base and strides)"
    return why


def traced_takes(p: AttentionProblem, q, k, v, *, dropout_p: float, softcap, sinks) -> bool:
    """Whether a traced forward records ``flashfuse::_hopper_forward``: the
    problem suits the kernel (the layout is checked when it runs)."""
    if p.interpret or p.device.type != "cuda" or not _traced((q, k, v)):
        return False
    return problem_refusal(p, dropout_p, softcap, sinks) is None


def _triton_version() -> str:
    import triton

    return triton.__version__


def kernel():
    """The Gluon kernel, imported on first use."""
    from . import hopper_gluon

    return hopper_gluon._hopper_attn_fwd_ws


def kernel_args(p: AttentionProblem, q, k, v, out, lse) -> tuple[tuple, dict]:
    """The kernel's positional arguments and launch options for a problem."""
    args = (
        q, k, v, out, lse,
        *p.q_strides[:3], *p.k_strides[:3], *p.v_strides[:3], *out.stride()[:3],
        p.Hq, p.Hkv, p.N, p.M,
        p.qk_scale, p.diag_off, p.window_left, p.window_right,
    )
    # Two consumer warp groups at 240 registers and the copy warp at 24 (its
    # warp group's share): 168 per thread at launch over 12 warps.
    meta = dict(HAS_WINDOW_LEFT=p.has_window_left, HAS_WINDOW_RIGHT=p.has_window_right,
                HEAD_DIM=p.D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=WS_STAGES[p.D], num_warps=4, maxnreg=168)
    return args, meta


def hopper_forward(p: AttentionProblem, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward on the Hopper kernel; ``(out, lse)`` as ``forward.attention_forward``
    returns them (out laid out as ``empty(B, N, Hq, D).transpose(1, 2)``)."""
    B, Hq, N = p.B, p.Hq, p.N
    out = torch.empty_strided((B, Hq, N, p.Dv), (N * Hq * p.Dv, p.Dv, Hq * p.Dv, 1), dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    args, meta = kernel_args(p, q, k, v, out, lse)
    ensure_scratch_allocator()
    with torch.cuda.device(q.device):
        kernel()[(cdiv(N, BLOCK_M), Hq, B)](*args, **meta)
    return out, lse
