"""What a mask costs the Hopper kernels, split into its parts: the mask
loads, and everything else the masked variant does (its tables, its wider
per-element work, its registers).

Each shape runs forward+backward with the Hopper forward and fused backward
(the backward's crossover lifted, as ``block_mask_times.py
--hopper-backward-everywhere`` does) in five ways, every mask through a
block mask built once outside the timed step (``find_band=False``: these
masks are bands, which a block mask would otherwise run without the mask):

* ``is_causal``: no mask;
* ``float causal`` / ``bool causal``: the causal mask as a tensor (bf16 of 0
  and the lowest value, as Hugging Face builds it; or bool), the diagonal
  blocks read from it;
* ``float neutral`` / ``bool neutral``: a mask that hides nothing (zeros;
  all True) with ``is_causal``: the masked kernels with their tables, but
  every block neutral, so no mask load runs.

``neutral - is_causal`` is the masked variant's fixed cost, ``causal -
neutral`` its loads. Device time per step from the CUDA profiler, split
into the forward kernel and the rest (the backward's kernels).

    python bench/mask_cost_probe.py
    python bench/mask_cost_probe.py --mask-loads coalesced   # the backward's mask tile loads
    python bench/mask_cost_probe.py --ablate tables           # mask_ablations.py
    python bench/mask_cost_probe.py --shapes 64x1024          # GPT-2's layer only

``--ablate`` swaps stand-ins for parts of the masked kernels
(``mask_ablations.py``: the table reads, the per-score mask code, or both)
and runs only ``is_causal`` and the neutral rows, the ones the stand-ins
leave exact: what the neutral rows lose against the same rows without
``--ablate`` is what that part costs.
"""

from __future__ import annotations

import common
import torch
from block_mask_times import TABLE_KERNELS
from kernel_times import profile_kernels

# (D, B, H, N): GPT-2's layer, and the attention benchmark's 4k shapes.
SHAPES = [(64, 8, 12, 1024), (64, 4, 32, 4096), (128, 4, 16, 4096)]
VARIANTS = ("is_causal", "float causal", "bool causal", "float neutral", "bool neutral")


def split(times: dict, reps: int) -> tuple[float, float]:
    """(forward kernel, every other kernel) µs per step."""
    fwd = sum(sum(t) for n, t in times.items() if "attn_fwd" in n) / reps
    rest = sum(sum(t) for n, t in times.items() if "attn_fwd" not in n and n not in TABLE_KERNELS) / reps
    return fwd, rest


def _wanted_shapes(parser, text: str | None) -> set | None:
    """``--shapes`` as a set of (D, N), None for all; a shape the probe does
    not have is an error naming the ones it has."""
    if not text:
        return None
    known = {(D, N) for D, _, _, N in SHAPES}
    try:
        wanted = {tuple(int(x) for x in item.split("x")) for item in text.split(",") if item}
    except ValueError:
        wanted = None
    if not wanted or not wanted <= known:
        parser.error(f"--shapes {text!r}: give DxN items from {', '.join(f'{D}x{N}' for D, N in sorted(known))}")
    return wanted


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--mask-loads", choices=("coalesced", "direct"), default=None,
                   help="the fused backward's mask tile loads at every head dim (default: hopper.BWD_MASK_LOADS)")
    p.add_argument("--ablate", choices=common.MASK_ABLATIONS, default=None,
                   help="swap stand-ins for parts of the masked kernels (mask_ablations.py); neutral rows only")
    p.add_argument("--mask-runs", choices=("split", "single"), default=None,
                   help="a masked tile's blocks in three loops or one, forward and backward "
                        "(hopper.FWD_MASK_SPLIT_RUNS, BWD_MASK_SPLIT_RUNS; default: their settings)")
    p.add_argument("--shapes", default=None,
                   help="only these (D, N) shapes, e.g. 64x1024 or 64x1024,128x4096 (default: all three)")
    args = p.parse_args()
    wanted = _wanted_shapes(p, args.shapes)
    device = common.gpu_device(args, "times the Hopper kernels")
    if device is None:
        return
    swapped = []
    if args.ablate:
        import mask_ablations  # Gluon: imported only where the kernels run

        swapped = mask_ablations.apply(args.ablate)
    variants = [v for v in VARIANTS if not args.ablate or v == "is_causal" or "neutral" in v]
    import flashfuse

    common.hopper_backward_everywhere()
    if args.mask_loads:
        common.hopper_mask_loads(args.mask_loads)
    if args.mask_runs:
        common.hopper_mask_runs(args.mask_runs)
    env = dict(common.env_info(device), backward_rule="hopper everywhere", mask_loads=args.mask_loads or "default",
               mask_runs=args.mask_runs or "default",
               ablate="+".join(swapped) or "none")
    res = common.Results(args.out, "mask_cost_probe.csv", env)
    print(env, flush=True)
    rows = []
    for D, B, H, N in SHAPES:
        if wanted is not None and (D, N) not in wanted:
            continue
        torch.manual_seed(0)
        q, k, v, _ = common.make_inputs(common.AttnCase(B=B, Hq=H, N=N, D=D), device)
        g = torch.randn_like(q)
        causal = common.hf_mask(B, N, "causal", device)
        masks = {
            "float causal": (causal, False),
            "bool causal": (causal == 0, False),
            "float neutral": (torch.zeros(B, 1, N, N, dtype=torch.bfloat16, device=device), True),
            "bool neutral": (torch.ones(B, 1, N, N, dtype=torch.bool, device=device), True),
        }
        # (the call's arguments, the same with the mask itself: what the
        # kernel-naming rule takes)
        calls = {"is_causal": (dict(is_causal=True), dict(is_causal=True))}
        for name, (mask, with_causal) in masks.items():
            calls[name] = (dict(attn_mask=flashfuse.block_mask(mask, N, N, is_causal=with_causal, find_band=False)),
                           dict(attn_mask=mask, is_causal=with_causal))
        out = {}
        for name in variants:
            kwargs, plain = calls[name]
            kernel = flashfuse.ops.backward_kernel(q, k, v, **plain)

            def step():
                torch.autograd.grad(flashfuse.attention(q, k, v, **kwargs), (q, k, v), g)

            fwd, bwd = split(profile_kernels(step, args.reps), args.reps)
            out[name] = (fwd, bwd)
            res.add(D=D, B=B, H=H, N=N, variant=name, fwd_us=fwd, bwd_us=bwd, backward_kernel=kernel)
            print(f"D={D} N={N} {name:14s} fwd {fwd:8.1f}  bwd {bwd:8.1f}  ({kernel})", flush=True)
        base = out["is_causal"]
        for name in variants:
            fwd, bwd = out[name]
            rows.append([D, f"{B}x{H}x{N}", name, f"{fwd:.1f}", f"{bwd:.1f}", f"{fwd / base[0]:.2f}",
                         f"{bwd / base[1]:.2f}"])
    common.tables_header()
    common.print_table(rows, ["D", "B x H x N", "variant", "fwd µs", "bwd µs", "fwd / is_causal",
                              "bwd / is_causal"],
                       title="the masked Hopper kernels' cost: loads (causal) against fixed cost (neutral)")
    print(f"\n{len(res.rows)} rows -> {res.path}")


if __name__ == "__main__":
    main()
