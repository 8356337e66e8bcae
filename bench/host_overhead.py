"""Host time per attention call: where the microseconds go when the GPU work
is small.

Each variant is called in a loop with one synchronisation at the end, so the
number is the throughput of a host-bound caller (microseconds per call):

* ``impl f+b``: the op's forward and backward implementations called
  directly (``flashfuse.ops._attention_forward`` / ``_attention_backward``:
  the Triton launchers on CUDA), no dispatch, no autograd;
* ``op fwd``: ``flashfuse.attention`` under ``no_grad``;
* ``op f+b``: ``flashfuse.attention`` forward and backward through autograd;
* ``compiled f+b``: the same inside ``torch.compile``;
* the last three for ``F.scaled_dot_product_attention`` as the baseline.

Shapes: ``small`` (B=1, H=8, N=128, D=64) and ``gpt2`` (B=8, H=12, N=1024,
D=64, dropout 0.1), causal, bf16; with fixed kernel configs
(``FLASHFUSE_AUTOTUNE=0``) and with autotuning.

    python bench/host_overhead.py
    python bench/host_overhead.py --smoke --out /tmp/x     # tiny, on the CPU
"""

from __future__ import annotations

import os

import common
import torch
import torch.nn.functional as F

SHAPES = {"small": (1, 8, 128, 64, 0.0), "gpt2": (8, 12, 1024, 64, 0.1)}


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--calls", type=int, default=None, help="calls per measurement (default 200; smoke 5)")
    return p.parse_args()


def variants(B, H, N, D, p, device, dtype, compiler):
    import flashfuse
    from flashfuse import ops

    torch.manual_seed(0)
    q = torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    g = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    seed = torch.randint(2**62, (), dtype=torch.int64, device=device) if p > 0 else None
    scale = D ** -0.5

    def impl():
        out, lse = ops._attention_forward(qd, kd, vd, None, seed, p, scale, None, 0, False)
        ops._attention_backward(g, qd, kd, vd, None, seed, out, lse, p, scale, None, 0, False, False)

    def ff(a, b, c):
        return flashfuse.attention(a, b, c, dropout_p=p, is_causal=True)

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, dropout_p=p, is_causal=True)

    def fwd(f):
        def run():
            with torch.no_grad():
                f(qd, kd, vd)
        return run

    def fwd_bwd(f):
        def run():
            f(q, k, v).backward(g)
        return run

    cff, csdpa = torch.compile(ff, backend=compiler), torch.compile(sdpa, backend=compiler)
    flashfuse_variants = [("impl f+b", impl), ("op fwd", fwd(ff)), ("op f+b", fwd_bwd(ff)),
                          ("compiled f+b", fwd_bwd(cff))]
    sdpa_variants = [("op fwd", fwd(sdpa)), ("op f+b", fwd_bwd(sdpa)), ("compiled f+b", fwd_bwd(csdpa))]
    return flashfuse_variants, sdpa_variants


def main():
    args = parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    calls = args.calls or (5 if args.smoke else 200)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    compiler = "aot_eager" if args.smoke else "inductor"
    shapes = {"tiny": (1, 2, 16, 16, 0.0), "tiny-dropout": (1, 2, 16, 16, 0.1)} if args.smoke else SHAPES
    results = common.Results(args.out, "host_overhead.csv", common.env_info(device))
    saved = os.environ.get("FLASHFUSE_AUTOTUNE")
    try:
        for shape, (B, H, N, D, p) in shapes.items():
            ffv, sdv = variants(B, H, N, D, p, device, dtype, compiler)
            runs = [(f"flashfuse (autotune={mode})", mode, ffv) for mode in ("0", "1")] + [("sdpa", None, sdv)]
            for provider, mode, fns in runs:
                if mode is not None:
                    os.environ["FLASHFUSE_AUTOTUNE"] = mode
                for what, fn in fns:
                    for _ in range(3 if args.smoke else 10):  # compile, tune, warm up
                        fn()
                    us = common.per_call_us(fn, device, calls)
                    results.add(shape=shape, B=B, H=H, N=N, D=D, dropout=p, provider=provider, call=what,
                                status="ok", us_per_call=us)
                    print(f"{shape:>12} {provider:>22} {what:>13}: {us:9.1f} us", flush=True)
    finally:
        if saved is None:
            os.environ.pop("FLASHFUSE_AUTOTUNE", None)
        else:
            os.environ["FLASHFUSE_AUTOTUNE"] = saved
    common.tables_header()
    t, h = common.pivot(results.rows, ["shape", "call"], "provider", lambda r: common.cell(r, "us_per_call", 0))
    common.print_table(t, h, f"host time per call (us), causal, {common.DTYPE_NAMES[dtype]}, {calls} calls per loop")
    print(f"-> {results.path}")


if __name__ == "__main__":
    main()
