"""Attention kernel benchmark: flashfuse's op against PyTorch's attention.

Providers: ``flashfuse`` (torch.ops.flashfuse.attention), ``flashfuse_portable``
(the same with ``FLASHFUSE_HOPPER=0``: the portable Triton kernels), ``sdpa`` (default
dispatch), ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_efficient`` (one SDPA
backend forced with ``sdpa_kernel``), ``flex`` (FlexAttention compiled once per
configuration, block mask built once) and ``naive`` (eager matmul-softmax-matmul, only where it
fits in memory).

For every configuration and provider it measures forward, backward and
forward+backward: median milliseconds, TFLOP/s and peak memory. Each
configuration's providers are built, compiled and run once first, then
timed in ``--rounds`` rounds (``do_bench`` each), alternating their order
from round to round; the median over the rounds is reported, with the
spread (max - min over median). One timing per provider in a fixed order
read whichever came first after a pause a few percent fast (bench/NOTES.md
run 35).

Default sweep: bf16, B*N = 16k tokens, H*D = 2048, D in {64, 128},
N in {1k, 4k, 16k}, causal and not; then feature rows (masks, grouped heads,
dropout, bottom-right causal, fp16/fp32) and a host-overhead row.

    python bench/bench_attention.py                 # the default sweep
    python bench/bench_attention.py --d 128 --n 4096 --providers flashfuse,sdpa
    python bench/bench_attention.py --smoke --out /tmp/x   # CPU, tiny shapes
    python bench/bench_attention.py --from-csv bench/results/attention_run33.csv --out /tmp/x  # tables, plot
"""

from __future__ import annotations

import os
import time

import common
import torch
from common import AttnCase

MODES = ("fwd", "bwd", "fwd+bwd")
SMOKE_PROVIDERS = ["flashfuse", "sdpa", "sdpa_flash", "sdpa_efficient", "naive"]


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=200)
    p.add_argument("--providers", default=None,
                   help=f"comma-separated subset of {','.join(common.ATTENTION_PROVIDERS)}")
    p.add_argument("--d", default=None, help="comma-separated head dims (default 64,128)")
    p.add_argument("--n", default=None, help="comma-separated sequence lengths (default 1024,4096,16384)")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--dtype", default="bf16", choices=list(common.DTYPES))
    p.add_argument("--tokens", type=int, default=None, help="B*N per configuration (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="H*D per configuration (default 2048)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of fwd,bwd,fwd+bwd")
    p.add_argument("--no-features", action="store_true", help="skip the feature rows")
    p.add_argument("--no-host", action="store_true", help="skip the host-overhead row")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warmup (ms)")
    p.add_argument("--rep-ms", type=float, default=30.0, help="do_bench measurement time (ms)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds per configuration, providers in alternating order (median reported)")
    p.add_argument("--from-csv", default=None, help="redraw the tables and the plot of this CSV, measuring nothing")
    return p.parse_args()


def ints(text: str | None, default: list[int]) -> list[int]:
    return default if text is None else [int(x) for x in text.split(",") if x]


def sweep_cases(args, dtype) -> list[AttnCase]:
    """The main sweep, D=128 first so that a run cut short by its budget has
    the most common head dim."""
    if args.smoke:
        ds, ns, tokens, hidden = ints(args.d, [32]), ints(args.n, [64]), args.tokens or 128, args.hidden or 64
    else:
        ds, ns = ints(args.d, [128, 64]), ints(args.n, [1024, 4096, 16384])
        tokens, hidden = args.tokens or 16384, args.hidden or 2048
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cases = []
    for D in ds:
        for N in ns:
            for causal in causals:
                cases.append(AttnCase(B=max(1, tokens // N), Hq=max(1, hidden // D), N=N, D=D,
                                      dtype=dtype, causal=causal))
    return cases


def feature_cases(smoke: bool) -> list[tuple[str, AttnCase]]:
    """One row per feature on a fixed base shape (B=4, H=16, N=4k, D=128 bf16)."""
    base = AttnCase(B=1, Hq=4, N=64, D=32) if smoke else AttnCase(B=4, Hq=16, N=4096, D=128)
    n_short = base.N // 4
    return [
        ("bool padding mask (B,1,1,N)", base.with_(mask="bool_pad")),
        ("float mask (B,1,N,N)", base.with_(mask="float")),
        ("causal as a float mask (B,1,N,N)", base.with_(mask="causal_float")),
        ("GQA Hq=4*Hkv", base.with_(Hkv=base.Hq // 4)),
        ("dropout 0.1", base.with_(dropout=0.1)),
        ("causal bottom-right N<M", base.with_(N=n_short, M=base.N, causal=True, bottom_right=True)),
        ("fp16", base.with_(dtype=torch.float16)),
        ("fp32", base.with_(dtype=torch.float32)),
    ]


def measure_case(results, section, label, case, providers, modes, device, args, budget):
    """All providers and modes of one case; every failure becomes a row.

    Each provider's step is built and run once (compiles, autotuning, peak
    memory), then every step that ran is timed in ``args.rounds`` rounds in
    the order ``common.alternating`` gives, so a drift of the machine (or a
    pause before the first timing) weighs on every provider alike."""
    import statistics

    def add(provider, mode, **values):
        results.add(section=section, feature=label, provider=provider, **case.columns(), mode=mode, **values)

    def failure(exc) -> dict:
        return dict(status="OOM" if common.is_oom(exc) else "error", error=common.short_error(exc))

    if budget.exceeded():
        for provider in providers:
            for mode in modes:
                add(provider, mode, status="skipped", error="time budget")
        return
    torch.manual_seed(0)
    q, k, v, mask = common.make_inputs(case, device)
    fns = {}
    for provider in providers:
        try:
            fns[provider] = common.build_attention(provider, case, mask, device)
        except Exception as exc:  # unsupported provider or OOM while building
            why = dict(failure(exc), status="skipped") if isinstance(exc, common.Unsupported) else failure(exc)
            for mode in modes:
                add(provider, mode, **why)
            common.free_memory(collect=True)
    for mode in modes:
        # Warm-up and peak memory one provider at a time (a backward step
        # keeps its forward's graph, which must not count in another's peak).
        peaks = {}
        for provider, fn in fns.items():
            step = grads = None
            try:
                step, grads = common.attention_step(fn, q, k, v, mode)
                step()  # warm-up: compiles, autotunes
                common.sync(device)
                peaks[provider] = common.peak_memory_mib(step, device, grads)
                oom = False
            except Exception as exc:
                oom = common.is_oom(exc)
                add(provider, mode, **failure(exc))
            # Outside the except block: the traceback no longer pins tensors.
            step = grads = None
            for t in (q, k, v):
                t.grad = None
            common.free_memory(collect=oom)
        steps = {}
        for provider, (peak, extra) in peaks.items():
            try:
                step, grads = common.attention_step(fns[provider], q, k, v, mode)
                steps[provider] = (step, grads, peak, extra)
            except Exception as exc:
                add(provider, mode, **failure(exc))
        step = grads = None
        times = {provider: [] for provider in steps}
        failed = set()
        for r in range(max(1, args.rounds)):
            for provider in common.alternating(tuple(steps), r):
                if provider in failed:
                    continue
                step, grads = steps[provider][:2]
                try:
                    times[provider].append(common.bench_ms(step, device, args.warmup_ms, args.rep_ms, grads))
                except Exception as exc:
                    failed.add(provider)
                    add(provider, mode, **failure(exc))
        for provider, (step, grads, peak, extra) in steps.items():
            ts = times[provider]
            if provider in failed or not ts:
                continue
            ms = statistics.median(ts)
            add(provider, mode, status="ok", ms=ms, tflops=common.tflops(case.flops(mode), ms), peak_mem_mib=peak,
                extra_mem_mib=extra, rounds=len(ts), spread=(max(ts) - min(ts)) / ms)
        steps = None
        for t in (q, k, v):
            t.grad = None
        common.free_memory()
    q = k = v = mask = fns = None
    common.free_memory()


def host_overhead(results, device, smoke, budget):
    """Per-call time of a tiny attention (B=1, H=8, N=128, D=64): the op and
    SDPA, each eager and inside a function compiled with default
    torch.compile. At this size the GPU work is a few microseconds, so the
    number is what the host spends dispatching the call."""
    import flashfuse
    import torch.nn.functional as F

    case = AttnCase(B=1, Hq=8, N=128, D=64)
    torch.manual_seed(0)
    q, k, v, _ = common.make_inputs(case, device, requires_grad=False)

    def ff(q, k, v):
        return flashfuse.attention(q, k, v)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    calls = 50 if smoke else 500
    variants = [("flashfuse", "eager", ff), ("sdpa", "eager", sdpa)]
    # Default backend (Inductor) on GPU; the CPU smoke run stays in seconds with aot_eager.
    backend = "aot_eager" if smoke else "inductor"
    variants += [("flashfuse", "torch.compile", torch.compile(ff, backend=backend)),
                 ("sdpa", "torch.compile", torch.compile(sdpa, backend=backend))]
    for provider, how, f in variants:
        row = dict(section="host", feature=f"host overhead ({how})", provider=provider, mode="fwd",
                   **case.columns())
        if budget.exceeded():
            results.add(**row, status="skipped", error="time budget")
            continue
        try:
            for _ in range(3):  # compile and warm up
                f(q, k, v)
            us = common.per_call_us(lambda: f(q, k, v), device, calls)
            results.add(**row, status="ok", us_per_call=us, ms=us / 1e3)
        except Exception as exc:
            results.add(**row, status="error", error=common.short_error(exc))


def report(results, out_dir, no_plot):
    rows = results.rows
    common.tables_header()
    sweep = [r for r in rows if r["section"] == "sweep" and r["mode"] in ("fwd", "fwd+bwd")]
    if sweep:
        t, h = common.pivot(sweep, ["D", "N", "causal", "mode"], "provider", lambda r: common.cell(r, "tflops", 0))
        common.print_table(t, h, "Sweep: TFLOP/s (higher is better)")
    feats = [r for r in rows if r["section"] == "feature" and r["mode"] in ("fwd", "fwd+bwd")]
    if feats:
        t, h = common.pivot(feats, ["feature", "mode"], "provider", lambda r: common.cell(r, "tflops", 0))
        common.print_table(t, h, "Features (B=4, H=16, N=4k, D=128 unless stated): TFLOP/s")
        t, h = common.pivot(feats, ["feature", "mode"], "provider", lambda r: common.cell(r, "peak_mem_mib", 0))
        common.print_table(t, h, "Features: peak memory (MiB)")
    host = [r for r in rows if r["section"] == "host"]
    if host:
        t, h = common.pivot(host, ["feature"], "provider", lambda r: common.cell(r, "us_per_call", 1))
        common.print_table(t, h, "Host overhead: microseconds per call (B=1, H=8, N=128, D=64)")
    if no_plot or not sweep:
        return
    panels = {}
    for mode in ("fwd", "fwd+bwd"):
        for D in sorted({r["D"] for r in sweep}):
            for causal in (False, True):
                series = {}
                for r in sweep:
                    if r["mode"] == mode and r["D"] == D and r["causal"] == causal and r["status"] == "ok":
                        xs, ys = series.setdefault(r["provider"], ([], []))
                        xs.append(r["N"])
                        ys.append(r["tflops"])
                panels[f"{mode}, D={D}, {'causal' if causal else 'non-causal'}"] = series
    ncols = 2 * len({r["D"] for r in sweep})
    path = common.plot_panels(os.path.join(out_dir, "attention_tflops.png"), panels, "sequence length N",
                              "TFLOP/s", ncols=ncols, title=f"attention, {rows[0]['gpu']}")
    if path:
        print(f"plot: {path}")


def main():
    args = parse_args()
    if args.from_csv:
        os.makedirs(args.out, exist_ok=True)
        report(common.Results.load(args.from_csv), args.out, args.no_plot)
        return
    if args.smoke:
        args.warmup_ms, args.rep_ms = min(args.warmup_ms, 2.0), min(args.rep_ms, 5.0)
    common.quiet_warnings()
    common.interrupt_on_sigterm()
    device = common.pick_device(args)
    dtype = common.DTYPES[args.dtype]
    default_providers = SMOKE_PROVIDERS if args.smoke else common.ATTENTION_PROVIDERS
    providers = args.providers.split(",") if args.providers else default_providers
    unknown = set(providers) - set(common.ATTENTION_PROVIDERS)
    if unknown:
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {common.ATTENTION_PROVIDERS}")
    modes = [m for m in args.modes.split(",") if m]
    results = common.Results(args.out, "attention.csv", common.env_info(device))
    budget = common.make_budget(args)
    t0 = time.perf_counter()
    try:
        cases = sweep_cases(args, dtype)
        # D=128 sweep, then features and host overhead, then the other head dims.
        first = [c for c in cases if c.D == cases[0].D]
        rest = [c for c in cases if c.D != cases[0].D]
        for case in first:
            measure_case(results, "sweep", "", case, providers, modes, device, args, budget)
        if not args.no_features:
            for label, case in feature_cases(args.smoke):
                measure_case(results, "feature", label, case, providers, modes, device, args, budget)
        if not args.no_host:
            host_overhead(results, device, args.smoke, budget)
        for case in rest:
            measure_case(results, "sweep", "", case, providers, modes, device, args, budget)
    except KeyboardInterrupt:
        print("interrupted: reporting what was measured")
    finally:
        print(f"\n{len(results.rows)} rows in {time.perf_counter() - t0:.0f} s -> {results.path}")
        report(results, args.out, args.no_plot)


if __name__ == "__main__":
    main()
