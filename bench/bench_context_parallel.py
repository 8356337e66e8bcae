"""Context-parallel benchmark: one causal attention layer, forward+backward,
with the sequence sharded over the GPUs of one host.

flashfuse's ring attention (``flashfuse.ring_attention``, load-balanced
sharding) against PyTorch's own context parallelism over SDPA
(``torch.distributed.tensor.experimental.context_parallel``), same shapes,
same run. Two sweeps: strong scaling (``--lengths``: global sequence lengths,
split over the world) and weak scaling (``--tokens-per-gpu``: the global
length grows with the world). Each row: time per fwd+bwd (slowest rank),
TFLOP/s per GPU, peak memory per GPU. The scaling efficiency needs the rows of
several world sizes: run once per GPU count into the same --out directory
(one CSV per world size, ``context_parallel_<W>gpu.csv``) and compare.

    torchrun --standalone --nproc-per-node 8 bench/bench_context_parallel.py
    torchrun --standalone --nproc-per-node 1 bench/bench_context_parallel.py --lengths 131072
    python bench/bench_context_parallel.py --smoke --out /tmp/x   # world size 1, CPU, gloo
"""

from __future__ import annotations

import time

import common
import torch
import torch.distributed as dist
from distcommon import start

PROVIDERS = ["flashfuse_ring", "torch_cp_sdpa"]


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=420)
    p.add_argument("--lengths", default=None, help="strong scaling: global lengths (default 131072,262144,524288)")
    p.add_argument("--tokens-per-gpu", default=None, help="weak scaling: tokens per GPU (default 32768,65536)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(common.DTYPES))
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--reps", type=int, default=5, help="timed fwd+bwd calls per row (after one warm-up)")
    return p.parse_args()


def timed(fn, device, reps) -> tuple[float, float]:
    """(ms per call on the slowest rank, peak MiB on the largest rank)."""
    fn()  # warm-up (kernel choice, compiled code)
    common.sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    common.sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / reps
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    stats = torch.tensor([ms, peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return float(stats[0]), float(stats[1])


def ring_step(q, k, v, do):
    import flashfuse

    def step():
        for t in (q, k, v):
            t.grad = None
        flashfuse.ring_attention(q, k, v, is_causal=True).backward(do)

    return step


def torch_cp_step(full_q, full_k, full_v, full_do, device, world):
    """PyTorch's context parallelism: the buffers are sharded in place on
    entering the context; SDPA inside it runs its ring. Needs CUDA (it
    dispatches the CUDA SDPA kernels)."""
    if device.type != "cuda":
        raise common.Unsupported("PyTorch's context_parallel dispatches CUDA SDPA kernels only")
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    try:  # load balancing for causal attention (a private option, named differently across versions)
        from torch.distributed.tensor.experimental._attention import _cp_options

        _cp_options.enable_load_balance = True
    except (ImportError, AttributeError):
        pass
    mesh = init_device_mesh("cuda", (world,))
    bufs = [full_q.detach().clone(), full_k.detach().clone(), full_v.detach().clone(), full_do.clone()]
    ctx = context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs))

    def step():
        q, k, v = (b.detach().requires_grad_() for b in bufs[:3])
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(bufs[3])

    return ctx, step


def main():
    args = parse_args()
    device, world, rank = start(args)
    if args.smoke:
        lengths, per_gpu, H, D, dtype, reps = [64], [32], 2, 16, torch.float32, 1
    else:
        lengths = [int(x) for x in (args.lengths or "131072,262144,524288").split(",") if x]
        per_gpu = [int(x) for x in (args.tokens_per_gpu or "32768,65536").split(",") if x]
        H, D, dtype, reps = args.heads, args.head_dim, common.DTYPES[args.dtype], args.reps
    providers = [p for p in args.providers.split(",") if p]
    budget = common.make_budget(args)
    env = {**common.env_info(device), "world_size": world}
    res = common.Results(args.out, f"context_parallel_{world}gpu.csv", env) if rank == 0 else None
    from flashfuse.parallel import shard

    cases = [("strong", n) for n in lengths] + [("weak", t * world) for t in per_gpu]
    for scaling, N in cases:
        for provider in providers:
            row = dict(provider=provider, scaling=scaling, world_size=world, seq_len=N, tokens_per_gpu=N // world,
                       heads=H, head_dim=D, dtype=common.DTYPE_NAMES[dtype])
            status, ms, peak = "ok", float("nan"), float("nan")
            if budget.exceeded():
                status = "skipped: time budget"
            else:
                try:
                    if N % (2 * world):
                        raise common.Unsupported(f"length {N} not divisible by 2 x world size")
                    g = torch.Generator(device=device).manual_seed(0)
                    full = [torch.randn(1, H, N, D, generator=g, device=device, dtype=dtype) for _ in range(4)]
                    if provider == "flashfuse_ring":
                        q, k, v = (shard(t).requires_grad_() for t in full[:3])
                        ms, peak = timed(ring_step(q, k, v, shard(full[3])), device, reps)
                    else:
                        ctx, step = torch_cp_step(*full, device, world)
                        with ctx:
                            ms, peak = timed(step, device, reps)
                except common.Unsupported as exc:
                    status = f"skipped: {exc}"
                except Exception as exc:  # noqa: BLE001 - a row, not a crash
                    status = "OOM" if common.is_oom(exc) else f"error: {common.short_error(exc)}"
                finally:
                    full = q = k = v = None  # noqa: F841
                    common.free_memory(collect=status != "ok")
            flops = common.attention_flops(1, H, N, N, D, D, causal=True, mode="fwd+bwd")
            row.update(status=status, ms=ms, tflops_per_gpu=common.tflops(flops / world, ms) if status == "ok"
                       else float("nan"), peak_mib_per_gpu=peak)
            if res is not None:
                res.add(**row)
                print(f"{provider:15s} {scaling:6s} W={world} N={N:8d}: {status} {ms:.2f} ms "
                      f"{row['tflops_per_gpu']:.1f} TFLOP/s/GPU {peak:.0f} MiB", flush=True)
    if res is not None:
        common.tables_header()
        table = [[r["provider"], r["scaling"], r["seq_len"], r["tokens_per_gpu"], common.fmt(r["ms"], 2),
                  common.fmt(r["tflops_per_gpu"]), common.fmt(r["peak_mib_per_gpu"], 0), r["status"][:60]]
                 for r in res.rows]
        common.print_table(table, ["provider", "scaling", "N", "N/GPU", "ms", "TFLOP/s/GPU", "peak MiB", "status"],
                           title=f"context parallel, {world} GPU(s), causal, H={H}, D={D}")
        print(f"wrote {res.path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
