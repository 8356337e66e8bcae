"""Tests of ``flashfuse.attention_with_kvcache`` (contiguous cache with
per-row lengths, paged cache) and ``flashfuse.attention_with_lse`` (lse as a
result, with its gradient), against the float64 reference; each on the
interpreted kernels and the blockwise CPU path."""

from __future__ import annotations

import pytest
import torch

import flashfuse
from flashfuse import reference as ref

from tests.kernels.padding import poison_empty

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["kernels", "blockwise"])
def path(request, monkeypatch):
    if request.param == "blockwise":
        if DEVICE == "cuda":
            pytest.skip("the blockwise path is CPU only")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    poison_empty(monkeypatch)
    return request.param


def _reference(q, k, v, lens, causal=True, window_left=None):
    """float64 out and lse of each row against its own first lens[b] keys,
    bottom-right aligned; k, v (B, Hkv, M, D): the reference attention of
    each batch row alone, on its keys cut to its length."""
    outs, lses = [], []
    band = dict(window_right=0 if causal else None, window_left=window_left, bottom_right=True)
    for b in range(q.shape[0]):
        L = int(lens[b])
        qb, kb, vb = q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L]
        if L == 0:  # an empty row sees nothing: output 0, lse +inf (as the op documents)
            outs.append(torch.zeros(*qb.shape[:3], v.shape[-1], dtype=torch.float64, device=q.device))
            lses.append(torch.full(qb.shape[:3], float("inf"), dtype=torch.float64, device=q.device))
            continue
        outs.append(ref.reference_attention(qb, kb, vb, **band))
        lses.append(ref.reference_lse(qb, kb, **band))
    return torch.cat(outs), torch.cat(lses)


def _close(out, lse, want, want_lse, tol=2e-6):
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=tol, rtol=tol)


@pytest.mark.parametrize("group,n,splits", [(1, 1, 1), (4, 3, 2), (8, 1, None)])
def test_contiguous_cache_with_lengths(path, group, n, splits):
    torch.manual_seed(group)
    B, Hkv, S, D = 3, 1, 40, 16
    q = torch.randn(B, Hkv * group, n, D, device=DEVICE)
    # Held as Hugging Face holds it, (B, Hkv, S, D), passed as a free view.
    k = torch.randn(B, Hkv, S, D, device=DEVICE)
    v = torch.randn(B, Hkv, S, D, device=DEVICE)
    lens = torch.tensor([0, S, 17], dtype=torch.int32, device=DEVICE)  # empty, full, partial
    out, lse = flashfuse.attention_with_kvcache(q, k.transpose(1, 2), v.transpose(1, 2), lens,
                                                num_splits=splits, return_lse=True)
    _close(out, lse, *_reference(q, k, v, lens))


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_cache(path, page_size):
    torch.manual_seed(page_size)
    B, Hq, Hkv, N, D, pages = 3, 4, 1, 2, 16, 7
    k_cache = torch.randn(pages, page_size, Hkv, D, device=DEVICE)
    v_cache = torch.randn(pages, page_size, Hkv, D, device=DEVICE)
    per_row = 3
    table = torch.stack([torch.randperm(pages)[:per_row] for _ in range(B)]).to(torch.int32).to(DEVICE)
    cap = per_row * page_size
    lens = torch.tensor([cap, 1, page_size + 3], dtype=torch.int32, device=DEVICE)
    table[1, 1:] = -1  # entries past a row's length are never read
    q = torch.randn(B, Hq, N, D, device=DEVICE)
    out, lse = flashfuse.attention_with_kvcache(q, k_cache, v_cache, lens, table, num_splits=2, return_lse=True)
    k = k_cache[table.long().clamp(0)].flatten(1, 2).transpose(1, 2)
    v = v_cache[table.long().clamp(0)].flatten(1, 2).transpose(1, 2)
    _close(out, lse, *_reference(q, k, v, lens))


def test_not_causal_and_window(path):
    torch.manual_seed(5)
    q = torch.randn(2, 2, 3, 16, device=DEVICE)
    k = torch.randn(2, 2, 30, 16, device=DEVICE)
    v = torch.randn(2, 2, 30, 16, device=DEVICE)
    lens = torch.tensor([30, 9], dtype=torch.int32, device=DEVICE)
    for causal, wl in ((False, None), (True, 4)):
        out, lse = flashfuse.attention_with_kvcache(q, k.transpose(1, 2), v.transpose(1, 2), lens,
                                                    is_causal=causal, window_left=wl, return_lse=True)
        _close(out, lse, *_reference(q, k, v, lens, causal=causal, window_left=wl))


def _cache(B=2, S=32, pages=4, page=16):
    q = torch.randn(B, 4, 1, 16, device=DEVICE)
    k = torch.randn(B, S, 2, 16, device=DEVICE)
    paged = torch.randn(pages, page, 2, 16, device=DEVICE)
    return q, k, paged


@pytest.mark.parametrize("case,match", [
    ("long", r"cache_seqlens\[1\] = 33 is outside \[0, 32\]"),
    ("negative", r"cache_seqlens\[0\] = -1"),
    ("int64", "must be int32"),
    ("shape", r"cache_seqlens must have shape \(batch,\)"),
    ("page", r"block_table\[0, 1\] = 4 is not a page"),
    ("paged_long", r"outside \[0, 32\]"),
    ("heads", "multiple of the cache's key/value heads"),
    ("batch", "holds 3 sequences"),
])
def test_bad_inputs(case, match):
    q, k, paged = _cache()
    lens = torch.tensor([5, 7], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32, device=DEVICE)
    args = dict(cache_seqlens=lens)
    kc = k
    if case == "long":
        args["cache_seqlens"] = torch.tensor([5, 33], dtype=torch.int32, device=DEVICE)
    elif case == "negative":
        args["cache_seqlens"] = torch.tensor([-1, 3], dtype=torch.int32, device=DEVICE)
    elif case == "int64":
        args["cache_seqlens"] = lens.long()
    elif case == "shape":
        args["cache_seqlens"] = lens[:1]
    elif case == "page":
        kc = paged
        args.update(block_table=torch.tensor([[0, 4], [1, 2]], dtype=torch.int32, device=DEVICE),
                    cache_seqlens=torch.tensor([17, 3], dtype=torch.int32, device=DEVICE))
    elif case == "paged_long":
        kc = paged
        args.update(block_table=table, cache_seqlens=torch.tensor([33, 3], dtype=torch.int32, device=DEVICE))
    elif case == "heads":
        q = torch.randn(2, 3, 1, 16, device=DEVICE)
    elif case == "batch":
        kc = torch.randn(3, 32, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        flashfuse.attention_with_kvcache(q, kc, kc, **args)


def test_unchecked_bad_values_stay_in_bounds(monkeypatch):
    """With the host checks off, lengths past the cache and pages out of
    range are clamped in the kernel: finite output, no out-of-bounds read."""
    monkeypatch.setenv("FLASHFUSE_KVCACHE_CHECKS", "0")
    q, _, paged = _cache()
    table = torch.tensor([[0, 99], [-5, 2]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([1000, 20], dtype=torch.int32, device=DEVICE)
    out = flashfuse.attention_with_kvcache(q, paged, paged, lens, table)
    assert torch.isfinite(out).all()


def test_kvcache_is_inference_only():
    q, k, _ = _cache()
    q.requires_grad_(True)
    out = flashfuse.attention_with_kvcache(q, k, k)
    with pytest.raises(RuntimeError, match="inference only"):
        out.sum().backward()


def test_eager_calls_skip_the_dispatcher_only_where_it_is_the_same(path, monkeypatch):
    """A plain eager call runs the op's implementation itself (the
    dispatcher's Python cost half an eager decode call): bitwise the op's
    result. Calls that need the op take it: inputs that need a gradient
    (its autograd node raises "inference only"), a dispatch mode, a
    torch-function mode, a profiler."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashfuse import kvcache

    gen = torch.Generator(device=DEVICE).manual_seed(11)
    q = torch.randn(2, 8, 2, 16, generator=gen, device=DEVICE)
    k, v = (torch.randn(2, 40, 2, 16, generator=gen, device=DEVICE) for _ in range(2))
    lens = torch.tensor([0, 33], dtype=torch.int32, device=DEVICE)
    ops_seen = []
    real_op = torch.ops.flashfuse.attention_with_kvcache

    class _Counting:  # the op packet, counting calls through the dispatcher
        def __call__(self, *args):
            ops_seen.append(1)
            return real_op(*args)

        def __getattr__(self, name):
            return getattr(real_op, name)

    monkeypatch.setattr(torch.ops.flashfuse, "attention_with_kvcache", _Counting())
    out, lse = flashfuse.attention_with_kvcache(q, k, v, lens, return_lse=True, num_splits=3)
    assert not ops_seen
    want, want_lse = real_op(q, k, v, lens, None, 0.25, True, None, 3)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)

    class _Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class _SeenFn(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for ctx in (_Seen(), _SeenFn(), torch.profiler.profile()):
        ops_seen.clear()
        with ctx:
            got = flashfuse.attention_with_kvcache(q, k, v, lens, num_splits=3)
        assert ops_seen and torch.equal(got, want), type(ctx).__name__
    ops_seen.clear()
    q.requires_grad_(True)
    assert not kvcache._may_skip_dispatch(q, k, v, lens, None)
    with torch.no_grad():
        assert kvcache._may_skip_dispatch(q, k, v, lens, None)
    got = flashfuse.attention_with_kvcache(q, k, v, lens, num_splits=3)
    assert ops_seen and got.grad_fn is not None and torch.equal(got.detach(), want)


def test_kvcache_traces_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 3, 16)
        k = torch.empty(5, 16, 2, 16)
        table = torch.zeros(2, 3, dtype=torch.int32)
        out, lse = torch.ops.flashfuse.attention_with_kvcache(q, k, k, None, table, 0.25, True, None, None)
    assert out.shape == (2, 8, 3, 16) and lse.shape == (2, 8, 3)


@pytest.mark.parametrize("kw", [dict(is_causal=True, alignment="bottom_right"), dict(mask="float")])
def test_lse_result_and_its_gradient(path, kw):
    torch.manual_seed(7)
    dtype = torch.float64 if path == "blockwise" else torch.float32
    q = torch.randn(1, 4, 5, 16, dtype=dtype, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, 7, 16, dtype=dtype, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 2, 7, 16, dtype=dtype, device=DEVICE, requires_grad=True)
    band, mask = {}, None
    if kw.get("mask"):
        mask = torch.randn(5, 7, dtype=dtype, device=DEVICE, requires_grad=True)
        args = (q, k, v, mask)
        call = dict(enable_gqa=True)
    else:
        args = (q, k, v)
        call = dict(kw, enable_gqa=True)
        band = dict(window_right=0, bottom_right=True)
    out, lse = flashfuse.attention_with_lse(*args, **call)
    want = ref.reference_attention(q, k, v, mask, **band)
    want_lse = ref.reference_lse(q, k, mask, **band)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-6)
    go = torch.randn_like(want)
    gl = torch.randn_like(want_lse)
    got = torch.autograd.grad((out * go).sum() + (lse * gl).sum(), args, retain_graph=True)
    exp = torch.autograd.grad((want * go).sum() + (want_lse * gl).sum(), args, retain_graph=True)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    # The lse alone (no gradient reaches out).
    got = torch.autograd.grad(lse, args[:2], gl.float())
    exp = torch.autograd.grad(want_lse, args[:2], gl)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


def test_lse_gradcheck_through_out(blockwise_cpu):
    """gradcheck in float64 on the blockwise path (lse itself is stored in
    float32, so the gradcheck sees the output; the lse term is checked
    against float64 autograd above)."""
    torch.manual_seed(8)
    q = torch.randn(1, 2, 3, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 6, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 6, 16, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return flashfuse.attention_with_lse(q, k, v, is_causal=True, alignment="bottom_right", enable_gqa=True)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_lse_of_rows_a_fill_hides():
    """A bool mask with a finite fill: the hidden row's lse is the fill plus
    the log of its key count, not the stored marker."""
    q = torch.randn(1, 1, 2, 16)
    k = torch.randn(1, 1, 5, 16)
    mask = torch.tensor([[True] * 5, [False] * 5])
    _, lse = flashfuse.attention_with_lse(q, k, k, mask, mask_fill=-1e9)
    want = ref.reference_lse(q, k, mask, mask_fill=-1e9)
    torch.testing.assert_close(lse.double(), want, atol=1e-4, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_gpu_paged_real_sizes(page_size):
    torch.manual_seed(9)
    B, Hq, Hkv, D, cap = 4, 32, 8, 128, 8192
    per_row = cap // page_size
    pages = B * per_row
    k_cache = torch.randn(pages, page_size, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(pages, page_size, Hkv, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(pages, device="cuda").view(B, per_row).to(torch.int32)
    lens = torch.tensor([cap, 1, 0, 5000], dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    out, lse = flashfuse.attention_with_kvcache(q, k_cache, v_cache, lens, table, return_lse=True)
    k = k_cache[table.long()].flatten(1, 2).transpose(1, 2)
    v = v_cache[table.long()].flatten(1, 2).transpose(1, 2)
    want, want_lse = _reference(q, k, v, lens)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=1e-3, rtol=1e-3)
