"""Decoding benchmark: few new queries against a long key/value cache.

Hq = 32, Hkv = 8, D = 128, bf16; 1 and 16 queries, 4k-128k cached keys,
batch 1 and 8. flashfuse (``flashfuse.attention`` with bottom-right causal
alignment, which takes the split-KV decoding kernels) against
``F.scaled_dot_product_attention(enable_gqa=True)`` with its default
dispatch (one query: no mask; 16 queries: the bottom-right causal band as a
bool mask, SDPA's ``is_causal`` being top-left), and the time to read the
cache once at the device copy bandwidth measured here (a large
device-to-device copy). Two more rows per length at batch 8, one query:
``flashfuse.attention_with_kvcache`` with per-row ``cache_seqlens`` (all
full, so the same work) and with a paged cache (pages of 256 keys, shuffled).
One more per length and batch, one query: a static cache as Hugging Face's
``cache_implementation="static"`` hands it over, a bool mask (B, 1, 1, M)
showing the first 3/4 of the slots and no causal band, flashfuse against
SDPA with the same mask (the read floor counts the filled slots only).
Times are ``triton.testing.do_bench`` medians of eager calls (host launch
cost included) and, on CUDA, ``do_bench_cudagraph`` medians (as a decoding
loop under CUDA graphs runs). With ``--eager``, also the throughput of
back-to-back eager calls with one synchronisation at the end (``loop us``:
what a host-bound caller such as ``generate()`` with a dynamic cache gets,
so the host time per call shows where it exceeds the GPU's). Writes bench/results/decode.csv and
decode.png (time against cache length).

    python bench/bench_decode.py
    python bench/bench_decode.py --smoke --out /tmp/x
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashfuse  # noqa: E402

HQ, HKV, D = 32, 8, 128


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=110)
    p.add_argument("--eager", action="store_true",
                   help="also time back-to-back eager calls, no CUDA graph, one sync at the end (host time)")
    p.add_argument("--lengths", default=None, help="comma-separated cache lengths (default 4096,16384,32768,131072)")
    p.add_argument("--from-csv", default=None,
                   help="redraw the table and the plot of this CSV (--eager: with its loop columns), measuring nothing")
    return p.parse_args()


def copy_bandwidth(device) -> float:
    """Device memory bandwidth in bytes/s from a 1 GiB copy (read + write)."""
    if device.type != "cuda":
        return float("nan")
    from triton.testing import do_bench

    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3)


def timer(device):
    """(eager, graph): median microseconds of one call, plain and replayed
    from a CUDA graph (NaN off CUDA or where a provider cannot be captured)."""
    def eager(fn):
        return common.bench_ms(fn, device) * 1e3

    if device.type != "cuda":
        return eager, lambda fn: float("nan")

    def graph(fn):
        try:
            return common.graph_us(fn, rep_ms=30)
        except Exception:  # noqa: BLE001 - a provider that cannot be captured
            return float("nan")

    return eager, graph


def main():
    args = parse_args()
    if args.from_csv:
        os.makedirs(args.out, exist_ok=True)
        report(common.Results.load(args.from_csv), args)
        return
    device, budget = common.start(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        lengths, batches, queries, hq, hkv, d = [64, 128], [1, 2], [1, 4], 4, 2, 16
    else:
        lengths = [int(x) for x in (args.lengths or "4096,16384,32768,131072").split(",")]
        batches, queries, hq, hkv, d = [1, 8], [1, 16], HQ, HKV, D
    bw = copy_bandwidth(device)
    eager, graph = timer(device)
    res = common.Results(args.out, "decode.csv" if not args.smoke else "decode_smoke.csv", common.env_info(device))
    print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s" if bw == bw else "device copy bandwidth: - (not CUDA)")

    def record(case, provider, fn, M, B, N, cache_bytes):
        if budget.exceeded():
            res.add(**case, provider=provider, status="time budget")
            return
        try:
            t_eager, t_graph = eager(fn), graph(fn)
            floor = cache_bytes / bw * 1e6 if bw == bw else float("nan")
            loop = {}
            if args.eager:
                fn()
                loop["us_loop"] = common.per_call_us(fn, device, 20 if args.smoke else 200)
            res.add(**case, provider=provider, status="ok", us=t_eager, us_graph=t_graph, floor_us=floor,
                    bandwidth_tbs=bw / 1e12, **loop)
        except Exception as exc:  # noqa: BLE001
            res.add(**case, provider=provider, status="error", error=common.short_error(exc))
            if common.is_oom(exc):
                common.free_memory(collect=True)

    gen = torch.Generator(device=device).manual_seed(0)
    for B in batches:
        for N in queries:
            for M in lengths:
                case = dict(B=B, N=N, M=M, Hq=hq, Hkv=hkv, D=d, dtype=common.DTYPE_NAMES.get(dtype, str(dtype)),
                            cache="contiguous")
                try:
                    q = torch.randn(B, hq, N, d, device=device, dtype=dtype, generator=gen)
                    k = torch.randn(B, hkv, M, d, device=device, dtype=dtype, generator=gen)
                    v = torch.randn(B, hkv, M, d, device=device, dtype=dtype, generator=gen)
                except Exception as exc:  # noqa: BLE001
                    res.add(**case, provider="all", status="error", error=common.short_error(exc))
                    continue
                cache_bytes = 2 * k.numel() * k.element_size()
                mask = None if N == 1 else torch.ones(N, M, dtype=torch.bool, device=device).tril(M - N)
                record(case, "flashfuse", lambda: flashfuse.attention(
                    q, k, v, is_causal=True, alignment="bottom_right", enable_gqa=True), M, B, N, cache_bytes)
                record(case, "sdpa", lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, enable_gqa=True), M, B, N, cache_bytes)
                if N == 1:
                    filled = 3 * M // 4
                    smask = (torch.arange(M, device=device) < filled).view(1, 1, 1, M).expand(B, 1, 1, M)
                    smask = smask.contiguous()  # per batch row, as transformers builds it
                    static = dict(case, cache="static 3/4")
                    record(static, "flashfuse", lambda: flashfuse.attention(
                        q, k, v, smask, alignment="bottom_right", enable_gqa=True), M, B, N, cache_bytes * 3 // 4)
                    record(static, "sdpa", lambda: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=smask, enable_gqa=True), M, B, N, cache_bytes * 3 // 4)
                    del smask
                if B == max(batches) and N == 1:
                    lens = torch.full((B,), M, dtype=torch.int32, device=device)
                    kc, vc = k.transpose(1, 2), v.transpose(1, 2)
                    record(dict(case, cache="cache_seqlens"), "flashfuse", lambda: flashfuse.attention_with_kvcache(
                        q, kc, vc, lens), M, B, N, cache_bytes)
                    page = 16 if args.smoke else 256
                    per_row = M // page
                    kp = kc.reshape(B * per_row, page, hkv, d)
                    vp = vc.reshape(B * per_row, page, hkv, d)
                    perm = torch.randperm(B * per_row, device=device, generator=gen)
                    kp, vp = kp[perm].contiguous(), vp[perm].contiguous()
                    table = torch.argsort(perm).view(B, per_row).to(torch.int32)
                    record(dict(case, cache=f"paged {page}"), "flashfuse", lambda: flashfuse.attention_with_kvcache(
                        q, kp, vp, lens, table), M, B, N, cache_bytes)
                    del kp, vp, kc, vc
                del q, k, v
                common.free_memory()
    report(res, args)


def report(res, args):
    common.tables_header()
    ok = [r for r in res.rows if r.get("status") == "ok"]
    bw = next((r["bandwidth_tbs"] for r in ok if isinstance(r.get("bandwidth_tbs"), float)), float("nan"))
    print(f"device copy bandwidth: {common.fmt(bw, 2)} TB/s; floor = time to read K and V once at it")
    by_case = {}
    for r in res.rows:
        by_case.setdefault((r["B"], r["N"], r["M"], r["cache"]), {})[r["provider"]] = r
    rows = []
    for (B, N, M, cache), prov in by_case.items():
        ff, sd = prov.get("flashfuse", {}), prov.get("sdpa", {})
        speed = (sd["us"] / ff["us"]) if ff.get("status") == "ok" and sd.get("status") == "ok" else float("nan")
        floor = ff.get("floor_us", float("nan")) if ff.get("status") == "ok" else float("nan")
        floor = floor if isinstance(floor, float) else float("nan")  # '' in a CSV row without it
        row = [B, N, M, cache, common.cell(ff, "us"), common.cell(ff, "us_graph"), common.cell(sd, "us"),
               common.cell(sd, "us_graph"), common.fmt(speed, 2), common.fmt(floor),
               common.fmt(ff["us"] / floor if floor == floor and floor > 0 else float("nan"), 2)]
        if args.eager:
            loop = (sd["us_loop"] / ff["us_loop"] if ff.get("us_loop") and sd.get("us_loop") else float("nan"))
            row += [common.cell(ff, "us_loop"), common.cell(sd, "us_loop"), common.fmt(loop, 2)]
        rows.append(row)
    headers = ["B", "queries", "cached keys", "cache", "flashfuse us", "flashfuse graph us", "sdpa us",
               "sdpa graph us", "speed vs sdpa", "read floor us", "x floor"]
    if args.eager:
        headers += ["flashfuse loop us", "sdpa loop us", "loop speed vs sdpa"]
    common.print_table(rows, headers, title="Decoding (Hq 32, Hkv 8, D 128)")
    print(f"\nCSV: {res.path}")
    if args.no_plot:
        return
    panels = {}
    for (B, N, M, cache), prov in by_case.items():
        if cache != "contiguous":
            continue
        panel = panels.setdefault(f"B={B}, {N} quer{'y' if N == 1 else 'ies'}", {})
        for name, key, src in (("flashfuse", "us", "flashfuse"), ("sdpa", "us", "sdpa"),
                               ("read floor", "floor_us", "flashfuse")):
            r = prov.get(src, {})
            xs, ys = panel.setdefault(name, ([], []))
            xs.append(M)
            ys.append(r.get(key, float("nan")) if r.get("status") == "ok" else float("nan"))
    path = os.path.join(args.out, "decode.png" if not args.smoke else "decode_smoke.png")
    written = common.plot_panels(path, panels, xlabel="cached keys", ylabel="time (us)", logx=True, logy=True)
    if written:
        print(f"plot: {written}")


if __name__ == "__main__":
    main()
