"""Backward schedules side by side: flashfuse's two-pass backward (dK/dV,
then dQ) against the one-pass one (dQ by float32 atomics inside the dK/dV
kernel), with SDPA's default backend as the reference, at a few shapes.

For each shape it prints forward, backward and forward+backward times
(microseconds, median of ``triton.testing.do_bench`` through
``common.bench_ms``) and TFLOP/s (``common.attention_flops``), the
backward under ``FLASHFUSE_BWD=two_pass`` and ``one_pass``. Times include
host overhead when it exceeds the GPU work (the GPT-2-sized shapes).

    FLASHFUSE_AUTOTUNE=0 python bench/backward_schedules.py
    python bench/backward_schedules.py --cases "gpt2 drop,d128 4k causal"
    python bench/backward_schedules.py --smoke      # tiny, on the CPU
"""

from __future__ import annotations

import os

import common
import torch
import torch.nn.functional as F

# name: (B, H, N, D, causal, dropout_p)
CASES = {n: common.KERNEL_CASES[n] for n in ("gpt2 drop", "gpt2 nodrop", "d128 4k causal", "d128 4k", "d128 4k drop")}
SMOKE_CASES = {"tiny drop": (1, 2, 64, 32, True, 0.1)}


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--cases", default=None, help=f"comma-separated subset of {list(CASES)}")
    return p.parse_args()


def run_case(name, B, H, N, D, causal, p, device):
    import flashfuse

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    g = torch.randn_like(q)

    def time_ms(fn):
        return common.bench_ms(fn, device, warmup_ms=10, rep_ms=60)

    def timeit(fn, mode):
        if mode == "fwd":
            with torch.no_grad():
                return time_ms(lambda: fn(q, k, v))
        if mode == "bwd":
            out = fn(q, k, v)
            return time_ms(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
        return time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), g))

    def ff(a, b, c):
        return flashfuse.attention(a, b, c, dropout_p=p, is_causal=causal)

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, dropout_p=p, is_causal=causal)

    res = {}
    before = os.environ.get("FLASHFUSE_BWD")
    try:
        for mode in ("fwd", "bwd", "f+b"):
            if mode == "fwd":
                res[f"ff {mode}"] = timeit(ff, mode)
            else:
                for schedule in ("two_pass", "one_pass"):
                    os.environ["FLASHFUSE_BWD"] = schedule
                    res[f"ff-{schedule} {mode}"] = timeit(ff, mode)
            res[f"sdpa {mode}"] = timeit(sdpa, mode)
    finally:
        if before is None:
            os.environ.pop("FLASHFUSE_BWD", None)
        else:
            os.environ["FLASHFUSE_BWD"] = before
    def tflops(key, ms):
        mode = {"f+b": "fwd+bwd"}.get(key.split()[-1], key.split()[-1])
        return common.tflops(common.attention_flops(B, H, N, N, D, D, causal=causal, mode=mode), ms)

    cells = [f"{key}={ms * 1e3:.0f}us/{tflops(key, ms):.0f}T" for key, ms in res.items()]
    print(f"{name}: " + "  ".join(cells), flush=True)


def main():
    args = parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    cases = SMOKE_CASES if args.smoke else CASES
    names = args.cases.split(",") if args.cases else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(cases)}")
    print(common.env_info(device), flush=True)
    for name in names:
        run_case(name, *cases[name], device)


if __name__ == "__main__":
    main()
