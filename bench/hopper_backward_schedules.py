"""The Hopper backward's schedules, checked and timed side by side.

* ``separate``: two deterministic kernels, dK/dV per key tile then dQ per
  query tile (seven products per tile pair);
* ``atomic``: one kernel, dQ from the dK/dV kernel's dS added into a float32
  buffer by relaxed atomics, then a convert kernel (five products);
* ``tma1`` / ``tma2``: the same with the copy engine's reduce-add from one or
  two float32 staging tiles per consumer;
* ``persistent``: the copy engine's reduce with the call's query side
  (``hopper.fused_tile``), on the persistent grid the launcher's plan
  sizes (the other fused schedules run one program per key tile);
* ``q64`` / ``q128``: ``persistent`` with the D = 64 query side set to
  64-row q/dO blocks (three slots, two staging tiles) or 128-row ones (two
  slots, one staging tile); D = 64 only.

Each schedule is first checked against float64 at odd sizes and bands
(NaN-poisoned outputs), in worker processes so that the Gluon compiles run
in parallel; then the whole Hopper backward of each schedule (given the
forward's lse and the row delta) is timed at bf16, B·N = 16k, H·D = 2048,
with SDPA's backward (its default, cuDNN on the H200) in the same process,
in ``--rounds`` alternating rounds (medians).
CUDA with Triton 3.6.

    python bench/hopper_backward_schedules.py         # CSV in bench/results/
    python bench/hopper_backward_schedules.py --schedules q64,q128 --d 64 --rounds 5
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from unittest.mock import patch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from hopper_backward_configs import (  # noqa: E402
    _setup, _timed_inputs, float64_grads, odd_inputs, rel_error, reported,
)

SCHEDULES = ("separate", "atomic", "tma1", "tma2", "persistent")
# The D = 64 query sides the q64 / q128 schedules set (hopper.FusedTile).
TILE_SCHEDULES = {"q64": (64, 3, 2), "q128": (128, 2, 1)}
# Odd sizes and bands the checks run: (B, Hq, Hkv, N, M), band.
CHECKS = [((1, 8, 2, 129, 4097), dict(window_right=0, bottom_right=True)),
          ((2, 2, 1, 2048, 640), dict(window_left=100, window_right=0)),
          ((1, 3, 1, 77, 200), {}),
          ((2, 4, 4, 1000, 1000), dict(window_right=0))]
TIMED = [(D, N, causal) for D in (128, 64) for N in (1024, 2048, 4096, 16384) for causal in (False, True)]


def run_schedule(schedule, p, do, q, k, v, lse, delta):
    """``(dq, dk, dv)`` of one schedule."""
    from flashfuse.kernels import hopper

    if schedule == "separate":
        return hopper.hopper_backward_separate(p, do, q, k, v, lse, delta)
    if schedule == "atomic":
        return hopper.hopper_backward_fused(p, do, q, k, v, lse, delta, how="atomic", persistent=False)
    if schedule == "persistent":
        return hopper.hopper_backward_fused(p, do, q, k, v, lse, delta, how="tma", persistent=True)
    if schedule in TILE_SCHEDULES:  # that query side, whatever the rows' length
        tile = hopper.FusedTile(*TILE_SCHEDULES[schedule])
    else:  # tma1, tma2: the call's own query side with that many staging tiles
        tile = hopper.fused_tile(p)._replace(dq_buffers=int(schedule[-1]))
    # Both tables at p's head dim, so that fused_tile answers ``tile`` for any rows.
    with patch.dict(hopper.BWD_FUSED_TILES, {p.D: tile}), patch.dict(hopper.BWD_LONG_ROW_TILES, {p.D: tile}):
        return hopper.hopper_backward_fused(p, do, q, k, v, lse, delta, how="tma",
                                            persistent=schedule in TILE_SCHEDULES)


def check(job):
    """Worker: ``_check`` of one (schedule, D), failures reported."""
    return reported(_check, job)


def _check(job):
    """One (schedule, D) at the odd sizes against float64: the largest
    relative error over dq, dk, dv (inf for NaN). Then one run at each timed
    shape, to compile those too."""
    schedule, D = job
    worst = 0.0
    for i, ((B, Hq, Hkv, N, M), kw) in enumerate(CHECKS):
        q, k, v, do = odd_inputs(B, Hq, Hkv, N, M, D, seed=100 * i + D)
        p, lse, delta = _setup(q, k, v, do, kw)
        # Fill free memory with NaN first: the caching allocator is likely,
        # not certain, to hand it out next, so an element the kernels do not
        # write would show (the GPU tests poison every allocation).
        torch.full((4 * (q.numel() + k.numel() + v.numel()),), float("nan"), device="cuda")
        got = run_schedule(schedule, p, do, q, k, v, lse, delta)
        torch.cuda.synchronize()
        for name, t, e in zip("qkv", got, float64_grads(q, k, v, do, kw)):
            err = rel_error(t, e)
            print(f"  {schedule:8s} D={D:3d} case {i} d{name}: {err:.2e}", flush=True)
            worst = max(worst, err)
    for D_, N, causal in TIMED:
        if D_ == D:
            q, k, v, do, kw = _timed_inputs(D, N, causal, "cuda")
            p, lse, delta = _setup(q, k, v, do, kw)
            run_schedule(schedule, p, do, q, k, v, lse, delta)
    torch.cuda.synchronize()
    return job, worst


def _sdpa_backward(q, k, v, do, causal):
    import torch.nn.functional as F

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=0.125)
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def main():
    ap = common.base_parser(__doc__.splitlines()[0], budget_s=200)
    ap.add_argument("--workers", type=int, default=8, help="processes that check and compile the schedules")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--d", default="128,64", help="comma-separated head dims")
    ap.add_argument("--n", default="1024,4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternating rounds, each timing every schedule and SDPA once (medians reported)")
    args = ap.parse_args()
    if args.smoke:
        sys.exit("the Hopper kernels need a Hopper GPU; there is no smoke run")
    device, budget = common.start(args)
    schedules = args.schedules.split(",")
    dims = [int(d) for d in args.d.split(",")]
    timed = [(D, N, causal) for D, N, causal in TIMED if D in dims and N in {int(n) for n in args.n.split(",")}]
    env = common.env_info(device)
    results = common.Results(args.out, "hopper_backward_schedules.csv", env)
    jobs = [(s, D) for s in schedules for D in dims if s not in TILE_SCHEDULES or D == 64]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = dict(pool.map(check, jobs))
    print("checked:", {f"{s} D={D}": f"{e:.2e}" for (s, D), e in errors.items()}, flush=True)
    for D, N, causal in timed:
        if budget.exceeded():
            print("budget exceeded: the remaining shapes were not timed", flush=True)
            break
        q, k, v, do, kw = _timed_inputs(D, N, causal, device)
        p, lse, delta = _setup(q, k, v, do, kw)
        flops = common.attention_flops(q.shape[0], q.shape[1], N, N, D, D, causal=causal, mode="bwd")
        row = dict(D=D, N=N, causal=causal)
        runs = [(s, lambda s=s: run_schedule(s, p, do, q, k, v, lse, delta)) for s in schedules
                if errors.get((s, D), float("inf")) != float("inf")]
        times = common.timed_in_rounds(runs + [("sdpa", _sdpa_backward(q, k, v, do, causal))], device,
                                       args.rounds)
        for s, ms in times.items():
            results.add(**row, schedule=s, ms=ms, tflops=common.tflops(flops, ms),
                        rel_err=errors.get((s, D), float("nan")), rounds=args.rounds)
        del q, k, v, do, lse, delta
    table = []
    for D, N, causal in timed:
        rows = {r["schedule"]: r for r in results.rows if (r["D"], r["N"], r["causal"]) == (D, N, causal)}
        if "sdpa" not in rows:
            continue
        sdpa = rows["sdpa"]["ms"]
        table.append([D, N, causal, f"{sdpa:.3f}"] + [
            f"{rows[s]['ms']:.3f} ({sdpa / rows[s]['ms']:.2f}x)" if s in rows else "-" for s in schedules])
    common.print_table(table, ["D", "N", "causal", "sdpa ms"] + [f"{s} ms (vs sdpa)" for s in schedules],
                       title=f"Hopper backward schedules, bf16, B*N = 16k, H*D = 2048 ({env['gpu']}, torch "
                             f"{env['torch_version']}, Triton {env['triton_version']})")


if __name__ == "__main__":
    main()
