"""Where a ``generate()`` step spends its time, ``ffuse`` against ``sdpa``.

The model and the call are ``bench_generate.py``'s (LLaMA-shaped, head dim
128, 16 query and 4 key/value heads, 4 layers, bf16, dynamic or static
cache). For
each implementation: the wall time of one ``generate()`` (both timed in
alternating order before any profiler runs: run 16's first version timed
``ffuse`` after ``sdpa``'s profiles, and all of its host work, not only
flashfuse's, came out 1.4-2x slower); a ``cProfile`` of
one call (the functions with the largest own time, and flashfuse's by
cumulative time, per generated token); and ``torch.profiler``'s device
kernels (total device time per token, the largest kernels), the launches
the host made per token (kernel launches and CUDA graph replays: a compiled
static cache whose graphs replay launches few kernels), the span the device
was busy per token against the wall time, and what Dynamo and Inductor
counted (graphs, graph breaks, frames compiled, CUDA graphs skipped). Prints the
report and writes it to bench/results/profile_generate_<cache>_b<B>_t<T>.txt.

    python bench/profile_generate.py --batch 1 --prompt 512 --new 64
    python bench/profile_generate.py --smoke --out /tmp/x
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import common
import torch

# Host-side CUDA calls that start device work: one per kernel launch, one per
# CUDA graph replay.
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
GRAPH_CALLS = ("cudaGraphLaunch",)

import bench_generate


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=120)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"],
                   help="transformers' dynamic cache, or cache_implementation='static' (compiled on CUDA)")
    return p.parse_args()


def _stats(prof, sort: str, *restrictions) -> str:
    """The table ``pstats`` prints for ``prof``, from its header line on."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(*restrictions)
    text = out.getvalue()
    return "ncalls" + text.split("ncalls", 1)[1] if "ncalls" in text else ""


def _compile_counters() -> dict:
    """What Dynamo and Inductor counted so far in this process."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"].get("unique_graphs", 0),
            "graph breaks": sum(counters["graph_break"].values()),
            "frames compiled": counters["frames"].get("ok", 0),
            "cudagraph skips": counters["inductor"].get("cudagraph_skips", 0)}


def _busy_us(events) -> tuple[float, float]:
    """(time the device was busy, span from its first kernel's start to its
    last kernel's end), in microseconds, over the profiled call: the gaps
    between them are the device waiting for the host."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return 0.0, 0.0
    busy, cur_start, cur_end = 0.0, *spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, spans[-1][1] - spans[0][0]


def main():
    args = parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    new = 4 if args.smoke else args.new
    B, T = (1, 16) if args.smoke else (args.batch, args.prompt)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = bench_generate.config(args.smoke, T + new + 64)
    model = bench_generate.build(cfg, dtype, device)
    ids = torch.randint(1, cfg.vocab_size, (B, T), device=device)
    env = common.env_info(device)
    lines = [f"generate() profile: batch {B}, prompt {T}, {new} new tokens, {args.cache} cache, {env}"]
    impls = bench_generate.IMPLS
    for impl in impls:
        before = _compile_counters()
        bench_generate.generate(model, impl, ids, new, args.cache)  # warm-up (compiles a static cache)
        after = _compile_counters()
        lines.append(f"== {impl}: first call " + ", ".join(f"{k} {after[k] - before[k]}" for k in after))
    # Wall times first, in alternating order, before any profiler runs (see
    # the module docstring).
    walls = {impl: [] for impl in impls}
    for impl in (*impls, *reversed(impls)):
        common.sync(device)
        t0 = time.perf_counter()
        bench_generate.generate(model, impl, ids, new, args.cache)
        common.sync(device)
        walls[impl].append((time.perf_counter() - t0) / new * 1e3)
    for impl in impls:
        lines.append(f"== {impl}: {min(walls[impl]):.3f} ms per token (unprofiled wall time, best of 2)")
    for impl in impls:
        prof = cProfile.Profile()
        prof.enable()
        bench_generate.generate(model, impl, ids, new, args.cache)
        common.sync(device)
        prof.disable()
        lines.append(f"\n== {impl}: cProfile")
        lines.append("-- cProfile, largest own time (whole call; divide by the tokens):")
        lines.append(_stats(prof, "tottime", 18))
        lines.append("-- cProfile, flashfuse functions by cumulative time:")
        lines.append(_stats(prof, "cumulative", r"hf\.py|fastpath|ops\.py|decode\.py|launch\.py", 14))
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for impl in impls:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                bench_generate.generate(model, impl, ids, new, args.cache)
                torch.cuda.synchronize()
            ka = p.key_averages()
            dev_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
            launches = sum(e.count for e in ka if e.key in LAUNCH_CALLS)
            replays = sum(e.count for e in ka if e.key in GRAPH_CALLS)
            busy, span = _busy_us(p.events())
            lines.append(f"\n== {impl}: torch.profiler")
            lines.append(f"-- device kernels: {dev_us / new:.1f} us per token in all")
            lines.append(f"-- host launches per token: {launches / new:.1f} kernels, {replays / new:.2f} CUDA graph replays")
            lines.append(f"-- device busy {busy / new:.1f} us per token over a span of {span / new:.1f} us per token "
                         f"(the rest: the device waiting for the host)")
            lines.append(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    name = f"profile_generate_{args.cache}_b{B}_t{T}.txt" if not args.smoke else "profile_generate_smoke.txt"
    with open(os.path.join(args.out, name), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
