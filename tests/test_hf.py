"""The Hugging Face integration (flashfuse.hf) on tiny random models, CPU.

Every model runs twice, with transformers' eager attention and with flashfuse,
and the two must agree: logits, gradients, greedy generation with a KV cache.
The op runs on its blockwise PyTorch path (TRITON_INTERPRET=0) for speed; the
kernels themselves are tested elsewhere.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashfuse.hf as ffhf  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

IMPL = ffhf.ATTN_IMPLEMENTATION
VOCAB = 100
SEQ = 12
WINDOW = 4  # smaller than SEQ, so sliding windows cut keys off
ATOL = 1e-4  # fp32 on both sides; differences are summation order only


pytestmark = pytest.mark.usefixtures("blockwise_cpu")


@pytest.fixture
def op_calls(monkeypatch):
    """Record the arguments of every op call made by the attention function,
    through either of its entries (the second for a layer's kept reads; its
    ``transpose_out`` is how the output comes back, not an op argument)."""
    calls = []

    def spy_on(name):
        real = getattr(ffhf, name)

        def spy(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, **kw):
            op_kw = {key: value for key, value in kw.items() if key != "transpose_out"}
            calls.append(dict(q=q.shape, k=k.shape, mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                              enable_gqa=enable_gqa, **op_kw))
            return real(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, **kw)

        monkeypatch.setattr(ffhf, name, spy)

    spy_on("_attention_op")
    spy_on("_attention_op_not_compiling")
    return calls


# --------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------

def _llama(**kw):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    return LlamaForCausalLM(cfg)


def _gpt2(**kw):
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, **kw)
    return GPT2LMHeadModel(cfg)


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        sliding_window=WINDOW, **kw)
    return MistralForCausalLM(cfg)


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Layer 0 full attention, layer 1 sliding: the window must follow the layer.
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **kw)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    return Qwen2ForCausalLM(cfg)


def _bert(**kw):
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0, **kw)
    return BertModel(cfg, add_pooling_layer=False)


DECODERS = {"gpt2": _gpt2, "llama_gqa": _llama, "mistral_sliding": _mistral, "qwen2_mixed_sliding": _qwen2}


def _build(factory, **kw):
    try:
        torch.manual_seed(0)
        return factory(**kw)
    except ImportError as exc:  # a model family missing from this transformers
        pytest.skip(f"model not available: {exc}")


def _inputs(batch=2, seq=SEQ, left_pad=3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if left_pad:
        mask[0, :left_pad] = 0
    return ids, mask


def _output(model, impl, **inputs):
    model.set_attn_implementation(impl)
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# --------------------------------------------------------------------------
# Registration and import
# --------------------------------------------------------------------------

def test_plain_import_does_not_import_transformers():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    code = "import sys, flashfuse; assert 'transformers' not in sys.modules, 'transformers was imported'"
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_registered_in_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface()[IMPL] is ffhf.flashfuse_attention_forward
    assert AttentionMaskInterface()[IMPL] is ffhf.flashfuse_mask
    assert "flash" not in IMPL


def test_register_refuses_names_transformers_reserves():
    with pytest.raises(ValueError, match="contains 'flash'"):
        ffhf.register("flashfuse")


def test_config_and_from_pretrained_select_flashfuse(tmp_path, op_calls):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=IMPL)
    model = LlamaForCausalLM(cfg)
    assert model.config._attn_implementation == IMPL
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=IMPL)
    assert loaded.config._attn_implementation == IMPL
    ids, _ = _inputs(left_pad=0)
    loaded(ids)
    assert len(op_calls) == 2  # one per layer: the op really runs


# --------------------------------------------------------------------------
# Numerics against eager
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_logits_match_eager(name):
    model = _build(DECODERS[name]).eval()
    ids, mask = _inputs()
    with torch.no_grad():
        for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
            ref = _output(model, "eager", **kwargs)
            got = _output(model, IMPL, **kwargs)
            # Left-padded positions see no real key: eager averages garbage there,
            # the kernel gives 0. Only real tokens are compared.
            real = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
            torch.testing.assert_close(got[real], ref[real], atol=ATOL, rtol=1e-4)


def test_bert_padding_mask_matches_eager():
    model = _build(_bert).eval()
    ids, mask = _inputs(left_pad=0)
    mask[1, -4:] = 0  # right padding, BERT style
    with torch.no_grad():
        for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
            ref = _output(model, "eager", **kwargs)
            got = _output(model, IMPL, **kwargs)
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "mistral_sliding", "bert"])
def test_gradients_match_eager_in_train_mode(name):
    factory = _bert if name == "bert" else DECODERS[name]
    dropout_off = {"bert": {"attention_probs_dropout_prob": 0.0}, "gpt2": {"attn_pdrop": 0.0}}.get(name, {})
    model = _build(factory, **dropout_off).train()
    ids, mask = _inputs(left_pad=0)
    mask[1, -3:] = 0
    grads = {}
    for impl in ("eager", IMPL):
        model.zero_grad()
        out = _output(model, impl, input_ids=ids, attention_mask=mask)
        loss = (out.float() * mask[..., None]).square().mean()
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[IMPL].keys() == grads["eager"].keys() and grads[IMPL]
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads[IMPL][n], g, atol=1e-5, rtol=1e-3, msg=lambda m: f"{n}: {m}")


def test_dropout_in_train_mode_is_applied_and_reproducible(op_calls):
    model = _build(_llama, attention_dropout=0.5)
    ids, _ = _inputs(left_pad=0)
    model.set_attn_implementation(IMPL)

    model.eval()
    with torch.no_grad():
        clean = model(ids).logits
    assert all(c["dropout_p"] == 0.0 for c in op_calls), "dropout must be off in eval mode"

    model.train()
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        with torch.no_grad():
            runs.append(model(ids).logits)
    assert op_calls[-1]["dropout_p"] == 0.5
    torch.testing.assert_close(runs[0], runs[1], atol=0, rtol=0)  # same seed, same result
    assert not torch.allclose(runs[0], runs[2])  # another seed drops other weights
    assert not torch.allclose(runs[0], clean)  # dropout did something

    # The dropout also reaches the backward pass.
    torch.manual_seed(7)
    model(ids).logits.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_dropout_ignored_when_module_not_training(op_calls):
    """Eager attention drops only while module.training; so does flashfuse."""
    model = _build(_llama).eval()
    layer = model.model.layers[0].self_attn
    q = torch.randn(2, 4, SEQ, 16)
    kv = torch.randn(2, 2, SEQ, 16)
    out, weights = ffhf.flashfuse_attention_forward(layer, q, kv, kv, None, dropout=0.9)
    assert weights is None and out.shape == (2, SEQ, 4, 16) and out.is_contiguous()
    assert op_calls[-1]["dropout_p"] == 0.0 and op_calls[-1]["enable_gqa"]


def _t5_pair():
    """The same tiny T5 twice, eager and flashfuse. (transformers 5.17's
    set_attn_implementation does not reach T5's encoder/decoder stacks, so the
    implementation is chosen in the config.)"""
    from transformers import T5Config, T5ForConditionalGeneration

    models = {}
    for impl in ("eager", IMPL):
        cfg = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                       num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
                       decoder_start_token_id=0, pad_token_id=0, attn_implementation=impl)
        torch.manual_seed(0)
        models[impl] = T5ForConditionalGeneration(cfg).eval()
    models[IMPL].load_state_dict(models["eager"].state_dict())
    return models


def test_t5_relative_position_bias_matches_eager(op_calls):
    """Encoder-decoder: learned position bias (with its gradient), cross-attention,
    a padded encoder, cached decoding."""
    models = _t5_pair()
    ids, _ = _inputs(left_pad=0)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    dec = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    logits, tokens, grads = {}, {}, {}
    for impl, model in models.items():
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        model.train()
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        out.square().mean().backward()
        logits[impl] = out.detach()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert op_calls and any(c["mask"] is not None and c["mask"].is_floating_point() for c in op_calls)
    torch.testing.assert_close(logits[IMPL], logits["eager"], atol=ATOL, rtol=1e-4)
    assert torch.equal(tokens[IMPL], tokens["eager"])
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert grads[IMPL][bias].abs().max() > 0
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads[IMPL][n], g, atol=1e-5, rtol=1e-3, msg=lambda m: f"{n}: {m}")


# --------------------------------------------------------------------------
# Generation with a KV cache
# --------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, left_pad",
    [("gpt2", 3), ("llama_gqa", 3), ("mistral_sliding", 3), ("qwen2_mixed_sliding", 3),
     # Without padding the mask is None and the kernel's bottom-right causal
     # diagonal and window do all the work.
     ("llama_gqa", 0), ("mistral_sliding", 0)],
)
def test_greedy_generation_matches_eager(name, left_pad):
    model = _build(DECODERS[name]).eval()
    ids, mask = _inputs(left_pad=left_pad)
    tokens = {}
    for impl in ("eager", IMPL):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)
    assert torch.equal(tokens[IMPL], tokens["eager"])


def test_static_cache_generation_matches_eager():
    model = _build(_llama).eval()
    ids, mask = _inputs(left_pad=0)
    tokens = {}
    for impl in ("eager", IMPL):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                      cache_implementation="static", pad_token_id=0)
    assert torch.equal(tokens[IMPL], tokens["eager"])


def test_decoding_logits_match_eager_step_by_step():
    """Prefill then one-token steps: bottom-right causal alignment with N < M."""
    model = _build(_mistral).eval()
    ids, _ = _inputs(batch=1, left_pad=0)
    # transformers renamed the argument after 5.17.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = {}
    for impl in ("eager", IMPL):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out = model(ids[:, :5], use_cache=True)
            steps = [out.logits[:, -1]]
            cache = out.past_key_values
            for t in range(5, SEQ):  # runs past the window of 4
                out = model(ids[:, t : t + 1], use_cache=True, **{cache_arg: cache})
                cache = out.past_key_values
                steps.append(out.logits[:, -1])
        logits[impl] = torch.stack(steps)
    torch.testing.assert_close(logits[IMPL], logits["eager"], atol=ATOL, rtol=1e-4)


# --------------------------------------------------------------------------
# What the kernel receives
# --------------------------------------------------------------------------

def test_sliding_window_reaches_the_kernel_as_a_window(op_calls):
    model = _build(_qwen2).eval()
    model.set_attn_implementation(IMPL)
    ids, mask = _inputs()
    with torch.no_grad():
        model(ids)
    full, sliding = op_calls
    # No padding: no mask at all, causality and the window are the kernel's.
    assert full["mask"] is None and full["is_causal"] and full["window_left"] is None
    assert sliding["mask"] is None and sliding["is_causal"] and sliding["window_left"] == WINDOW - 1
    assert full["enable_gqa"] and full["k"][1] == 2  # grouped heads are not repeated
    op_calls.clear()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for call in op_calls:
        # Padding: a compact bool mask holding the whole pattern, shared by all heads.
        m = call["mask"]
        assert m.dtype == torch.bool and m.shape == (2, 1, SEQ, SEQ) and not call["is_causal"]
        assert call["window_left"] is None


def test_decoding_step_uses_bottom_right_causal_without_mask(op_calls):
    model = _build(_llama).eval()
    model.set_attn_implementation(IMPL)
    ids, _ = _inputs(left_pad=0)
    model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    step = op_calls[-1]
    assert step["q"][2] == 1 and step["k"][2] == SEQ + 1
    assert step["mask"] is None and step["alignment"] == "bottom_right"


def test_bert_without_padding_gets_no_mask(op_calls):
    model = _build(_bert).eval()
    model.set_attn_implementation(IMPL)
    ids, _ = _inputs(left_pad=0)
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids))
    assert all(c["mask"] is None and not c["is_causal"] for c in op_calls)


def test_mask_function_keeps_patterns_the_kernel_cannot_express():
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    # Queries not at the end of the keys (static-cache prefill): a real mask.
    kw = dict(batch_size=1, q_length=4, kv_length=10, q_offset=0, kv_offset=0)
    got = ffhf.flashfuse_mask(**kw)
    ref = sdpa_mask(**kw, allow_is_causal_skip=False)
    assert got is not None and torch.equal(got, ref)
    # A local size that is a chunk size, not the config's sliding window.
    cfg = LlamaConfig(sliding_window=None)
    kw = dict(batch_size=1, q_length=10, kv_length=10, local_size=4, config=cfg)
    assert ffhf.flashfuse_mask(**kw, mask_function=causal_mask_function) is not None
    # The same local size as the sliding window: the kernel's window handles it.
    cfg = LlamaConfig()
    cfg.sliding_window = 4
    kw["config"] = cfg
    assert ffhf.flashfuse_mask(**kw, mask_function=causal_mask_function) is None
    # Padding among the keys always needs a mask.
    pad = torch.ones(1, 10, dtype=torch.bool)
    pad[0, 0] = False
    assert ffhf.flashfuse_mask(batch_size=1, q_length=10, kv_length=10, attention_mask=pad) is not None


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

def test_output_attentions_raises_with_a_way_out():
    model = _build(_llama).eval()
    model.set_attn_implementation(IMPL)
    ids, _ = _inputs(left_pad=0)
    with pytest.raises(ValueError, match="output_attentions=True.*attn_implementation='eager'"):
        model(ids, output_attentions=True)


def test_bad_head_dim_raises():
    # (Soft-capping and sinks are served: tests/test_hf_capsink.py.)
    model = _build(_llama).eval()
    layer = model.model.layers[0].self_attn
    q8 = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="head dim 8.*sdpa"):
        ffhf.flashfuse_attention_forward(layer, q8, q8, q8, None)


# --------------------------------------------------------------------------
# GPU (run with `pytest -m gpu`): the Triton kernels behind the same hook
# --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_precision_matches_eager(name, dtype):
    model = _build(DECODERS[name]).to("cuda", dtype).eval()
    ids, mask = (t.cuda() for t in _inputs(seq=300, left_pad=37))
    with torch.no_grad():
        for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
            ref = _output(model, "eager", **kwargs).float()
            got = _output(model, IMPL, **kwargs).float()
            real = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
            err = (got[real] - ref[real]).abs().max().item()
            assert err < 5e-2, f"max abs logit error {err}"


@pytest.mark.gpu
def test_gpu_generation_and_t5_bias_match_eager():
    model = _build(_mistral).cuda().eval()  # fp32: greedy tokens must agree exactly
    ids, mask = (t.cuda() for t in _inputs(seq=40, left_pad=5))
    tokens = {}
    for impl in ("eager", IMPL):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                      pad_token_id=0)
    assert torch.equal(tokens[IMPL], tokens["eager"])

    # bf16 activations with T5's position bias: a floating mask in another dtype.
    models = {k: m.cuda().to(torch.bfloat16) for k, m in _t5_pair().items()}
    ids = ids[:, :16]
    dec = ids[:, :6]
    with torch.no_grad():
        out = {k: m(input_ids=ids, decoder_input_ids=dec).logits.float() for k, m in models.items()}
    err = (out[IMPL] - out["eager"]).abs().max().item()
    assert err < 5e-2, f"max abs logit error {err}"


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_mixed_sliding"])
def test_hook_traces_without_a_graph_break(family, fresh_dynamo):
    """The hook as a compiled layer runs it (transformers compiles static-cache
    decoding): its reads of the config must trace, or every layer breaks
    the graph (a graph break made static-cache generate() 2.8x slower)."""
    model = _build(DECODERS[family]).eval()
    layer = model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 6, 16, generator=g) for h in (4, 2, 2))

    def hook(q, k, v):
        return ffhf.flashfuse_attention_forward(layer, q, k, v, None, scaling=0.25)[0]

    with torch.no_grad():
        got = torch.compile(hook, fullgraph=True, backend="eager")(q, k, v)
        want = hook(q, k, v)
    torch.testing.assert_close(got, want)


def test_module_attribute_reads_what_getattr_reads():
    """``hf._module_attr`` skips ``nn.Module.__getattr__``'s raise for a
    name a layer lacks; everywhere else it must read what ``getattr(module,
    name, None)`` reads: instance attributes, parameters, buffers,
    submodules, class attributes and properties, and objects that are not
    plain modules."""

    class Layer(torch.nn.Module):
        window_of_class = 7

        @property
        def window_property(self):
            return self.width * 2

    class Custom(torch.nn.Module):
        def __getattr__(self, name):
            return 5 if name == "sliding_window" else super().__getattr__(name)

    layer = Layer()
    layer.width = 3
    layer.sliding_window = 4
    layer.weight = torch.nn.Parameter(torch.ones(1))
    layer.register_buffer("kept", torch.zeros(1))
    layer.child = torch.nn.Linear(1, 1)
    import types

    plain = types.SimpleNamespace(sliding_window=9)
    for obj, name in [(layer, "sliding_window"), (layer, "width"), (layer, "weight"), (layer, "kept"),
                      (layer, "child"), (layer, "window_of_class"), (layer, "window_property"),
                      (layer, "missing"), (Layer(), "sliding_window"), (Custom(), "sliding_window"),
                      (plain, "sliding_window"), (plain, "missing")]:
        for compiling in (False, True):
            assert ffhf._module_attr(obj, name, compiling) is getattr(obj, name, None), (name, compiling)


# --------------------------------------------------------------------------
# A layer's kept reads (hf._LayerReads)
# --------------------------------------------------------------------------

DROPOUT = 0.3


def _decode_tensors(layer, keys=9):
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d = layer.config.num_attention_heads, layer.config.num_key_value_heads, layer.head_dim
    return (torch.randn(1, heads, 1, d, generator=g), torch.randn(1, kv_heads, keys, d, generator=g),
            torch.randn(1, kv_heads, keys, d, generator=g))


def _hook(layer, tensors, **kw):
    torch.manual_seed(0)  # dropout's seed, the same for both paths
    return ffhf.flashfuse_attention_forward(layer, *tensors, None, **kw)[0]


def _full_path(layer, tensors, **kw):
    """The hook's call without the layer's kept reads."""
    ffhf._LAYER_READS.clear()
    return _hook(layer, tensors, **kw)


def _change(case, model, layer, kw):
    """Change what ``case`` names between two calls of ``layer``; returns the
    next call's kwargs."""
    kw = dict(kw)
    if case == "training":
        layer.train()
    elif case == "is_causal":
        layer.is_causal = False
    elif case == "config output_attentions":
        # What its property reads (its setter refuses any implementation but eager).
        model.config._output_attentions = True
        assert model.config.output_attentions
    elif case == "layer_types entry":
        model.config.layer_types[1] = "full_attention"  # in place: the list object stays
    elif case == "config sliding_window":
        model.config.sliding_window = 2
    elif case == "layer sliding_window":
        layer.sliding_window = 3
    elif case == "sliding_window argument":
        kw["sliding_window"] = 5
    elif case == "scaling":
        kw["scaling"] = 0.5
    elif case == "dropout":
        kw["dropout"] = 0.0
    elif case == "softcap":
        kw["softcap"] = 5.0
    return kw


@pytest.mark.parametrize("case", ["training", "is_causal", "config output_attentions", "layer_types entry",
                                  "config sliding_window", "layer sliding_window", "sliding_window argument",
                                  "scaling", "dropout", "softcap"])
def test_kept_layer_reads_follow_every_change_they_read(op_calls, case):
    """A layer's second call takes its kept reads; after any change of what
    the hook reads (the layer's and config's attributes, an entry of
    ``layer_types`` changed in place, the arguments) the next call makes
    the full path's op call, bitwise, or raises what it raises."""
    factory = _llama if case == "layer sliding_window" else _qwen2
    model = _build(factory)
    model.eval()
    layer = model.model.layers[1].self_attn
    tensors = _decode_tensors(layer)
    kw = dict(dropout=DROPOUT, scaling=layer.scaling)
    _full_path(layer, tensors, **kw)
    reads = ffhf._LAYER_READS[id(layer)]
    assert reads.hold(layer, DROPOUT, layer.scaling, None, {})
    kw = _change(case, model, layer, kw)
    if case == "config output_attentions":
        with pytest.raises(ValueError, match="output_attentions"):
            _hook(layer, tensors, **kw)
        return
    got = _hook(layer, tensors, **kw)
    got_call = op_calls[-1]
    assert not reads.hold(layer, kw["dropout"], kw["scaling"], None,
                          {k: v for k, v in kw.items() if k not in ("dropout", "scaling")}), case
    want = _full_path(layer, tensors, **kw)
    assert got_call == op_calls[-1], case
    assert torch.equal(got, want), case


def test_kept_layer_reads_compare_the_config_by_value():
    """The config's instance dict is compared with a copy: a value replaced
    by an equal one reads the same (the kept reads hold, and give the full
    path's result); one that cannot be compared counts as changed."""
    import numpy as np

    model = _build(_qwen2)
    model.eval()
    layer = model.model.layers[1].self_attn
    tensors = _decode_tensors(layer)
    kw = dict(dropout=0.0, scaling=layer.scaling)
    model.config.stand_in_array = np.arange(3)
    _full_path(layer, tensors, **kw)
    reads = ffhf._LAYER_READS[id(layer)]
    assert reads.hold(layer, 0.0, layer.scaling, None, {})
    model.config.layer_types = list(model.config.layer_types)  # an equal list, another object
    assert reads.hold(layer, 0.0, layer.scaling, None, {})
    assert torch.equal(_hook(layer, tensors, **kw), _full_path(layer, tensors, **kw))
    _full_path(layer, tensors, **kw)
    reads = ffhf._LAYER_READS[id(layer)]
    model.config.stand_in_array = np.arange(3)  # equal, but == gives an array
    assert not reads.hold(layer, 0.0, layer.scaling, None, {})
    model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
    assert not reads.hold(layer, 0.0, layer.scaling, None, {})


@pytest.mark.parametrize("name", ffhf._READ_ATTRIBUTES)
def test_hold_compares_every_attribute_it_names(name):
    """``hold`` unrolls its comparison of ``_READ_ATTRIBUTES``: each of them
    replaced in the layer's instance dict by another object (or added where
    the layer has none) ends the kept reads."""
    model = _build(_llama)
    layer = model.model.layers[0].self_attn
    _full_path(layer, _decode_tensors(layer), dropout=0.0, scaling=layer.scaling)
    reads = ffhf._LAYER_READS[id(layer)]
    assert reads.hold(layer, 0.0, layer.scaling, None, {})
    layer.__dict__[name] = object()
    assert not reads.hold(layer, 0.0, layer.scaling, None, {}), name


def test_kept_layer_reads_refuse_a_parameter_or_buffer_named_sliding_window():
    model = _build(_llama)
    layer = model.model.layers[0].self_attn
    tensors = _decode_tensors(layer)
    _full_path(layer, tensors, dropout=0.0, scaling=layer.scaling)
    reads = ffhf._LAYER_READS[id(layer)]
    assert reads.hold(layer, 0.0, layer.scaling, None, {})
    layer.register_buffer("sliding_window", torch.tensor(4))
    assert not reads.hold(layer, 0.0, layer.scaling, None, {})


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_mixed_sliding", "mistral_sliding"])
def test_generation_with_kept_layer_reads_is_the_full_paths(monkeypatch, name):
    """Greedy decoding takes the layers' kept reads at every step after the
    first, and gives bitwise the logits of the hook without them."""
    model = _build(DECODERS[name]).eval()
    model.set_attn_implementation(IMPL)
    ids, _ = _inputs(batch=1, left_pad=0)
    taken = []
    real_hold = ffhf._LayerReads.hold
    monkeypatch.setattr(ffhf._LayerReads, "hold", lambda self, *a: taken.append(real_hold(self, *a)) or taken[-1])
    with torch.no_grad():
        kept = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert taken and all(taken), name
    ffhf._LAYER_READS.clear()
    monkeypatch.setattr(ffhf._LayerReads, "record", classmethod(lambda cls, *a: None))
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    assert torch.equal(kept.sequences, full.sequences)
    assert all(torch.equal(a, b) for a, b in zip(kept.logits, full.logits))


def test_kept_layer_reads_go_with_their_layer():
    """A layer's kept reads hold its parameter dicts: they must go when the
    layer does, or a deleted model's weights would stay in memory."""
    import gc
    import weakref

    model = _build(_llama)
    layer = model.model.layers[0].self_attn
    _full_path(layer, _decode_tensors(layer), dropout=0.0, scaling=layer.scaling)
    key, weight = id(layer), weakref.ref(layer.q_proj.weight)
    assert key in ffhf._LAYER_READS
    del model, layer
    gc.collect()
    assert key not in ffhf._LAYER_READS
    assert weight() is None
