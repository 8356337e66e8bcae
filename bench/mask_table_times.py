"""Device time of the two mask-table passes (``flashfuse/kernels/mask_ranges.py``)
per launch config, from the CUDA profiler: the key table (one program per 16 query rows, stepping
over keys) and the query table (one program per 32 keys, stepping over rows).
Both are latency-bound chains of small loads, so the step size and warp count
decide their time; this is the evidence behind the configs in
``mask_ranges``.

Masks: the causal bfloat16 (B, 1, N, N) masks of 0 and the lowest value that
Hugging Face models pass, at GPT-2's (B = 8, N = 1024) and a LLaMA-style
(B = 4, N = 2048) shape, and a BERT-style (B, 1, 1, N) key-padding mask.

    python bench/mask_table_times.py
"""

from __future__ import annotations

import statistics

import common
import torch
import triton
from kernel_times import profile_kernels

KEY_CANDIDATES = [(128, 4), (256, 4), (256, 8), (512, 8), (64, 4)]  # (STEP, num_warps)
QUERY_CANDIDATES = [(64, 4), (128, 4), (128, 8), (256, 8), (32, 4)]
SHAPES = {"gpt2 causal": (8, 1024, "causal"), "llama causal": (4, 2048, "causal"),
          "bert padding": (16, 512, "padding")}


def main():
    args = common.base_parser(__doc__.splitlines()[0], budget_s=0).parse_args()
    device = common.gpu_device(args, "times GPU kernels")
    if device is None:
        return
    from flashfuse.kernels import mask_ranges as mr

    res = common.Results(args.out, "mask_table_times.csv", common.env_info(device))
    band = dict(diag_off=0, window_left=0, window_right=0, has_window_left=False, has_window_right=False)
    summary = []
    for name, (B, N, kind) in SHAPES.items():
        torch.manual_seed(0)
        mask = common.hf_mask(B, N, kind, device).expand(B, 12, N, N)
        keys = mr.mask_key_table(mask, N, N, **band)
        best = {}
        for table, cands in (("key", KEY_CANDIDATES), ("query", QUERY_CANDIDATES)):
            for step, warps in cands:
                cfg = triton.Config({"STEP": step}, num_warps=warps, num_stages=2)
                if table == "key":
                    mr._KEY_CONFIG, launcher = cfg, mr._key_launcher
                    fn = lambda: mr.mask_key_table(mask, N, N, **band)  # noqa: E731
                else:
                    mr._QUERY_CONFIG, launcher = cfg, mr._query_launcher
                    fn = lambda: mr.mask_query_table(mask, keys, N, N, **band)  # noqa: E731
                launcher.forget()
                kname = "_mask_key_table" if table == "key" else "_mask_query_table"
                us = statistics.median(profile_kernels(fn, 20)[kname])
                res.add(shape=name, table=table, step=step, num_warps=warps, us=us)
                print(f"{name:14s} {table:5s} STEP={step:<4d} warps={warps}  {us:7.1f} us", flush=True)
                if table not in best or us < best[table][1]:
                    best[table] = ((step, warps), us)
        summary.append([name, f"{best['key'][0]} {best['key'][1]:.1f}", f"{best['query'][0]} {best['query'][1]:.1f}"])
    common.tables_header()
    common.print_table(summary, ["mask", "key table: best (STEP, warps) µs", "query table: best (STEP, warps) µs"],
                       title="mask-table passes, device time per call (median of 20 profiled calls)")
    print(f"\n{len(res.rows)} rows -> {res.path}")


if __name__ == "__main__":
    main()
