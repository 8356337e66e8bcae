"""Hopper kernels against the portable ones and SDPA's default (cuDNN on an H200).

For the shapes of issue 18's table (bf16, B*N = 16k tokens, H*D = 2048,
D in {64, 128}, N in {1k, 4k, 16k}, causal and not): forward and
forward+backward TFLOP/s (medians of ``triton.testing.do_bench``) of

- ``portable``: the op with ``FLASHFUSE_HOPPER=0``;
- ``hopper``: the op with ``FLASHFUSE_HOPPER=1`` (the row names the
  selection rule's reason when the Hopper kernels do not apply);
- ``sdpa``: ``scaled_dot_product_attention``'s default dispatch.

Rows print as they finish; a table and ``bench/results/hopper.csv`` at the
end (the CSV is rewritten after every row).

    python bench/bench_hopper.py                       # the whole table
    python bench/bench_hopper.py --d 128 --n 4096 --max-seconds 120
    FLASHFUSE_AUTOTUNE=0 python bench/bench_hopper.py  # first config, no tuning
"""

from __future__ import annotations

import os

import common
import torch
from common import AttnCase

PROVIDERS = ("portable", "hopper", "sdpa")
MODES = ("fwd", "fwd+bwd")


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=600)
    p.add_argument("--max-seconds", type=float, default=None, help="same as --budget-s")
    p.add_argument("--d", default="128,64", help="comma-separated head dims")
    p.add_argument("--n", default="1024,4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--gqa", type=int, default=1, help="query heads per key/value head")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench measurement time per row (ms)")
    args = p.parse_args()
    if args.max_seconds is not None:
        args.budget_s = args.max_seconds
    return args


def cases(args):
    if args.smoke:
        return [AttnCase(B=1, Hq=2, N=32, D=32, causal=c) for c in (False, True)]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    out = []
    for D in (int(x) for x in args.d.split(",")):
        for N in (int(x) for x in args.n.split(",")):
            for causal in causals:
                Hq = 2048 // D
                out.append(AttnCase(B=max(1, 16384 // N), Hq=Hq, Hkv=Hq // args.gqa, N=N, D=D,
                                    dtype=common.DTYPES[args.dtype], causal=causal))
    return out


def hopper_reason(case, q, k, v) -> str:
    from flashfuse.kernels.hopper import hopper_problem

    return hopper_problem(q, k, v) or "used"


def main():
    args = parse_args()
    common.interrupt_on_sigterm()
    common.quiet_warnings()
    device = common.pick_device(args)
    budget = common.make_budget(args)
    results = common.Results(args.out, "hopper.csv", common.env_info(device))
    providers = [p for p in args.providers.split(",") if p]
    print(f"{'D':>4} {'N':>6} {'causal':>6} {'provider':>9} {'mode':>8} {'ms':>8} {'TFLOP/s':>8}  note", flush=True)
    saved = os.environ.get("FLASHFUSE_HOPPER")
    try:
        for case in cases(args):
            for provider in providers:
                row = dict(provider=provider, **case.columns())
                if budget.exceeded():
                    for mode in MODES:
                        results.add(**row, mode=mode, status="skipped", error="time budget")
                    continue
                note = ""
                if provider in ("portable", "hopper"):
                    os.environ["FLASHFUSE_HOPPER"] = "1" if provider == "hopper" else "0"
                torch.manual_seed(0)
                q, k, v, mask = common.make_inputs(case, device)
                if provider == "hopper" and device.type == "cuda":
                    note = hopper_reason(case, q, k, v)
                fn = common.build_attention("flashfuse" if provider != "sdpa" else "sdpa", case, mask, device)
                for mode in MODES:
                    try:
                        step, grads = common.attention_step(fn, q, k, v, mode)
                        step()  # compile and autotune outside the timing
                        common.sync(device)
                        ms = common.bench_ms(step, device, 25, args.rep_ms, grads)
                        tf = common.tflops(case.flops(mode), ms)
                        results.add(**row, mode=mode, status="ok", ms=ms, tflops=tf, hopper=note)
                        print(f"{case.D:>4} {case.N:>6} {str(case.causal):>6} {provider:>9} {mode:>8} {ms:>8.3f} "
                              f"{tf:>8.1f}  {note}", flush=True)
                    except Exception as exc:  # a row per failure, the run goes on
                        results.add(**row, mode=mode, status="error", error=common.short_error(exc), hopper=note)
                        print(f"{case.D:>4} {case.N:>6} {str(case.causal):>6} {provider:>9} {mode:>8} "
                              f"error: {common.short_error(exc)}", flush=True)
                    step = grads = None
                q = k = v = mask = fn = None
                common.free_memory()
    except KeyboardInterrupt:
        print("interrupted: tabulating what finished")
    finally:
        if saved is None:
            os.environ.pop("FLASHFUSE_HOPPER", None)
        else:
            os.environ["FLASHFUSE_HOPPER"] = saved

    common.tables_header()
    rows = [r for r in results.rows if r.get("status") == "ok"]
    table = {}
    for r in rows:
        table.setdefault((r["D"], r["N"], r["causal"], r["mode"]), {})[r["provider"]] = r["tflops"]
    lines = []
    for (D, N, causal, mode), t in table.items():
        line = [D, N, "yes" if causal else "no", mode] + [common.fmt(t.get(p), 0) for p in providers]
        if "hopper" in t and "sdpa" in t:
            line.append(common.fmt(t["hopper"] / t["sdpa"], 2))
        if "hopper" in t and "portable" in t:
            line.append(common.fmt(t["hopper"] / t["portable"], 2))
        lines.append(line)
    headers = ["D", "N", "causal", "mode"] + list(providers)
    headers += [h for h, need in (("hopper/sdpa", ("hopper", "sdpa")), ("hopper/portable", ("hopper", "portable")))
                if all(p in providers for p in need)]
    common.print_table(lines, headers, title=f"TFLOP/s ({args.dtype}, medians of do_bench)")
    print(f"\nCSV: {results.path}")


if __name__ == "__main__":
    main()
