"""The Hopper backward kernels (``hopper_gluon._hopper_attn_bwd_dkdv`` and
``_hopper_attn_bwd_dq``) alone, before the op takes them: their gradients
against a float64 reference at odd sizes (causal and not, grouped heads,
outputs poisoned with NaN) beside the portable backward's, then kernel
times at B·N = 16k, H·D = 2048 in bf16 against the portable backward and
SDPA's default backward. CUDA with Triton 3.6 only.

    python bench/hopper_backward.py
"""
import os
import sys
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashfuse.kernels import attention_forward, attention_backward
from flashfuse.kernels.problem import AttentionProblem
from flashfuse.kernels.launch import ensure_scratch_allocator
from flashfuse.kernels import hopper_gluon as hb


def dkdv(q, k, v, do, lse, delta, scale, wr):
    p = AttentionProblem.build(q, k, v, None, dropout_p=0.0, scale=scale, window_left=None, window_right=wr,
                               bottom_right=False, backward=True)
    dk = torch.full_like(k, float("nan")); dv = torch.full_like(v, float("nan"))
    B, Hq, N, D = q.shape; Hkv, M = k.shape[1], k.shape[2]
    ensure_scratch_allocator()
    args = (q, k, v, do, dk, dv, lse, delta, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
            *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2], Hq, Hkv, N, M, p.qk_scale, scale, p.diag_off,
            p.window_left, p.window_right)
    meta = dict(HAS_WINDOW_LEFT=p.has_window_left, HAS_WINDOW_RIGHT=p.has_window_right, HEAD_DIM=D, BLOCK_M=64,
                BLOCK_N=128, STAGES=2 if D == 128 else 3, num_warps=4, maxnreg=168)
    grid = (triton.cdiv(M, 128), Hkv, B)
    fn = lambda: hb._hopper_attn_bwd_dkdv[grid](*args, **meta)
    fn()
    return dk, dv, fn


def dq_kernel(q, k, v, do, lse, delta, scale, wr):
    p = AttentionProblem.build(q, k, v, None, dropout_p=0.0, scale=scale, window_left=None, window_right=wr,
                               bottom_right=False, backward=True)
    dq = torch.full_like(q, float("nan"))
    B, Hq, N, D = q.shape; Hkv, M = k.shape[1], k.shape[2]
    args = (q, k, v, do, dq, lse, delta, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
            *dq.stride()[:3], *lse.stride()[:2], Hq, Hkv, N, M, p.qk_scale, scale, p.diag_off,
            p.window_left, p.window_right)
    meta = dict(HAS_WINDOW_LEFT=p.has_window_left, HAS_WINDOW_RIGHT=p.has_window_right, HEAD_DIM=D, BLOCK_M=128,
                BLOCK_N=64 if D == 128 else 128, STAGES=2, num_warps=4, maxnreg=168)
    grid = (triton.cdiv(N, 128), Hq, B)
    fn = lambda: hb._hopper_attn_bwd_dq[grid](*args, **meta)
    fn()
    return dq, fn


def case(B, Hq, Hkv, N, M, D, causal):
    g = torch.Generator(device="cuda").manual_seed(N * 7 + D)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, do = mk(B, Hq, N, D), mk(B, Hkv, M, D), mk(B, Hkv, M, D), mk(B, Hq, N, D)
    scale = D ** -0.5
    wr = 0 if causal else None
    kw = dict(dropout_p=0.0, scale=scale, window_left=None, window_right=wr, bottom_right=False)
    out, lse = attention_forward(q, k, v, None, None, **kw)
    delta = (do.float() * out.float()).sum(-1).contiguous()
    dq0, dk0, dv0, _ = attention_backward(do, q, k, v, None, None, out, lse, **kw, mask_grad=False)
    dk, dv, _ = dkdv(q, k, v, do, lse, delta, scale, wr)
    try:
        dq, _ = dq_kernel(q, k, v, do, lse, delta, scale, wr)
    except Exception as e:  # noqa
        print("dq kernel", repr(e)[:300]); dq = torch.full_like(q, float("nan"))
    # float64 reference gradients
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    G = Hq // Hkv
    s = (q64 @ k64.repeat_interleave(G, 1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(N, M, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    o = torch.softmax(s, -1).nan_to_num() @ v64.repeat_interleave(G, 1)
    o.backward(do.double())
    def err(a, ref):
        return ((a.double() - ref).norm() / ref.norm()).item()
    row = dict(B=B, Hq=Hq, Hkv=Hkv, N=N, M=M, D=D, causal=causal, dk_err=err(dk, k64.grad), dv_err=err(dv, v64.grad),
               dq_err=err(dq, q64.grad), dq_port=err(dq0, q64.grad), dk_port=err(dk0, k64.grad),
               dv_port=err(dv0, v64.grad), nan=bool(dk.isnan().any() or dv.isnan().any()),
               dq_nan=bool(dq.isnan().any()))
    return row


if __name__ == "__main__":
    rows = []
    for args in [(1, 2, 2, 200, 200, 64, False), (2, 4, 2, 333, 333, 128, True), (1, 8, 2, 1000, 1000, 128, False),
                 (1, 2, 1, 129, 129, 64, True), (2, 4, 4, 513, 513, 128, False), (1, 4, 1, 700, 700, 64, True)]:
        try:
            rows.append(case(*args))
        except Exception as e:  # noqa
            rows.append(dict(case=args, error=repr(e)[:300]))
        print(rows[-1], flush=True)
    for N, D, causal in [(4096, 128, False), (4096, 128, True), (16384, 128, True), (4096, 64, False)]:
        B, H = 16384 // N, 2048 // D
        try:
            g = torch.Generator(device="cuda").manual_seed(1)
            mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
            q, k, v, do = mk(B, H, N, D), mk(B, H, N, D), mk(B, H, N, D), mk(B, H, N, D)
            kw = dict(dropout_p=0.0, scale=D ** -0.5, window_left=None, window_right=0 if causal else None,
                      bottom_right=False)
            out, lse = attention_forward(q, k, v, None, None, **kw)
            delta = (do.float() * out.float()).sum(-1).contiguous()
            _, _, fn = dkdv(q, k, v, do, lse, delta, D ** -0.5, kw["window_right"])
            t_dkdv = triton.testing.do_bench(fn)
            try:
                _, fq = dq_kernel(q, k, v, do, lse, delta, D ** -0.5, kw["window_right"])
                t_dq = triton.testing.do_bench(fq)
            except Exception as e:  # noqa
                t_dq = repr(e)[:200]
            t_port = triton.testing.do_bench(lambda: attention_backward(do, q, k, v, None, None, out, lse, **kw,
                                                                        mask_grad=False))
            qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
            o_sd = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            t_sdpa_bwd = triton.testing.do_bench(lambda: torch.autograd.grad(o_sd, (qr, kr, vr), do, retain_graph=True))
            flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)  # two of the backward's products per pair
            print(dict(N=N, D=D, causal=causal, dkdv_ms=t_dkdv, dkdv_tflops_4products=2 * flops / t_dkdv / 1e9,
                       dq_ms=t_dq, portable_bwd_ms=t_port, sdpa_bwd_ms=t_sdpa_bwd), flush=True)
        except Exception as e:  # noqa
            print(dict(N=N, D=D, error=repr(e)[:300]), flush=True)
