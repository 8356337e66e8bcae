"""Forward+backward with a mask tensor: the Hopper backward reading the mask
through its query table against the portable backward, and SDPA.

Every flashfuse variant runs the forward on the Hopper kernel (which reads
the mask through its key table). The Hopper backward is forced past the
rule's crossovers (``BWD_MASK_MIN_KEYS``, ``BWD_FLOAT_MASK_DIMS``) and timed
with both ways of loading a mask tile (``hopper.BWD_MASK_LOADS``:
"coalesced" and "direct"); the portable backward is forced by making
``hopper.mask_refusal`` refuse the backward. Each shape times, in one
process, the Hopper backward with coalesced loads, with direct loads, the
portable backward, the first again (the spread between the two is the
noise) and SDPA's default with the same mask: ``triton.testing.do_bench``
medians of a step that returns the gradients of q, k and v. Masks: a key-padding bool mask (B, 1, 1, N) that
hides the last quarter of the keys, and a causal mask as a bf16 (B, 1, N, N)
tensor of 0 and the dtype's lowest (as Hugging Face builds it). The last
column names the backward kernel the op takes by default.

    python bench/hopper_mask_probe.py
"""

from __future__ import annotations

import common
import torch
import torch.nn.functional as F

# (D, B, H, N, mask): the attention benchmark's D = 128 feature shape,
# GPT-2's and a BERT-style layer, and D = 64 at 4k.
SHAPES = [(128, 4, 16, 4096, "padding"), (128, 4, 16, 4096, "causal"), (64, 8, 12, 1024, "causal"),
          (64, 16, 12, 512, "padding"), (64, 4, 32, 4096, "padding"), (64, 4, 32, 4096, "causal"),
          (128, 16, 16, 1024, "causal")]
VARIANTS = ("hopper bwd coalesced", "hopper bwd direct", "portable bwd", "hopper bwd coalesced again", "sdpa")


# The masks as the attention benchmark's feature rows build them (common.make_inputs).
MASKS = {"padding": "bool_pad", "causal": "causal_float"}


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    args = p.parse_args()
    device = common.gpu_device(args, "times the Hopper kernels")
    if device is None:
        return
    import triton

    import flashfuse
    from flashfuse.kernels import hopper

    real_refusal = hopper.mask_refusal
    rule = (hopper.BWD_MASK_MIN_KEYS, hopper.BWD_FLOAT_MASK_DIMS, hopper.BWD_MASK_LOADS)

    def portable_backward(p, backward=False):
        return "forced: the portable backward" if backward else real_refusal(p, backward)

    def setup(name):
        """The rule for variant ``name``; any other name restores the default."""
        hopper.mask_refusal = portable_backward if name == "portable bwd" else real_refusal
        hopper.BWD_MASK_MIN_KEYS, hopper.BWD_FLOAT_MASK_DIMS, hopper.BWD_MASK_LOADS = rule
        if name.startswith("hopper bwd"):
            common.hopper_backward_everywhere()
            common.hopper_mask_loads("direct" if "direct" in name else "coalesced")

    print(common.env_info(device), flush=True)
    rows = []
    for D, B, H, N, kind in SHAPES:
        torch.manual_seed(0)
        q, k, v, mask = common.make_inputs(common.AttnCase(B=B, Hq=H, N=N, D=D, mask=MASKS[kind]), device)
        times = {}
        try:
            for name in VARIANTS:
                setup(name)
                attention = F.scaled_dot_product_attention if name == "sdpa" else flashfuse.attention

                def fn(q, k, v):
                    return attention(q, k, v, attn_mask=mask)

                step, _ = common.attention_step(fn, q, k, v, "fwd+bwd", grads=True)
                step()
                torch.cuda.synchronize()
                times[name] = triton.testing.do_bench(step, warmup=25, rep=100) * 1e3
        finally:
            setup("default")
        named = flashfuse.ops.backward_kernel(q, k, v, attn_mask=mask)
        rows.append([D, B, H, N, kind, *(f"{times[n]:.1f}" for n in VARIANTS), named])
        print(" ".join(str(x) for x in rows[-1]), flush=True)
    common.tables_header()
    common.print_table(rows, ["D", "B", "H", "N", "mask", *(f"{n} µs" for n in VARIANTS), "default backward"],
                       title="forward+backward with a mask tensor, µs (do_bench medians)")


if __name__ == "__main__":
    main()
