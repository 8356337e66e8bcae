"""Device time of each attention kernel per tile config, from the CUDA
profiler: kernel durations only, so host time never counts, even at shapes
where launching takes longer than computing (GPT-2's). The evidence behind
the best-first config lists in ``flashfuse/kernels``.

For each case it forces every candidate config of one kernel in turn (the
other kernels keep their first candidate), runs forward+backward ``--reps``
times under ``torch.profiler`` and records the median duration of each
flashfuse kernel; SDPA's default backend is profiled the same way for
reference. A config that does not compile or fit is recorded with its error.
Prints one table per case and a summary (best config per kernel, sum of the
best against SDPA), and writes ``kernel_times.csv``.

    python bench/kernel_times.py --cases "gpt2 drop,gpt2 nodrop"
    python bench/kernel_times.py --kernels fwd,dq --one-pass
    python bench/kernel_times.py --smoke     # CPU: lists what it would time
"""

from __future__ import annotations

import os
import statistics

import common
import torch
import torch.nn.functional as F

# name: (B, H, N, D, causal, dropout_p[, mask]); mask "causal-float": flashfuse
# gets the causal mask as a float tensor, SDPA is_causal (what its users get).
CASES = {n: common.KERNEL_CASES[n] for n in ("gpt2 drop", "gpt2 nodrop", "d128 4k drop", "d128 4k causal",
                                             "d64 4k causal", "gpt2 fmask drop", "llama fmask")}
SMOKE_CASES = {"tiny drop": (1, 2, 64, 32, True, 0.1)}

# Kernel name in the profile -> the config list it draws from.
KERNELS = {"fwd": "_attn_fwd", "dkdv": "_bwd_dkdv", "dq": "_bwd_dq", "dkdv_dq": "_bwd_dkdv"}


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--cases", default=None, help=f"comma-separated names from {list(common.KERNEL_CASES)}")
    p.add_argument("--kernels", default="fwd,dkdv,dq", help="kernels whose configs to sweep: fwd, dkdv, dq")
    p.add_argument("--one-pass", action="store_true", help="also sweep the one-pass dK/dV+dQ kernel")
    p.add_argument("--reps", type=int, default=10, help="profiled forward+backward steps per config")
    p.add_argument("--max-configs", type=int, default=0, help="sweep only the first N candidates (0: all)")
    p.add_argument("--tiles", default=None,
                   help="sweep these tiles instead of the candidate lists, e.g. '128,64,8,3;128,128,8,3'")
    return p.parse_args()


def candidates(kind: str, D: int, limit: int = 0, tiles: str | None = None) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, warps, stages) candidates of a kernel for head dim D,
    the first ``limit`` of them if ``limit > 0``; ``tiles`` ("bm,bn,w,s;...")
    replaces the kernel's own list."""
    from flashfuse.kernels import backward, forward

    if tiles:
        return [tuple(int(x) for x in t.split(",")) for t in tiles.split(";") if t.strip()]
    if kind == "fwd":
        tiles = list(forward._CUDA_CONFIGS)
    else:
        tiles = backward._DQ_TILES if kind == "dq" else backward._DKDV_TILES
        tiles = list(tiles[64 if D <= 64 else 128 if D <= 128 else 256])
    return tiles[:limit] if limit > 0 else tiles


class forced:
    """Context manager: kernel ``kind`` runs config ``tile`` (and nothing else)."""

    def __init__(self, kind: str, tile: tuple | None):
        self.kind, self.tile = kind, tile

    def __enter__(self):
        from flashfuse.kernels import backward, forward

        self.saved = (forward._FWD_CONFIGS, dict(backward._CONFIGS), backward._DKDV_TILES, backward._DQ_TILES)
        if self.tile is not None:
            bm, bn, w, s = self.tile
            if self.kind == "fwd":
                forward._FWD_CONFIGS = [forward.triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w,
                                                               num_stages=s)]
            else:
                only = {c: [self.tile] for c in (64, 128, 256)}
                if self.kind == "dq":
                    backward._DQ_TILES = only
                else:
                    backward._DKDV_TILES = only
                backward._CONFIGS[self.kind] = [backward._cfg(*self.tile)]
        _forget_choices()
        return self

    def __exit__(self, *exc):
        from flashfuse.kernels import backward, forward

        forward._FWD_CONFIGS, configs, backward._DKDV_TILES, backward._DQ_TILES = self.saved
        backward._CONFIGS.clear()
        backward._CONFIGS.update(configs)
        _forget_choices()


def _forget_choices():
    from flashfuse.kernels import backward, forward

    for launcher in (forward._attn_fwd_launcher, *backward._LAUNCHERS.values()):
        launcher.forget()


def profile_kernels(step, reps: int) -> dict[str, list[float]]:
    """Durations (µs) of every CUDA kernel launched by ``reps`` calls of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(e.name, []).append(e.time_range.elapsed_us())
    return times


def main():
    args = parse_args()
    common.quiet_warnings()
    device = common.pick_device(args)
    cases = SMOKE_CASES if args.smoke else CASES
    if args.cases:
        cases = {n.strip(): common.KERNEL_CASES[n.strip()] for n in args.cases.split(",")}
    kinds = [k.strip() for k in args.kernels.split(",")] + (["dkdv_dq"] if args.one_pass else [])
    if args.smoke or device.type != "cuda":
        for name, (B, H, N, D, causal, p, *_) in cases.items():
            for kind in kinds:
                print(f"{name}: {kind} candidates {candidates(kind, D, args.max_configs, args.tiles)}")
        return

    import flashfuse

    res = common.Results(args.out, "kernel_times.csv", common.env_info(device))
    # Which loads the kernels use when FLASHFUSE_TMA forces one kind.
    loads = {"1": " (tma)", "0": " (pointers)"}.get(os.environ.get("FLASHFUSE_TMA", ""), "")
    summary = []
    for name, (B, H, N, D, causal, p, *mask_kind) in cases.items():
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn_like(q)
        mask = None
        if mask_kind == ["causal-float"]:
            later = torch.ones(N, N, dtype=torch.bool, device=device).triu(1)
            mask = torch.zeros(B, 1, N, N, dtype=torch.bfloat16, device=device).masked_fill(
                later, torch.finfo(torch.bfloat16).min)

        def step(fn):
            def run():
                out = fn(q, k, v)
                torch.autograd.grad(out, (q, k, v), g)
            return run

        ff = step(lambda q, k, v: flashfuse.attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=p))
        sdpa = step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal or mask is not None,
                                                                   dropout_p=p))
        sdpa_times = profile_kernels(sdpa, args.reps)
        sdpa_us = sum(statistics.median(t) for t in sdpa_times.values())
        for kname, t in sorted(sdpa_times.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"{name:16s} sdpa kernel {statistics.median(t):8.1f} us  {kname[:90]}")
        res.add(case=name, kernel="sdpa (all kernels)", config="default", us=sdpa_us, status="ok", error="")
        # flashfuse as a user runs it: default schedule and configs, mask tables included.
        ff_times = profile_kernels(ff, args.reps)
        ff_us = sum(statistics.median(t) for t in ff_times.values())
        for kname, t in sorted(ff_times.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"{name:16s} flashfuse kernel {statistics.median(t):8.1f} us  {kname[:80]}")
        res.add(case=name, kernel="flashfuse (all kernels)" + loads, config="default", us=ff_us, status="ok", error="")
        best = {}
        for kind in kinds:
            os.environ["FLASHFUSE_BWD"] = "one_pass" if kind == "dkdv_dq" else "two_pass"
            for tile in candidates(kind, D, args.max_configs, args.tiles):
                try:
                    with forced(kind, tile):
                        times = profile_kernels(ff, args.reps)
                    us = statistics.median(times[KERNELS[kind]])
                    row = res.add(case=name, kernel=kind + loads, config=str(tile), us=us, status="ok", error="")
                    if kind not in best or us < best[kind][1]:
                        best[kind] = (tile, us)
                except Exception as e:  # does not compile / fit: record it, go on
                    row = res.add(case=name, kernel=kind + loads, config=str(tile), us=float("nan"), status="error",
                                  error=common.short_error(e))
                print(f"{name:16s} {kind:8s} {row['config']:18s} {common.cell(row, 'us')} us", flush=True)
        os.environ.pop("FLASHFUSE_BWD", None)
        two = sum(best[kk][1] for kk in ("fwd", "dkdv", "dq") if kk in best)
        summary.append([name, *(f"{best[kk][0]} {best[kk][1]:.0f}" if kk in best else "-" for kk in kinds),
                        f"{two:.0f}", f"{ff_us:.0f}", f"{sdpa_us:.0f}"])
    common.tables_header()
    common.print_table(summary, ["case", *(f"best {k} (µs)" for k in kinds), "fwd+dkdv+dq µs",
                                 "flashfuse default, all kernels µs", "SDPA µs"],
                       title="fastest config per kernel (device time, median of the profiled steps)")
    print(f"\n{len(res.rows)} rows -> {res.path}")


if __name__ == "__main__":
    main()
