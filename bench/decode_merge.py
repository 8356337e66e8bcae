"""Eager decode calls: the split kernel's fused merge against the combine kernel.

An eager decode call splits the cache across programs; the partial results
are merged either by the last split of each tile inside the split kernel (the
fused merge, one launch) or by a second launch (the combine kernel). The
fused merge takes a tile's rows one after the other, each reading its S
partials, so its cost grows with the rows a tile holds (queries times grouped
heads) and the split count. ``decode.FUSED_MAX_MERGES`` (rows times splits)
and ``decode.FUSED_MAX_BYTES`` (cache size) bound where eager calls take it;
this script measures where those limits belong.

For each shape (Hq = 32, Hkv = 8, D = 128, bf16, causal with bottom-right
alignment, 1-16 new queries, 4k-16k cached keys, batch 1 and 8) and each variant
("fused": the fused merge at any row count and cache size; "combine": the combine kernel;
"as shipped": the library's policy; "sdpa": PyTorch's SDPA with the same
mask) it reports

* ``device_us``: device time per call, the calls queued behind a GPU sleep
  (no host time in it), the L2 cache not flushed (calls back to back, as a
  decoding loop makes them);
* ``loop_us``: wall time per call of back-to-back calls with one
  synchronisation at the end (what a host-bound caller gets).

The variants alternate over ``--rounds`` rounds; the best round is kept.

    python bench/decode_merge.py
    python bench/decode_merge.py --smoke --out /tmp/x      # tiny, on the CPU
"""

from __future__ import annotations

import contextlib
import time

import common
import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 1, 4096), (1, 2, 4096), (1, 4, 4096), (1, 8, 4096), (1, 16, 4096),
          (1, 1, 8192), (1, 2, 8192), (1, 4, 8192),
          (1, 1, 16384), (1, 4, 16384), (1, 16, 16384), (8, 1, 4096), (8, 4, 4096)]
SMOKE_SHAPES = [(1, 1, 300), (1, 4, 300)]
VARIANTS = ("fused", "combine", "as shipped", "sdpa")


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per shape")
    p.add_argument("--calls", type=int, default=50, help="calls per timed loop")
    return p.parse_args()


@contextlib.contextmanager
def _policy(name: str):
    """The decode kernels' merge policy for ``name``, plans forgotten around it."""
    from flashfuse.kernels import decode

    saved = decode.FUSE_COMBINE, decode.FUSED_MAX_MERGES, decode.FUSED_MAX_BYTES
    if name == "fused":
        decode.FUSE_COMBINE, decode.FUSED_MAX_MERGES, decode.FUSED_MAX_BYTES = True, 1 << 30, 1 << 40
    elif name == "combine":
        decode.FUSE_COMBINE = False
    decode.forget_plans()
    try:
        yield
    finally:
        decode.FUSE_COMBINE, decode.FUSED_MAX_MERGES, decode.FUSED_MAX_BYTES = saved
        decode.forget_plans()


def device_us(fn, device, calls: int) -> float:
    """Device microseconds per call of ``calls`` calls queued behind a GPU
    sleep (the host runs ahead, so no host time is timed). CPU: wall time."""
    fn()
    common.sync(device)
    if device.type != "cuda":
        return common.per_call_us(fn, device, calls)
    common.sleep_gpu(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def measure(B: int, N: int, M: int, device, rounds: int, calls: int) -> list[dict]:
    import flashfuse

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(B * 1000 + N * 10 + M)
    q = torch.randn(B, HQ, N, D, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, HKV, M, D, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, HKV, M, D, device=device, dtype=dtype, generator=gen)
    mask = None if N == 1 else torch.ones(N, M, dtype=torch.bool, device=device).tril(M - N)

    def ours():
        return flashfuse.attention(q, k, v, is_causal=True, alignment="bottom_right", enable_gqa=True)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    ref = sdpa().float()
    best: dict = {}
    for r in range(rounds):
        for name in common.alternating(VARIANTS, r):
            fn = sdpa if name == "sdpa" else ours
            with _policy(name):
                out = fn()
                err = (out.float() - ref).abs().max().item()
                if name != "sdpa" and err > 2e-2:
                    raise AssertionError(f"{name} at B={B} N={N} M={M}: max error {err:.3g} against SDPA")
                dev = device_us(fn, device, calls)
                loop = common.per_call_us(fn, device, calls)
            old = best.get(name)
            best[name] = (min(dev, old[0]), min(loop, old[1])) if old else (dev, loop)
    rows = [dict(B=B, N=N, M=M, rows_per_tile=N * HQ // HKV, variant=name,
                 device_us=best[name][0], loop_us=best[name][1]) for name in VARIANTS]
    del q, k, v
    common.free_memory()
    return rows


def main():
    args = parse_args()
    device, budget = common.start(args)
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("decode_merge.py times CUDA launches: run it on a GPU (or --smoke)")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rounds, calls = (1, 3) if args.smoke else (args.rounds, args.calls)
    results = common.Results(args.out, "decode_merge.csv", common.env_info(device))
    t0 = time.perf_counter()
    for B, N, M in shapes:
        if budget.exceeded():
            break
        for row in measure(B, N, M, device, rounds, calls):
            results.add(**row)
        print(f"B={B} N={N} M={M} done at {time.perf_counter() - t0:.0f} s", flush=True)
    common.tables_header()
    table = {}
    for r in results.rows:
        key = (r["B"], r["N"], r["M"], r["rows_per_tile"])
        table.setdefault(key, {})[r["variant"]] = r
    lines = [[*key] + [f"{common.fmt(v[n]['device_us'])} / {common.fmt(v[n]['loop_us'])}" for n in VARIANTS]
             for key, v in table.items()]
    common.print_table(lines, ["B", "N", "M", "rows/tile", *VARIANTS],
                       title="eager call, device us / loop us per call (best of the alternating rounds)")


if __name__ == "__main__":
    main()
