"""nn.MultiheadAttention through the backend: Dynamo records its attention
as one ``F.multi_head_attention_forward`` call, which the pass rewrites into
the op and the projections when the attention weights are unused.

Each case runs the compiled module in float32 against eager PyTorch in
float64 (a deep copy of the module and the inputs), forward and the
gradients of the inputs and of every parameter.
"""

from __future__ import annotations

import copy
import math

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxutil import Recorder
from flashfuse.backend import make_backend
from test_fx_snapshots import render

E, H = 32, 2  # head size 16, the op's smallest
L, S, B = 5, 7, 3


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _masks(kind: str, *, batched=True, seed=0, n=L, m=S):
    """(key_padding_mask, attn_mask) of a kind such as "kpm_bool+am3_float",
    for n queries and m keys. Masks never hide every key of a row (eager
    gives NaN there, the op 0). A bool and a float mask together make
    PyTorch warn, and Dynamo breaks the graph there: the cases pair alike
    masks."""
    L, S = n, m
    g = torch.Generator().manual_seed(seed)
    kpm = am = None
    b = B if batched else 1
    for part in kind.split("+"):
        if part == "none":
            continue
        what, dtype = part.split("_")
        if what == "kpm":
            hide = torch.rand(b, S, generator=g) < 0.3
            hide[:, 0] = False
            kpm = hide if dtype == "bool" else torch.where(hide, -1e9, torch.randn(b, S, generator=g))
            if not batched:
                kpm = kpm[0]
        else:
            shape = (L, S) if what == "am2" else (b * H, L, S)
            hide = torch.rand(*shape, generator=g) < 0.3
            hide[..., 1] = False
            am = hide if dtype == "bool" else torch.where(hide, float("-inf"), torch.randn(*shape, generator=g))
    return kpm, am


def _compare(module, call, inputs, *, expect=1, dynamic=False, training=False, rtol=1e-3, atol=1e-4):
    """Compile ``call(module, *inputs)`` with the backend; compare with eager
    float64, outputs and gradients. Returns the backend (candidates kept)."""
    module.train(training).zero_grad(set_to_none=True)
    ref_module = copy.deepcopy(module).double()
    rec = Recorder("aot_eager")
    backend = make_backend(compiler=rec, record=True)
    compiled = torch.compile(lambda *a: call(module, *a), backend=backend, dynamic=dynamic)

    def leaf(x, dtype=None):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach().clone()
        if y.is_floating_point():
            y = y.to(dtype or y.dtype).requires_grad_(True)
        return y

    xs = [leaf(x) for x in inputs]
    refs = [leaf(x, torch.float64) for x in inputs]
    out = compiled(*xs)
    ref = call(ref_module, *refs)
    reasons = [c.reason for c in backend.candidates if not c.rewritten]
    assert rec.ops == expect, f"expected {expect} rewrites, got {rec.ops}: {reasons}"
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref.float(), rtol=rtol, atol=atol)
    grad = _rand(*out.shape, seed=99)
    out.backward(grad)
    ref.backward(grad.double())
    for x, y in zip(xs, refs):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            assert (x.grad is None) == (y.grad is None)
            if x.grad is not None:
                torch.testing.assert_close(x.grad, y.grad.float(), rtol=rtol, atol=atol)
    for (name, p), (_, p_ref) in zip(module.named_parameters(), ref_module.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad.float(), rtol=rtol, atol=atol, msg=name)
    return backend


def _mha(seed=0, **kw):
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, **kw)
    with torch.no_grad():  # nonzero biases, so that every bias path is checked
        for name, p in m.named_parameters():
            if "bias" in name:
                p.normal_()
    return m


def self_attn(m, x):
    return m(x, x, x)[0]


def self_attn_masked(m, x, kpm, am):
    return m(x, x, x, key_padding_mask=kpm, attn_mask=am)[0]


def cross_attn(m, x, k, v, kpm, am):
    return m(x, k, v, key_padding_mask=kpm, attn_mask=am)[0]


# --- the projections, biases and layouts ----------------------------------------


@pytest.mark.parametrize("batch_first, bias, training", [(False, True, True), (True, True, False),
                                                       (True, False, True), (False, False, False)])
def test_self_attention(batch_first, bias, training):
    """The default need_weights=True, weights discarded: one packed
    in-projection; training (dropout 0) and eval."""
    x = _rand(*((B, L, E) if batch_first else (L, B, E)), seed=1)
    _compare(_mha(bias=bias, batch_first=batch_first), self_attn, [x], training=training)


@pytest.mark.parametrize("kv", ["same", "different"])
def test_packed_cross_attention(kv):
    """key is value (PyTorch's packed k/v product), or all three differ."""
    q, k = _rand(L, B, E, seed=1), _rand(S, B, E, seed=2)
    v = k if kv == "same" else _rand(S, B, E, seed=3)
    _compare(_mha(), lambda m, q, k, v: m(q, k, v)[0], [q, k, v] if kv != "same" else [q, k, k])


@pytest.mark.parametrize("extras", [dict(add_bias_kv=True), dict(add_zero_attn=True),
                                    dict(add_bias_kv=True, add_zero_attn=True)])
@pytest.mark.parametrize("masks", ["none", "kpm_bool+am2_bool", "kpm_float+am3_float"])
def test_kdim_vdim_bias_kv_zero_attn(extras, masks):
    """Separate q/k/v projection weights (kdim, vdim), bias_k/bias_v and the
    zero key, with the masks padded for the extra keys."""
    kpm, am = _masks(masks)
    args = [_rand(L, B, E, seed=1), _rand(S, B, 24, seed=2), _rand(S, B, 20, seed=3), kpm, am]
    _compare(_mha(kdim=24, vdim=20, **extras), cross_attn, args, training=True)


@pytest.mark.parametrize("masks", ["kpm_bool", "kpm_float", "am2_bool", "am2_float", "am3_bool",
                                   "am3_float", "kpm_bool+am2_bool", "kpm_float+am3_float",
                                   "kpm_bool+am3_bool", "kpm_float+am2_float"])
def test_masks(masks):
    """key_padding_mask and attn_mask, bool (True hides) and float (added),
    2-D and 3-D, and both merged as PyTorch merges them; a float mask that
    requires grad gets its gradient."""
    kpm, am = _masks(masks, n=S)
    backend = _compare(_mha(batch_first=True), self_attn_masked, [_rand(B, S, E, seed=1), kpm, am])
    assert backend.candidates[0].facts["spelling"] == "nn.MultiheadAttention"


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_kpm", [False, True])
def test_is_causal(need_weights, with_kpm):
    """is_causal=True with a causal attn_mask: PyTorch drops the mask for the
    hint only without weights and without a key padding mask (the op's causal
    flag then); otherwise the mask itself is used."""
    x = _rand(B, L, E, seed=1)
    am = nn.Transformer.generate_square_subsequent_mask(L)
    kpm = _masks("kpm_float", m=L)[0] if with_kpm else None

    def fn(m, x, am, kpm):
        return m(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=need_weights, is_causal=True)[0]

    backend = _compare(_mha(batch_first=True), fn, [x, am, kpm])
    facts = backend.candidates[0].facts
    assert (facts["causal"] == "top-left") == (not need_weights and not with_kpm)


def test_causal_hint_trusted_like_pytorch():
    """Without weights or padding, PyTorch trusts is_causal and ignores the
    mask it was given (here not causal at all); so does the rewrite."""
    x = _rand(B, L, E, seed=1)
    am = torch.zeros(L, L)

    def fn(m, x, am):
        return m(x, x, x, attn_mask=am, need_weights=False, is_causal=True)[0]

    _compare(_mha(batch_first=True), fn, [x, am])


@pytest.mark.parametrize("masks", ["none", "kpm_bool+am2_bool", "kpm_float+am3_float"])
def test_unbatched(masks):
    """2-D inputs (L, E): PyTorch's batch of one, with a (S,) padding mask
    and a 2-D or (H, L, S) attention mask."""
    kpm, am = _masks(masks, batched=False)
    args = [_rand(L, E, seed=1), _rand(S, E, seed=2), _rand(S, E, seed=3), kpm, am]
    _compare(_mha(add_bias_kv=True), cross_attn, args)


def test_functional_call_with_bool_masks():
    """F.multi_head_attention_forward called directly, with bool masks that
    no module canonicalised first."""
    m = _mha()
    kpm, am = _masks("kpm_bool+am3_bool")

    def fn(m, q, kv, kpm, am):
        return F.multi_head_attention_forward(
            q, kv, kv, E, H, m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0,
            m.out_proj.weight, m.out_proj.bias, key_padding_mask=kpm, attn_mask=am)[0]

    _compare(m, fn, [_rand(L, B, E, seed=1), _rand(S, B, E, seed=2), kpm, am])


# --- dynamic shapes ------------------------------------------------------------------


def test_chained_modules_leave_no_original_call():
    """The second module reads the first one's output: its projections must
    read the first rewrite's result, so that no original call stays alive
    (computed beside the op)."""
    torch.manual_seed(0)
    mods = nn.ModuleList([_mha(seed=1), _mha(seed=2)])
    x = _rand(L, B, E, seed=3).requires_grad_()
    rec = Recorder("aot_eager")
    backend = make_backend(compiler=rec, record=True)
    out = torch.compile(lambda x: mods[1](*(3 * [mods[0](x, x, x)[0]]))[0], backend=backend)(x)
    y = x.detach()
    torch.testing.assert_close(out, mods[1](*(3 * [mods[0](y, y, y)[0]]))[0], rtol=1e-4, atol=1e-5)
    assert rec.ops == 2
    left = [n for g in rec.graphs for n in g.graph.nodes if n.target is F.multi_head_attention_forward]
    assert not left, left


def test_dynamic_shapes_keep_the_rewrite():
    """dynamic=True: lengths and batch stay symbolic (one compile for two
    sizes), masks and bias_k included."""
    m = _mha(add_bias_kv=True, add_zero_attn=True, batch_first=True)
    kpm, am = _masks("kpm_float+am2_float", m=L)
    _compare(m, self_attn_masked, [_rand(B, L, E, seed=1), kpm, am], dynamic=True, training=True)
    m.eval()
    rec = Recorder("aot_eager")
    compiled = torch.compile(lambda *a: self_attn_masked(m, *a), backend=make_backend(compiler=rec), dynamic=True)
    for b, n in ((2, 9), (4, 3)):
        kpm = torch.where(torch.rand(b, n) < 0.3, float("-inf"), 0.0)
        kpm[:, 0] = 0.0
        x, am = _rand(b, n, E, seed=n), _rand(n, n, seed=n + 1)
        torch.testing.assert_close(compiled(x, kpm, am), self_attn_masked(m, x, kpm, am), rtol=1e-3, atol=1e-4)
    assert rec.ops == 1  # one graph served both sizes


def test_automatic_dynamic_keeps_the_rewrite():
    m = _mha().eval()
    rec = Recorder("aot_eager")
    compiled = torch.compile(lambda x: self_attn(m, x), backend=make_backend(compiler=rec))
    for n in (5, 8, 11):
        x = _rand(n, B, E, seed=n)
        torch.testing.assert_close(compiled(x), self_attn(m, x), rtol=1e-3, atol=1e-4)
    assert rec.ops == len(rec.graphs) == 2  # static, then one dynamic graph


# --- dropout ---------------------------------------------------------------------------


def _by_hand(m, x, p):
    """nn.MultiheadAttention's computation, its attention as the op with the
    given dropout: the same random draw as the rewrite under the same seed."""
    q, k, v = F.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, -1)
    q, k, v = (t.unflatten(-1, (H, E // H)).permute(1, 2, 0, 3) for t in (q, k, v))
    o = torch.ops.flashfuse.attention(q, k, v, dropout_p=p, scale=math.sqrt(1.0 / (E // H)))
    return F.linear(o.permute(2, 0, 1, 3).flatten(2), m.out_proj.weight, m.out_proj.bias)


@pytest.mark.parametrize("dynamic", [False, True])
def test_dropout_in_training_only(dynamic):
    """The module's dropout becomes the op's dropout_p in training (a
    symbolic p under dynamic=True is specialised, so a new p recompiles) and
    vanishes in eval."""
    m = _mha(dropout=0.25)
    x = _rand(L, B, E, seed=1)
    backend = make_backend(compiler="aot_eager", record=True)
    compiled = torch.compile(lambda x: self_attn(m, x), backend=backend, dynamic=dynamic)
    torch.manual_seed(5)
    out = compiled(x)
    torch.manual_seed(5)
    torch.testing.assert_close(out, _by_hand(m, x, 0.25), rtol=1e-4, atol=1e-5)
    m.dropout = 0.5
    compiled(x)
    m.eval()
    torch.testing.assert_close(compiled(x), self_attn(m, x), rtol=1e-4, atol=1e-5)
    # (Under dynamic=True the specialisation restarts Dynamo's first
    # analysis: the pass then sees that graph twice.)
    seen = [c.plan.dropout_p for c in backend.candidates]
    assert [p for i, p in enumerate(seen) if i == 0 or p != seen[i - 1]] == [0.25, 0.5, 0.0]


# --- nn.TransformerEncoderLayer ---------------------------------------------------------


def _encoder_layer(**kw):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(E, H, dim_feedforward=24, dropout=0.0, batch_first=True, **kw)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer(norm_first):
    """It calls self_attn with need_weights=False: rewritten in training and
    in eval with grad enabled, with a padding mask and a causal mask."""
    layer = _encoder_layer(norm_first=norm_first)
    kpm = _masks("kpm_float", m=L)[0]
    am = nn.Transformer.generate_square_subsequent_mask(L)

    def fn(layer, x, am, kpm):
        return layer(x, src_mask=am, src_key_padding_mask=kpm)

    for training in (True, False):
        torch._dynamo.reset()
        _compare(layer, fn, [_rand(B, L, E, seed=1), am, kpm], training=training)


def test_transformer_encoder_layer_causal_hint():
    layer = _encoder_layer()
    am = nn.Transformer.generate_square_subsequent_mask(L)
    backend = _compare(layer, lambda m, x, am: m(x, src_mask=am, is_causal=True), [_rand(B, L, E, seed=1), am],
                       training=True)
    assert backend.candidates[0].facts["causal"] == "top-left"


def test_eval_without_grad():
    """In eval without grad, eager takes the module's fused fast path; this
    torch's Dynamo traces the unfused call (rewritten), older ones record
    torch._native_multi_head_attention (reported, left alone)."""
    m = _mha(batch_first=True).eval()
    x = _rand(B, L, E, seed=1)
    backend = make_backend(compiler="eager", record=True)
    with torch.no_grad():
        out = torch.compile(lambda x: m(x, x, x)[0], backend=backend)(x)
        torch.testing.assert_close(out, m(x, x, x)[0], rtol=1e-4, atol=1e-5)
    (cand,) = backend.candidates
    assert cand.rewritten or "fused" in cand.reason


def test_transformer_encoder_layer_eval_fast_path_left_alone():
    """In eval without grad the layer takes its fused fast path
    (torch._transformer_encoder_layer_fwd): one op for the whole layer,
    reported, never rewritten."""
    layer = _encoder_layer().eval()
    x = _rand(B, L, E, seed=1)
    backend = make_backend(compiler="eager", record=True)
    with torch.no_grad():
        out = torch.compile(layer, backend=backend)(x)
        torch.testing.assert_close(out, layer(x))
    assert not any(c.rewritten for c in backend.candidates)
    if backend.candidates:  # the fast path, when this torch's Dynamo records it
        assert "fused" in backend.candidates[0].reason
    # As the reason says: without the fast path, the layer's attention is rewritten.
    torch._dynamo.reset()
    backend = make_backend(compiler="eager", record=True)
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(layer, backend=backend)(x), layer(x), rtol=1e-4, atol=1e-5)
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    assert [c.rewritten for c in backend.candidates] == [True]


# --- near misses: left alone, with the reason ------------------------------------------------


def _refused(fn, *args, reason: str):
    torch._dynamo.reset()
    rec = Recorder("eager")
    backend = make_backend(compiler=rec, record=True)
    out = torch.compile(fn, backend=backend)(*args)
    expected = fn(*args)
    torch.testing.assert_close(out, expected)
    assert rec.ops == 0
    assert [c.rewritten for c in backend.candidates] == [False]
    assert reason in backend.candidates[0].reason, backend.candidates[0].reason
    return backend


@pytest.mark.parametrize("average", [True, False])
def test_weights_used_left_alone(average):
    m = _mha().eval()
    x = _rand(L, B, E, seed=1)
    _refused(lambda x: m(x, x, x, average_attn_weights=average), x, reason="weights")

    def weights_summed(x):
        out, w = m(x, x, x, average_attn_weights=average)
        return out + w.sum()

    _refused(weights_summed, x, reason="weights")


def test_small_head_dim_left_alone():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 2).eval()  # head size 8
    _refused(lambda x: m(x, x, x)[0], _rand(L, B, 16, seed=1), reason="head size 8")


def test_float64_left_alone():
    m = _mha().double().eval()
    _refused(lambda x: m(x, x, x)[0], _rand(L, B, E, seed=1).double(), reason="dtype")


def test_static_k_left_alone():
    m = _mha().eval()
    sk = _rand(B * H, S, E // H, seed=2)
    sv = _rand(B * H, S, E // H, seed=3)

    def fn(x, sk, sv):
        return F.multi_head_attention_forward(x, x, x, E, H, m.in_proj_weight, m.in_proj_bias, None, None, False,
                                              0.0, m.out_proj.weight, m.out_proj.bias, static_k=sk, static_v=sv)[0]

    _refused(fn, _rand(L, B, E, seed=1), sk, sv, reason="static_k")


def test_autocast_left_alone():
    m = _mha().eval()

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, x, x)[0]

    _refused(fn, _rand(L, B, E, seed=1), reason="autocast")


def test_explain_reports_it():
    import flashfuse

    m = _mha(batch_first=True).eval()
    x = _rand(B, L, E, seed=1)
    kpm = _masks("kpm_bool", m=L)[0]
    rows = flashfuse.explain(lambda x, kpm: m(x, x, x, key_padding_mask=kpm)[0], x, kpm, print_table=False).rows
    assert [r.rewritten for r in rows] == [True]
    assert rows[0].mask == "key_padding_mask bool" and rows[0].scale == "0.25"
    rows = flashfuse.explain(lambda x: m(x, x, x), x, print_table=False).rows
    assert not rows[0].rewritten and "weights" in rows[0].reason


def test_triton_interpreter(monkeypatch):
    """One case through the Triton kernels (interpreted on CPU): masks,
    bias_k and the zero key, forward and backward."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kpm, am = _masks("kpm_bool+am2_bool")
    args = [_rand(L, B, E, seed=1), _rand(S, B, E, seed=2), _rand(S, B, E, seed=3), kpm, am]
    _compare(_mha(add_bias_kv=True, add_zero_attn=True), cross_attn, args, training=True)


# --- the rewritten graph ------------------------------------------------------------------------


class TestSnapshot(expecttest.TestCase):
    def test_batch_first_with_padding_mask(self):
        torch._dynamo.reset()
        m = _mha(batch_first=True).eval()
        rec = Recorder("eager")
        kpm = _masks("kpm_bool")[0]
        torch.compile(lambda x, kpm: m(x, x, x, key_padding_mask=kpm)[0], backend=make_backend(compiler=rec))(
            _rand(B, S, E, seed=1), kpm)
        self.assertExpectedInline(render(rec.graphs[0]), """\
%0 = torch.zeros_like(L_kpm_, dtype=torch.float32)
%1 = .masked_fill_()(%0, L_kpm_, -inf)
%2 = .transpose()(L_x_, 1, 0)
%3 = torch._C._nn.linear(%2, L_m_parameters_in_proj_weight_, L_m_parameters_in_proj_bias_)
%4 = .chunk()(%3, 3, -1)
%5 = operator.getitem(%4, 0)
%6 = operator.getitem(%4, 1)
%7 = operator.getitem(%4, 2)
%8 = .unflatten()(%5, -1, (2, 16))
%9 = .permute()(%8, 1, 2, 0, 3)
%10 = .unflatten()(%6, -1, (2, 16))
%11 = .permute()(%10, 1, 2, 0, 3)
%12 = .unflatten()(%7, -1, (2, 16))
%13 = .permute()(%12, 1, 2, 0, 3)
%14 = .unsqueeze()(%1, 1)
%15 = .unsqueeze()(%14, 1)
%16 = flashfuse.attention(%9, %11, %13, attn_mask=%15, dropout_p=0, is_causal=False, scale=0.25)
%17 = .permute()(%16, 2, 0, 1, 3)
%18 = .flatten()(%17, 2)
%19 = torch._C._nn.linear(%18, L_m_modules_out_proj_parameters_weight_, L_m_modules_out_proj_parameters_bias_)
%20 = .transpose()(%19, 1, 0)
return (%20)""")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_inductor(dtype):
    """On the GPU through Inductor: the kernels themselves, a padding mask
    and a causal mask, training, against eager in float32."""
    m = _mha(batch_first=True, add_bias_kv=True).cuda().to(dtype).train()
    ref = copy.deepcopy(m).float()
    low = copy.deepcopy(m)  # eager in the same dtype: how far rounding alone goes
    n = 300
    x = _rand(4, n, E, seed=1).cuda().to(dtype).requires_grad_()
    kpm = torch.rand(4, n, device="cuda") < 0.2
    kpm[:, 0] = False
    am = torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1)
    backend = make_backend(record=True)
    out = torch.compile(lambda x: m(x, x, x, key_padding_mask=kpm, attn_mask=am)[0], backend=backend)(x)
    xr = x.detach().float().requires_grad_()
    expected = ref(xr, xr, xr, key_padding_mask=kpm, attn_mask=am)[0]
    assert [c.rewritten for c in backend.candidates] == [True]
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    g = torch.randn_like(expected)
    out.backward(g.to(dtype))
    expected.backward(g)
    torch.testing.assert_close(x.grad.float(), xr.grad, **tol)
    xl = x.detach().requires_grad_()
    low(xl, xl, xl, key_padding_mask=kpm, attn_mask=am)[0].backward(g.to(dtype))
    # Parameter gradients sum over all 1,200 tokens in the low dtype: each
    # within twice eager's own error in that dtype (and a small floor).
    for (name, p), (_, p_ref), (_, p_low) in zip(m.named_parameters(), ref.named_parameters(),
                                                 low.named_parameters()):
        err = (p.grad.float() - p_ref.grad).abs().max().item()
        eager_err = (p_low.grad.float() - p_ref.grad).abs().max().item()
        assert err <= 2 * eager_err + 1e-2 * p_ref.grad.abs().max().item(), (name, err, eager_err)
