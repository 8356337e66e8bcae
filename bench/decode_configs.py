"""Decoding kernel sweep: every (BLOCK_N, warps, stages) config of the split
kernel at several split counts, per decode shape, against SDPA.

The split-KV decode path launches its first fitting config unless tuning
is on (``FLASHFUSE_AUTOTUNE=1``), and inside ``torch.compile`` and CUDA
graphs it never tunes, so its default choice decides the speed users get.
This script measures, for the shapes of ``bench_decode.py`` (Hq = 32,
Hkv = 8, D = 128, bf16; one query against a contiguous cache and against a
static cache's 3/4-filled bool mask; 16 queries with the bottom-right band),
the CUDA-graph median of every config at the split count the launcher
picks (``x1``: one wave of the default config's programs) and at half and
twice it, and SDPA's default beside it. The
table gives per shape the default config's time, the best config and split
factor, and SDPA's. Writes bench/results/decode_configs.csv.

    python bench/decode_configs.py --budget-s 240
    python bench/decode_configs.py --smoke --out /tmp/x
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import flashfuse  # noqa: E402
from flashfuse.kernels import decode  # noqa: E402

HQ, HKV, D = 32, 8, 128
CONFIGS = ([(32, 4, st) for st in (2, 3, 4)] + [(64, w, st) for w in (4, 8) for st in (2, 3, 4)]
           + [(128, w, st) for w in (4, 8) for st in (2, 3)] + [(256, w, 2) for w in (4, 8)])
FACTORS = (0.5, 1.0, 2.0)


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=240)
    p.add_argument("--lengths", default="4096,32768,131072", help="comma-separated cache lengths")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--configs", default="all",
                   help="BLOCK_Nxwarpsxstages, comma-separated (default: all of CONFIGS)")
    return p.parse_args()


def graph_us(fn, device) -> float:
    """CUDA-graph median µs (a plain median on the CPU smoke run)."""
    if device.type != "cuda":
        return common.bench_ms(fn, device) * 1e3
    return common.graph_us(fn, rep_ms=10)


def forced(cfg):
    """The split kernel restricted to this one config (``decode.split_candidates``)."""
    bn, w, st = cfg
    return decode.split_candidates([triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)])


def main():
    args = parse_args()
    device, budget = common.start(args)
    os.environ["FLASHFUSE_AUTOTUNE"] = "0"
    if args.smoke:
        lengths, batches, hq, hkv, d, dtype = [64], [1], 4, 2, 16, torch.float32
        configs, factors = [(16, 4, 1)], (1.0,)
        os.environ["FLASHFUSE_DECODE"] = "1"
    else:
        lengths = [int(x) for x in args.lengths.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
        hq, hkv, d, dtype, configs, factors = HQ, HKV, D, torch.bfloat16, CONFIGS, FACTORS
        if args.configs != "all":
            configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    res = common.Results(args.out, "decode_configs.csv" if not args.smoke else "decode_configs_smoke.csv",
                         common.env_info(device))
    gen = torch.Generator(device=device).manual_seed(0)
    summary = []
    for B in batches:
        for M in lengths:
            for cache, N in (("contiguous", 1), ("static 3/4", 1), ("contiguous", 16)):
                if budget.exceeded():
                    res.add(B=B, N=N, M=M, cache=cache, provider="all", status="time budget")
                    continue
                q = torch.randn(B, hq, N, d, device=device, dtype=dtype, generator=gen)
                k = torch.randn(B, hkv, M, d, device=device, dtype=dtype, generator=gen)
                v = torch.randn(B, hkv, M, d, device=device, dtype=dtype, generator=gen)
                if cache == "static 3/4":
                    smask = (torch.arange(M, device=device) < 3 * M // 4).view(1, 1, 1, M).expand(B, 1, 1, M)
                    smask = smask.contiguous()

                    def ff(q=q, k=k, v=v, m=smask):
                        return flashfuse.attention(q, k, v, m, alignment="bottom_right", enable_gqa=True)

                    sd_mask = smask
                else:
                    def ff(q=q, k=k, v=v):
                        return flashfuse.attention(q, k, v, is_causal=True, alignment="bottom_right", enable_gqa=True)

                    sd_mask = None if N == 1 else torch.ones(N, M, dtype=torch.bool, device=device).tril(M - N)
                case = dict(B=B, N=N, M=M, cache=cache)
                t_sdpa = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=sd_mask, enable_gqa=True),
                                  device)
                res.add(**case, provider="sdpa", status="ok", us_graph=t_sdpa)
                tiles = decode.cdiv(hq // hkv * N, decode.row_tile(hq // hkv, N))
                masked = cache != "contiguous"
                auto = 1  # the CPU smoke run: no SMs to fill
                if device.type == "cuda":
                    block_d = max(16, triton.next_power_of_2(d))  # D == Dv here
                    per_sm = decode._default_per_sm(q, block_d, block_d, masked)
                    auto = decode.choose_splits(B, hkv, tiles, M, decode.sm_count(q), per_sm)
                default_cfg = (decode._CUDA_MASK_CONFIGS if masked else decode._CUDA_CONFIGS)[0]
                best, t_default = None, float("nan")
                for cfg in configs:
                    with forced(cfg):
                        for f in factors:
                            S = max(1, min(decode.MAX_SPLITS, round(auto * f)))
                            os.environ["FLASHFUSE_DECODE_SPLITS"] = str(S)
                            try:
                                t = graph_us(ff, device)
                            except Exception as exc:  # noqa: BLE001 - a config the GPU cannot fit
                                res.add(**case, provider="flashfuse", block_n=cfg[0], warps=cfg[1], stages=cfg[2],
                                        splits=S, status="error", error=common.short_error(exc))
                                continue
                            finally:
                                os.environ.pop("FLASHFUSE_DECODE_SPLITS", None)
                            res.add(**case, provider="flashfuse", block_n=cfg[0], warps=cfg[1], stages=cfg[2], splits=S,
                                    split_factor=f, status="ok", us_graph=t)
                            if cfg == default_cfg and f == 1.0:
                                t_default = t
                            if best is None or t < best[0]:
                                best = (t, cfg, S)
                summary.append([B, N, M, cache, auto, common.fmt(t_default),
                                common.fmt(best[0]) if best else "-",
                                "x".join(map(str, best[1])) if best else "-", best[2] if best else "-",
                                common.fmt(t_sdpa), common.fmt(t_sdpa / best[0], 2) if best else "-"])
                del q, k, v
                common.free_memory()
    common.tables_header()
    common.print_table(summary, ["B", "queries", "cached keys", "cache", "auto splits", "default us",
                                 "best us", "best BLOCK_N x warps x stages", "best splits", "sdpa us",
                                 "best speed vs sdpa"], title="Decode configs (CUDA-graph medians)")
    print(f"\nCSV: {res.path}")


if __name__ == "__main__":
    main()
