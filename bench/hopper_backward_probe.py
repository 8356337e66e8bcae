"""The fused Hopper backward and the op's forward+backward timed at a few
shapes, outside bench_attention.py's sweep: the backward with dO contiguous
or in the output's (B, N, H, D) layout, on one program per key tile and on
the persistent grid (where the launcher has the choice), then the op's
forward+backward with each dO. bf16, B·N = 16k, H·D = 2048, medians of
``triton.testing.do_bench`` (25 ms warm-up, 100 ms). Prints one line per
measurement; CUDA with Triton 3.6.

    python bench/hopper_backward_probe.py [label]
"""

from __future__ import annotations

import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from hopper_backward_configs import _setup, _timed_inputs  # noqa: E402

SHAPES = [(128, 1024, True), (128, 1024, False), (128, 4096, True), (64, 1024, False)]


def main():
    import triton.testing as tt

    import flashfuse
    from flashfuse.kernels import hopper

    label = sys.argv[1] if len(sys.argv) > 1 else "flashfuse"
    # Trees before the persistent backward have no grid argument.
    grids = (False, True) if "persistent" in inspect.signature(hopper.hopper_backward_fused).parameters else (None,)
    for D, N, causal in SHAPES:
        q, k, v, do, kw = _timed_inputs(D, N, causal, "cuda")
        do_bnhd = do.transpose(1, 2).contiguous().transpose(1, 2)
        for name, d in (("contig", do), ("bnhd", do_bnhd)):
            p, lse, delta = _setup(q, k, v, d, kw)
            for persistent in grids:
                grid = {} if persistent is None else dict(persistent=persistent)
                ms = tt.do_bench(lambda: hopper.hopper_backward_fused(p, d, q, k, v, lse, delta, how="tma", **grid),
                                 warmup=25, rep=100)
                print(f"{label} D={D} N={N} causal={causal} dO={name} persistent={persistent}: {ms:.3f} ms",
                      flush=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashfuse.attention(*leaves, is_causal=causal)
        for name, d in (("contig", torch.randn(out.shape, device="cuda", dtype=out.dtype)),
                        ("like_out", torch.randn_like(out))):
            ms = tt.do_bench(lambda: flashfuse.attention(*leaves, is_causal=causal).backward(d), warmup=25, rep=100,
                             grad_to_none=leaves)
            print(f"{label} D={D} N={N} causal={causal} op fwd+bwd dout={name}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
