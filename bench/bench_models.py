"""Model benchmark: whole training steps and inference passes of Hugging Face
models, with attention left to flashfuse's torch.compile backend or to
PyTorch's own paths.

Models (random init, bf16; nothing is downloaded):

* ``gpt2``: GPT2LMHeadModel, 124M config, B=8, T in {1024, 2048}, one training
  step (forward, backward, AdamW step), attention dropout 0.1 in train mode.
* ``llama``: a small LlamaConfig with grouped heads (16 query, 4 key/value
  heads, head dim 64), B=4, T=2048: one training step and one inference pass.
* ``llama128``: LLaMA-shaped at head dim 128 (hidden 2048, 16 query and 4
  key/value heads, 8 layers), B=1, T=4096: training step and inference pass.
* ``bert``: a BERT-style encoder (BertForMaskedLM) with a padding mask
  (random lengths between T/2 and T), B=16, T=512: training step and
  inference pass.

Variants per model: ``eager`` / ``sdpa`` (transformers' attention
implementations), each also under default ``torch.compile``;
``eager+flashfuse`` (eager attention compiled with flashfuse's backend, which
rewrites the matmul-softmax-matmul into the flash op, then Inductor); and
``ffuse-hook`` (the ``attn_implementation="ffuse"`` hook of ``flashfuse.hf``, no
compile). Each row reports the median step time after warm-up, tokens/s,
peak memory, compile time and, for the flashfuse backend, how many attention
candidates it rewrote.

    python bench/bench_models.py                      # everything, default sizes
    python bench/bench_models.py --only gpt2 --t 1024
    python bench/bench_models.py --compile-scope block # compile each block (seconds)
    python bench/bench_models.py --smoke --out /tmp/x # tiny configs on the CPU
    python bench/bench_models.py --from-csv bench/results/models.csv --since "2026-11-30 18:00"
"""

from __future__ import annotations

import importlib.util
import math
import os
import time

import common
import torch

# (name, attn_implementation, compile with). Order = priority when the time
# budget runs out: the baselines and flashfuse first, compiled baselines after.
VARIANTS = [
    ("eager", "eager", None),
    ("sdpa", "sdpa", None),
    ("eager+flashfuse", "eager", "flashfuse"),
    ("sdpa+compile", "sdpa", "inductor"),
    ("eager+compile", "eager", "inductor"),
    ("ffuse-hook", "ffuse", None),
]


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=560)
    p.add_argument("--only", default=None, help="comma-separated subset of gpt2,llama,llama128,bert")
    p.add_argument("--t", default=None, help="GPT-2 sequence lengths, comma-separated (default 1024,2048)")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {[v[0] for v in VARIANTS]}")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 5; smoke 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row (the first compiles)")
    p.add_argument("--compile-scope", default="model", choices=["block", "model"],
                   help="torch.compile the whole model, as a user would (default; one large graph, about a "
                        "minute to compile with flashfuse) or each repeated transformer block (one graph serves "
                        "every layer, so compiling takes seconds, but the code between blocks runs eagerly)")
    p.add_argument("--from-csv", default=None,
                   help="measure nothing: redraw the tables and the plot from this CSV (the last row of each "
                        "model, T, task and variant wins)")
    p.add_argument("--since", default="",
                   help="with --from-csv: only rows whose date is at or after this 'YYYY-MM-DD HH:MM'")
    return p.parse_args()


# --------------------------------------------------------------------------
# Models and batches
# --------------------------------------------------------------------------

def gpt2_config(smoke: bool, T: int):
    from transformers import GPT2Config

    if smoke:
        return GPT2Config(vocab_size=128, n_positions=T, n_embd=64, n_layer=2, n_head=2)
    # The 124M configuration; n_positions grows with T (random init, so the
    # longer position table is just more parameters). Dropouts are GPT-2's 0.1.
    return GPT2Config(n_positions=max(1024, T))


# LLaMA-style sizes (hidden, intermediate, layers, query heads, key/value
# heads), full and smoke: ``llama`` at head dim 64, ``llama128`` at 128.
LLAMA_SIZES = {
    "llama": ((1024, 2816, 8, 16, 4), (64, 128, 2, 4, 2)),
    "llama128": ((2048, 5632, 8, 16, 4), (256, 256, 2, 2, 1)),
}


def llama_config(smoke: bool, T: int, model: str = "llama"):
    from transformers import LlamaConfig

    hidden, intermediate, layers, heads, kv_heads = LLAMA_SIZES[model][1 if smoke else 0]
    return LlamaConfig(vocab_size=128 if smoke else 32000, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=T)


def llama128_config(smoke: bool, T: int):
    return llama_config(smoke, T, "llama128")


def bert_config(smoke: bool, T: int):
    from transformers import BertConfig

    if smoke:
        return BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=T)
    return BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                      intermediate_size=3072, max_position_embeddings=T)


def build_model(model: str, config, attn: str):
    """A randomly initialised model with the given attention implementation."""
    import transformers

    if attn == "ffuse":
        import flashfuse.hf  # registers the implementation with transformers

        attn = flashfuse.hf.ATTN_IMPLEMENTATION
    cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "llama128": transformers.LlamaForCausalLM,
        "bert": transformers.BertForMaskedLM,
    }[model]
    return cls._from_config(config, attn_implementation=attn)


def make_batch(model: str, vocab: int, B: int, T: int, device, with_labels: bool) -> dict:
    """Random token ids (and labels = ids); BERT also gets a padding mask with
    each sequence's length drawn between T/2 and T."""
    ids = torch.randint(0, vocab, (B, T), device=device)
    batch = {"input_ids": ids}
    if model == "bert":
        lengths = torch.randint(T // 2, T + 1, (B, 1), device=device)
        batch["attention_mask"] = (torch.arange(T, device=device)[None, :] < lengths).long()
    else:
        # No KV cache: training and a full-sequence forward do not need one, and
        # updating it makes Dynamo specialise each layer (a recompile per block).
        batch["use_cache"] = False
    if with_labels:
        batch["labels"] = ids
    return batch


def repeated_blocks(model) -> list:
    """The transformer blocks: the longest ModuleList of identical modules."""
    best: list = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best) and len({type(b) for b in m}) == 1:
            best = list(m)
    if not best:
        raise RuntimeError("no repeated blocks found; use --compile-scope model")
    return best


# --------------------------------------------------------------------------
# One row
# --------------------------------------------------------------------------

def build_step(spec, variant, task, device, args, counter=None):
    """The model of ``spec`` with ``variant``'s attention and compiler, and
    ``step()``: one training step (forward, backward, AdamW) or one inference
    pass. Returns ``(step, flashfuse backend or None)``; ``counter["graphs"]``
    counts the graphs the flashfuse backend compiles."""
    _, attn, compiler = variant
    torch.manual_seed(0)
    config = spec["config"]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build_model(spec["model"], config, attn).to(device=device, dtype=dtype)
    model.train(task == "train")
    backend = ff_backend = None
    if compiler == "inductor":
        backend = "aot_eager" if args.smoke else "inductor"
    elif compiler == "flashfuse":
        from flashfuse.backend import make_backend

        # Inductor on GPU; on the CPU smoke run aot_eager keeps it in seconds.
        ff_backend = make_backend(compiler="aot_eager" if args.smoke else "inductor", record=True)

        def backend(gm, example_inputs):
            if counter is not None:
                counter["graphs"] += 1
            return ff_backend(gm, example_inputs)
    runner = model
    if backend is not None:
        if args.compile_scope == "model":
            runner = torch.compile(model, backend=backend)
        else:
            for blk in repeated_blocks(model):
                blk.compile(backend=backend)
    batch = make_batch(spec["model"], config.vocab_size, spec["B"], spec["T"], device, task == "train")
    if task == "train":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step():
            loss = runner(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        def step():
            with torch.no_grad():
                runner(**batch)
    return step, ff_backend


def run_row(results, spec, variant, task, device, args, budget):
    name, _, compiler = variant
    row = dict(model=spec["model"], task=task, variant=name, B=spec["B"], T=spec["T"],
               dtype="fp32" if args.smoke else "bf16", compile_scope=args.compile_scope if compiler else "")
    if budget.exceeded():
        results.add(**row, status="skipped", error="time budget")
        return
    step = None
    counter = {"graphs": 0}
    ff_backend = None
    try:
        torch._dynamo.reset()  # every compiled row compiles from scratch and is timed alike
        step, ff_backend = build_step(spec, variant, task, device, args, counter)
        t0 = time.perf_counter()
        step()  # compiles
        common.sync(device)
        first_s = time.perf_counter() - t0
        for _ in range(max(0, args.warmup - 1)):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        ms = common.wall_ms(step, device, args.steps)
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else math.nan
        extra = {}
        if ff_backend is not None:
            extra = dict(attn_rewritten=sum(c.rewritten for c in ff_backend.candidates),
                         attn_candidates=len(ff_backend.candidates), graphs=counter["graphs"],
                         layers=spec["config"].num_hidden_layers)
        results.add(**row, status="ok", ms=ms, tokens_per_s=spec["B"] * spec["T"] / (ms / 1e3),
                    peak_mem_mib=peak, first_step_s=first_s, **extra)
        print(f"{spec['model']:>5} T={spec['T']:<5} {task:<5} {name:<16} {ms:9.1f} ms  "
              f"first step {first_s:6.1f} s", flush=True)
    except Exception as exc:
        results.add(**row, status="OOM" if common.is_oom(exc) else "error", error=common.short_error(exc))
        print(f"{spec['model']:>5} T={spec['T']:<5} {task:<5} {name:<16} {common.short_error(exc)}", flush=True)
    finally:
        step = ff_backend = None  # release before the next row
        torch._dynamo.reset()
        common.free_memory(collect=True)


# Batch size and default sequence length of each model: (full run, --smoke).
SIZES = {"gpt2": ((8, 1024), (2, 32)), "llama": ((4, 2048), (2, 32)), "llama128": ((1, 4096), (1, 32)),
         "bert": ((16, 512), (2, 32))}


def model_spec(model: str, smoke: bool, T: int | None = None) -> dict:
    """One model's benchmark spec: name, batch size, sequence length, config."""
    B, default_T = SIZES[model][1 if smoke else 0]
    T = T or default_T
    config = {"gpt2": gpt2_config, "llama": llama_config, "llama128": llama128_config,
              "bert": bert_config}[model](smoke, T)
    return dict(model=model, B=B, T=T, config=config)


def plan(args) -> list[tuple[dict, str]]:
    """(model spec, task) pairs in run order: GPT-2 at the first T, then the
    LLaMA- and BERT-style models, then GPT-2 at the other lengths."""
    only = set(args.only.split(",")) if args.only else set(SIZES)
    unknown = only - set(SIZES)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; choose from {', '.join(SIZES)}")
    ts = [int(x) for x in args.t.split(",")] if args.t else ([32] if args.smoke else [1024, 2048])
    gpt2 = [model_spec("gpt2", args.smoke, T) for T in ts]
    out = []
    if "gpt2" in only:
        out.append((gpt2[0], "train"))
    for model in ("llama", "llama128", "bert"):
        if model in only:
            spec = model_spec(model, args.smoke)
            out += [(spec, "train"), (spec, "infer")]
    if "gpt2" in only:
        out += [(s, "train") for s in gpt2[1:]]
    return out


def latest_rows(rows: list[dict], since: str, scope: str) -> list[dict]:
    """The rows of one configuration from a CSV that holds many runs: dated at
    or after ``since``, compiled rows of ``scope`` only, the last row of each
    (model, T, task, variant) kept."""
    kept: dict[tuple, dict] = {}
    for r in rows:
        if str(r.get("date", "")) < since or r.get("compile_scope", "") not in ("", scope):
            continue
        kept[(r["model"], r["T"], r["task"], r["variant"])] = r
    return list(kept.values())


def plot(rows: list[dict], path: str) -> str | None:
    """Bars of step time and peak memory per variant, each relative to
    ``sdpa + compile`` of the same model, length and task (lower is better)."""
    ok = [r for r in rows if r["status"] == "ok"]
    groups = list(dict.fromkeys((r["model"], r["T"], r["task"]) for r in ok))
    base = {(r["model"], r["T"], r["task"]): r for r in ok if r["variant"] == "sdpa+compile"}
    groups = [g for g in groups if g in base]
    variants = [v[0] for v in VARIANTS if any(r["variant"] == v[0] for r in ok)]
    if not groups or not variants:
        return None
    plt = common.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.9 + 0.75 * len(groups)), sharey=True)
    height = 0.8 / len(variants)
    for ax, key, title in ((axes[0], "ms", "step time"), (axes[1], "peak_mem_mib", "peak memory")):
        for i, v in enumerate(variants):
            ys, xs = [], []
            for j, g in enumerate(groups):
                r = next((r for r in ok if (r["model"], r["T"], r["task"]) == g and r["variant"] == v), None)
                ref = base[g].get(key)
                if r is None or not isinstance(r.get(key), (int, float)) or not ref or not math.isfinite(ref):
                    continue
                ys.append(j + (i - (len(variants) - 1) / 2) * height)
                xs.append(r[key] / ref)
            bars = ax.barh(ys, xs, height=height, label=v)
            if v == "eager+flashfuse":
                ax.bar_label(bars, labels=[f"{x:.2f}x" for x in xs], fontsize=7, padding=2)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(left=0)
        ax.set_title(f"{title}, relative to sdpa+compile (lower is better)", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(groups)))
    axes[0].set_yticklabels([f"{m} T={t} {task}" for m, t, task in groups])
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=8, loc="lower right")
    scope = {"model": "whole", "block": "block by block"}.get(
        next((r["compile_scope"] for r in ok if r.get("compile_scope")), ""), "n/a")
    fig.suptitle(f"Hugging Face models, bf16, compiled {scope}; {ok[0].get('gpu', '')}, "
                 f"torch {ok[0].get('torch_version', '')}, Triton {ok[0].get('triton_version', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(results, out_dir: str | None = None):
    rows = results.rows
    if not rows:
        return
    common.tables_header()
    t, h = common.pivot(rows, ["model", "T", "task"], "variant", lambda r: common.cell(r, "ms", 1))
    common.print_table(t, h, "Milliseconds per training step / inference pass (median)")
    t, h = common.pivot(rows, ["model", "T", "task"], "variant", lambda r: common.cell(r, "peak_mem_mib", 0))
    common.print_table(t, h, "Peak memory (MiB)")
    ff = [r for r in rows if r["variant"] == "eager+flashfuse" and r["status"] == "ok"]
    if ff:
        common.print_table(
            [[r["model"], r["T"], r["task"], r["attn_rewritten"], r["attn_candidates"], r["graphs"], r["layers"],
              r["compile_scope"]] for r in ff],
            ["model", "T", "task", "rewritten", "candidates", "graphs", "layers", "compile scope"],
            "flashfuse backend: attention rewrites (summed over compiled graphs; with block scope one graph "
            "serves all layers)")
    if out_dir:
        path = plot(rows, os.path.join(out_dir, "models.png"))
        if path:
            print(f"plot: {path}")


def main():
    args = parse_args()
    common.quiet_warnings()
    common.interrupt_on_sigterm()
    if args.from_csv:
        results = common.Results.load(args.from_csv)
        results.rows = latest_rows(results.rows, args.since, args.compile_scope)
        os.makedirs(args.out, exist_ok=True)
        report(results, None if args.no_plot else args.out)
        return
    device = common.pick_device(args)
    if args.steps is None:
        args.steps = 2 if args.smoke else 5
    variants = VARIANTS
    if args.variants:
        wanted = args.variants.split(",")
        variants = [v for v in VARIANTS if v[0] in wanted]
    if importlib.util.find_spec("transformers") is None:
        raise SystemExit("bench_models.py needs transformers (pip install transformers)")
    results = common.Results(args.out, "models.csv", common.env_info(device))
    budget = common.make_budget(args)
    t0 = time.perf_counter()
    try:
        for spec, task in plan(args):
            for variant in variants:
                run_row(results, spec, variant, task, device, args, budget)
    except KeyboardInterrupt:
        print("interrupted: reporting what was measured")
    finally:
        print(f"\n{len(results.rows)} rows in {time.perf_counter() - t0:.0f} s -> {results.path}")
        report(results, None if args.no_plot else args.out)


if __name__ == "__main__":
    main()
