"""Context parallelism (flashfuse.parallel): ring attention over gloo CPU
processes, against the single-process op and a float64 reference.

Each spawn runs all its cases in one go (start-up and imports dominate);
most cases use the blockwise CPU path, one small case runs the Triton
kernels in the interpreter."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distutil import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

# (name, B, Hq, Hkv, N, M, D, causal, alignment, dtype)
CASES = [
    ("full", 1, 2, 2, 24, 24, 16, False, "top_left", torch.float32),
    ("causal", 2, 2, 2, 40, 40, 16, True, "top_left", torch.float32),
    ("causal_gqa", 1, 4, 2, 24, 24, 32, True, "top_left", torch.float32),
    ("causal_f64", 1, 2, 1, 16, 16, 16, True, "top_left", torch.float64),
    ("bottom_right", 1, 2, 2, 16, 32, 16, True, "bottom_right", torch.float32),
]


def reference64(q, k, v, causal, alignment):
    """flashfuse's float64 reference attention on the whole sequence."""
    from flashfuse.reference import reference_attention

    return reference_attention(q.double(), k.double(), v.double(), window_right=0 if causal else None,
                               bottom_right=alignment == "bottom_right")


def _inputs(case, seed=0):
    _, B, Hq, Hkv, N, M, D, causal, alignment, dtype = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, M, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, M, D, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def _ring_cases(rank, world, cases):
    import flashfuse
    from flashfuse.parallel import shard, unshard

    results = {}
    for case in cases:
        name, causal, alignment = case[0], case[7], case[8]
        q, k, v, do = _inputs(case)
        lb = causal
        ql, kl, vl = (shard(t, load_balanced=lb).requires_grad_() for t in (q, k, v))
        out = flashfuse.ring_attention(ql, kl, vl, is_causal=causal, enable_gqa=True, alignment=alignment)
        out.backward(shard(do, load_balanced=lb))
        results[name] = [unshard(t, load_balanced=lb) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    if world == 1:
        return results
    # Uneven lengths: every rank raises the same ValueError (none hangs).
    q, k, v, _ = _inputs(CASES[0])
    n = 8 if rank == 0 else 4
    try:
        flashfuse.ring_attention(q[:, :, :n], k[:, :, :8], v[:, :, :8])
        results["uneven"] = None
    except ValueError as e:
        results["uneven"] = str(e)
    try:
        shard(q[:, :, :7], load_balanced=True)
        results["indivisible"] = None
    except ValueError as e:
        results["indivisible"] = str(e)
    return results


def _check(results, cases, world):
    for case in cases:
        name, causal, alignment, dtype = case[0], case[7], case[8], case[9]
        q, k, v, do = _inputs(case)
        # The single-process op on the whole sequence.
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        import flashfuse

        expected = flashfuse.attention(qs, ks, vs, is_causal=causal, enable_gqa=True, alignment=alignment)
        expected.backward(do)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = reference64(q64, k64, v64, causal, alignment)
        ref.backward(do.double())
        # The op's lse is float32 even for float64 inputs: merging partial
        # results through it costs float32 rounding.
        tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
        for rank in range(world):
            got = results[rank][name]
            for what, g, e, r in zip(("out", "dq", "dk", "dv"), got, (expected, qs.grad, ks.grad, vs.grad),
                                     (ref, q64.grad, k64.grad, v64.grad)):
                torch.testing.assert_close(g, e.detach(), **tol, msg=lambda m: f"{name} {what} vs op: {m}")
                torch.testing.assert_close(g.double(), r.detach(), **tol, msg=lambda m: f"{name} {what} vs f64: {m}")
    for rank in range(world if world > 1 else 0):
        assert "different sequence lengths" in (results[rank]["uneven"] or "")
        assert "not divisible by" in (results[rank]["indivisible"] or "")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_matches_single_process(world, tmp_path, blockwise_cpu):
    # World size 1 (one GPU through the same code path: no messages at all).
    cases = {1: ["causal_gqa"], 2: [c[0] for c in CASES], 4: ["causal_gqa", "bottom_right"]}[world]
    cases = [c for c in CASES if c[0] in cases]
    results = run_ranks(_ring_cases, world, tmp_path, cases)
    _check(results, cases, world)


def _interpreter_and_context_manager(rank, world):
    """A small causal GQA case through the Triton kernels (interpreter), and
    ``context_parallel`` redirecting F.scaled_dot_product_attention."""
    import torch.nn.functional as F

    import flashfuse
    from flashfuse import ops
    from flashfuse.parallel import shard, unshard

    assert ops._use_triton(torch.empty(1))  # the kernels, not the blockwise path
    case = ("interp", 1, 2, 1, 32, 32, 16, True, "top_left", torch.float32)
    q, k, v, do = _inputs(case, seed=3)
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = flashfuse.ring_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
    out.backward(shard(do))
    ring = [unshard(t) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]

    # The context manager: buffers sharded in place on entry, gathered on exit.
    qb, kb, vb = (t.clone() for t in (q, k, v))
    sdpa, op = F.scaled_dot_product_attention, flashfuse.attention
    with flashfuse.context_parallel(buffers=[qb, kb, vb], buffer_seq_dims=[2, 2, 2]):
        local_len = qb.shape[2]
        cm_out = unshard(F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))
        try:
            F.scaled_dot_product_attention(qb, kb, vb, attn_mask=torch.ones(1, dtype=torch.bool))
            refused = None
        except ValueError as e:
            refused = str(e)
    restored = torch.equal(qb, q) and F.scaled_dot_product_attention is sdpa and flashfuse.attention is op
    return dict(ring=ring, cm_out=cm_out, local_len=local_len, refused=refused, restored=restored)


def test_ring_attention_interpreter_and_context_manager(tmp_path):
    results = run_ranks(_interpreter_and_context_manager, 2, tmp_path, interpret=True)
    case = ("interp", 1, 2, 1, 32, 32, 16, True, "top_left", torch.float32)
    q, k, v, do = _inputs(case, seed=3)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference64(q64, k64, v64, True, "top_left")
    ref.backward(do.double())
    for r in results:
        for what, g, e in zip(("out", "dq", "dk", "dv"), r["ring"], (ref, q64.grad, k64.grad, v64.grad)):
            torch.testing.assert_close(g.double(), e.detach(), atol=2e-5, rtol=2e-5, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(r["cm_out"].double(), ref.detach(), atol=2e-5, rtol=2e-5)
        assert r["local_len"] == 16 and r["restored"]
        assert "no mask" in (r["refused"] or "")


def _ring_compiled(rank, world, backends):
    import flashfuse
    from flashfuse.parallel import shard, unshard

    q, k, v, do = _inputs(CASES[1])
    results = {}
    for backend in backends:
        torch._dynamo.reset()
        ql, kl, vl = (shard(t, load_balanced=True).requires_grad_() for t in (q, k, v))
        f = torch.compile(lambda a, b, c: flashfuse.ring_attention(a, b, c, is_causal=True, enable_gqa=True),
                          backend=backend)
        out = f(ql, kl, vl)
        out.backward(shard(do, load_balanced=True))
        results[backend] = [unshard(t, load_balanced=True) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    return results


def test_ring_attention_under_torch_compile(tmp_path, blockwise_cpu):
    """ring_attention inside a compiled function (two ranks, causal,
    load-balanced): the same output and gradients as the single-process op."""
    backends = ["aot_eager"]  # Inductor too in a manual run; left out here for CI time
    results = run_ranks(_ring_compiled, 2, tmp_path, backends)
    q, k, v, do = _inputs(CASES[1])
    import flashfuse

    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    expected = flashfuse.attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    expected.backward(do)
    for rank in range(2):
        for backend in backends:
            for what, got, want in zip(("out", "dq", "dk", "dv"), results[rank][backend],
                                       (expected, qs.grad, ks.grad, vs.grad)):
                torch.testing.assert_close(got, want.detach(), atol=2e-5, rtol=2e-5,
                                           msg=lambda m: f"{backend} {what}: {m}")
