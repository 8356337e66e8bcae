"""Data-parallel training benchmark: DDP and FSDP2 with ``torch.compile``,
attention by flashfuse's backend or by SDPA.

Models (random init, bf16, nothing downloaded): GPT-2 124M
(GPT2LMHeadModel) and a LLaMA-shaped model with head dim 128
(LlamaForCausalLM: hidden 2048, 16 query / 4 key-value heads, 8 layers).
Variants: ``flashfuse`` (transformers' eager attention compiled with
``flashfuse.backend``, which rewrites it into the flash op) and ``sdpa``
(transformers' SDPA attention compiled with Inductor). Wrappers:
``DistributedDataParallel`` and FSDP2 (``fully_shard`` per block, then the
root). Each row: median step time (forward, backward, AdamW; slowest rank),
tokens per second per GPU, peak memory per GPU, compile time (first step),
attentions rewritten. One CSV per world size (``data_parallel_<W>gpu.csv``).

    torchrun --standalone --nproc-per-node 8 bench/bench_data_parallel.py
    torchrun --standalone --nproc-per-node 2 bench/bench_data_parallel.py --models gpt2 --wrappers ddp
    python bench/bench_data_parallel.py --smoke --out /tmp/x   # world size 1, CPU, gloo
"""

from __future__ import annotations

import statistics
import time

import common
import torch
import torch.distributed as dist
from distcommon import start

MODELS = ["gpt2", "llama"]
VARIANTS = ["flashfuse", "sdpa"]
WRAPPERS = ["ddp", "fsdp2"]


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=480)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--wrappers", default=",".join(WRAPPERS))
    p.add_argument("--batch", type=int, default=8, help="sequences per GPU (default 8)")
    p.add_argument("--t", type=int, default=1024, help="sequence length (default 1024)")
    p.add_argument("--steps", type=int, default=10, help="timed steps after 3 warm-up steps")
    return p.parse_args()


def config(model: str, smoke: bool, T: int):
    """Training configs: no KV cache (under FSDP2 each block is its own
    compiled frame, and a cache passed to it adds a guard per layer that
    recompiles every block until Dynamo's recompile limit sends the rest to
    eager)."""
    from transformers import GPT2Config, LlamaConfig

    if model == "gpt2":
        if smoke:
            return GPT2Config(vocab_size=128, n_positions=T, n_embd=64, n_layer=2, n_head=2, use_cache=False)
        return GPT2Config(n_positions=max(1024, T), use_cache=False)
    if smoke:
        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T,
                           use_cache=False)
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=T,
                       use_cache=False)


def build(model: str, variant: str, wrapper: str, smoke: bool, T: int, device, dtype):
    import transformers

    import flashfuse

    cls = transformers.GPT2LMHeadModel if model == "gpt2" else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    net = cls._from_config(config(model, smoke, T), attn_implementation="eager" if variant == "flashfuse" else "sdpa")
    net = net.to(device=device, dtype=dtype).train()
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        blocks = net.transformer.h if model == "gpt2" else net.model.layers
        for block in blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(net, mesh=mesh)
    # The smoke run checks the path, not Inductor's CPU code generation.
    compiler = "aot_eager" if smoke else "inductor"
    backend = flashfuse.make_backend(compiler=compiler, record=True) if variant == "flashfuse" else compiler
    return net, torch.compile(wrapped, backend=backend), backend


def main():
    args = parse_args()
    device, world, rank = start(args)
    B, T, steps = (2, 32, 2) if args.smoke else (args.batch, args.t, args.steps)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    budget = common.make_budget(args)
    env = {**common.env_info(device), "world_size": world}
    res = common.Results(args.out, f"data_parallel_{world}gpu.csv", env) if rank == 0 else None
    for model in [m for m in args.models.split(",") if m]:
        for wrapper in [w for w in args.wrappers.split(",") if w]:
            for variant in [v for v in args.variants.split(",") if v]:
                row = dict(model=model, wrapper=wrapper, variant=variant, world_size=world, batch_per_gpu=B, seq_len=T)
                status, times, compile_s, peak, rewritten = "ok", [], float("nan"), float("nan"), ""
                if budget.exceeded():
                    status = "skipped: time budget"
                else:
                    try:
                        torch._dynamo.reset()
                        net, compiled, backend = build(model, variant, wrapper, args.smoke, T, device, dtype)
                        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
                        g = torch.Generator(device=device).manual_seed(rank)
                        ids = torch.randint(0, net.config.vocab_size, (B, T), generator=g, device=device)

                        def step():
                            loss = compiled(input_ids=ids, labels=ids).loss
                            loss.backward()
                            opt.step()
                            opt.zero_grad(set_to_none=True)

                        t0 = time.perf_counter()
                        step()
                        common.sync(device)
                        compile_s = time.perf_counter() - t0
                        for _ in range(2):
                            step()
                        if device.type == "cuda":
                            torch.cuda.reset_peak_memory_stats(device)
                        for _ in range(steps):
                            common.sync(device)
                            dist.barrier()
                            t0 = time.perf_counter()
                            step()
                            common.sync(device)
                            times.append((time.perf_counter() - t0) * 1e3)
                        if device.type == "cuda":
                            peak = torch.cuda.max_memory_allocated(device) / 2**20
                        if variant == "flashfuse":
                            cands = backend.candidates
                            rewritten = f"{sum(c.rewritten for c in cands)}/{len(cands)}"
                    except Exception as exc:  # noqa: BLE001 - a row, not a crash
                        status = "OOM" if common.is_oom(exc) else f"error: {common.short_error(exc)}"
                    finally:
                        net = compiled = backend = opt = None  # noqa: F841
                        common.free_memory(collect=True)
                ms = statistics.median(times) if times else float("nan")
                stats = torch.tensor([ms, peak], dtype=torch.float64, device=device)
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                ms, peak = float(stats[0]), float(stats[1])
                row.update(status=status, step_ms=ms, tokens_per_s_per_gpu=B * T / (ms * 1e-3) if times else
                           float("nan"), peak_mib_per_gpu=peak, compile_s=compile_s, rewritten=rewritten)
                if res is not None:
                    res.add(**row)
                    print(f"{model} {wrapper} {variant} W={world}: {status} {ms:.1f} ms/step "
                          f"{row['tokens_per_s_per_gpu']:.0f} tok/s/GPU rewritten {rewritten}", flush=True)
    if res is not None:
        common.tables_header()
        table = [[r["model"], r["wrapper"], r["variant"], common.fmt(r["step_ms"], 1),
                  common.fmt(r["tokens_per_s_per_gpu"], 0), common.fmt(r["peak_mib_per_gpu"], 0),
                  common.fmt(r["compile_s"], 1), r["rewritten"], r["status"][:60]] for r in res.rows]
        common.print_table(table, ["model", "wrapper", "attention", "ms/step", "tok/s/GPU", "peak MiB",
                                   "compile s", "rewritten", "status"],
                           title=f"data parallel, {world} GPU(s), B={B}/GPU, T={T}")
        print(f"wrote {res.path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
