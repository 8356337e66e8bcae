"""Host time of an eager attention step against its benchmarked time.

For flashfuse and SDPA at a few shapes, each of forward, backward and
forward+backward: the host time per step (twenty steps launched while the
GPU sleeps on a queued ``torch.cuda._sleep``, so that no device time counts;
the best of three such loops) beside the step's ``triton.testing.do_bench``
median. Where the host time reaches the benchmarked time, the benchmark
measured the host, not the kernels: the cause of attention rows whose
forward+backward took longer than its two parts (bench/NOTES.md runs 25
and 26).

With ``--masked``, GPT-2's layer shape (B = 8, H = 12, N = 1024, D = 64)
and a BERT-style one (B = 16, N = 512, a key-padding mask) with the mask
given as ``is_causal`` (GPT-2 only), as a tensor (tables built in every
call) and as a ``flashfuse.block_mask`` built once (its tables: ``find_band=False``); SDPA with the tensor.

    python bench/host_step_probe.py
    python bench/host_step_probe.py --masked
"""

from __future__ import annotations

import common
import torch
import torch.nn.functional as F

# (D, B, H, N, causal)
SHAPES = [(64, 16, 32, 1024, True), (128, 16, 16, 1024, True), (128, 4, 16, 4096, True), (64, 4, 32, 4096, False)]
# (D, B, H, N, mask kind) for --masked; common.make_inputs' masks.
MASKED_SHAPES = [(64, 8, 12, 1024, "causal_float"), (64, 16, 12, 512, "bool_pad")]


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--masked", action="store_true", help="mask tensors and block masks at GPT-2's and BERT's shapes")
    args = p.parse_args()
    device = common.gpu_device(args, "times CUDA launches")
    if device is None:
        return
    import triton

    import flashfuse

    print(common.env_info(device), flush=True)
    rows = []
    for D, B, H, N, causal, name, fn, q, k, v in _cases(args.masked, device, flashfuse):
        row = [D, B, H, N, causal, name]
        for mode in ("fwd", "bwd", "fwd+bwd"):
            step, _ = common.attention_step(fn, q, k, v, mode, grads=True)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            host = common.host_ms(step, device)
            bench = triton.testing.do_bench(step, warmup=25, rep=100)
            row += [f"{host:.3f}", f"{bench:.3f}"]
        rows.append(row)
        print(" ".join(str(x) for x in row), flush=True)
    common.tables_header()
    common.print_table(rows, ["D", "B", "H", "N", "mask", "impl", "fwd host ms", "fwd do_bench ms",
                              "bwd host ms", "bwd do_bench ms", "fwd+bwd host ms", "fwd+bwd do_bench ms"],
                       title="host time per eager step (GPU asleep) against do_bench")


def _cases(masked: bool, device, flashfuse):
    """(D, B, H, N, the mask as given, implementation, fn(q, k, v), q, k, v) per row."""
    sdpa = F.scaled_dot_product_attention
    if not masked:
        for D, B, H, N, causal in SHAPES:
            torch.manual_seed(0)
            q, k, v, _ = common.make_inputs(common.AttnCase(B=B, Hq=H, N=N, D=D), device)
            given = "is_causal" if causal else "none"
            for name, attention in (("flashfuse", flashfuse.attention), ("sdpa", sdpa)):
                yield D, B, H, N, given, name, lambda q, k, v, f=attention, c=causal: f(q, k, v, is_causal=c), q, k, v
        return
    for D, B, H, N, kind in MASKED_SHAPES:
        torch.manual_seed(0)
        q, k, v, mask = common.make_inputs(common.AttnCase(B=B, Hq=H, N=N, D=D, mask=kind), device)
        rows = [("is_causal", "flashfuse", flashfuse.attention, dict(is_causal=True))] if kind == "causal_float" else []
        rows += [(kind, "flashfuse", flashfuse.attention, dict(attn_mask=mask)),
                 ("block mask", "flashfuse", flashfuse.attention, dict(attn_mask=flashfuse.block_mask(mask, N, N, find_band=False))),
                 (kind, "sdpa", sdpa, dict(attn_mask=mask))]
        for given, name, attention, kw in rows:
            yield D, B, H, N, given, name, lambda q, k, v, f=attention, kw=kw: f(q, k, v, **kw), q, k, v


if __name__ == "__main__":
    main()
