"""Gemma 2's soft-capping and gpt-oss's attention sinks through the "ffuse"
Hugging Face hook, against the models' own eager attention (tiny random
configs, CPU fp32, the op's blockwise path): logits with and without
padding, and the gradients of every parameter (the sinks included)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashfuse.hf as ffhf  # noqa: E402

IMPL = ffhf.ATTN_IMPLEMENTATION
VOCAB, SEQ, WINDOW = 100, 10, 4

pytestmark = pytest.mark.usefixtures("blockwise_cpu")


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # query_pre_attn_scalar=1 (scale 1) and a cap of 1: the scores of a
    # random model are then capped noticeably (checked below).
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       query_pre_attn_scalar=1, sliding_window=WINDOW, attn_logit_softcapping=1.0,
                       final_logit_softcapping=None, attention_dropout=0.0)
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # scores large enough for the cap to matter
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, attention_dropout=0.0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks that matter (the init's are ~0.02)
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


MODELS = {"gemma2_softcap": _gemma2, "gpt_oss_sinks": _gpt_oss}


def _build(name):
    try:
        torch.manual_seed(0)
        return MODELS[name]()
    except ImportError as exc:  # pragma: no cover - model family missing from this transformers
        pytest.skip(f"model not available: {exc}")


def _inputs(left_pad):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if left_pad:
        mask[0, :left_pad] = 0
    return ids, mask


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    return model(**inputs).logits


@pytest.fixture
def op_calls(monkeypatch):
    calls = []
    real = ffhf._attention_op

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(ffhf, "_attention_op", spy)
    return calls


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("left_pad", [0, 3])
def test_logits_match_eager(name, left_pad, op_calls):
    model = _build(name).eval()
    ids, mask = _inputs(left_pad)
    with torch.no_grad():
        ref = _logits(model, "eager", input_ids=ids, attention_mask=mask)
        got = _logits(model, IMPL, input_ids=ids, attention_mask=mask)
    # Left-padded positions see no real key: eager averages them over
    # finfo.min scores, the op gives 0 (as in test_hf.py). Real tokens only.
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-4, rtol=1e-4)
    assert op_calls and all(("softcap" in c) == (name == "gemma2_softcap") for c in op_calls)
    assert all(("sinks" in c) == (name == "gpt_oss_sinks") for c in op_calls)


def test_gemma2_cap_changes_the_result():
    """The cap chosen above does cap: without it eager differs."""
    model = _build("gemma2_softcap").eval()
    ids, mask = _inputs(0)
    with torch.no_grad():
        capped = _logits(model, "eager", input_ids=ids, attention_mask=mask)
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    assert (capped - uncapped).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_match_eager(name):
    model = _build(name).train()
    ids, mask = _inputs(0)
    mask[1, -3:] = 0
    grads = {}
    for impl in ("eager", IMPL):
        model.zero_grad()
        out = _logits(model, impl, input_ids=ids, attention_mask=mask)
        (out * mask[..., None]).square().mean().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[IMPL].keys() == grads["eager"].keys() and grads[IMPL]
    if name == "gpt_oss_sinks":
        assert any(n.endswith("sinks") for n in grads[IMPL])
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads[IMPL][n], g, atol=1e-5, rtol=1e-3, msg=lambda m: f"{n}: {m}")


def test_sinks_in_another_dtype_are_cast():
    """bf16 sinks with fp32 queries reach the op as float32."""
    layer = _build("gpt_oss_sinks").model.layers[0].self_attn.eval()
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    out, _ = ffhf.flashfuse_attention_forward(layer, q, k, k, None, scaling=0.25, s_aux=layer.sinks.bfloat16())
    ref, _ = ffhf.flashfuse_attention_forward(layer, q, k, k, None, scaling=0.25,
                                              s_aux=layer.sinks.bfloat16().float())
    torch.testing.assert_close(out, ref)
