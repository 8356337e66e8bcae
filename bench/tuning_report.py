"""Which tile configs the autotuner picks, and what the fixed configs
(``FLASHFUSE_AUTOTUNE=0``) cost against them.

For each case, runs the op forward and backward once with autotuning on,
prints the config each kernel chose (forward, dK/dV, dQ), then times forward
and forward+backward with the tuned and with the fixed configs (do_bench
medians). This is how the best-first lists in ``flashfuse/kernels`` are
checked against a GPU.

    python bench/tuning_report.py                 # default cases, bf16
    python bench/tuning_report.py --cases gpt2,d128-4k-causal
"""

from __future__ import annotations

import os

import common
import torch

# name: (B, H, N, M, D, causal, bottom_right, dropout_p)
CASES = {
    "d128-4k": (4, 16, 4096, 4096, 128, False, False, 0.0),
    "d128-4k-causal": (4, 16, 4096, 4096, 128, True, False, 0.0),
    "d64-4k-causal": (4, 32, 4096, 4096, 64, True, False, 0.0),
    "d128-1k-causal": (16, 16, 1024, 1024, 128, True, False, 0.0),
    "d128-1k-4k-bottom-right": (4, 16, 1024, 4096, 128, True, True, 0.0),
    "gpt2": (8, 12, 1024, 1024, 64, True, False, 0.1),
}


# --smoke: tiny shapes on the CPU (no autotuning happens there; checks the script runs).
SMOKE_CASES = {
    "tiny": (1, 2, 40, 40, 32, False, False, 0.0),
    "tiny-causal-dropout": (1, 2, 33, 65, 32, True, True, 0.1),
}


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--cases", default=None, help=f"comma-separated subset of {list(CASES)} (default: all)")
    p.add_argument("--dtype", default="bf16", choices=list(common.DTYPES))
    return p.parse_args()


def describe(cfg) -> str:
    kw = cfg.kwargs
    return f"({kw['BLOCK_M']},{kw['BLOCK_N']},{cfg.num_warps}w,{cfg.num_stages}s)"


def main():
    args = parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    dtype = common.DTYPES[args.dtype]
    import flashfuse
    from flashfuse.kernels import backward as kb
    from flashfuse.kernels import forward as kf

    launchers = {"fwd": kf._attn_fwd_launcher, "dkdv": kb._LAUNCHERS["dkdv"], "dq": kb._LAUNCHERS["dq"]}
    cases = SMOKE_CASES if args.smoke else CASES
    names = args.cases.split(",") if args.cases else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(cases)}")
    rows = []
    for name in names:
        B, H, N, M, D, causal, br, p = cases[name]
        q = torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(B, H, M, D, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(B, H, M, D, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(B, H, N, D, device=device, dtype=dtype)

        def fwd():
            return flashfuse.attention(q, k, v, dropout_p=p, is_causal=causal,
                                       alignment="bottom_right" if br else "top_left")

        def fwd_bwd():
            fwd().backward(g)

        times = {}
        for mode in ("1", "0"):
            os.environ["FLASHFUSE_AUTOTUNE"] = mode
            before = {k_: set(t.chosen) for k_, t in launchers.items()}
            fwd_bwd()  # tunes (mode 1) or compiles (mode 0)
            common.sync(device)
            if mode == "1":
                picks = {}
                for k_, t in launchers.items():
                    new = [key for key in t.chosen if key[1] and key not in before[k_]]
                    new = new or [key for key in t.chosen if key[1]][-1:]
                    picks[k_] = describe(t.chosen[new[-1]]) if new else "-"  # not tuned (CPU)
            times[mode] = (common.bench_ms(fwd, device), common.bench_ms(fwd_bwd, device, grad_to_none=[q, k, v]))
        fl = common.attention_flops(B, H, N, M, D, D, causal=causal, bottom_right=br)
        rows.append([name, picks["fwd"], picks["dkdv"], picks["dq"],
                     f"{times['1'][0]:.3f}", f"{times['0'][0]:.3f}",
                     f"{times['1'][1]:.3f}", f"{times['0'][1]:.3f}",
                     f"{common.tflops(fl, times['1'][0]):.0f}", f"{common.tflops(3.5 * fl, times['1'][1]):.0f}",
                     f"{common.tflops(3.5 * fl, times['0'][1]):.0f}"])
        print(rows[-1], flush=True)
    common.print_table(rows, ["case", "fwd pick", "dkdv pick", "dq pick", "fwd ms tuned", "fwd ms fixed",
                              "f+b ms tuned", "f+b ms fixed", "fwd TF tuned", "f+b TF tuned", "f+b TF fixed"],
                       f"autotuner picks and fixed-config cost, {args.dtype}")


if __name__ == "__main__":
    main()
