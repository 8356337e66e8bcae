"""Generation benchmark: Hugging Face ``generate()`` with the ``ffuse`` hook
against ``attn_implementation="sdpa"``, tokens per second.

Model: a LLaMA-shaped decoder (random init, bf16; nothing is downloaded) with
head dim 128 and grouped heads (16 query, 4 key/value heads), 4 layers, so that
attention over the cache is a visible share of each step. Greedy decoding of
``--new`` tokens (default 256, forced: no early stop) after a prompt of 512 or
8k tokens, batch 1 and 8, with

* ``dynamic``: transformers' default dynamic cache, no compile;
* ``static``: ``cache_implementation="static"``, which transformers compiles
  itself (``torch.compile`` with CUDA graphs) on CUDA.

Each row times both implementations in alternating order (``--reps`` calls
each after a warm-up), the median per implementation. Before timing, each
cache kind checks that ``ffuse`` and ``sdpa`` produce the
same greedy tokens on a short fp32 prompt (column ``tokens_match``); bf16 rows
record the fraction of generated tokens that agree with ``sdpa`` (random
weights make near-ties common, so bf16 can diverge legitimately).

    python bench/bench_generate.py                 # the default grid
    python bench/bench_generate.py --smoke         # tiny model on the CPU
"""

from __future__ import annotations

import statistics
import time

import common
import torch

IMPLS = ("sdpa", "ffuse")


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=420)
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt", default="512,8192", help="prompt lengths, comma-separated")
    p.add_argument("--new", type=int, default=256, help="new tokens per sequence")
    p.add_argument("--caches", default="dynamic,static", help="cache kinds, comma-separated")
    p.add_argument("--reps", type=int, default=2, help="timed generate() calls per row (after one warm-up)")
    return p.parse_args()


def config(smoke: bool, max_len: int):
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=max_len)
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                       max_position_embeddings=max_len)


def build(cfg, dtype, device):
    import transformers

    import flashfuse.hf  # registers "ffuse"

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    return model.to(device, dtype).eval()


def generate(model, impl: str, ids, new: int, cache: str, **generate_kwargs):
    """Greedy ``generate()`` of exactly ``new`` tokens with ``impl``'s
    attention and ``cache`` ("dynamic" or "static"); ``generate_kwargs``
    go to ``model.generate`` (e.g. a logits processor)."""
    import flashfuse.hf

    model.set_attn_implementation(flashfuse.hf.ATTN_IMPLEMENTATION if impl == "ffuse" else impl)
    if cache == "static":
        generate_kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0, **generate_kwargs)


def tokens_match(cfg, device, cache: str) -> bool:
    """Greedy tokens of ``ffuse`` and ``sdpa`` on a short fp32 prompt."""
    model = build(cfg, torch.float32, device)
    ids = torch.randint(1, cfg.vocab_size, (2, 40), device=device)
    out = {impl: generate(model, impl, ids, 16, cache) for impl in IMPLS}
    return bool(torch.equal(out["ffuse"], out["sdpa"]))


def main():
    args = parse_args()
    device, budget = common.start(args)
    batches = [int(b) for b in args.batch.split(",")]
    prompts = [int(t) for t in args.prompt.split(",")]
    caches = args.caches.split(",")
    new = args.new
    if args.smoke:
        batches, prompts, new, caches = [1, 2], [16], 4, ["dynamic"]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    results = common.Results(args.out, "generate.csv", common.env_info(device))
    cfg = config(args.smoke, max(prompts) + new + 64)
    torch.manual_seed(0)
    match = {cache: tokens_match(cfg, device, cache) for cache in caches}
    model = build(cfg, dtype, device)
    try:
        for cache in caches:
            for T in prompts:
                for B in batches:
                    ids = torch.randint(1, cfg.vocab_size, (B, T), device=device)
                    run_row(model, ids, dict(cache=cache, batch=B, prompt=T, new=new, tokens_match=match[cache]),
                            args.reps, budget, results, device)
    except KeyboardInterrupt:
        print("interrupted: reporting what ran")
    report(results.rows, args)


def run_row(model, ids, base: dict, reps: int, budget, results, device) -> None:
    """One (cache, batch, prompt) row for both implementations: a warm-up
    call each (which compiles a static cache), then ``reps`` timed calls
    each in alternating order (sdpa, ffuse, ffuse, sdpa, ...), so that a
    drift of the machine over the row weighs on both alike."""
    T, new, cache = base["prompt"], base["new"], base["cache"]
    first, times, outs, failed = {}, {impl: [] for impl in IMPLS}, {}, {}
    if budget.exceeded():
        for impl in IMPLS:
            results.add(**base, impl=impl, status="skipped")
            print_row(results.rows[-1])
        return
    for rep in range(-1, reps):
        order = common.alternating(IMPLS, rep)
        for impl in order:
            if impl in failed:
                continue
            try:
                common.sync(device)
                t0 = time.perf_counter()
                outs[impl] = generate(model, impl, ids, new, cache)
                common.sync(device)
                dt = time.perf_counter() - t0
                if rep < 0:
                    first[impl] = dt
                else:
                    times[impl].append(dt)
            except Exception as exc:  # noqa: BLE001 - a failed row is recorded, the run goes on
                failed[impl] = common.short_error(exc)
                common.free_memory(collect=True)
    for impl in IMPLS:
        row = dict(base, impl=impl)
        if impl in failed:
            results.add(**row, status="error", error=failed[impl])
        else:
            s = statistics.median(times[impl])
            if impl == "ffuse" and "sdpa" in outs:  # the same tokens as SDPA's, as a share
                row["bf16_token_agreement"] = (outs["ffuse"][:, T:] == outs["sdpa"][:, T:]).float().mean().item()
            B = ids.shape[0]
            results.add(**row, status="ok", seconds=s, first_call_s=first[impl], tokens_per_s=B * new / s)
        print_row(results.rows[-1])


def print_row(r: dict) -> None:
    """One finished row, at once: a run cut short still shows what it measured."""
    what = (f"{common.fmt(r.get('tokens_per_s'), 0)} tok/s (first call {common.fmt(r.get('first_call_s'), 1)} s)"
            if r["status"] == "ok" else r["status"] + (f": {r['error']}" if r.get("error") else ""))
    print(f"{r['cache']:>8} batch {r['batch']:>2} prompt {r['prompt']:>5} {r['impl']:>6}: {what}", flush=True)


def report(rows, args):
    common.tables_header()
    lines = []
    keyed = {(r["cache"], r["batch"], r["prompt"], r["impl"]): r for r in rows}
    for (cache, B, T, impl), r in keyed.items():
        if impl != "ffuse":
            continue
        base = keyed.get((cache, B, T, "sdpa"), {})
        ratio = (r["tokens_per_s"] / base["tokens_per_s"]
                 if r.get("status") == "ok" and base.get("status") == "ok" else float("nan"))
        lines.append([cache, B, T, common.cell(base, "tokens_per_s", 0), common.cell(r, "tokens_per_s", 0),
                      common.fmt(ratio, 2), r.get("tokens_match"), common.fmt(r.get("bf16_token_agreement"), 2)])
    common.print_table(lines, ["cache", "batch", "prompt", "sdpa tok/s", "ffuse tok/s", "ffuse/sdpa",
                               "fp32 tokens equal", "bf16 agreement"],
                       title=f"generate(), {rows[0]['new'] if rows else '?'} new tokens, greedy")


if __name__ == "__main__":
    main()
