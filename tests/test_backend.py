"""The torch.compile backend: registration, compiler choice, Inductor end to end."""

from __future__ import annotations

import logging
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

# Not `import flashfuse.backend as ...`: flashfuse/__init__ binds the name
# flashfuse.backend to the backend object, which shadows the module.
from flashfuse.backend import Backend, make_backend
from flashfuse.backend import backend as default_backend

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fx"))
from fxutil import Recorder, count_ops, qkv  # noqa: E402
from test_fx_spellings import NanoGPTAttention  # noqa: E402


pytestmark = pytest.mark.usefixtures("blockwise_cpu", "fresh_dynamo")


def attn(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


def test_registered_by_name_with_inductor(caplog):
    """backend="flashfuse" (Inductor after the rewrite): forward and backward
    of a causal block in training mode match eager."""
    torch.manual_seed(0)
    m = NanoGPTAttention().train()
    ref = NanoGPTAttention().train()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 12, 64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with caplog.at_level(logging.INFO, logger="flashfuse"):
        out = torch.compile(m, backend="flashfuse")(x)
    assert any("rewrote attention" in r.getMessage() for r in caplog.records)
    expected = ref(xr)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    for p, pr in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad, atol=1e-4, rtol=1e-4)


def test_default_backend_object():
    assert isinstance(default_backend, Backend) and default_backend.compiler == "inductor"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("flashfuse") is default_backend


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_debug_compilers(compiler):
    backend = make_backend(compiler=compiler, record=True)
    q, k, v = qkv(d=16)
    out = torch.compile(attn, backend=backend)(q, k, v)
    torch.testing.assert_close(out, attn(q, k, v), atol=1e-5, rtol=1e-5)
    assert [c.rewritten for c in backend.candidates] == [True]
    out.sum().backward()
    assert q.grad is not None


def test_callable_compiler_sees_rewritten_graph():
    rec = Recorder("eager")
    torch.compile(attn, backend=make_backend(compiler=rec))(*qkv(d=16, grad=False))
    assert count_ops(rec.graphs[0]) == 1
    assert not any("softmax" in str(n.target) for n in rec.graphs[0].graph.nodes)


def test_bad_arguments():
    with pytest.raises(TypeError, match="compiler must be"):
        make_backend(compiler=3)
    with pytest.raises(ValueError, match="only understood by the inductor"):
        make_backend(compiler="eager", options={"max_autotune": True})
    with pytest.raises(ValueError, match="cannot be flashfuse"):
        make_backend(compiler="flashfuse")
    assert "aot_eager" in repr(make_backend(compiler="aot_eager"))


def test_no_global_config_changed():
    import torch._inductor.config as ic

    before = dict(ic.get_config_copy())
    make_backend(options={"max_autotune": True})
    assert dict(ic.get_config_copy()) == before


def _has_flashfuse_op(gm) -> bool:
    return any("flashfuse" in str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_a_rewritten_graph_that_fails_to_compile_falls_back_to_the_traced_graph(caplog):
    """flashfuse never fails a compile: when the compiler after the rewrite
    raises, the backend compiles the graph as Dynamo traced it, and says why
    in the log and on the candidates."""
    seen = []

    def picky(gm, example_inputs):
        seen.append(_has_flashfuse_op(gm))
        if seen[-1]:
            raise RuntimeError("out of resource: shared memory (a stand-in failure)")
        return gm.forward

    be = make_backend(compiler=picky, record=True)
    q, k, v = qkv(2, 3, 37, d=24)
    with caplog.at_level(logging.WARNING, logger="flashfuse"):
        out = torch.compile(attn, backend=be)(q, k, v)
    assert seen == [True, False], "the rewritten graph first, then the traced one"
    ref = attn(*(t.detach().requires_grad_() for t in (q, k, v)))
    torch.testing.assert_close(out, ref)
    (cand,) = be.candidates
    assert not cand.rewritten and "compiling the rewritten graph failed (RuntimeError: out of resource" in cand.reason
    assert "left unrewritten" in caplog.text


def test_a_failure_that_is_not_flashfuses_is_still_raised():
    def broken(gm, example_inputs):
        raise ValueError("the user's own compiler is broken")

    with pytest.raises(Exception, match="the user's own compiler is broken"):
        torch.compile(attn, backend=make_backend(compiler=broken))(*qkv(1, 2, 16, d=16))


@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_gpu_symbolic_head_dims_and_head_counts_recompile_instead_of_failing():
    """The sequence users hit with automatic dynamic shapes: new batch and
    length (sizes become symbolic), then new heads and head dim; and
    dynamic=True from the first call. Every call compiles and matches eager."""
    torch._dynamo.reset()
    for dynamic, seq in ((None, [(16, 32, 1024, 64), (4, 32, 4096, 64), (16, 16, 1024, 128)]),
                         (True, [(2, 8, 300, 64), (3, 4, 517, 80)])):
        be = make_backend(record=True)
        f = torch.compile(attn, backend=be, dynamic=dynamic)
        for b, h, n, d in seq:
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out = f(q, k, v)
            ref = attn(q.double(), k.double(), v.double())
            assert (out.double() - ref).norm() / ref.norm() < 1e-2, (dynamic, b, h, n, d)
        assert be.candidates and all(c.rewritten for c in be.candidates), [c.reason for c in be.candidates]
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("d,train", [(80, True), (96, True), (128, True), (256, False), (256, True)])
def test_gpu_fp32_large_head_dims_compile(d, train):
    """fp32 at large head dims: the traced launches take a config that fits
    the GPU (or the attention is left unrewritten with a reason); the
    compile never fails and matches eager."""
    torch._dynamo.reset()
    be = make_backend(record=True)
    q, k, v = (torch.randn(2, 4, 257, d, device="cuda", requires_grad=train) for _ in range(3))
    out = torch.compile(attn, backend=be)(q, k, v)
    hi = [t.detach().double().requires_grad_(train) for t in (q, k, v)]
    ref = attn(*hi)
    assert (out.double() - ref).norm() / ref.norm() < 1e-4
    if train:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        want = torch.autograd.grad(ref, hi, g.double())
        for a, b in zip(got, want):
            assert (a.double() - b).norm() / b.norm() < 1e-4
    (cand,) = be.candidates
    assert cand.rewritten or "cannot run this shape" in cand.reason, cand.reason


# Programs flashfuse leaves alone on purpose, which Inductor's own attention
# rewrite (fuse_attention, a joint-graph pattern pass) must not touch either.


def softmax_over_queries(q, k, v):
    return F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-2) @ v


def gqa_bnhd_tensor_scale_bias(x, kx, vx, bias):
    # (B, N, H, D) inputs, grouped heads by repeat_interleave after the
    # transposes, a 0-d tensor scale and an additive bias; head size 8 is
    # below the op's minimum, so flashfuse leaves it alone.
    q = x.transpose(1, 2)
    k = kx.transpose(1, 2).repeat_interleave(2, dim=1)
    v = vx.transpose(1, 2).repeat_interleave(2, dim=1)
    scale = torch.tensor(math.sqrt(q.size(-1)))
    s = torch.matmul(q, k.transpose(-2, -1)) / scale + bias
    return torch.matmul(s.softmax(dim=-1), v)


def _left_alone_inputs(fn):
    g = torch.Generator().manual_seed(0)
    if fn is softmax_over_queries:
        shapes = [(2, 3, 7, 16)] * 3
    else:
        shapes = [(2, 7, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8), (2, 4, 7, 7)]
    return [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fn", [softmax_over_queries, gqa_bnhd_tensor_scale_bias], ids=lambda f: f.__name__)
def test_inductor_attention_rewrite_is_off(fn, dynamic):
    """Under the flashfuse backend Inductor does not rewrite attention itself:
    forward and gradients of programs the pass leaves alone match eager."""
    inputs = _left_alone_inputs(fn)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    backend = make_backend(record=True)
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*inputs)
    assert [c.rewritten for c in backend.candidates] == [False]
    ref = fn(*ref_inputs)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-4)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    ref.backward(g.double())
    for x, xr in zip(inputs, ref_inputs):
        torch.testing.assert_close(x.grad, xr.grad.float(), atol=1e-5, rtol=1e-4)


def test_only_inductors_attention_patterns_are_left_out():
    """The joint-graph pattern table loses Inductor's attention rewrites
    while a flashfuse compile runs, and nothing else; outside it, Inductor
    is as it was."""
    from torch._inductor.fx_passes import joint_graph

    from flashfuse.backend import _is_inductor_attention_pattern, inductor_attention_patterns_off

    joint_graph.lazy_init()
    table = joint_graph.patterns
    entries = [e for es in table.patterns.values() for e in es]
    attention = [e for e in entries if _is_inductor_attention_pattern(e)]
    assert attention and len(attention) < len(entries), "both kinds are registered"
    seen = []
    original = type(table).apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(table), "apply", lambda self, graph: seen.append(
            sum(len(es) for es in self.patterns.values())) or 0)
        with inductor_attention_patterns_off():
            table.apply(None)
        table.apply(None)
    assert seen == [len(entries) - len(attention), len(entries)]
    assert type(table).apply is original and "apply" not in vars(table)


def test_unrecognised_attention_patterns_skip_the_table(monkeypatch, caplog):
    """If an Inductor registers its attention patterns in a way this does
    not recognise, the joint-graph table is skipped for the compile rather
    than run with them."""
    from torch._inductor.fx_passes import joint_graph

    backend_module = sys.modules["flashfuse.backend"]  # the name flashfuse.backend is the backend object
    joint_graph.lazy_init()
    monkeypatch.setattr(backend_module, "_is_inductor_attention_pattern", lambda entry: False)
    applied = []
    monkeypatch.setattr(type(joint_graph.patterns), "apply", lambda self, graph: applied.append(1) or 0)
    with caplog.at_level(logging.WARNING, logger="flashfuse"), backend_module.inductor_attention_patterns_off():
        assert joint_graph.patterns.apply(None) == 0
    assert not applied and "not recognised" in caplog.text


def test_inductor_options_mark_the_cache_key_and_keep_user_options():
    from flashfuse.backend import _inductor_patches

    patches = _inductor_patches({"max_autotune": True})
    assert patches["max_autotune"] is True
    assert "fuse_attention" in patches["joint_custom_pre_pass"].uuid()
    own = object()
    patches = _inductor_patches({"joint_custom_pre_pass": own})
    assert patches["joint_custom_pre_pass"] is own and patches["fx_graph_cache"] is False
