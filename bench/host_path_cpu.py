"""Host time of the op's CUDA launch path, measured on a CPU-only machine:
the Python between ``flashfuse.attention`` and the Triton launches, with the
launches themselves stubbed out (no GPU is touched).

The CUDA code path is forced onto CPU tensors: the op is told to use the
Triton kernels, the kernels that they are not interpreted, and the
launchers' Triton launch is replaced by a stand-in binary whose launch does
nothing (in the form of Triton 3.6's launcher, whose C launch the kept
launches call directly, as on a GPU host with that Triton). What remains is exactly the Python that a GPU call runs before and
after its launches: argument checks, allocations, the autograd function, the
launchers' config lookup, fingerprint and argument assembly. Useful to
measure host-side changes without a GPU; the numbers are this machine's, not
a GPU host's.

The decode rows time the split-KV decoding path the same way (one query,
a long cache: what ``generate()`` calls once per layer per token), through
``flashfuse.attention`` (no grad, bottom-right causal, grouped heads),
the op through the dispatcher (``torch.ops.flashfuse.attention``, as a
graph calls it; no eager fast path, see ``flashfuse.fastpath``), the Hugging
Face hook as a LLaMA layer calls it while decoding (on a fixed cache, and on
a dynamic one that grows by a key per call),
``flashfuse.attention_with_kvcache`` (per-row lengths, the value check off:
on a GPU it synchronises), and ``decode_forward`` itself, and count
the Python function calls one such call makes (``calls/op``: independent of
the machine's speed). On this path a CPU tensor goes through one more
dispatcher hop than a CUDA one (the opaque CPU op of
``attention_with_kvcache``), so its time is a little above a GPU host's.

The Hopper rows time the op on the Hopper route with its Gluon launches
stubbed (``hopper_rows``): flashfuse's own Python there, without Triton's
launcher.

The last rows (``generate_rows``, with transformers) time the hook where
``generate()`` calls it: a 4-layer LLaMA-shaped model decoding on a dynamic
cache, the rest of each layer running between two attention calls. A call
there costs a multiple of the same call repeated in a loop (the loop keeps
the path's code and dictionaries in the CPU's caches; a model's layer
evicts them), so these rows say what a token pays, and where: the hook's
own Python, the layer's lane site (``flashfuse.fastpath.lane_call_at``),
the lane's step, and the allocation and launch (bench/NOTES.md runs 36
and 39).

    python bench/host_path_cpu.py
    python bench/host_path_cpu.py --smoke
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types

import common
import torch


class CudaLauncher:
    """A launch that does nothing, in the form of Triton 3.6's CUDA launcher
    (``flashfuse.kernels.launch._C_LAUNCH_WRAPPER``: a wrapper around a C
    launch, no scratch), so that the kept launches take the path they take
    on a GPU host with that Triton: the C launch, called directly."""

    launch_cooperative_grid, launch_pdl = False, False
    global_scratch_size = profile_scratch_size = 0

    def __init__(self):
        self.launch = lambda *args: None

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class _StubBinary:
    """A compiled kernel whose launch does nothing."""

    function = 0
    packed_metadata = None

    def __init__(self):
        self.run = CudaLauncher()

    def launch_metadata(self, *args):
        return None


class _StubDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0


def force_cuda_path_on_cpu():
    """Route CPU tensors through the CUDA launch path with stubbed launches."""
    import triton

    from flashfuse import ops
    from flashfuse.kernels import backward, decode, forward, launch, mask_ranges, problem

    triton.runtime.driver.set_active(_StubDriver())
    launch.ConfigLauncher._launch = lambda self, cfg, grid, args, kwargs: (grid(cfg.kwargs), _StubBinary())[1]
    ops._use_triton = lambda q: True
    forward._interpreting = backward._interpreting = mask_ranges._interpreting = lambda t: False
    decode._interpreting = launch._interpreting = problem._interpreting = lambda t: False
    # An H200's multiprocessors, for the decode path's split count.
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(multi_processor_count=132)
    backward._max_shared_mem = lambda device: 227 * 1024
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch.cuda.is_current_stream_capturing = lambda: False
    # the two above and the stub driver's stream, not their C functions
    decode._CUDA_CAPTURING = decode._CUDA_DEVICE = None
    decode._device_stream = launch._device_stream = launch._triton_device_stream
    launch._capability = lambda index: (9, 0)  # a Hopper GPU


def best_us(fn, loops: int, calls: int) -> float:
    """Best (lowest) mean microseconds per call over ``loops`` loops."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def python_calls(fn) -> int:
    """Python function calls (not C functions) one call of ``fn`` makes."""
    fn()
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # fn itself


def decode_rows(loops: int, calls: int, smoke: bool) -> None:
    """Host time of one decode call (see the module docstring)."""
    import flashfuse
    from flashfuse.kernels.decode import decode_forward

    B, Hq, Hkv, M, D = (1, 4, 2, 64, 16) if smoke else (1, 32, 8, 4096, 128)
    os.environ["FLASHFUSE_DECODE"] = "1"  # whatever the (smoke) sizes
    os.environ["FLASHFUSE_KVCACHE_CHECKS"] = "0"
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, M, D, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kc, vc = k.transpose(1, 2), v.transpose(1, 2)  # (B, M, Hkv, D) views, as a cache hands them over
    lens = torch.full((B,), M, dtype=torch.int32)
    scale = D ** -0.5

    def op():
        with torch.no_grad():
            flashfuse.attention(q, k, v, is_causal=True, enable_gqa=True, alignment="bottom_right")

    def kvcache():
        flashfuse.attention_with_kvcache(q, kc, vc, lens)

    def kernel():
        decode_forward(q, k, v, scale=scale, window_right=0)

    def torch_op():  # the op through the dispatcher, as a graph would call it
        with torch.no_grad():
            torch.ops.flashfuse.attention(q, k, v, None, 0.0, True, None, True, alignment="bottom_right")

    rows = [("attention", op), ("torch.ops attention", torch_op)]
    hook = _hf_hook(q, k, v, scale)
    if hook is not None:
        rows.append(("hf hook", hook))
        rows.append(("hf hook, growing cache", _growing(hook, k, loops * calls + 40)))
    rows += [("attention_with_kvcache", kvcache), ("decode_forward", kernel)]
    for name, fn in rows:
        print(f"decode host path, B={B} Hq={Hq} Hkv={Hkv} N=1 M={M} D={D} bf16, {name:>22}: "
              f"{best_us(fn, loops, calls):6.1f} us, {python_calls(fn):4d} calls/op", flush=True)


def hopper_rows(loops: int, calls: int) -> None:
    """Host time of the op on the Hopper route (forward, and forward+backward
    on the fused backward), its Gluon launches stubbed: the problem built
    as if on a Hopper GPU, every launch a stand-in that does nothing. What
    remains is flashfuse's own Python on that route (the routing rules, the
    problem, the launch arguments, allocations, the autograd function), not
    Triton's launcher, which ``bench/host_step_probe.py`` measures with it
    on a GPU host."""
    import dataclasses

    import flashfuse
    from flashfuse import kernels
    from flashfuse.kernels import hopper, hopper_gluon

    class _StubGluon:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: _StubBinary()

    stub = _StubGluon()
    hopper._capability = lambda index: (9, 0)
    hopper.gluon_available = lambda: True
    hopper_gluon._hopper_attn_fwd = stub
    hopper_gluon._hopper_attn_bwd_fused = stub
    hopper._dq_convert = stub
    hopper._fused_bwd_prologue = stub
    real_problem = kernels._problem

    def on_hopper(*args, **kwargs):  # a CPU tensor's problem as a CUDA one's
        return dataclasses.replace(real_problem(*args, **kwargs), device=torch.device("cuda", 0), interpret=False)

    kernels._problem = on_hopper
    B, H, N, D = 1, 1, 1024, 64
    q = torch.randn(B, H, N, D, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    g = torch.randn_like(q)
    taken = []
    real_fwd, real_bwd = hopper.hopper_forward, hopper.hopper_backward
    hopper.hopper_forward = lambda *a, **kw: taken.append("fwd") or real_fwd(*a, **kw)
    hopper.hopper_backward = lambda *a, **kw: taken.append("bwd") or real_bwd(*a, **kw)

    def fwd():
        with torch.no_grad():
            flashfuse.attention(q, k, v, is_causal=True)

    def fwd_bwd():
        torch.autograd.grad(flashfuse.attention(q, k, v, is_causal=True), (q, k, v), g)

    fwd_bwd()
    assert taken == ["fwd", "bwd"], taken  # the Hopper route, both ways
    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        print(f"hopper route, B={B} H={H} N={N} D={D} causal bf16, Gluon launches stubbed, {name:>16}: "
              f"{best_us(fn, loops, calls):6.1f} us, {python_calls(fn):4d} calls/op", flush=True)


def generate_rows(smoke: bool) -> None:
    """The hook's host time per call inside ``generate()`` on a dynamic
    cache (see the module docstring), by stage, and the same hook on the
    same shapes called in a loop."""
    try:
        from transformers import LlamaConfig
    except ImportError:
        print("generate rows: transformers is not installed", flush=True)
        return
    import bench_generate
    import generate_probe

    from flashfuse import hf
    from flashfuse.kernels import decode

    os.environ["FLASHFUSE_DECODE"] = "1"  # whatever the (smoke) sizes
    layers, heads, kv_heads, head_dim = (2, 4, 2, 16) if smoke else (4, 8, 2, 128)
    prompt, new = (16, 6) if smoke else (256, 128)
    # A narrow model (hidden 64) keeps the layers' own data small, so what
    # evicts the path's state is mostly the layers' Python and dispatch, as
    # on a GPU host, not their weights streaming through the CPU's caches.
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=prompt + new + 8)
    model = bench_generate.build(cfg, torch.float32, torch.device("cpu"))
    ids = torch.randint(1, cfg.vocab_size, (1, prompt))
    # Outermost first: each stage's time includes the ones after it.
    stages = [("lane site (fastpath.lane_call_at)", hf, "_lane_call_at"),
              ("lane step (decode.lane_step_forward)", decode, "lane_step_forward"),
              ("allocation and launch (decode._launch_direct)", decode, "_launch_direct")]
    generate_probe.host_split(model, "ffuse", ids, new, "dynamic")  # warm-up: plans and binaries
    clocks = [common.HostClock(getattr(owner, name)) for _, owner, name in stages]
    for (_, owner, name), clock in zip(stages, clocks):
        setattr(owner, name, clock)
    try:
        split = generate_probe.host_split(model, "ffuse", ids, new, "dynamic")
    finally:
        for (_, owner, name), clock in zip(stages, clocks):
            setattr(owner, name, clock.fn)
    shape = (f"B=1 Hq={heads} Hkv={kv_heads} D={head_dim} fp32, hidden 64, {layers} layers, prompt {prompt}, "
             f"{new} new tokens")
    print(f"generate() host path, {shape}, launches stubbed: the hook {split['attention_us_per_call']:.1f} us "
          f"a call, {split['token_us']:.0f} us a token in all", flush=True)
    for (label, _, _), clock in zip(stages, clocks):
        print(f"  of which {label}: {clock.seconds / max(clock.calls, 1) * 1e6:.1f} us", flush=True)
    q = torch.randn(1, heads, 1, head_dim)
    k = torch.randn(1, kv_heads, prompt, head_dim)
    hook = _hf_hook(q, k, k, head_dim ** -0.5)
    loops, calls = (2, 5) if smoke else (15, 200)
    print(f"  the same hook in a loop, growing cache: {best_us(_growing(hook, k, loops * calls + 40), loops, calls):.1f}"
          f" us a call", flush=True)


def _growing(hook, k, calls: int):
    """``hook`` on a dynamic cache: one key more at every call, each length
    a fresh contiguous (B, Hkv, M, D) tensor as ``torch.cat`` leaves it (all
    views of one buffer, so that no allocation is timed)."""
    B, Hkv, M, D = k.shape
    buf = torch.randn(B * Hkv * (M + calls + 40) * D, dtype=k.dtype)
    state = {"M": M}

    def call():
        m = state["M"] = state["M"] + 1
        kk = common.cache_view(buf, B, Hkv, m, D)
        hook(kk, kk)

    return call


def _hf_hook(q, k, v, scale):
    """One call of the Hugging Face hook as a LLaMA layer makes it while
    decoding (no mask: flashfuse_mask vouched for the causal pattern), or
    None without transformers."""
    try:
        from flashfuse import hf
    except ImportError:
        return None
    layer = torch.nn.Module()  # a layer's attributes as the hook reads them
    layer.eval()
    layer.is_causal, layer.config, layer.layer_idx = True, None, 0

    def hook(key=k, value=v):
        with torch.no_grad():
            hf.flashfuse_attention_forward(layer, q, key, value, None, dropout=0.0, scaling=scale,
                                           sliding_window=None)

    return hook


def main():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=0)
    p.add_argument("--loops", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    os.environ["FLASHFUSE_AUTOTUNE"] = "0"
    os.environ["TRITON_INTERPRET"] = "0"
    import flashfuse

    force_cuda_path_on_cpu()
    torch.set_flush_denormal(True)  # the stubbed kernels leave outputs uninitialised
    loops, calls = (2, 5) if args.smoke else (args.loops, args.calls)
    B, H, N, D = 1, 8, 128, 64
    q = torch.randn(B, H, N, D, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    g = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            flashfuse.attention(q, k, v, is_causal=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None  # assign, never accumulate into garbage
        flashfuse.attention(q, k, v, is_causal=True).backward(g)

    info = common.env_info(torch.device("cpu"))
    print(f"{info['gpu']}, torch {info['torch_version']}, triton {info['triton_version']}, {info['date']}")
    print(f"host path, B={B} H={H} N={N} D={D} causal, launches stubbed: "
          f"fwd {best_us(fwd, loops, calls):.1f} us, fwd+bwd {best_us(fwd_bwd, loops, calls):.1f} us "
          f"(best of {loops} loops of {calls} calls)", flush=True)
    decode_rows(loops, calls, args.smoke)
    hopper_rows(loops, calls)
    generate_rows(args.smoke)


if __name__ == "__main__":
    main()
