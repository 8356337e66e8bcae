"""Compile the Hopper kernels for sm_90 (no GPU needed) and report what
ptxas made of them: warps, registers, spills, shared memory, and whether
warp specialisation took effect.

    python bench/hopper_compile_report.py [--ttgir-dir DIR]

Warp specialisation counts as applied when the PTX raises/lowers register
budgets per partition (``setmaxnreg``) and the TTGIR holds a
``ttg.warp_specialize`` op; the total warps then exceed the 4 requested.
Register and spill counts come from the compiled metadata (``n_regs``,
``n_spills``) where this Triton exposes them, else from ``ptxas -v``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is the default

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from flashfuse.kernels import hopper  # noqa: E402

_TARGET = GPUTarget("cuda", 90, 128)
WS_CHOICES = [True]  # --baseline adds each kernel without warp specialisation


def _compile(fn, signature, constexprs, num_warps, num_stages):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=_TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def _ptxas_regs(ptx: str):
    """(registers, spill bytes) of the PTX by the bundled ptxas (``-v``)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90)  # Triton 3.9 takes the architecture
    except TypeError:
        ptxas = get_ptxas()  # Triton 3.6
    path = getattr(ptxas, "path", ptxas)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", text)]
    return (max(regs) if regs else None, max(spills) if spills else None, max(stack) if stack else None)


def report(name, compiled, requested_warps, ttgir_dir=None):
    md = compiled.metadata
    asm = compiled.asm
    ptx, ttgir = asm.get("ptx", ""), asm.get("ttgir", "")
    regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
    p_regs, p_spills, stack = _ptxas_regs(ptx)
    if regs is None:
        regs, spills = p_regs, p_spills
    setmax = sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    ws_op = "ttg.warp_specialize" in ttgir
    total_warps = getattr(md, "num_warps", requested_warps)
    # Partitions' warps are added to the default group's in the launch.
    extra = re.findall(r"ttg\.total-num-warps\"? = (\d+)", ttgir)
    if extra:
        total_warps = int(extra[0])
    ws = "yes" if (ws_op and setmax) else ("partial" if ws_op or setmax else "no")
    print(f"{name:<34} warps {requested_warps}->{total_warps:<3} regs {regs!s:>4} (ptxas max {p_regs!s:>4}) "
          f"spills {spills!s:>4} stack {stack!s:>5} smem {md.shared:>6} B  warp-spec {ws:<7} "
          f"setmaxnreg {setmax or '-'}")
    if ttgir_dir:
        os.makedirs(ttgir_dir, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(ttgir_dir, f"{name}.{ext}"), "w") as f:
                f.write(asm.get(ext, ""))


_TENSORS = ("Q", "K", "V", "Out", "Lse", "DO", "Delta", "DK", "DV", "DQ")


def _signature(fn, dtype, const):
    """Triton's signature for one of the kernels: tensors (lse and delta
    fp32), the scales fp32, the other integers i32, the constexprs marked."""
    import inspect

    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in const:
            sig[name] = "constexpr"
        elif name in _TENSORS:
            sig[name] = "*fp32" if name in ("Lse", "Delta") else "*" + dtype
        elif name in ("qk_scale", "scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def forward_cases():
    for d in hopper.HOPPER_HEAD_DIMS:
        for causal in (False, True):
            for bm, bn, stages in hopper._FWD_TILES[d]:
                for ws in WS_CHOICES:
                    const = dict(HEAD_DIM=d, HAS_WL=False, HAS_WR=causal, CHECK_M=True, WARP_SPEC=ws,
                                 BLOCK_M=bm, BLOCK_N=bn)
                    sig = _signature(hopper._hopper_fwd, "bf16", const)
                    name = f"fwd d{d} {'causal' if causal else 'full'} {bm}x{bn}x{stages}{' ws' if ws else ''}"
                    yield name, hopper._hopper_fwd, sig, const, 4, stages


def backward_cases():
    kernels = (("dkdv", hopper._hopper_dkdv, hopper._BWD_TILES, None),
               ("dq", hopper._hopper_dq, hopper._DQ_TILES, "CHECK_M"))
    for kind, fn, tiles, check in kernels:
        for d in hopper.HOPPER_HEAD_DIMS:
            for causal in (False, True):
                for bm, bn, stages in tiles[d]:
                    for ws in WS_CHOICES:
                        const = dict(HEAD_DIM=d, HAS_WL=False, HAS_WR=causal, WARP_SPEC=ws, BLOCK_M=bm, BLOCK_N=bn)
                        if check:
                            const[check] = True
                        sig = _signature(fn, "bf16", const)
                        name = f"{kind} d{d} {'causal' if causal else 'full'} {bm}x{bn}x{stages}{' ws' if ws else ''}"
                        yield name, fn, sig, const, 4, stages


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttgir-dir", help="also write each kernel's TTGIR and PTX here")
    ap.add_argument("--only", default="", help="substring of the kernel names to compile")
    ap.add_argument("--baseline", action="store_true", help="also compile each variant without warp specialisation")
    args = ap.parse_args()
    if args.baseline:
        WS_CHOICES.append(False)
    print(f"Triton {triton.__version__}, target sm_90")
    for cases in (forward_cases(), backward_cases()):
        for name, fn, sig, const, warps, stages in cases:
            if args.only not in name:
                continue
            try:
                compiled = _compile(fn, sig, const, warps, stages)
            except Exception as exc:  # report and go on: one failing variant says something too
                msg = str(exc).strip().splitlines()
                print(f"{name:<34} FAILED: {type(exc).__name__}: {msg[-1] if msg else ''}"[:300])
                continue
            report(name, compiled, warps, args.ttgir_dir)


if __name__ == "__main__":
    main()
