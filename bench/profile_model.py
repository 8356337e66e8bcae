"""Where a model step's time goes: torch.profiler over a few training steps
of one model/variant of ``bench_models.py``, printing the operators and
kernels that take the most GPU and CPU time, and the step's wall time against
its GPU-busy time (a step whose wall time far exceeds its GPU time is bound by
the host: Python, dispatch, launches, or a synchronisation).

    python bench/profile_model.py --model gpt2 --t 1024 --variant ffuse-hook
    python bench/profile_model.py --model gpt2 --variant eager+flashfuse,sdpa+compile
    python bench/profile_model.py --smoke --variant ffuse-hook     # tiny, on the CPU
"""

from __future__ import annotations

import time

import bench_models
import common
import torch
from torch.profiler import ProfilerActivity, profile


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama", "bert"])
    p.add_argument("--task", default="train", choices=["train", "infer"])
    p.add_argument("--t", type=int, default=None, help="sequence length (default: bench_models' size)")
    p.add_argument("--variant", default="ffuse-hook",
                   help=f"comma-separated subset of {[v[0] for v in bench_models.VARIANTS]}")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 3 warm-up steps)")
    p.add_argument("--top", type=int, default=15, help="rows per table")
    p.add_argument("--compile-scope", default="block", choices=["block", "model"])
    return p.parse_args()


def main():
    args = parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    spec = bench_models.model_spec(args.model, args.smoke, args.t)
    wanted = args.variant.split(",")
    variants = [v for v in bench_models.VARIANTS if v[0] in wanted]
    if not variants:
        raise SystemExit(f"no variant among {wanted}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for variant in variants:
        torch._dynamo.reset()
        step, _ = bench_models.build_step(spec, variant, args.task, device, args)
        for _ in range(3):
            step()
        common.sync(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        common.sync(device)
        wall = (time.perf_counter() - t0) * 1e3 / args.steps
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            common.sync(device)
        events = prof.key_averages()
        print(f"\n===== {spec['model']} T={spec['T']} {args.task} {variant[0]}: "
              f"{wall:.1f} ms per step (wall, unprofiled) =====")
        if device.type == "cuda":
            gpu_us = sum(e.self_device_time_total for e in events) / args.steps
            print(f"GPU busy (sum of kernel times): {gpu_us / 1e3:.1f} ms per step")
            print(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70))
        print(events.table(sort_by="cpu_time_total", row_limit=args.top, max_name_column_width=70))
        step = None
        torch._dynamo.reset()
        common.free_memory(collect=True)


if __name__ == "__main__":
    main()
