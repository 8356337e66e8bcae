"""What the compiler makes of the attention kernels, without a GPU.

Runs the op's CUDA launch path on CPU tensors (launches captured, not run,
as in ``host_path_cpu.py``), then compiles every captured kernel launch for
a Hopper target (sm_90a) with Triton's bundled ``ptxas`` and reports, per
kernel and config: registers per thread, spill bytes, shared memory, and
counts of the instructions and IR operations that decide speed: ``HGMMA``
(Hopper warp-group matrix instructions), ``MMA`` (older ``HMMA``), local
memory traffic (``LDL``/``STL``, i.e. spills), layout conversions and
shared-memory tiles in the TTGIR. Read with the measured times: it explains
them, it does not replace them. The local Triton may be newer than the GPU
machine's, so counts can differ there.

    python bench/kernel_report.py --d 64 --n 1024 --causal --dropout 0.1
    python bench/kernel_report.py --d 128 --n 4096 --all-configs --dump kernels_dump
    python bench/kernel_report.py --d 128 --h 32 --kv-heads 8 --decode-keys 4096 --n 1
    python bench/kernel_report.py --hopper --d 128 --causal    # the Gluon kernels (Triton 3.6)
    python bench/kernel_report.py --hopper --mask causal-float --loops 16   # their inner loops too
    python bench/kernel_report.py --hopper --mask causal-float --mask-runs single   # masked tiles in one loop

``--hopper`` compiles the Hopper (Gluon) kernels as their launchers would
launch them for the problem (forward, the two deterministic backward
kernels and the fused backward with each dQ mode), with their launch
options; registers are per thread at launch (the consumer warp groups run
at 240 after ``setmaxnreg``), spills and stack are the kernel's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import common
import torch

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "i1"}


def capture_launches(run):
    """Run ``run()`` on the forced CUDA path; return the launches it made as
    (launcher, key, candidates, grid, args, kwargs) tuples."""
    from host_path_cpu import force_cuda_path_on_cpu

    from flashfuse.kernels import launch

    force_cuda_path_on_cpu()
    seen = []

    def capture(self, key, candidates, grid, *args, tune=False, **kwargs):
        seen.append((self, key, candidates(), grid, args, kwargs))

    launch.ConfigLauncher.__call__ = capture
    run()
    return seen


def _signature(fn, args, kwargs, cfg_kwargs):
    """Triton signature, constexprs and divisibility attributes of a call,
    specialised the way the JIT would (16-byte-aligned pointers; integers
    equal to 1 or divisible by 16 unless marked do_not_specialize)."""
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update(kwargs)
    values.update(cfg_kwargs)
    sig, consts, attrs = {}, {}, {}
    no_spec = set(fn.do_not_specialize) | {names[i] for i in fn.do_not_specialize if isinstance(i, int)}
    for i, name in enumerate(names):
        v = values[name]
        p = fn.params[i]
        if p.is_constexpr:
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and name not in no_spec:  # the JIT makes 1 a constant
                sig[name] = "constexpr"
                consts[name] = 1
                continue
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if name not in no_spec and v % 16 == 0:  # 0 too, as the JIT does
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {type(v).__name__}")
    return sig, consts, attrs


class _LaunchOptions:
    """What ``report`` reads of a Triton config, for a Gluon launch."""

    def __init__(self, kwargs: dict, num_warps: int, label: str = ""):
        self.kwargs, self.num_warps, self.num_stages, self.label = kwargs, num_warps, 1, label


def compile_gluon_sm90(fn, args, meta):
    """Compile one Gluon launch (positional ``args``, ``meta`` with its
    constexprs and the launch options ``num_warps`` / ``maxnreg``) for
    sm_90a; returns Triton's CompiledKernel and the options for ``report``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    # num_warps is also a constexpr parameter of these kernels; maxnreg only a launch option.
    consts = {k: v for k, v in meta.items() if k != "maxnreg"}
    sig, consts, attrs = _signature(fn, args, consts, {})
    src = GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": meta["num_warps"], "maxnreg": meta["maxnreg"]})
    return kernel, _LaunchOptions(consts, meta["num_warps"])


def hopper_launches(a, dtype):
    """``(name, kernel, args, meta)`` of every Hopper kernel for the problem
    of ``a`` (B, H, kv heads, N, D, causal), built by the launchers' own
    argument functions on CPU tensors."""
    from flashfuse.kernels import hopper, hopper_gluon
    from flashfuse.kernels.problem import AttentionProblem

    hkv = a.kv_heads or a.h
    q = torch.randn(a.b, a.h, a.n, a.d, dtype=dtype)
    k, v = (torch.randn(a.b, hkv, a.n, a.d, dtype=dtype) for _ in range(2))
    band = dict(dropout_p=0.0, scale=a.d ** -0.5, window_left=None, window_right=0 if a.causal else None,
                bottom_right=False)
    p = AttentionProblem.build(q, k, v, None, **band, backward=True)
    out, dout = torch.empty_like(q), torch.randn_like(q)
    lse = torch.empty(a.b, a.h, a.n)
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launches = [("forward", hopper_gluon._hopper_attn_fwd, *hopper.kernel_args(p, q, k, v, out, lse)[:2])]
    # The forward reading a mask through its key table: a bool key-padding
    # mask and a float (B, 1, N, N) mask.
    from flashfuse.kernels.mask_ranges import COL_GROUP, KEY_ENTRY, QUERY_ENTRY, ROW_GROUP

    masks = (("bool padding", torch.ones(a.b, 1, 1, a.n, dtype=torch.bool)),
             ("float", torch.zeros(a.b, 1, a.n, a.n, dtype=dtype)))
    for name, mask in masks:
        pm = AttentionProblem.build(q, k, v, mask, **band)
        table = torch.empty(a.b, 1, -(-a.n // ROW_GROUP), KEY_ENTRY, dtype=torch.int32)
        launches.append((f"forward, {name} mask", hopper_gluon._hopper_attn_fwd,
                         *hopper.kernel_args(pm, q, k, v, out, lse, key_table=table)[:2]))
    a1, m1, a2, m2 = hopper.backward_kernel_args(p, dout, q, k, v, lse, delta, dq, dk, dv)
    launches += [("dK/dV (deterministic)", hopper_gluon._hopper_attn_bwd_dkdv, a1, m1),
                 ("dQ (deterministic)", hopper_gluon._hopper_attn_bwd_dq, a2, m2)]
    acc = torch.empty(a.b, a.h, a.n, a.d)
    rows = hopper.fused_row_buffers(p, q.device)
    for how in ("tma", "atomic"):
        args, meta, _ = hopper.fused_kernel_args(p, dout, q, k, v, rows, acc, dk, dv, how)
        if how == "atomic":
            launches.append(("fused, dQ by atomics", hopper_gluon._hopper_attn_bwd_fused, args, meta))
            continue
        # Every query side in the tile tables (hopper.BWD_FUSED_TILES,
        # BWD_LONG_ROW_TILES), whichever head dim it is for.
        tiles = dict.fromkeys((*hopper.BWD_FUSED_TILES.values(), *hopper.BWD_LONG_ROW_TILES.values()))
        for t in tiles:
            name = (f"fused, dQ by the copy engine, {t.block_m}-row q/dO blocks, {t.stages} slots, "
                    f"{t.dq_buffers} staging tile{'s' * (t.dq_buffers > 1)}"
                    + (" (default)" if t == hopper.fused_tile(p) else ""))
            launches.append((name, hopper_gluon._hopper_attn_bwd_fused, args,
                             dict(meta, BLOCK_M=t.block_m, STAGES=t.stages, DQ_BUFFERS=t.dq_buffers)))
    for name, mask in masks:  # the default fused backward reading a mask through its query table
        pm = AttentionProblem.build(q, k, v, mask, **band, backward=True)
        table = torch.empty(a.b, 1, -(-a.n // COL_GROUP), QUERY_ENTRY, dtype=torch.int32)
        args, meta, _ = hopper.fused_kernel_args(pm, dout, q, k, v, hopper.fused_row_buffers(pm, q.device), acc, dk,
                                                 dv, "tma", query_table=table)
        launches.append((f"fused, {name} mask", hopper_gluon._hopper_attn_bwd_fused, args, meta))
        other = "direct" if meta["COALESCED_MASK"] else "coalesced"  # the load hopper.BWD_MASK_LOADS does not take
        launches.append((f"fused, {name} mask, {other} loads", hopper_gluon._hopper_attn_bwd_fused, args,
                         dict(meta, COALESCED_MASK=not meta["COALESCED_MASK"])))
    return launches


def compile_sm90(fn, args, kwargs, cfg):
    """Compile one launch for sm_90a; returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = _signature(fn, args, kwargs, cfg.kwargs)
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def _nvidia_tool(name: str) -> str:
    """Path of a CUDA tool that ships with Triton's NVIDIA backend."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _ptxas_report(ptx: str) -> dict:
    """Registers, spill bytes and shared memory from ``ptxas -v``."""
    import tempfile

    from triton.backends.nvidia import compiler

    try:  # the ptxas Triton itself uses for sm_90 (its signature changed across versions)
        ptxas = compiler.get_ptxas(90).path
    except TypeError:
        ptxas = compiler.get_ptxas().path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    out = {}
    for key, pat in (("regs", r"Used (\d+) registers"), ("spill_st", r"(\d+) bytes spill stores"),
                     ("spill_ld", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame")):
        m = re.search(pat, text)
        out[key] = int(m.group(1)) if m else None
    return out


def _sass(cubin: bytes) -> str:
    import tempfile

    cuobjdump = _nvidia_tool("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout


def loop_bodies(sass: str) -> list[int]:
    """Instruction counts of the SASS loops (a branch back to a lower
    address), largest first: the per-iteration cost of each main loop.
    Branches from the out-of-line blocks after the kernel's last ``EXIT``
    (the retry paths of barrier waits) jump back into a loop without
    closing one, so they are not counted."""
    exits = [int(m.group(1), 16) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+EXIT\b", sass)]
    last_exit = max(exits) if exits else None
    loops = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+[^;]*\bBRA\s+(?:`\()?0x([0-9a-f]+)", sass):
        at, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < at and (last_exit is None or at < last_exit):
            loops.append((at - target) // 16 + 1)  # Hopper instructions are 16 bytes
    return sorted(loops, reverse=True)


def report(kernel, cfg, loops: int = 4) -> dict:
    sass = _sass(kernel.asm["cubin"])
    ttgir = kernel.asm["ttgir"]
    tile = "x".join(str(cfg.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N") if k in cfg.kwargs)
    row = {"kernel": kernel.name, "config": f"{tile} w{cfg.num_warps} s{cfg.num_stages}"}
    row.update(_ptxas_report(kernel.asm["ptx"]))
    row["smem"] = kernel.metadata.shared
    row["HGMMA"] = len(re.findall(r"\bHGMMA\.", sass))
    row["HMMA"] = len(re.findall(r"\bHMMA\.", sass))
    row["LDL/STL"] = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    row["cvt_layout"] = ttgir.count("ttg.convert_layout")
    row["local_alloc"] = ttgir.count("ttg.local_alloc")
    row["loops"] = " ".join(str(n) for n in loop_bodies(sass)[:loops])
    return row


def _dump(kernel, folder: str, name: str) -> None:
    """Write one compiled kernel's ttgir, ptx and sass into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, re.sub(r"[^A-Za-z0-9_.=-]+", "_", name))
    for ext in ("ttgir", "ptx"):
        with open(f"{stem}.{ext}", "w") as f:
            f.write(kernel.asm[ext])
    with open(f"{stem}.sass", "w") as f:
        f.write(_sass(kernel.asm["cubin"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--b", type=int, default=2)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--mask", choices=["none", "causal-float", "causal-bool", "padding-bool"], default="none",
                   help="an attention mask tensor: causal as a (N, N) float mask of 0 and the dtype's lowest "
                        "value (as Hugging Face builds it) or bool, or bool key padding (B, 1, 1, N)")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--kv-heads", type=int, help="key/value heads (grouped heads; default --h)")
    p.add_argument("--decode-keys", type=int,
                   help="--n new queries against this many cached keys, bottom-right causal, inference "
                        "(the split-KV decode kernels)")
    p.add_argument("--hopper", action="store_true",
                   help="the Hopper (Gluon) kernels instead, as their launchers launch them (needs the Triton "
                        "version flashfuse's Gluon code is written for)")
    p.add_argument("--ablate", choices=common.MASK_ABLATIONS,
                   help="with --hopper: the masked kernels with stand-ins for a part (mask_ablations.py)")
    p.add_argument("--fwd-softmax", metavar="FOLDS,POLY",
                   help="with --hopper: the forward's softmax variant at --d (hopper.FWD_SOFTMAX: row-max folds, "
                        "exponentials of each eight on the FMA units)")
    p.add_argument("--mask-runs", choices=("split", "single"),
                   help="with --hopper: a masked tile's blocks in three loops or one, forward and backward "
                        "(hopper.FWD_MASK_SPLIT_RUNS, BWD_MASK_SPLIT_RUNS)")
    p.add_argument("--all-configs", action="store_true", help="every candidate, not just the first")
    p.add_argument("--dump", help="write each kernel's ttgir, ptx and sass into this folder")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--loops", type=int, default=4,
                   help="loop sizes shown per kernel, largest first (more: the inner loops after the round loops)")
    a = p.parse_args()

    import flashfuse
    from tabulate import tabulate

    dtype = getattr(torch, a.dtype)

    def make_mask():
        later = torch.ones(a.n, a.n, dtype=torch.bool).triu(1)
        if a.mask == "causal-float":
            return torch.zeros(a.n, a.n, dtype=dtype).masked_fill(later, torch.finfo(dtype).min)
        if a.mask == "causal-bool":
            return ~later
        if a.mask == "padding-bool":
            return (torch.arange(a.n) < a.n * 3 // 4).expand(a.b, 1, 1, a.n)
        return None

    def run():
        if a.decode_keys:
            q = torch.randn(a.b, a.h, a.n, a.d, dtype=dtype)
            k, v = (torch.randn(a.b, a.kv_heads or a.h, a.decode_keys, a.d, dtype=dtype) for _ in range(2))
            flashfuse.attention(q, k, v, is_causal=True, alignment="bottom_right", enable_gqa=True)
            return
        q, k, v = (torch.randn(a.b, a.h, a.n, a.d, dtype=dtype, requires_grad=True) for _ in range(3))
        out = flashfuse.attention(q, k, v, attn_mask=make_mask(), is_causal=a.causal, dropout_p=a.dropout)
        if not a.no_backward:
            out.sum().backward()

    rows = []
    if a.hopper:
        from flashfuse.kernels import hopper

        if not hopper.gluon_available():
            sys.exit(f"--hopper: the Gluon kernels are written for Triton {', '.join(hopper.SUPPORTED_TRITON)}")
        if a.mask_runs:
            common.hopper_mask_runs(a.mask_runs)
        if a.fwd_softmax:
            hopper.FWD_SOFTMAX = common.fwd_softmax_variant(a.d, *common.softmax_pair(a.fwd_softmax))
        if a.ablate:
            import mask_ablations

            print("stand-ins:", ", ".join(mask_ablations.apply(a.ablate)))
        for name, fn, args, meta in hopper_launches(a, dtype):
            kernel, opts = compile_gluon_sm90(fn, args, meta)
            row = report(kernel, opts, a.loops)
            row["config"] = name
            rows.append(row)
            if a.dump:
                _dump(kernel, a.dump, f"{kernel.name}_{name}")
        candidates_of = []
    else:
        candidates_of = capture_launches(run)
    for launcher, _key, candidates, _grid, args, kwargs in candidates_of:
        for cfg in candidates if a.all_configs else candidates[:1]:
            try:
                kernel = compile_sm90(launcher.kernel, args, kwargs, cfg)
            except Exception as e:  # out of resources and the like: say so, go on
                rows.append({"kernel": launcher.kernel.__name__, "config": str(cfg.kwargs),
                             "error": f"{type(e).__name__}: {str(e)[:80]}"})
                continue
            row = report(kernel, cfg, a.loops)
            rows.append(row)
            if a.dump:
                _dump(kernel, a.dump, f"{kernel.name}_{row['config']}")
    if a.json:
        import json

        print(json.dumps(rows))
    else:
        print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
