"""The torch.library layer: checks, registration, autograd, compile, export.

The numerics of each implementation are tested in tests/kernels (Triton) and
tests/test_reference.py (blockwise); here the op is exercised end to end on
CPU tensors, through both the blockwise path and the Triton interpreter.
"""

import contextlib
import functools
import math
import os

import pytest
import script_runner
import torch
import torch.nn.functional as F

import flashfuse
from flashfuse import reference

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_qkv(B=2, Hq=4, Hkv=4, N=17, M=23, D=16, Dv=None, dtype=torch.float32, requires_grad=False):
    Dv = D if Dv is None else Dv
    q = torch.randn(B, Hq, N, D, dtype=dtype)
    k = torch.randn(B, Hkv, M, D, dtype=dtype)
    v = torch.randn(B, Hkv, M, Dv, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.fixture(params=["blockwise", "triton-interpreter"])
def path(request, monkeypatch):
    """Run a test once on each CPU implementation."""
    monkeypatch.setenv("TRITON_INTERPRET", "0" if request.param == "blockwise" else "1")
    if request.param != "blockwise" and not flashfuse.ops._kernels.BUILT_FOR_INTERPRETER:
        pytest.skip("kernels were not built for the Triton interpreter")
    return request.param


# ---------------------------------------------------------------------------
# Bad input: a clear error naming the problem
# ---------------------------------------------------------------------------

def _bad_cases():
    q, k, v = make_qkv()
    yield "rank", (q[0], k, v), {}, "must be 4-D"
    yield "dtypes", (q, k.half(), v), {}, "share a dtype"
    yield "int dtype", (q.long(), k.long(), v.long()), {}, "not supported"
    yield "batch", (q, k[:1], v[:1]), {}, "batch sizes differ"
    yield "kv heads", (q, k, v[:, :2]), {}, "same heads"
    yield "kv length", (q, k, v[:, :, :5]), {}, "same heads and sequence length"
    yield "head dim qk", (q, k[..., :8].contiguous(), v), {}, "head dims differ"
    yield "head dim small", (q[..., :8], k[..., :8], v), {}, "head dim 8 is not supported"
    big = torch.randn(1, 1, 3, 288)
    yield "head dim big", (big, big, big), {}, "16 to 256"
    q6, k3, v3 = make_qkv(Hq=6, Hkv=4)
    yield "gqa ratio", (q6, k3, v3), {"enable_gqa": True}, "multiple of key/value heads"
    q8, k2, v2 = make_qkv(Hq=8, Hkv=2)
    yield "gqa flag", (q8, k2, v2), {}, "enable_gqa=True"
    yield "mask shape", (q, k, v), {"attn_mask": torch.ones(17, 5, dtype=torch.bool)}, "does not broadcast"
    yield "mask rank", (q, k, v), {"attn_mask": torch.ones(1, 2, 4, 17, 23, dtype=torch.bool)}, "does not broadcast"
    yield "mask dtype", (q, k, v), {"attn_mask": torch.ones(17, 23, dtype=torch.int32)}, "attn_mask dtype"
    yield "dropout neg", (q, k, v), {"dropout_p": -0.1}, "dropout_p"
    yield "dropout big", (q, k, v), {"dropout_p": 1.5}, "dropout_p"
    yield "window", (q, k, v), {"window_left": -1}, "window_left"
    yield "alignment", (q, k, v), {"alignment": "middle"}, "alignment"
    yield "fill with float mask", (q, k, v), {"attn_mask": torch.zeros(17, 23), "mask_fill": -1e4}, \
        "mask_fill replaces the scores that a bool attn_mask hides"
    yield "fill nan", (q, k, v), {"attn_mask": torch.ones(17, 23, dtype=torch.bool), "mask_fill": math.nan}, \
        "mask_fill must be a finite number"


@pytest.mark.parametrize("name,args,kwargs,message", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_rejected_with_a_clear_message(name, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        flashfuse.attention(*args, **kwargs)


def test_device_mismatch_is_rejected():
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match="one device"):
        flashfuse.attention(q, k.to("meta"), v)


# ---------------------------------------------------------------------------
# Numerics end to end, forward and gradients
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_op_matches_reference(path, dtype, causal):
    q, k, v = make_qkv(B=1, Hq=4, Hkv=2, N=19, M=33, D=24, Dv=40, dtype=dtype, requires_grad=True)
    mask = torch.randn(1, 4, 19, 33, dtype=dtype, requires_grad=True)
    out = flashfuse.attention(q, k, v, mask, is_causal=causal, enable_gqa=True, alignment="bottom_right")
    assert out.dtype == dtype and out.shape == (1, 4, 19, 40)
    # The documented layout: (B, N, H, Dv) in memory.
    assert out.transpose(1, 2).is_contiguous()
    ref = reference.reference_attention(
        q, k, v, mask, window_right=0 if causal else None, bottom_right=True
    )
    assert rel_err(out, ref) < TOL[dtype]
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v, mask), grad.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v, mask), grad)
    for name, g, w in zip("q k v mask".split(), got, want):
        assert g.shape == w.shape, name
        assert rel_err(g, w) < 4 * TOL[dtype], name


def test_matches_sdpa_defaults():
    q, k, v = make_qkv(N=31, M=31, D=32)
    for causal in (False, True):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        assert rel_err(flashfuse.attention(q, k, v, is_causal=causal), ref) < TOL[torch.float32]


def test_empty_key_sequence_gives_zeros():
    q, k, v = make_qkv(M=0)
    out = flashfuse.attention(q, k, v)
    assert out.shape == (2, 4, 17, 16) and torch.all(out == 0)


def test_float64_gradcheck_on_cpu(blockwise_cpu):
    q, k, v = make_qkv(B=1, Hq=2, Hkv=1, N=5, M=7, D=16, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, mask):
        return flashfuse.attention(q, k, v, mask, is_causal=True, enable_gqa=True, alignment="bottom_right")

    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


# ---------------------------------------------------------------------------
# Dropout: reproducible, unbiased, gradients with the very same mask
# ---------------------------------------------------------------------------

def test_dropout_uses_the_documented_mask(path):
    q, k, v = make_qkv(B=1, Hq=2, Hkv=2, N=21, M=37, D=16, requires_grad=True)
    p = 0.3
    seed = torch.tensor(1234567890123, dtype=torch.int64)
    out, _ = torch.ops.flashfuse._attention_forward(q, k, v, None, seed, p, 0.25, None, None, False)
    keep = reference.dropout_keep_mask(int(seed), 1, 2, 21, 37, p)
    ref = reference.reference_attention(q, k, v, scale=0.25, dropout_mask=keep, dropout_p=p)
    assert rel_err(out, ref) < TOL[torch.float32]
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.float())
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 4 * TOL[torch.float32]


def test_dropout_is_reproducible_and_unbiased(blockwise_cpu):
    q, k, v = make_qkv(B=2, Hq=2, Hkv=2, N=64, M=64, D=16)
    torch.manual_seed(0)
    a = flashfuse.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = flashfuse.attention(q, k, v, dropout_p=0.5)
    c = flashfuse.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # Keep rate: with values all ones, out is the mean of the kept, rescaled weights.
    ones = torch.ones_like(v)
    outs = torch.stack([flashfuse.attention(q, k, ones, dropout_p=0.5) for _ in range(16)])
    mean = outs.mean()
    assert abs(mean.item() - 1.0) < 0.02, mean  # unbiased: E[out] = softmax @ v


def test_dropout_one_drops_everything(blockwise_cpu):
    q, k, v = make_qkv(requires_grad=True)
    out = flashfuse.attention(q, k, v, dropout_p=1.0)
    assert torch.all(out == 0)
    out.sum().backward()
    assert torch.all(q.grad == 0)


# ---------------------------------------------------------------------------
# torch.library contract, compile and export
# ---------------------------------------------------------------------------

def test_opcheck_public_and_private_ops(blockwise_cpu):
    q, k, v = make_qkv(B=1, Hq=4, Hkv=2, N=9, M=13, D=16, requires_grad=True)
    mask = torch.randn(1, 1, 9, 13, requires_grad=True)
    torch.library.opcheck(
        torch.ops.flashfuse.attention.default, (q, k, v, mask, 0.0, True, None, True),
        {"alignment": "bottom_right"},
    )
    seed = torch.tensor(7, dtype=torch.int64)
    torch.library.opcheck(
        torch.ops.flashfuse._attention_forward.default,
        (q, k, v, mask, seed, 0.2, 0.3, 4, 0, False),
    )


def test_compile_fullgraph_forward_and_backward(blockwise_cpu):
    q, k, v = make_qkv(B=1, Hq=2, Hkv=2, N=33, M=33, D=16, requires_grad=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fn(q, k, v):
        return flashfuse.attention(q, k, v, is_causal=True).square().sum()

    loss = fn(q, k, v)
    loss.backward()
    ref = reference.reference_attention(q, k, v, window_right=0).square().sum()
    want = torch.autograd.grad(ref, (q, k, v))
    assert abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-5
    for g, w in zip((q.grad, k.grad, v.grad), want):
        assert rel_err(g, w) < 1e-4


def test_compile_dynamic_does_not_recompile_for_new_lengths(blockwise_cpu):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    @torch.compile(fullgraph=True, dynamic=True, backend=counter)
    def fn(q, k, v):
        return flashfuse.attention(q, k, v, is_causal=True)

    compiles = []
    for n in (17, 40, 65):
        q, k, v = make_qkv(B=1, Hq=2, Hkv=2, N=n, M=n, D=16)
        out = fn(q, k, v)
        compiles.append(counter.frame_count)
        ref = reference.reference_attention(q, k, v, window_right=0)
        assert rel_err(out, ref) < 1e-5
    assert compiles[0] >= 1 and compiles[-1] == compiles[0], compiles


def test_export_keeps_the_op(blockwise_cpu):
    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return flashfuse.attention(q, k, v, is_causal=True)

    q, k, v = make_qkv(B=1, Hq=2, Hkv=2, N=8, M=8, D=16)
    ep = torch.export.export(Attn(), (q, k, v))
    assert "flashfuse" in str(ep.graph)
    assert torch.allclose(ep.module()(q, k, v), Attn()(q, k, v))


def test_default_scale_is_one_over_sqrt_head_dim(blockwise_cpu):
    q, k, v = make_qkv(D=36)
    a = flashfuse.attention(q, k, v)
    b = flashfuse.attention(q, k, v, scale=1 / math.sqrt(36))
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# Eager calls skip the private ops; everything else records them
# ---------------------------------------------------------------------------

class _PassThroughMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Watches every op and changes nothing: enough to make the op take the
    path that tracers and compilers see (the private ops)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "learned-bias", "bool-fill"])
def test_eager_path_computes_what_the_ops_compute(path, mask_kind, monkeypatch):
    q, k, v = make_qkv(B=2, Hq=2, Hkv=1, N=19, M=27, D=16, requires_grad=True)
    mask, fill = None, None
    if mask_kind in ("bool", "bool-fill"):
        mask = torch.rand(2, 1, 19, 27) > 0.3
    elif mask_kind == "learned-bias":
        mask = torch.randn(1, 2, 19, 27, requires_grad=True)
    if mask_kind == "bool-fill":  # rows hidden entirely average their keys
        mask[:, :, [0, 5]] = False
        fill = torch.finfo(torch.float32).min
    g = torch.randn(2, 2, 19, 16)
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]

    eager_calls = []
    apply = flashfuse.ops._EagerAttention.apply
    monkeypatch.setattr(flashfuse.ops._EagerAttention, "apply", lambda *a: eager_calls.append(1) or apply(*a))

    def run(mode):
        for t in leaves:
            t.grad = None
        torch.manual_seed(3)
        with mode if mode is not None else contextlib.nullcontext():
            out = flashfuse.attention(q, k, v, attn_mask=mask, dropout_p=0.25, enable_gqa=True,
                                      window_left=7, window_right=2, mask_fill=fill)
            out.backward(g)
        return [out.detach()] + [t.grad for t in leaves]

    fast = run(None)
    assert len(eager_calls) == 1
    recorded = run(_PassThroughMode())
    assert len(eager_calls) == 1, "under a dispatch mode the op must go through its private ops"
    for a, b in zip(fast, recorded):
        assert torch.equal(a, b)


def test_compiled_graphs_record_the_private_ops(blockwise_cpu):
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = make_qkv(B=1, Hq=2, Hkv=2, N=8, M=8, D=16)
    gm = make_fx(lambda q, k, v: flashfuse.attention(q, k, v, is_causal=True))(q, k, v)
    assert "flashfuse._attention_forward" in gm.code


_TRACED_CASES = ["causal", "bool_mask", "float_mask_dropout"]


@functools.lru_cache(maxsize=None)
def _traced_cuda_graphs() -> tuple[dict, str]:
    """Every case of the test below, traced in one fresh process (see
    tests/trace_cuda_graph.py): {(case, dynamic): trace}, and its stderr."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "trace_cuda_graph.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    specs = [f"{case}{mode}" for case in _TRACED_CASES for mode in ("", ":dynamic", ":dynamic_head")]
    proc = subprocess.run([sys.executable, script, *specs], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {(t["case"], t["dynamic"]): t for t in traces}, proc.stderr


@pytest.mark.parametrize("dynamic", [False, True, "head"], ids=["static", "dynamic", "dynamic_head"])
@pytest.mark.parametrize("case", _TRACED_CASES)
def test_traced_cuda_graph_launches_the_kernels_itself(case, dynamic):
    """Under torch.compile the private ops decompose into their kernel
    launches (torch.library.triton_op), so that Inductor launches the kernels
    from its generated code instead of calling back into Python. Traced on
    fake CUDA tensors in a fresh process (see tests/trace_cuda_graph.py);
    with a symbolic sequence length the graph must stay general in it; a
    symbolic head dim (tiles are compiled for it) is specialised by a guard,
    so another head dim recompiles rather than failing the trace."""
    traces, stderr = _traced_cuda_graphs()
    assert "assuming every input is mutated" not in stderr, stderr[-3000:]
    traced = traces[(case, dynamic)]
    (graph,) = traced["graphs"]
    if dynamic:
        assert graph["inputs"][0][2] != "80", graph["inputs"]  # still symbolic
        pins = [g for g in traced["guards"] if g.startswith("Eq(")]
        # Only range guards (e.g. N > 16): no guard pins the length to a value.
        if dynamic == "head":  # the head dim's symbol, pinned to its value
            assert len(pins) == 1 and pins[0].endswith(", 32)"), traced["guards"]
        else:
            assert not pins, traced["guards"]
    kernels = [launch["kernel"] for launch in graph["launches"]]
    expected = {
        "causal": ["_attn_fwd", "_bwd_preprocess", "_bwd_dkdv", "_bwd_dq"],
        "bool_mask": ["_mask_key_table", "_attn_fwd", "_mask_key_table", "_mask_query_table", "_bwd_preprocess",
                      "_bwd_dkdv", "_bwd_dq"],
        # dropout at small head dims: one backward pass, dQ by atomics
        "float_mask_dropout": ["_mask_key_table", "_attn_fwd", "_mask_key_table", "_mask_query_table",
                               "_bwd_preprocess", "_bwd_dkdv"],
    }
    assert kernels == expected[case]
    assert not [op for op in graph["ops"] if "flashfuse" in op], graph["ops"]
    fresh = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
             "aten.zeros.default", "aten.zeros_like.default"}
    for launch in graph["launches"]:
        # Kernels write only buffers allocated for them, which Inductor then
        # hands to the kernel in place; writing an input would mean a copy.
        assert launch["written_from"], launch
        assert set(launch["written_from"].values()) <= fresh, launch


def _gpu_case(case):
    """Inputs of one compiled-graph case on the GPU: (q, k, v, mask, kwargs)."""
    B, Hq, Hkv, N, D = 2, 4, 2 if case == "gqa_window" else 4, 200, 64
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16)
    mask, kwargs = None, {}
    if case == "causal":
        kwargs = {"is_causal": True}
    elif case == "bool_padding":
        mask = torch.ones(B, 1, 1, N, dtype=torch.bool, device="cuda")
        mask[0, ..., 150:] = False  # hides whole key blocks of batch 0
    elif case == "learned_bias":
        mask = torch.randn(1, Hq, N, N, device="cuda", dtype=torch.bfloat16)
    elif case == "gqa_window":
        kwargs = {"enable_gqa": True, "window_left": 37, "window_right": 5}
    return q, k, v, mask, kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "bool_padding", "learned_bias", "gqa_window"])
def test_gpu_inductor_launches_the_kernels_and_matches_float64(case):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q, k, v, mask, kwargs = _gpu_case(case)
    leaves = [q, k, v] + ([mask] if mask is not None and mask.is_floating_point() else [])
    for t in leaves:
        t.requires_grad_(True)
    grad_out = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], device="cuda", dtype=torch.bfloat16)

    @torch.compile(fullgraph=True)
    def fn(q, k, v, mask):
        return flashfuse.attention(q, k, v, mask, **kwargs)

    def run():
        out = fn(q, k, v, mask)
        grads = torch.autograd.grad(out, leaves, grad_out)
        return out, grads

    (out, grads), code = run_and_get_code(run)
    code = "\n".join(code)
    # Inductor launches the kernels from its own code: no call back into the op.
    assert "_attn_fwd" in code and "_bwd_dkdv" in code
    assert "flashfuse._attention_forward" not in code and "flashfuse._attention_backward" not in code

    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    q64, k64, v64 = leaves64[:3]
    mask64 = leaves64[3] if len(leaves64) > 3 else mask
    ref_kwargs = {"window_right": 0} if case == "causal" else {
        key: val for key, val in kwargs.items() if key.startswith("window")}
    ref = reference.reference_attention(q64, k64, v64, mask64, **ref_kwargs)
    ref_grads = torch.autograd.grad(ref, leaves64, grad_out.double())
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    for name, g, rg in zip(["dq", "dk", "dv", "dmask"], grads, ref_grads):
        assert rel_err(g, rg) < 2 * TOL[torch.bfloat16], name

    # A second call replays the compiled graph: same answer, bit for bit.
    out2, grads2 = run()
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


@pytest.mark.gpu
def test_gpu_inductor_dynamic_sequence_lengths():
    # Compiled with dynamic shapes, one graph serves every sequence length:
    # the launches are recorded with symbolic grids and lengths.
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True)
    def fn(q, k, v, mask):
        return flashfuse.attention(q, k, v, mask)

    for i, N in enumerate((200, 333)):
        gen = torch.Generator().manual_seed(N)
        q, k, v, go = (torch.randn(2, 4, N, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
        mask = torch.ones(2, 1, 1, N, dtype=torch.bool, device="cuda")
        mask[0, ..., N // 2:] = False
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = fn(q, k, v, mask)
            grads = torch.autograd.grad(out, leaves, go)
        leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = reference.reference_attention(*leaves64, mask)
        ref_grads = torch.autograd.grad(ref, leaves64, go.double())
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        for name, g, rg in zip(["dq", "dk", "dv"], grads, ref_grads):
            assert rel_err(g, rg) < 2 * TOL[torch.bfloat16], name


_FIRST_CALL_WITHOUT_INTERPRETER = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import flashfuse
from flashfuse import reference

# The premise: no kernel module is imported yet (importing flashfuse does not).
assert not any(m.startswith("flashfuse.kernels.") for m in sys.modules), sorted(sys.modules)
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
mask = torch.rand(1, 1, 40, 40) > 0.3
# The kernel modules are imported at the first call: here with the
# interpreter switched off for a moment (the blockwise CPU path), as a test
# or a user may do.
os.environ["TRITON_INTERPRET"] = "0"
flashfuse.attention(q, k, v, is_causal=True)
flashfuse.block_mask(mask)
flashfuse.attention_with_kvcache(q[:, :, :1], k.transpose(1, 2), v.transpose(1, 2))
os.environ["TRITON_INTERPRET"] = "1"
for name, got in [("attention", flashfuse.attention(q, k, v, attn_mask=mask, is_causal=True)),
                  ("block mask", flashfuse.attention(q, k, v, attn_mask=flashfuse.block_mask(mask, is_causal=True)))]:
    want = reference.reference_attention(q, k, v, attn_mask=mask, window_right=0)
    err = (got.double() - want).abs().max().item()
    assert err < 1e-4, (name, err)
got = flashfuse.attention_with_kvcache(q[:, :, :1], k.transpose(1, 2), v.transpose(1, 2))
want = reference.reference_attention(q[:, :, :1], k, v, window_right=0, bottom_right=True)
assert (got.double() - want).abs().max().item() < 1e-4
print("ok")
"""


def test_kernels_defined_for_the_interpreter_recorded_at_import(tmp_path):
    """The kernel modules are imported at the first call. Triton decides when
    a kernel is defined whether it runs in the interpreter, from
    TRITON_INTERPRET at that moment; a first call made while it was switched
    off (the blockwise CPU path) left compiled kernels that the
    interpreter's later calls could not launch ("0 active drivers"). In a
    fresh process, since the order of imports is the point."""
    script = tmp_path / "first_call.py"
    script.write_text(_FIRST_CALL_WITHOUT_INTERPRETER)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = script_runner.run(str(script), cwd=root, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("case", ["bool mask", "no mask", "float mask", "dropout", "many queries", "softcap",
                                  "bad scale"])
def test_takes_decode_kernels_answers_as_the_op_routes(monkeypatch, case):
    """``ops.takes_decode_kernels`` (the Hugging Face hook asks it before
    building block-mask tables) says True exactly for the calls whose forward
    the op runs on the split-KV decode kernels, and never raises: a bad
    argument is False (the op raises its own error)."""
    from flashfuse import ops
    from flashfuse.kernels import decode

    if not ops._use_triton(torch.empty(1)):
        pytest.skip("the kernels run only under TRITON_INTERPRET=1 on a CPU")
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    g = torch.Generator().manual_seed(4)
    N = 40 if case == "many queries" else 1
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h, n in ((4, N), (2, 30), (2, 30)))
    mask = torch.rand(1, 1, N, 30, generator=g) > 0.3
    if case == "no mask":
        mask = None
    elif case == "float mask":
        mask = torch.zeros(1, 1, N, 30).masked_fill(~mask, float("-inf"))
    kw = dict(dropout_p=0.3 if case == "dropout" else 0.0, is_causal=False,
              scale=float("nan") if case == "bad scale" else None, window_left=None, alignment="bottom_right",
              softcap=5.0 if case == "softcap" else None)
    said = ops.takes_decode_kernels(q, k, v, mask, kw["dropout_p"], False, kw["scale"], None, "bottom_right",
                                    softcap=kw["softcap"])
    taken = []
    real = decode.decode_forward
    monkeypatch.setattr(decode, "decode_forward", lambda *a, **kws: taken.append(1) or real(*a, **kws))
    try:
        torch.ops.flashfuse.attention(q, k, v, mask, kw["dropout_p"], False, kw["scale"], True,
                                      alignment="bottom_right", softcap=kw["softcap"])
    except (ValueError, RuntimeError):
        assert case == "bad scale" and not said
        return
    assert said == bool(taken) == (case in ("bool mask", "no mask")), case
