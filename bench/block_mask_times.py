"""Device time per attention layer at GPT-2's shape (B = 8, 12 heads,
N = 1024, D = 64, bf16), forward+backward, with and without dropout: the
causal mask given as a (B, 1, N, N) bfloat16 tensor (what Hugging Face
models pass) with the tables built in every call, the same mask through one
``flashfuse.block_mask`` built once per step and shared by ``--layers``
layers, each with its own k and v (its table passes counted once per step,
i.e. divided by the layers): as users get it (a causal mask is found to be
the causal band and runs without the mask) and with its tables
(``find_band=False``, what any mask that is not a band costs),
and ``is_causal``; SDPA's default backend for reference. Kernel durations from
the CUDA profiler (every kernel launch of a step summed, so host time never
counts). Also a BERT-style (B = 16, N = 512) key-padding mask. Each
kernel's share goes to ``block_mask_kernels.csv`` and a second table.

    python bench/block_mask_times.py
    python bench/block_mask_times.py --layers 12 --reps 20
    python bench/block_mask_times.py --hopper-backward-everywhere

``--hopper-backward-everywhere`` lifts the masked Hopper backward's
crossover and head-dim rule (``hopper.BWD_MASK_MIN_KEYS``,
``BWD_FLOAT_MASK_DIMS``) so that these 512- and 1k-key masked layers take
it: their kernel sums against the default rule's say where the crossover
belongs (bench/NOTES.md runs 26 and 28).
"""

from __future__ import annotations

import common
import torch
import torch.nn.functional as F
from kernel_times import profile_kernels

# name: (B, H, N, D, dropout_p, mask kind)
CASES = {
    "gpt2 drop": (8, 12, 1024, 64, 0.1, "causal"),
    "gpt2 nodrop": (8, 12, 1024, 64, 0.0, "causal"),
    "bert padding drop": (16, 12, 512, 64, 0.1, "padding"),
    "bert padding nodrop": (16, 12, 512, 64, 0.0, "padding"),
}
TABLE_KERNELS = ("_mask_key_table", "_mask_query_table")


def per_step(times: dict, reps: int) -> tuple[float, float]:
    """(all kernels, table kernels) µs per step: every launch summed."""
    total = sum(sum(t) for t in times.values()) / reps
    tables = sum(sum(t) for name, t in times.items() if name in TABLE_KERNELS) / reps
    return total, tables


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--layers", type=int, default=12, help="layers sharing one block mask (GPT-2, BERT: 12)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hopper-backward-everywhere", action="store_true",
                   help="masked backwards take the Hopper kernels at every key count and head dim")
    p.add_argument("--mask-loads", choices=("coalesced", "direct"), default=None,
                   help="how the fused backward loads a mask tile at every head dim "
                        "(hopper.BWD_MASK_LOADS; default: its rule)")
    args = p.parse_args()
    device = common.gpu_device(args, "times GPU kernels")
    if device is None:
        return
    import flashfuse

    if args.hopper_backward_everywhere:
        common.hopper_backward_everywhere()
    if args.mask_loads:
        common.hopper_mask_loads(args.mask_loads)

    env = dict(common.env_info(device),
               backward_rule="hopper everywhere" if args.hopper_backward_everywhere else "default",
               mask_loads=args.mask_loads or "default")
    res = common.Results(args.out, "block_mask_times.csv", env)
    per_kernel = common.Results(args.out, "block_mask_kernels.csv", env)
    summary, breakdown = [], {}

    def record_kernels(case, variant, times, layers):
        """Each kernel's device µs per layer (its launches summed per step)."""
        for kernel, ts in sorted(times.items()):
            us = sum(ts) / args.reps / layers
            per_kernel.add(case=case, variant=variant, kernel=kernel, us_per_layer=us)
            breakdown.setdefault((case, kernel), {})[variant] = us

    for name, (B, H, N, D, p_drop, kind) in CASES.items():
        torch.manual_seed(0)
        q, k, v, _ = common.make_inputs(common.AttnCase(B=B, Hq=H, N=N, D=D), device)
        g = torch.randn_like(q)
        mask = common.hf_mask(B, N, kind, device)
        causal = kind == "causal"

        def step(fn):
            def run():
                torch.autograd.grad(fn(), (q, k, v), g)
            return run

        rows = {}
        variants = {
            "mask tensor": lambda: flashfuse.attention(q, k, v, attn_mask=mask, dropout_p=p_drop),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask,
                                                           is_causal=causal, dropout_p=p_drop),
        }
        if causal:
            variants["is_causal"] = lambda: flashfuse.attention(q, k, v, is_causal=True, dropout_p=p_drop)
        for variant, fn in variants.items():
            times = profile_kernels(step(fn), args.reps)
            record_kernels(name, variant, times, 1)
            total, tables = per_step(times, args.reps)
            rows[variant] = total
            res.add(case=name, variant=variant, layers=1, us_per_layer=total, table_us=tables)
            print(f"{name:20s} {variant:12s} {total:8.1f} us per layer", flush=True)  # rows as they come
        # One block mask per step, shared by the layers: build it in the
        # step, run the layers on it, count the step's kernels per layer.
        # Each layer has its own k and v, as in a model: shared ones would
        # make autograd sum every layer's gradient into them (bf16 adds the
        # one-layer rows do not pay; run 16 found them 17-19 µs per layer).
        layer_kv = [tuple(torch.randn(B, H, N, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                          for _ in range(2)) for _ in range(args.layers)]
        leaves = (q, *(t for kv in layer_kv for t in kv))

        def shared_step(find_band):
            bm = flashfuse.block_mask(mask, N, N, find_band=find_band)
            x = q
            for lk, lv in layer_kv:
                x = flashfuse.attention(x, lk, lv, attn_mask=bm, dropout_p=p_drop)
            torch.autograd.grad(x, leaves, g)

        table_us = {}
        for variant, find_band in (("block mask", True), ("block mask tables", False)):
            times = profile_kernels(lambda: shared_step(find_band), args.reps)
            record_kernels(name, variant, times, args.layers)
            total, tables = per_step(times, args.reps)
            per_layer = total / args.layers
            rows[variant] = per_layer
            table_us[variant] = tables / args.layers
            res.add(case=name, variant=variant, layers=args.layers, us_per_layer=per_layer,
                    table_us=tables / args.layers, kv="per layer")
            print(f"{name:20s} {variant:12s} {per_layer:8.1f} us per layer", flush=True)
        del layer_kv, leaves
        ref = rows.get("is_causal", rows["sdpa"])
        summary.append([name, f"{rows['mask tensor']:.0f}", f"{rows['block mask']:.0f}",
                        f"{rows['block mask tables']:.0f}",
                        f"{rows['is_causal']:.0f}" if "is_causal" in rows else "-", f"{rows['sdpa']:.0f}",
                        f"{rows['block mask'] / ref:.2f}x", f"{rows['block mask tables'] / ref:.2f}x",
                        f"{table_us['block mask tables']:.1f}"])
        print(" | ".join(summary[-1]), flush=True)
    common.tables_header()
    common.print_table(summary, ["case", "mask tensor µs", f"block mask µs (per layer of {args.layers})",
                                 "block mask, tables µs", "is_causal µs", "SDPA µs",
                                 "block mask / is_causal (SDPA for padding)", "tables / is_causal",
                                 "tables µs per layer"],
                       title="attention kernels per layer, forward+backward (device time per step)")
    variants = ["mask tensor", "block mask", "block mask tables", "is_causal", "sdpa"]
    common.print_table([[case, kernel] + [common.fmt(v.get(x, float("nan"))) for x in variants]
                        for (case, kernel), v in breakdown.items()],
                       ["case", "kernel"] + [f"{x} µs" for x in variants],
                       title="each kernel's device time per layer, forward+backward")
    print(f"\n{len(res.rows)} rows -> {res.path}; per kernel -> {per_kernel.path}")


if __name__ == "__main__":
    main()
