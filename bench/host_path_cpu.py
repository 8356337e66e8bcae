"""Host time of the op's CUDA launch path, measured on a CPU-only machine:
the Python between ``flashfuse.attention`` and the Triton launches, with the
launches themselves stubbed out (no GPU is touched).

The CUDA code path is forced onto CPU tensors: the op is told to use the
Triton kernels, the kernels that they are not interpreted, and the
launchers' Triton launch is replaced by a stand-in binary whose launch does
nothing. What remains is exactly the Python that a GPU call runs before and
after its launches: argument checks, allocations, the autograd function, the
launchers' config lookup, fingerprint and argument assembly. Useful to
measure host-side changes without a GPU; the numbers are this machine's, not
a GPU host's.

    python bench/host_path_cpu.py
    python bench/host_path_cpu.py --smoke
"""

from __future__ import annotations

import contextlib
import os
import time

import common
import torch


class _StubBinary:
    """A compiled kernel whose launch does nothing."""

    function = 0
    packed_metadata = None

    def run(self, *args):
        pass

    def launch_metadata(self, *args):
        return None


class _StubDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0


def force_cuda_path_on_cpu():
    """Route CPU tensors through the CUDA launch path with stubbed launches."""
    import triton

    from flashfuse import ops
    from flashfuse.kernels import backward, forward, launch, mask_ranges

    triton.runtime.driver.set_active(_StubDriver())
    launch.ConfigLauncher._launch = lambda self, cfg, grid, args, kwargs: (grid(cfg.kwargs), _StubBinary())[1]
    ops._use_triton = lambda q: True
    forward._interpreting = backward._interpreting = mask_ranges._interpreting = lambda t: False
    launch._interpreting = lambda t: False
    backward._max_shared_mem = lambda device: 227 * 1024
    torch.cuda.device = lambda device: contextlib.nullcontext()
    launch._capability = lambda index: (9, 0)  # a Hopper GPU


def best_us(fn, loops: int, calls: int) -> float:
    """Best (lowest) mean microseconds per call over ``loops`` loops."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--loops", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    os.environ["FLASHFUSE_AUTOTUNE"] = "0"
    os.environ["TRITON_INTERPRET"] = "0"
    import flashfuse

    force_cuda_path_on_cpu()
    torch.set_flush_denormal(True)  # the stubbed kernels leave outputs uninitialised
    loops, calls = (2, 5) if args.smoke else (args.loops, args.calls)
    B, H, N, D = 1, 8, 128, 64
    q = torch.randn(B, H, N, D, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    g = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            flashfuse.attention(q, k, v, is_causal=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None  # assign, never accumulate into garbage
        flashfuse.attention(q, k, v, is_causal=True).backward(g)

    info = common.env_info(torch.device("cpu"))
    print(f"{info['gpu']}, torch {info['torch_version']}, triton {info['triton_version']}, {info['date']}")
    print(f"host path, B={B} H={H} N={N} D={D} causal, launches stubbed: "
          f"fwd {best_us(fwd, loops, calls):.1f} us, fwd+bwd {best_us(fwd_bwd, loops, calls):.1f} us "
          f"(best of {loops} loops of {calls} calls)")


if __name__ == "__main__":
    main()
