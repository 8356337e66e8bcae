"""Tile and slot options of the Hopper backward kernels: each option checked
against float64 at odd sizes, then each kernel timed alone per option.

The dK/dV kernel's q/dO slots (``hopper.BWD_STAGES``) and the dQ kernel's
key block and K/V slots (``BWD_DQ_BLOCK_N``, ``BWD_DQ_STAGES``) are fixed
per head dim; this sweep is where they come from. Options whose shared
memory exceeds the 227 KiB of an sm_90 block are left out. The checks run
in worker processes first (each option compiles per shape: a Gluon kernel
takes seconds, so they compile in parallel and fill the kernel cache the
timing then reads). bf16, B·N = 16k, H·D = 2048. CUDA with Triton 3.6.

    python bench/hopper_backward_configs.py          # CSV in bench/results/
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402

# (kernel, D) -> options: the dK/dV kernel's slots; the dQ kernel's (key block, slots).
OPTIONS = {
    ("dkdv", 128): [2, 3],
    ("dkdv", 64): [2, 3, 4],
    ("dq", 128): [(64, 2), (64, 3), (128, 2)],
    ("dq", 64): [(64, 2), (64, 3), (128, 2), (128, 3)],
}
# Odd sizes and bands the checks run: (B, Hq, Hkv, N, M), band.
CHECKS = [((1, 8, 2, 129, 4097), dict(window_right=0, bottom_right=True)),
          ((2, 2, 1, 2048, 640), dict(window_left=100, window_right=0)),
          ((1, 3, 1, 77, 200), {})]
TIMED_N = (4096, 16384)


def _band(kw):
    return dict(dropout_p=0.0, scale=0.125, window_left=kw.get("window_left"), window_right=kw.get("window_right"),
                bottom_right=kw.get("bottom_right", False))


def _setup(q, k, v, do, kw):
    from flashfuse.kernels import attention_forward, backward
    from flashfuse.kernels.problem import AttentionProblem

    band = _band(kw)
    out, lse = attention_forward(q, k, v, None, None, **band)
    p = AttentionProblem.build(q, k, v, None, **band, backward=True)
    delta, _ = backward.row_delta(p, out, do, lse)
    return p, lse.contiguous(), delta.contiguous()


def odd_inputs(B, Hq, Hkv, N, M, D, seed):
    """q, k, v and dO in bf16 on the GPU, fresh normal draws."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, N, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, Hkv, M, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    do = torch.randn(B, Hq, N, D, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, do


def float64_grads(q, k, v, do, kw):
    """dq, dk, dv of the float64 reference (scale 0.125, band ``kw``)."""
    from flashfuse import reference as ref

    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref.reference_attention(*leaves, scale=0.125, **kw).backward(do.cpu().double())
    return tuple(leaf.grad for leaf in leaves)


def rel_error(got, want) -> float:
    """Relative Frobenius error, inf for any NaN in ``got``."""
    got = got.cpu().double()
    return float("inf") if got.isnan().any() else ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def launcher(kernel, option, p, do, q, k, v, lse, delta):
    """A callable that runs one kernel with one option, and its outputs
    (dk, dv for "dkdv"; dq for "dq"), poisoned with NaN before the first run."""
    from flashfuse.kernels import hopper, hopper_gluon
    from flashfuse.kernels.launch import cdiv, ensure_scratch_allocator

    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    a1, m1, a2, m2 = hopper.backward_kernel_args(p, do, q, k, v, lse, delta, dq, dk, dv)
    ensure_scratch_allocator()
    if kernel == "dkdv":
        meta = dict(m1, STAGES=option)
        grid = (cdiv(p.M, hopper.BWD_BLOCK_N), p.Hkv, p.B)
        return (lambda: hopper_gluon._hopper_attn_bwd_dkdv[grid](*a1, **meta)), (dk, dv)
    meta = dict(m2, BLOCK_N=option[0], STAGES=option[1])
    grid = (cdiv(p.N, hopper.BWD_DQ_BLOCK_M), p.Hq, p.B)
    return (lambda: hopper_gluon._hopper_attn_bwd_dq[grid](*a2, **meta)), (dq,)


def _timed_inputs(D, N, causal, device):
    B, H = 16384 // N, 2048 // D
    g = torch.Generator(device=device).manual_seed(N + D)
    q, k, v, do = (torch.randn(B, H, N, D, device=device, generator=g, dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, do, (dict(window_right=0) if causal else {})


def reported(check_one, job):
    """``check_one(job)`` (``(job, error)``) in a worker, where a job that
    fails to compile or launch reports inf and the error instead of stopping
    the sweep."""
    try:
        return check_one(job)
    except Exception as e:  # noqa: BLE001 - reported per job
        print(f"{job}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        return job, float("inf")


def check(job):
    """Worker: ``_check`` of one (kernel, D, option), failures reported."""
    return reported(_check, job)


def _check(job):
    """One (kernel, D, option) on the odd sizes against float64 (the largest
    relative error over its outputs, inf for a NaN), then one run at each
    timed band to compile those too."""
    kernel, D, option = job
    worst = 0.0
    for i, ((B, Hq, Hkv, N, M), kw) in enumerate(CHECKS):
        q, k, v, do = odd_inputs(B, Hq, Hkv, N, M, D, seed=i + D)
        p, lse, delta = _setup(q, k, v, do, kw)
        run, outs = launcher(kernel, option, p, do, q, k, v, lse, delta)
        run()
        torch.cuda.synchronize()
        dq, dk, dv = float64_grads(q, k, v, do, kw)
        for got, e in zip(outs, (dk, dv) if kernel == "dkdv" else (dq,)):
            worst = max(worst, rel_error(got, e))
    for causal in (False, True):
        q, k, v, do, kw = _timed_inputs(D, TIMED_N[0], causal, "cuda")
        p, lse, delta = _setup(q, k, v, do, kw)
        launcher(kernel, option, p, do, q, k, v, lse, delta)[0]()
    torch.cuda.synchronize()
    return job, worst


def main():
    ap = common.base_parser(__doc__.splitlines()[0], budget_s=150)
    ap.add_argument("--workers", type=int, default=8, help="processes that check and compile the options")
    args = ap.parse_args()
    if args.smoke:
        sys.exit("the Hopper kernels need a Hopper GPU; there is no smoke run")
    device, budget = common.start(args)
    from flashfuse.kernels import hopper

    env = common.env_info(device)
    results = common.Results(args.out, "hopper_backward_configs.csv", env)
    defaults = {("dkdv", D): hopper.BWD_STAGES[D] for D in (64, 128)}
    defaults.update({("dq", D): (hopper.BWD_DQ_BLOCK_N[D], hopper.BWD_DQ_STAGES) for D in (64, 128)})
    jobs = [(kern, D, opt) for (kern, D), opts in OPTIONS.items() for opt in opts]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = dict(pool.map(check, jobs))
    print(f"checked {len(jobs)} options", flush=True)
    for (kern, D), opts in OPTIONS.items():
        for N in TIMED_N:
            for causal in (False, True):
                if budget.exceeded():
                    break
                q, k, v, do, kw = _timed_inputs(D, N, causal, device)
                p, lse, delta = _setup(q, k, v, do, kw)
                for opt in opts:
                    if errors[(kern, D, opt)] == float("inf") and opt != defaults[(kern, D)]:
                        continue
                    run = launcher(kern, opt, p, do, q, k, v, lse, delta)[0]
                    ms = common.bench_ms(run, device)
                    results.add(kernel=kern, D=D, N=N, causal=causal, option=str(opt),
                                default=opt == defaults[(kern, D)], ms=ms, rel_err=errors[(kern, D, opt)])
                del q, k, v, do, lse, delta
    table = []
    for r in results.rows:
        base = next(x["ms"] for x in results.rows if x["default"] and
                    (x["kernel"], x["D"], x["N"], x["causal"]) == (r["kernel"], r["D"], r["N"], r["causal"]))
        table.append([r["kernel"], r["D"], r["N"], r["causal"], r["option"], "yes" if r["default"] else "",
                      f"{r['ms']:.3f}", f"{base / r['ms']:.3f}", f"{r['rel_err']:.1e}"])
    common.print_table(table, ["kernel", "D", "N", "causal", "option", "default", "ms", "speed vs default",
                               "rel. error"],
                       title=f"Hopper backward options ({env['gpu']}, torch {env['torch_version']}, "
                             f"Triton {env['triton_version']})")


if __name__ == "__main__":
    main()
