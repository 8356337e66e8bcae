"""Long-context benchmark: one causal attention layer, forward+backward, as the
sequence grows.

H=16, D=128, bf16, B=1; N doubles from 1k up to ``--max-n`` (default 2M). For
flashfuse, SDPA (default dispatch) and naive attention it records time and
peak memory until the provider runs out of memory ('OOM' row, then that
provider stops) or out of its time share ('time budget' row: the next size
would take about 4x the last, and a 2M-token step takes minutes).

    python bench/bench_long_context.py
    python bench/bench_long_context.py --max-n 262144 --providers flashfuse,sdpa
    python bench/bench_long_context.py --smoke --out /tmp/x
"""

from __future__ import annotations

import os
import time

import common
import torch
from common import AttnCase

PROVIDERS = ["flashfuse", "sdpa", "naive"]


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=75)
    p.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset of flashfuse,sdpa,naive")
    p.add_argument("--min-n", type=int, default=None, help="first sequence length (default 1024)")
    p.add_argument("--max-n", type=int, default=None, help="last sequence length (default 2097152)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 16)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--single-pass-from", type=int, default=1 << 20,
                   help="from this N on, one fwd+bwd per size (no warm-up at that size, one timed call that "
                        "also gives the peak memory): a 2M-token step takes minutes (default 1M)")
    p.add_argument("--from-csv", default=None,
                   help="measure nothing: print the tables and draw the plot of this CSV's rows")
    p.add_argument("--provider-budget-s", type=float, default=30.0,
                   help="seconds each provider may spend before it stops growing N (0 = no limit)")
    return p.parse_args()


def reps_for(step_s: float) -> int:
    """Fewer timed repetitions as a step gets long: the median of 5 when cheap,
    a single one at multi-second sizes."""
    if step_s < 0.05:
        return 5
    if step_s < 0.5:
        return 3
    return 1


def run_provider(provider, args, device, results, total):
    """Grow N for one provider until OOM, its time share (or the script's
    budget ``total``) runs out, or --max-n."""
    own = common.Budget(args.provider_budget_s)
    N = args.min_n
    if N >= args.single_pass_from:
        # Compile (and tune) the kernels on a small size first, so the single
        # timed pass at each large size measures the kernels, not the compiler.
        warm = AttnCase(B=1, Hq=args.heads, N=4096, D=args.head_dim, causal=True)
        q, k, v, _ = common.make_inputs(warm, device)
        step, _ = common.attention_step(common.build_attention(provider, warm, None, device), q, k, v, "fwd+bwd")
        step()
        common.sync(device)
        del q, k, v, step
    while N <= args.max_n:
        case = AttnCase(B=1, Hq=args.heads, N=N, D=args.head_dim, causal=True)
        row = dict(provider=provider, mode="fwd+bwd", **case.columns())
        q = k = v = fn = step = None
        try:
            torch.manual_seed(0)
            q, k, v, _ = common.make_inputs(case, device)
            # No memory guard for naive: here running out of memory is the result.
            fn = common.build_attention(provider, case, None, device, guard_memory=False)
            step, grads = common.attention_step(fn, q, k, v, "fwd+bwd")
            if N >= args.single_pass_from:
                # One synchronised call is both the timing and the peak memory.
                t0 = time.perf_counter()
                peak, extra = common.peak_memory_mib(step, device, grads)
                ms, reps = (time.perf_counter() - t0) * 1e3, 1
            else:
                step()  # warm-up (compiles at the first size)
                t0 = time.perf_counter()
                peak, extra = common.peak_memory_mib(step, device, grads)  # synchronises
                reps = reps_for(time.perf_counter() - t0)
                ms = common.wall_ms(step, device, reps, before=lambda: [setattr(t, "grad", None) for t in grads])
            results.add(**row, status="ok", ms=ms, reps=reps, tflops=common.tflops(case.flops("fwd+bwd"), ms),
                        peak_mem_mib=peak, extra_mem_mib=extra)
            print(f"{provider:>9} N={N:>8}: {ms:10.2f} ms  peak {peak:10.1f} MiB", flush=True)
        except common.Unsupported as exc:
            results.add(**row, status="skipped", error=common.short_error(exc))
            break
        except Exception as exc:
            oom = common.is_oom(exc)
            results.add(**row, status="OOM" if oom else "error", error=common.short_error(exc))
            print(f"{provider:>9} N={N:>8}: {common.short_error(exc)}", flush=True)
            failed = True
        else:
            failed = False
        # Outside the except block, so the traceback no longer holds the
        # failed call's tensors when memory is returned.
        del q, k, v, fn, step
        common.free_memory(collect=failed)
        if failed:
            break
        # The next size costs about 4x (quadratic work) for (reps + 2) calls,
        # or for one call in single-pass mode.
        calls = 1 if 2 * N >= args.single_pass_from else reps_for(ms / 1e3 * 4) + 2
        next_s = ms / 1e3 * 4 * calls
        if 2 * N <= args.max_n and next_s > min(own.left(), total.left()):
            nxt = case.with_(N=2 * N)
            results.add(provider=provider, mode="fwd+bwd", **nxt.columns(), status="skipped",
                        error=f"time budget (next size ~{next_s:.0f} s)")
            break
        N *= 2


def report(results, args):
    rows = results.rows
    if not rows:
        return
    common.tables_header()
    t, h = common.pivot(rows, ["N"], "provider", lambda r: common.cell(r, "peak_mem_mib", 0))
    shape = f"H={args.heads}, D={args.head_dim}, bf16, B=1"
    common.print_table(t, h, f"Causal attention fwd+bwd, {shape}: peak memory (MiB)")
    t, h = common.pivot(rows, ["N"], "provider", lambda r: common.cell(r, "ms", 2))
    common.print_table(t, h, "Causal attention fwd+bwd: milliseconds")
    if args.no_plot:
        return
    mem, ms = {}, {}
    for r in rows:
        if r["status"] == "ok":
            for store, key in ((mem, "peak_mem_mib"), (ms, "ms")):
                xs, ys = store.setdefault(r["provider"], ([], []))
                xs.append(r["N"])
                ys.append(r[key])
    path = common.plot_panels(os.path.join(args.out, "long_context_memory.png"),
                              {"peak memory, fwd+bwd": mem, "time per fwd+bwd": ms}, "sequence length N",
                              "MiB", logy=True, ylabels={"time per fwd+bwd": "ms"}, title=f"causal attention fwd+bwd, {shape}, {rows[0]['gpu']}")
    if path:
        print(f"plot: {path}")


def main():
    args = parse_args()
    common.quiet_warnings()
    common.interrupt_on_sigterm()
    if args.from_csv:
        args.heads = args.heads or 16
        args.head_dim = args.head_dim or 128
        os.makedirs(args.out, exist_ok=True)
        report(common.Results.load(args.from_csv), args)
        return
    device = common.pick_device(args)
    if args.smoke:
        args.min_n = args.min_n or 64
        args.max_n = args.max_n or 256
        args.heads = args.heads or 2
        args.head_dim = args.head_dim or 32
    else:
        args.min_n = args.min_n or 1024
        args.max_n = args.max_n or 2097152
        args.heads = args.heads or 16
        args.head_dim = args.head_dim or 128
    results = common.Results(args.out, "long_context.csv", common.env_info(device))
    total = common.make_budget(args)
    t0 = time.perf_counter()
    try:
        for provider in args.providers.split(","):
            if provider not in PROVIDERS:
                raise SystemExit(f"unknown provider {provider!r}; choose from {PROVIDERS}")
            run_provider(provider, args, device, results, total)
    except KeyboardInterrupt:
        print("interrupted: reporting what was measured")
    finally:
        print(f"\n{len(results.rows)} rows in {time.perf_counter() - t0:.0f} s -> {results.path}")
        report(results, args)


if __name__ == "__main__":
    main()
