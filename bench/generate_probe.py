"""Time per generated token of ``generate()``, one implementation per
process, and what the machinery around it did.

``bench_generate.py`` times both implementations in one process, in
alternating order, on one model. This probe runs one implementation per
process (``--impl``, or ``both`` to alternate as the benchmark does) on
``bench_generate.py``'s model, so that neither implementation's compiled
graphs, CUDA graphs or allocator state weigh on the other's, and reports:

* the time per token, as the median of each window of 32 tokens (a logits
  processor stamps every token after a synchronisation), so that a cost
  growing with the cache shows as a trend;
* with the dynamic cache: the allocator's cudaMalloc / cudaFree calls and
  retries over the timed calls (a fragmenting allocator shows there);
* with the static cache (which transformers compiles with CUDA graphs): the
  cudagraph tree's functions, recorded graphs and re-recordings (a new
  static cache at a new address makes the tree record again), and the CUDA
  graphs Inductor skipped;
* with ``--host-split`` (eager caches): where the host's time per token goes,
  without synchronising: inside the attention function (per call), inside
  the mask function, and the rest of the forward and ``generate()``'s loop.
  The dynamic cache is bound by the host (the device idles most of each
  token), so this says whether flashfuse's extra time per token is its own
  call or something around it (bench/NOTES.md run 36).

    python bench/generate_probe.py --cache dynamic --impl ffuse --batch 8 --prompt 8192
    python bench/generate_probe.py --cache static --impl both --batch 1 --prompt 512 --new 64
    python bench/generate_probe.py --cache static --impl ffuse --batch 1 --prompt 512 --new 64 --no-kept-buffers
    python bench/generate_probe.py --cache dynamic --impl both --batch 1 --prompt 512 --host-split
    python bench/generate_probe.py --cache dynamic --impl both --batch 1 --prompt 512 --host-split --host-parts
"""

from __future__ import annotations

import statistics
import time

import common
import torch

import bench_generate


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    p.add_argument("--impl", default="ffuse", choices=["sdpa", "ffuse", "both"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--reps", type=int, default=2, help="timed generate() calls per implementation")
    p.add_argument("--no-kept-buffers", action="store_true",
                   help="the decode kernels allocate their partials and merge counters per call instead of "
                        "keeping them (decode.WORKSPACES, FUSE_COMBINE off): does a kept buffer move the next "
                        "static cache? (bench/NOTES.md run 35)")
    p.add_argument("--host-split", action="store_true",
                   help="after the timed calls, one more per implementation with the host's time per token split "
                        "into the attention function, the mask function and the rest (no synchronisation)")
    p.add_argument("--host-parts", action="store_true",
                   help="with --host-split: one more generate() per implementation with the attention function's "
                        "parts timed as well (flashfuse: the op's fast path, the decode lane, the kernels' run, "
                        "the launches; SDPA: the torch function)")
    return p.parse_args()


def _token_times(model, impl: str, ids, new: int, cache: str) -> list[float]:
    """ms per token of one generate() call, median of each 32-token window."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            self.t.append(time.perf_counter())
            return scores

    stamp = Stamp()
    bench_generate.generate(model, impl, ids, new, cache, logits_processor=LogitsProcessorList([stamp]))
    d = [(b - a) * 1e3 for a, b in zip(stamp.t, stamp.t[1:])]
    return [statistics.median(d[i:i + 32]) for i in range(0, len(d), 32)]


def host_split(model, impl: str, ids, new: int, cache: str, parts: tuple = ()) -> dict:
    """One ``generate()`` of ``new`` tokens with ``impl``'s attention and mask
    functions timed on the host (no synchronisation anywhere but where the
    model's own code waits): microseconds per decoding token in all, inside
    the attention function and inside the mask function, and the attention
    calls per token. The prefill (the first token) is left out. ``parts``:
    more ``common.HostClock`` objects, whose microseconds per attention
    call come back as ``parts_us_per_call``, and their calls per attention
    call as ``parts_calls_per_call``."""
    from transformers import AttentionInterface, AttentionMaskInterface, LogitsProcessor, LogitsProcessorList

    import flashfuse.hf

    name = flashfuse.hf.ATTN_IMPLEMENTATION if impl == "ffuse" else impl
    originals = (AttentionInterface._global_mapping[name], AttentionMaskInterface._global_mapping[name])
    attention, mask = common.HostClock(originals[0]), common.HostClock(originals[1])
    marks = []

    class Mark(LogitsProcessor):  # after each token's forward, before the next
        def __call__(self, input_ids, scores):
            marks.append((time.perf_counter(), attention.seconds, attention.calls, mask.seconds,
                          [(p.seconds, p.calls) for p in parts]))
            return scores

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    try:
        bench_generate.generate(model, impl, ids, new, cache, logits_processor=LogitsProcessorList([Mark()]))
    finally:
        AttentionInterface.register(name, originals[0])
        AttentionMaskInterface.register(name, originals[1])
    (t0, a0, c0, m0, p0), (t1, a1, c1, m1, p1) = marks[0], marks[-1]
    tokens, calls = len(marks) - 1, max(c1 - c0, 1)
    return {"token_us": (t1 - t0) / tokens * 1e6, "attention_us_per_call": (a1 - a0) / calls * 1e6,
            "attention_calls_per_token": (c1 - c0) / tokens, "attention_us": (a1 - a0) / tokens * 1e6,
            "mask_us": (m1 - m0) / tokens * 1e6,
            "parts_us_per_call": [(b[0] - a[0]) / calls * 1e6 for a, b in zip(p0, p1)],
            "parts_calls_per_call": [(b[1] - a[1]) / calls for a, b in zip(p0, p1)]}


# The parts of each implementation's attention function timed by
# ``--host-parts``, outermost first: (label, module, attribute); a part the
# code has not is left out. Each runs inside the ones before it, but for
# alternatives: the three fast-path entries (the hook takes the layer's
# lane site where it has one, else the second entry with the layer's kept
# reads), the decode lane's two ways in (``lane_forward`` from an entry,
# the lane step from a site) and its launches (``_run``, or the lane
# step's direct launch). Every clock adds its own frame and two clock
# reads (about 0.5 us) to the parts around it.
HOST_PARTS = {
    "ffuse": (("fast path (attention_op)", "flashfuse.hf", "_attention_op"),
              ("fast path (not compiling)", "flashfuse.hf", "_attention_op_not_compiling"),
              ("lane site (lane_call_at)", "flashfuse.hf", "_lane_call_at"),
              ("decode lane (lane_forward)", "flashfuse.kernels.decode", "lane_forward"),
              ("lane step (lane_step_forward)", "flashfuse.kernels.decode", "lane_step_forward"),
              ("outputs and launches (_run)", "flashfuse.kernels.decode", "_run"),
              ("direct launch (_launch_direct)", "flashfuse.kernels.decode", "_launch_direct"),
              ("one launch (run_binary)", "flashfuse.kernels.decode", "run_binary")),
    "sdpa": (("torch's SDPA", "torch.nn.functional", "scaled_dot_product_attention"),),
}


def host_parts(model, impl: str, ids, new: int, cache: str) -> list[tuple[str, float, float]]:
    """``host_split``'s generate() with the parts of ``impl``'s attention
    function (``HOST_PARTS``) timed too: (part, us per attention call, calls
    per attention call), the attention function itself first."""
    import importlib

    patched = []
    try:
        for label, module, attr in HOST_PARTS[impl]:
            mod = importlib.import_module(module)
            original = getattr(mod, attr, None)
            if original is None:  # this code has no such part
                continue
            setattr(mod, attr, common.HostClock(original))
            patched.append((label, mod, attr, original))
        h = host_split(model, impl, ids, new, cache, parts=tuple(getattr(mod, attr) for _, mod, attr, _ in patched))
    finally:
        for _, mod, attr, original in patched:
            setattr(mod, attr, original)
    return [("attention function", h["attention_us_per_call"], 1.0)] + [
        (label, us, n) for (label, *_), us, n in zip(patched, h["parts_us_per_call"], h["parts_calls_per_call"])]


def _print_host_split(impl: str, h: dict) -> None:
    rest = h["token_us"] - h["attention_us"] - h["mask_us"]
    print(f"{impl:5s} host per token {h['token_us']:.0f} us: attention {h['attention_us']:.0f} "
          f"({h['attention_calls_per_token']:.0f} calls of {h['attention_us_per_call']:.1f} us), "
          f"mask {h['mask_us']:.1f}, the rest {rest:.0f}", flush=True)


def _cudagraph_tree() -> str:
    """Functions, recorded graphs and re-recordings of the current device's tree."""
    import torch._inductor.cudagraph_trees as trees

    mgr = trees.get_container(torch.cuda.current_device()).tree_manager
    if mgr is None:
        return "no cudagraph tree"

    def count(nodes) -> int:
        return sum(1 + count(child.children) for group in nodes.values() for child in group)

    rerecords = sum(sum(v.values()) for v in mgr.num_rerecord.values())
    return f"cudagraph tree: {len(mgr.ids_to_funcs)} functions, {count(mgr.roots)} graphs, {rerecords} re-recordings"


def main():
    args = parse_args()
    device = common.gpu_device(args, "times generate() on the GPU")
    if device is None:
        return
    from torch._dynamo.utils import counters

    if args.no_kept_buffers:
        from flashfuse.kernels import decode

        decode.WORKSPACES = False
        decode.FUSE_COMBINE = False

    impls = ["sdpa", "ffuse"] if args.impl == "both" else [args.impl]
    cfg = bench_generate.config(False, args.prompt + args.new + 64)
    model = bench_generate.build(cfg, torch.bfloat16, device)
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.prompt), device=device)
    print(f"generate(), {args.cache} cache, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
          f"{common.env_info(device)}", flush=True)
    for impl in impls:  # warm-up: compiles a static cache
        _token_times(model, impl, ids, args.new, args.cache)
    before = torch.cuda.memory_stats()
    for rep in range(args.reps):
        for impl in (impls if rep % 2 == 0 else impls[::-1]):
            windows = _token_times(model, impl, ids, args.new, args.cache)
            print(f"{impl:5s} call {rep}: ms per token by 32-token window: "
                  + " ".join(f"{w:.2f}" for w in windows), flush=True)
    after = torch.cuda.memory_stats()
    print("allocator over the timed calls: "
          + ", ".join(f"{name} {after[key] - before[key]}" for name, key in
                      (("cudaMalloc", "num_device_alloc"), ("cudaFree", "num_device_free"),
                       ("retries", "num_alloc_retries"))), flush=True)
    if args.host_split and args.cache == "dynamic":
        for impl in impls:
            _print_host_split(impl, host_split(model, impl, ids, args.new, args.cache))
        if args.host_parts:
            for impl in impls:
                print(f"{impl:5s} host time by part, us per attention call (each part inside the one above):",
                      flush=True)
                for label, us, n in host_parts(model, impl, ids, args.new, args.cache):
                    print(f"      {label:30s} {us:7.1f}  ({n:.2f} calls)", flush=True)
    if args.cache == "static":
        print(f"{_cudagraph_tree()}; CUDA graphs skipped: {counters['inductor'].get('cudagraph_skips', 0)}",
              flush=True)


if __name__ == "__main__":
    main()
