"""Where the Hopper backward kernels overtake the portable backward: the
backward alone (delta, dK/dV, dQ) through the kernels' dispatch, once with
the Hopper kernels called directly and once on the portable kernels, over
sequence lengths short enough that the Hopper kernels' fixed cost per tile
shows. ``hopper.BWD_MIN_KEYS`` is placed from this table.

bf16, B·N = 16k tokens, H·D = 2048, D in {64, 128}, causal and not.

    python bench/hopper_backward_crossover.py            # CSV in bench/results/
"""

from __future__ import annotations

import common
import torch

from flashfuse.kernels import attention_forward, backward, hopper
from flashfuse.kernels.problem import AttentionProblem

NS = (256, 512, 1024, 2048, 4096)


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=120)
    p.add_argument("--n", default=",".join(map(str, NS)), help="comma-separated sequence lengths")
    args = p.parse_args()
    device, budget = common.start(args)
    env = common.env_info(device)
    results = common.Results(args.out, "hopper_backward_crossover.csv", env)
    rows = results.rows
    for D in (128, 64):
        for N in (int(x) for x in args.n.split(",")):
            for causal in (False, True):
                if budget.exceeded():
                    break
                B, H = 16384 // N, 2048 // D
                g = torch.Generator(device=device).manual_seed(N + D)
                q, k, v, do = (torch.randn(B, H, N, D, device=device, generator=g, dtype=torch.bfloat16)
                               for _ in range(4))
                band = dict(dropout_p=0.0, scale=D ** -0.5, window_left=None, window_right=0 if causal else None,
                            bottom_right=False)
                out, lse = attention_forward(q, k, v, None, None, **band)
                prob = AttentionProblem.build(q, k, v, None, **band, backward=True)

                def on_hopper():
                    delta, _ = backward.row_delta(prob, out, do, lse)
                    return hopper.hopper_backward(prob, do, q, k, v, lse, delta)

                def on_portable():
                    return backward.attention_backward(do, q, k, v, None, None, out, lse, **band, mask_grad=False,
                                                       problem=prob)

                t_h = common.bench_ms(on_hopper, device)
                t_p = common.bench_ms(on_portable, device)
                keys = hopper.mean_visible_keys(N, N, prob.diag_off, prob.window_left, prob.window_right,
                                                prob.has_window_left, prob.has_window_right)
                flops = common.attention_flops(B, H, N, N, D, D, causal=causal, mode="bwd")
                row = results.add(D=D, N=N, causal=causal, mean_keys=round(keys), hopper_ms=t_h, portable_ms=t_p,
                                  speedup=t_p / t_h, hopper_tflops=common.tflops(flops, t_h),
                                  rule=hopper.backward_problem_refusal(prob, do, dropout_p=0.0, softcap=None,
                                                                       mask_grad=False, tables=False) or "hopper")
                print({k: row[k] for k in ("D", "N", "causal", "hopper_ms", "portable_ms", "speedup")}, flush=True)
                del q, k, v, do, out, lse
    common.print_table([[r["D"], r["N"], r["causal"], r["mean_keys"], f"{r['hopper_ms']:.3f}",
                         f"{r['portable_ms']:.3f}", f"{r['speedup']:.2f}", r["rule"][:40]] for r in rows],
                       ["D", "N", "causal", "keys/row", "hopper ms", "portable ms", "speedup", "rule"],
                       title=f"Hopper backward against the portable one ({env['gpu']}, torch {env['torch_version']}, "
                             f"Triton {env['triton_version']})")


if __name__ == "__main__":
    main()
