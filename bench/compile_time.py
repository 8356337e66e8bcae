"""Where a model's first (compiling) step spends its time: every Triton
compilation timed by kernel name (flashfuse's kernels are the ones whose
names start with "_", Inductor's start with "triton_"), and torch.compile's
own phase timings. Compiles run in this process (one compile thread) so that
each is seen; run with cold caches for the numbers a first run pays, e.g.

    TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python bench/compile_time.py --model gpt2 --t 1024
    python bench/compile_time.py --smoke      # tiny, on the CPU (no Triton compiles there)
"""

from __future__ import annotations

import collections
import os
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import bench_models  # noqa: E402
import common  # noqa: E402


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama", "bert"])
    p.add_argument("--task", default="train", choices=["train", "infer"])
    p.add_argument("--t", type=int, default=None, help="sequence length (default: bench_models' size)")
    p.add_argument("--variant", default="eager+flashfuse", help=f"one of {[v[0] for v in bench_models.VARIANTS]}")
    p.add_argument("--compile-scope", default="model", choices=["block", "model"])
    p.add_argument("--top", type=int, default=12, help="kernels listed")
    return p.parse_args()


def time_triton_compiles() -> tuple[dict, collections.Counter]:
    """Wrap ``triton.compile`` (every path that reaches it looks it up at
    call time) so each compilation is timed under its kernel's name."""
    import triton
    import triton.compiler
    import triton.compiler.compiler as compiler

    seconds: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    inner = compiler.compile

    def timed(src, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(src, *args, **kwargs)
        finally:
            name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", None) or "?"
            seconds[name] += time.perf_counter() - t0
            counts[name] += 1

    for module in (compiler, triton.compiler, triton):
        module.compile = timed
    return seconds, counts


def main():
    args = parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    seconds, counts = time_triton_compiles()
    variant = next((v for v in bench_models.VARIANTS if v[0] == args.variant), None)
    if variant is None:
        raise SystemExit(f"unknown variant {args.variant!r}")
    spec = bench_models.model_spec(args.model, args.smoke, args.t)
    step, _ = bench_models.build_step(spec, variant, args.task, device, args)
    t0 = time.perf_counter()
    step()
    common.sync(device)
    first = time.perf_counter() - t0
    ours = {k: v for k, v in seconds.items() if k.startswith("_")}
    print(f"{args.model} T={spec['T']} {args.task} {args.variant}, compile scope {args.compile_scope}: "
          f"first step {first:.1f} s")
    print(f"Triton compiles: {sum(seconds.values()):.1f} s in {sum(counts.values())}; flashfuse kernels "
          f"{sum(ours.values()):.1f} s in {sum(counts[k] for k in ours)}")
    common.print_table([[f"{v:.2f}", counts[k], k] for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])[:args.top]],
                       ["s", "compiles", "kernel"], "slowest Triton compiles")
    from torch._dynamo.utils import compile_times

    print(compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
