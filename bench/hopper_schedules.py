"""The Hopper forward's two grids against the portable kernel and SDPA, forward only.

For each shape (bf16, B*N = 16k tokens, H*D = 2048, D in {64, 128}, N in
{512, 1k, 2k, 4k, 16k}, causal and not) it times, in one
process, ``do_bench`` medians of:

* the Hopper kernel (``flashfuse.kernels.hopper``: a copy warp and two
  consumer warp groups), its launcher called directly, whatever the
  selection rule would choose for the shape, on each grid: ``tiles`` (one
  program per tile) and ``persistent`` (the plan's persistent grid,
  ``hopper.forward_programs``, whether or not the rule takes it);
* ``portable``: the portable Triton forward (FLASHFUSE_HOPPER=0);
* ``sdpa``: PyTorch's default SDPA (cuDNN on Hopper);
* with ``--softmax``, the persistent grid with the default softmax and
  each variant (``hopper.FWD_SOFTMAX``: the row maximum folded, some
  exponentials on the FMA units), all compiled first, then timed in
  alternating rounds (medians of ``--rounds``);
* with ``--consumers``, the forward with each count of consumer warp
  groups (``hopper.FWD_CONSUMERS`` at the head dim: 2 makes 128-row
  tiles, 3 makes 192-row tiles), each on the grid the op's rule takes for
  it, and SDPA ("sdpa rounds"), in alternating rounds likewise;
* with ``--tails``, the three-consumer forward with its last query block
  of each head run as a split tail (``on``, the op's rule) or not
  (``off``: ``hopper.FWD_SPLIT_TAIL`` empty), beside SDPA in alternating
  rounds likewise.

Each Hopper output is checked against the portable one first (relative
error in the CSV; the float64 checks are the GPU tests). The column "the
op takes" is the grid the op's rule takes (``hopper.forward_persistent``)
or the portable kernel below the crossover (``hopper.MIN_KEYS``, set from
these rows); "persistent grid" is the plan's program count.
Writes bench/results/hopper_schedules.csv.

    python bench/hopper_schedules.py
    python bench/hopper_schedules.py --d 128 --n 4096 --causal yes
    python bench/hopper_schedules.py --d 64 --n 4096,16384 --softmax "3,0 0,1"
    python bench/hopper_schedules.py --d 64 --n 1024,4096,16384 --consumers "2 3"
    python bench/hopper_schedules.py --d 64 --n 4096,16384 --tails "off on"
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashfuse.kernels import forward, hopper  # noqa: E402
from flashfuse.kernels.problem import AttentionProblem  # noqa: E402


PROVIDERS = ["tiles", "persistent", "portable", "sdpa"]


def _hopper_runs(p, q, k, v):
    """(name, run) of the Hopper forward on each grid."""
    return [(name, (lambda pers=pers: hopper.hopper_forward(p, q, k, v, pers)))
            for name, pers in (("tiles", False), ("persistent", True))]


def _variant_runs(p, q, k, v, softmax_variants):
    """(name, run) of the Hopper forward on the persistent grid with the
    default softmax ("softmax default") and each variant (``hopper.FWD_SOFTMAX``
    at p's head dim set for the call: "softmax F,P" folds the row maximum F
    times and takes P of each eight exponentials on the FMA units)."""
    def run(folds=None, poly=None):
        saved = hopper.FWD_SOFTMAX
        if folds is not None:
            hopper.FWD_SOFTMAX = common.fwd_softmax_variant(p.D, folds, poly)
        try:
            return hopper.hopper_forward(p, q, k, v, True)
        finally:
            hopper.FWD_SOFTMAX = saved
    return [("softmax default", run)] + [(_variant_name(f, pl), lambda f=f, pl=pl: run(f, pl))
                                         for f, pl in softmax_variants]


def _consumer_runs(p, q, k, v, counts):
    """(name, run) of the forward with each count of consumer warp groups
    ("consumers N", ``hopper.FWD_CONSUMERS`` at p's head dim set for the
    call at every length, the grid the op's rule takes)."""
    def run(n):
        saved = hopper.FWD_CONSUMERS, hopper.FWD_THREE_CONSUMERS_MIN
        hopper.FWD_CONSUMERS, hopper.FWD_THREE_CONSUMERS_MIN = {**saved[0], p.D: n}, 0
        try:
            return hopper.hopper_forward(p, q, k, v)
        finally:
            hopper.FWD_CONSUMERS, hopper.FWD_THREE_CONSUMERS_MIN = saved
    return [(f"consumers {n}", lambda n=n: run(n)) for n in counts]


TAIL_MODES = ("off", "on")


def _tail_runs(p, q, k, v, modes):
    """(name, run) of the forward with split tails ("tails on", the op's
    rule) or without ("tails off": ``hopper.FWD_SPLIT_TAIL`` empty), each
    on the grid the op's rule takes."""
    def run(mode):
        with mock.patch.object(hopper, "FWD_SPLIT_TAIL", ()) if mode == "off" else contextlib.nullcontext():
            return hopper.hopper_forward(p, q, k, v)
    return [(f"tails {m}", lambda m=m: run(m)) for m in modes]


def _errors_against(runs, want) -> dict:
    """Each run's output (its first result) against ``want``: relative
    error in the Frobenius norm, by run name."""
    errors = {}
    for name, run in runs:
        out = run()[0].float()
        errors[name] = ((out - want).norm() / want.norm()).item()
    return errors


def _variant_name(folds, poly):
    return f"softmax {folds},{poly}"


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=240)
    p.add_argument("--d", default="128,64", help="comma-separated head dims")
    p.add_argument("--n", default="512,1024,2048,4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--softmax", default="",
                   help="softmax variants timed on the persistent grid beside the default, in alternating "
                        "rounds: space-separated FOLDS,POLY pairs (hopper.FWD_SOFTMAX), e.g. '3,0 0,1'")
    p.add_argument("--consumers", default="",
                   help="consumer warp group counts timed beside SDPA in alternating rounds: space-separated "
                        "(hopper.FWD_CONSUMERS), e.g. '2 3'")
    p.add_argument("--tails", default="",
                   help="split-tail modes of the three-consumer forward timed beside SDPA in alternating rounds: "
                        f"space-separated, of {' '.join(TAIL_MODES)} (hopper.FWD_SPLIT_TAIL), e.g. 'off on'")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds of the --softmax, --consumers and --tails timings (medians reported)")
    return p.parse_args()


def main():
    args = parse_args()
    device, budget = common.start(args)
    if device.type != "cuda":
        sys.exit("the Hopper kernels need a CUDA GPU (compute capability 9.x)")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    variants = [common.softmax_pair(item) for item in args.softmax.split()]
    counts = [int(c) for c in args.consumers.split()]
    tails = args.tails.split()
    if any(m not in TAIL_MODES for m in tails):
        sys.exit(f"--tails takes {', '.join(TAIL_MODES)}")
    providers = PROVIDERS + (["softmax default"] + [_variant_name(*v) for v in variants] if variants else [])
    providers += [f"consumers {n}" for n in counts] + [f"tails {m}" for m in tails]
    providers += ["sdpa rounds"] if counts or tails else []
    rounds = [f"consumers {n}" for n in counts] + [f"tails {m}" for m in tails]
    res = common.Results(args.out, "hopper_schedules.csv", common.env_info(device))
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    gen = torch.Generator(device=device).manual_seed(0)
    table = []
    ratios = []
    for D in (int(x) for x in args.d.split(",")):
        for N in (int(x) for x in args.n.split(",")):
            for causal in causals:
                B, H = max(1, args.tokens // N), args.hidden // D
                case = dict(D=D, N=N, causal=causal, B=B, H=H, dtype=args.dtype)
                if budget.exceeded():
                    res.add(**case, provider="all", status="time budget")
                    continue
                q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
                band = dict(window_left=None, window_right=0 if causal else None, bottom_right=False)
                p = AttentionProblem.build(q, k, v, None, dropout_p=0.0, scale=D ** -0.5, **band)
                flops = common.attention_flops(B, H, N, N, D, D, causal=causal)
                os.environ["FLASHFUSE_HOPPER"] = "0"
                try:
                    portable_fn = lambda: forward.attention_forward(  # noqa: E731
                        q, k, v, None, None, dropout_p=0.0, scale=D ** -0.5, **band)
                    want = portable_fn()[0].float()
                    times = {"portable": common.bench_ms(portable_fn, device)}
                finally:
                    del os.environ["FLASHFUSE_HOPPER"]
                times["sdpa"] = common.bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                device)
                errors = {}
                for name, run in _hopper_runs(p, q, k, v):
                    try:
                        out = run()[0].float()
                        errors[name] = ((out - want).norm() / want.norm()).item()
                        times[name] = common.bench_ms(run, device)
                    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
                        res.add(**case, provider=name, status="error", error=common.short_error(exc))
                if variants:
                    runs = _variant_runs(p, q, k, v, variants)
                    errors.update(_errors_against(runs, want))
                    times.update(common.timed_in_rounds(runs, device, args.rounds))
                if counts or tails:
                    runs = _consumer_runs(p, q, k, v, counts) + _tail_runs(p, q, k, v, tails)
                    errors.update(_errors_against(runs, want))
                    sdpa = ("sdpa rounds", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    times.update(common.timed_in_rounds(runs + [sdpa], device, args.rounds))
                chosen = "persistent" if hopper.forward_persistent(p) else "tiles"
                programs = hopper.forward_programs(p, True)
                for prov, ms in times.items():
                    res.add(**case, provider=prov, status="ok", ms=ms, tflops=common.tflops(flops, ms),
                            rel_err_vs_portable=errors.get(prov, ""), persistent_programs=programs,
                            op_grid=chosen)
                why = hopper.hopper_refusal(p, q, k, v, dropout_p=0.0, softcap=None, sinks=None)
                row = [D, N, causal, programs]
                for prov in providers:
                    row.append(common.fmt(common.tflops(flops, times[prov]), 0) if prov in times else "-")
                row += [common.fmt(times["sdpa"] / times[chosen], 2) if chosen in times else "-",
                        f"{max(errors.values()):.1e}" if errors else "-", chosen if why is None else "portable"]
                table.append(row)
                if rounds:
                    ratios.append([D, N, causal, hopper.forward_split_tail(p)]
                                  + [common.fmt(times["sdpa rounds"] / times[name], 3) for name in rounds])
                del q, k, v
                common.free_memory()
    common.tables_header()
    common.print_table(table, ["D", "N", "causal", "persistent grid", *providers, "op's grid / sdpa",
                               "max rel err vs portable", "the op takes"], title=f"Forward TFLOP/s, {args.dtype}")
    if ratios:
        common.print_table(ratios, ["D", "N", "causal", "rule splits tails", *(f"{name} / sdpa" for name in rounds)],
                           title=f"Speed against SDPA in the same alternating rounds (medians of {args.rounds})")
    print(f"\nCSV: {res.path}")


if __name__ == "__main__":
    main()
