"""Host time of an eager attention step against its benchmarked time.

For flashfuse and SDPA at a few shapes, each of forward, backward and
forward+backward: the host time per step (twenty steps launched while the
GPU sleeps on a queued ``torch.cuda._sleep``, so that no device time counts;
the best of three such loops) beside the step's ``triton.testing.do_bench``
median. Where the host time reaches the benchmarked time, the benchmark
measured the host, not the kernels: the cause of attention rows whose
forward+backward took longer than its two parts (bench/NOTES.md runs 25
and 26).

    python bench/host_step_probe.py
"""

from __future__ import annotations

import time

import common
import torch
import torch.nn.functional as F

# (D, B, H, N, causal)
SHAPES = [(64, 16, 32, 1024, True), (128, 16, 16, 1024, True), (128, 4, 16, 4096, True), (64, 4, 32, 4096, False)]
SLEEP_CYCLES = 200_000_000  # about 0.1 s of GPU time queued ahead of the timed launches


def _host_ms(step, steps: int = 20, loops: int = 3) -> float:
    best = float("inf")
    for _ in range(loops):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
        torch.cuda.synchronize()
    return best


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    args = p.parse_args()
    device = common.gpu_device(args, "times CUDA launches")
    if device is None:
        return
    import triton

    import flashfuse

    print(common.env_info(device), flush=True)
    rows = []
    for D, B, H, N, causal in SHAPES:
        torch.manual_seed(0)
        q, k, v, _ = common.make_inputs(common.AttnCase(B=B, Hq=H, N=N, D=D), device)
        for name in ("flashfuse", "sdpa"):
            attention = flashfuse.attention if name == "flashfuse" else F.scaled_dot_product_attention

            def fn(q, k, v):
                return attention(q, k, v, is_causal=causal)

            row = [D, B, H, N, causal, name]
            for mode in ("fwd", "bwd", "fwd+bwd"):
                step, _ = common.attention_step(fn, q, k, v, mode, grads=True)
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                host = _host_ms(step)
                bench = triton.testing.do_bench(step, warmup=25, rep=100)
                row += [f"{host:.3f}", f"{bench:.3f}"]
            rows.append(row)
            print(" ".join(str(x) for x in row), flush=True)
    common.tables_header()
    common.print_table(rows, ["D", "B", "H", "N", "causal", "impl", "fwd host ms", "fwd do_bench ms",
                              "bwd host ms", "bwd do_bench ms", "fwd+bwd host ms", "fwd+bwd do_bench ms"],
                       title="host time per eager step (GPU asleep) against do_bench")


if __name__ == "__main__":
    main()
