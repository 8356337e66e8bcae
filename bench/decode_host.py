"""Host time of eager decoding: the Hugging Face hook's call per layer per
token against SDPA, and ``generate()`` with a dynamic cache (eager,
host-bound). flashfuse runs in four variants: as it is ("flashfuse": the
eager fast path's decode lane, ``flashfuse.fastpath``, the split kernel
merging its own partials, scratch buffers kept per stream), allocating its
scratch at every call ("no workspaces", ``decode.WORKSPACES = False``),
with the combine kernel after the split kernel ("combine kernel",
``decode.FUSE_COMBINE = False``), and without the lane ("no lane").

Decode calls: one query, Hq = 32, Hkv = 8, D = 128, bf16, 4k cached keys,
called as a LLaMA layer calls the hook (``flashfuse_attention_forward``, no
mask) and, for SDPA, as transformers' SDPA integration does
(``enable_gqa``, then the output transposed to (B, N, H, D)). Two caches: a
fixed one, and a dynamic one one key longer at every call (each length a
fresh contiguous tensor, all views of one buffer). Each variant runs a loop
of calls with one synchronisation at the end (microseconds per call: the
throughput of a host-bound caller); the variants alternate over several
rounds in one process and the median is reported, because the host's speed
drifts between processes more than the differences measured here.

Device time of one call (``queued_device_us``: the L2 cache flushed, then
the call queued behind a GPU sleep, so that its host time never counts):
flashfuse with and without the combine kernel, and SDPA, at 4k and 32k keys,
alternating.

``generate()``: ``bench_generate.py``'s model (LLaMA-shaped, head dim 128,
16 query and 4 key/value heads, 4 layers), prompt 512, batch 1 and 8,
greedy, the five variants alternating (``--no-generate`` skips it).

    python bench/decode_host.py
    python bench/decode_host.py --smoke --out /tmp/x      # tiny, on the CPU
"""

from __future__ import annotations

import contextlib
import statistics
import time
import types

import common
import torch
import torch.nn.functional as F

VARIANTS = ("flashfuse", "no workspaces", "combine kernel", "no lane", "sdpa")


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per measurement")
    p.add_argument("--calls", type=int, default=1500, help="calls per loop")
    p.add_argument("--new", type=int, default=128, help="new tokens per generate() call")
    p.add_argument("--no-generate", action="store_true", help="skip the generate() rows")
    return p.parse_args()


@contextlib.contextmanager
def _variant(name: str):
    """flashfuse as ``name`` has it, every fast-path signature forgotten first."""
    from flashfuse import fastpath
    from flashfuse.kernels import decode

    if name == "no lane":
        with fastpath.decode_lane_off():
            yield
        return
    fastpath.forget_signatures()
    decode.FUSE_COMBINE = name != "combine kernel"
    decode.WORKSPACES = name != "no workspaces"
    try:
        yield
    finally:
        decode.FUSE_COMBINE = decode.WORKSPACES = True


def _dtype(device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def decode_calls(device, rounds: int, calls: int, smoke: bool) -> list:
    import flashfuse.hf as hf

    B, Hq, Hkv, M, D = (1, 4, 2, 64, 16) if smoke else (1, 32, 8, 4096, 128)
    dtype = _dtype(device)
    q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
    buf = torch.randn(B * Hkv * (M + calls + 64) * D, device=device, dtype=dtype)
    layer = types.SimpleNamespace(training=False, is_causal=True, config=None, layer_idx=0)

    def ffuse(k):
        return hf.flashfuse_attention_forward(layer, q, k, k, None, dropout=0.0, scaling=D ** -0.5)[0]

    def sdpa(k):
        return F.scaled_dot_product_attention(q, k, k, enable_gqa=True).transpose(1, 2).contiguous()

    def loop(fn, ks) -> float:
        for k in ks[:20]:
            fn(k)
        common.sync(device)
        t0 = time.perf_counter()
        for k in ks:
            fn(k)
        common.sync(device)
        return (time.perf_counter() - t0) / len(ks) * 1e6

    caches = {"fixed": [common.cache_view(buf, B, Hkv, M, D)] * calls,
              "growing": [common.cache_view(buf, B, Hkv, M + i, D) for i in range(calls)]}
    times = {}
    with torch.no_grad():
        for r in range(rounds):
            for name in common.alternating(VARIANTS, r):
                for cache, ks in caches.items():
                    with _variant(name):
                        times.setdefault((name, cache), []).append(loop(sdpa if name == "sdpa" else ffuse, ks))
    rows = []
    for cache in caches:
        for name in VARIANTS:
            t = times[(name, cache)]
            rows.append(dict(what="decode call", cache=cache, variant=name, B=B, Hq=Hq, Hkv=Hkv, M=M, D=D,
                             us_per_call=statistics.median(t), rounds=" ".join(f"{x:.1f}" for x in t)))
            print(f"decode call {cache} {name}: {rows[-1]['us_per_call']:.1f} us", flush=True)
    return rows


def queued_device_us(fn, device, reps: int = 25) -> float:
    """Median device microseconds of ``fn()``'s launches, from CUDA events
    around them, with the launches queued behind a 1-2 ms GPU sleep that
    the host outruns (a slower host than the kernels would otherwise be
    timed), after a 256 MB write that empties the L2 cache. CPU: wall time."""
    if device.type != "cuda":
        return 1e3 * common.bench_ms(fn, device, 5, 20)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(2_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def capture_check_us(device, calls: int = 20000) -> float:
    """Host microseconds of ``torch.cuda.is_current_stream_capturing()``,
    which every eager decode call asks (the fused combine is not taken
    under capture)."""
    if device.type != "cuda":
        return float("nan")
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.cuda.is_current_stream_capturing()
    return (time.perf_counter() - t0) / calls * 1e6


def device_rows(device, rounds: int, smoke: bool) -> list:
    import flashfuse.hf as hf

    names = ("flashfuse", "combine kernel", "sdpa")
    B, Hq, Hkv, D = (1, 4, 2, 16) if smoke else (1, 32, 8, 128)
    dtype = _dtype(device)
    layer = types.SimpleNamespace(training=False, is_causal=True, config=None, layer_idx=0)
    rows = []
    for M in ((64,) if smoke else (4096, 32768)):
        q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
        k, v = (torch.randn(B, Hkv, M, D, device=device, dtype=dtype) for _ in range(2))
        fns = {"flashfuse": lambda: hf.flashfuse_attention_forward(layer, q, k, v, None, scaling=D ** -0.5),
               "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).contiguous()}
        fns["combine kernel"] = fns["flashfuse"]
        times = {}
        with torch.no_grad():
            for r in range(rounds):
                for name in common.alternating(names, r):
                    with _variant(name):
                        times.setdefault(name, []).append(queued_device_us(fns[name], device))
        for name in names:
            t = times[name]
            rows.append(dict(what="device time", cache="fixed", variant=name, B=B, Hq=Hq, Hkv=Hkv, M=M, D=D,
                             us_per_call=statistics.median(t), rounds=" ".join(f"{x:.1f}" for x in t)))
            print(f"device time M={M} {name}: {rows[-1]['us_per_call']:.1f} us", flush=True)
    return rows


def generate_rows(device, rounds: int, new: int, smoke: bool) -> list:
    import bench_generate as bg

    prompt = 16 if smoke else 512
    cfg = bg.config(smoke, prompt + new + 64)
    dtype = _dtype(device)
    model = bg.build(cfg, dtype, device)
    rows = []
    for B in ((1,) if smoke else (1, 8)):
        ids = torch.randint(1, cfg.vocab_size, (B, prompt), device=device)
        tps = {}
        for r in range(-1, rounds):
            for name in common.alternating(VARIANTS, r):
                with _variant(name):
                    common.sync(device)
                    t0 = time.perf_counter()
                    bg.generate(model, "sdpa" if name == "sdpa" else "ffuse", ids, new, "dynamic")
                    common.sync(device)
                    if r >= 0:
                        tps.setdefault(name, []).append(B * new / (time.perf_counter() - t0))
        for name in VARIANTS:
            rows.append(dict(what="generate dynamic", cache="dynamic", variant=name, B=B, prompt=prompt, new=new,
                             tokens_per_s=statistics.median(tps[name]),
                             rounds=" ".join(f"{x:.0f}" for x in tps[name])))
            print(f"generate B={B} {name}: {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    return rows


def main():
    args = parse_args()
    device, _ = common.start(args)
    rounds, calls, new = (2, 30, 4) if args.smoke else (args.rounds, args.calls, args.new)
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("decode_host.py times the CUDA launch path: run it on a GPU (or --smoke)")
    results = common.Results(args.out, "decode_host.csv", common.env_info(device))
    t0 = time.perf_counter()
    measured = decode_calls(device, rounds, calls, args.smoke)
    print(f"decode calls done in {time.perf_counter() - t0:.0f} s", flush=True)
    measured += device_rows(device, rounds, args.smoke)
    print(f"device times done in {time.perf_counter() - t0:.0f} s", flush=True)
    measured.append(dict(what="capture check", variant="is_current_stream_capturing",
                         us_per_call=capture_check_us(device)))
    if not args.no_generate:
        measured += generate_rows(device, max(2, rounds // 2), new, args.smoke)
        print(f"generate done in {time.perf_counter() - t0:.0f} s", flush=True)
    for row in measured:
        results.add(**row)
    common.tables_header()
    calls_rows = [[r["cache"], r["variant"], common.fmt(r["us_per_call"], 1)] for r in results.rows
                  if r["what"] == "decode call"]
    common.print_table(calls_rows, ["cache", "variant", "us per call"],
                       title="eager decode call as the HF hook makes it (median of alternating rounds)")
    dev_rows = [[r["M"], r["variant"], common.fmt(r["us_per_call"], 1)] for r in results.rows
                if r["what"] == "device time"]
    common.print_table(dev_rows, ["keys", "variant", "us per call"], title="device time of one call (queued)")
    print("".join(f"\nhost time of torch.cuda.is_current_stream_capturing(): {common.fmt(r['us_per_call'], 2)} us"
                  for r in results.rows if r["what"] == "capture check"))
    gen_rows = [[r["B"], r["variant"], common.fmt(r["tokens_per_s"], 0)] for r in results.rows
                if r["what"] == "generate dynamic"]
    if gen_rows:
        common.print_table(gen_rows, ["batch", "variant", "tok/s"], title="generate(), dynamic cache, prompt 512")


if __name__ == "__main__":
    main()
