"""Host time of an eager step with the backward on autograd's device thread
and on the calling thread.

For CUDA tensors autograd runs each backward on a worker thread of its own
(one per device) while the calling thread waits; a Python backward (the
op's) then runs on a thread that has just woken up. This times, at GPT-2's
layer shape (B = 8, H = 12, N = 1024, D = 64, causal, bf16), flashfuse and
SDPA per forward, backward and forward+backward step: the host time per
step (twenty steps launched while the GPU sleeps on a queued
``torch.cuda._sleep``, best of three loops) with autograd's default
threads, with ``torch.autograd.set_multithreading_enabled(False)`` (the
backward on the calling thread), with the garbage collector off, and
without the GPU asleep. Then a CPU-side ``torch.profiler`` table of
flashfuse's backward and forward+backward steps.

    python bench/host_thread_probe.py
    python bench/host_thread_probe.py --smoke   # tiny shape on the CPU (a test)
"""

from __future__ import annotations

import gc

import common
import torch
import torch.nn.functional as F

SHAPE = (8, 12, 1024, 64)  # B, H, N, D
SMOKE_SHAPE = (1, 2, 64, 16)


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    args = p.parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    from torch.profiler import ProfilerActivity, profile

    import flashfuse

    print(common.env_info(device), flush=True)
    B, H, N, D = SMOKE_SHAPE if args.smoke else SHAPE
    torch.manual_seed(0)
    q, k, v, _ = common.make_inputs(common.AttnCase(B=B, Hq=H, N=N, D=D), device)
    rows = []
    for impl in ("flashfuse", "sdpa"):
        attention = flashfuse.attention if impl == "flashfuse" else F.scaled_dot_product_attention

        def fn(q, k, v, attention=attention):
            return attention(q, k, v, is_causal=True)

        for mode in ("fwd", "bwd", "fwd+bwd"):
            step, _ = common.attention_step(fn, q, k, v, mode, grads=True)
            for _ in range(5):
                step()
            common.sync(device)
            default = common.host_ms(step, device)
            torch.autograd.set_multithreading_enabled(False)
            try:
                calling_thread = common.host_ms(step, device)
            finally:
                torch.autograd.set_multithreading_enabled(True)
            gc.disable()
            try:
                gc_off = common.host_ms(step, device)
            finally:
                gc.enable()
            rows.append([impl, mode, f"{default:.3f}", f"{calling_thread:.3f}", f"{gc_off:.3f}",
                         f"{common.host_ms(step, device, loops=1, asleep=False):.3f}"])
            print(" ".join(rows[-1]), flush=True)
    for mode in ("bwd", "fwd+bwd"):
        step, _ = common.attention_step(lambda q, k, v: flashfuse.attention(q, k, v, is_causal=True), q, k, v, mode,
                                        grads=True)
        for _ in range(5):
            step()
        common.sync(device)
        common.sleep_gpu(device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                step()
        common.sync(device)
        print(f"===== flashfuse {mode}: 20 steps, CPU activities, GPU asleep")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    common.tables_header()
    common.print_table(rows, ["impl", "mode", "host ms", "backward on the calling thread", "gc off",
                              "GPU awake"], title=f"host time per eager step, B={B} H={H} N={N} D={D} causal bf16")


if __name__ == "__main__":
    main()
