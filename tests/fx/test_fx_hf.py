"""Unchanged Hugging Face models (eager attention) compiled with the backend:
every attention layer is rewritten, outputs and gradients match eager."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fxutil import OP, Recorder  # noqa: E402
from flashfuse.backend import make_backend  # noqa: E402

VOCAB, SEQ = 100, 10


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return GPT2LMHeadModel(cfg), 2


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                     vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     attn_implementation="eager")
    return BertModel(cfg), 2


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, attn_implementation="eager")
    return LlamaForCausalLM(cfg), 2


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    # A window shorter than the sequence, so it hides something.
    cfg = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=VOCAB, sliding_window=4, attn_implementation="eager")
    return MistralForCausalLM(cfg), 2


def _t5():
    from transformers import T5Config, T5Model

    cfg = T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, d_ff=128, num_heads=4,
                   vocab_size=VOCAB, dropout_rate=0.0, attn_implementation="eager")
    # Encoder self, decoder self and decoder cross attention in each layer.
    return T5Model(cfg), 6


MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "mistral": _mistral, "t5": _t5}


def _first(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


def _training_pair(name):
    """A seeded model in train mode without a cache, an identical copy for
    the eager reference, and its number of attention layers."""
    torch.manual_seed(0)
    model, n_attn = MODELS[name]()
    model.config.use_cache = False
    model.train()
    return model, copy.deepcopy(model), n_attn


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_all_layers_rewritten(name):
    model, ref_model, n_attn = _training_pair(name)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 7:] = 0  # padding in the second row
    kw = dict(input_ids=ids, attention_mask=mask)
    if name == "t5":
        kw["decoder_input_ids"] = ids

    # "eager" after the rewrite: the op's own autograd runs the backward
    # (AOTAutograd adds tracing time here and is covered by other tests).
    rec = Recorder("eager")
    backend = make_backend(compiler=rec, record=True)
    out = _first(torch.compile(model, backend=backend)(**kw))
    ref = _first(ref_model(**kw))
    reasons = [c.reason for c in backend.candidates if not c.rewritten]
    assert rec.ops == n_attn, reasons
    # Padded query rows see keys, so no row is fully masked: all positions compare.
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)

    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for (pname, p), (_, p_ref) in zip(model.named_parameters(), ref_model.named_parameters()):
        if p_ref.grad is None:
            assert p.grad is None or not p.grad.any(), pname
            continue
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-3, rtol=1e-3, msg=pname)


def _op_calls(rec):
    return [n for g in rec.graphs for n in g.graph.nodes if n.op == "call_function" and n.target is OP]


@pytest.mark.parametrize(
    "name,facts,op_args",
    [
        ("gpt2", {"causal": "top-left"}, {"is_causal": True, "window_left": None}),
        ("llama", {"causal": "top-left"}, {"is_causal": True, "window_left": None}),
        ("mistral", {"causal": None, "window": "(3, 0) top_left"},
         {"is_causal": False, "window_left": 3, "window_right": 0}),
    ],
)
def test_hf_causal_lm_without_padding_is_proven_causal(name, facts, op_args):
    """Training without a cache or padding mask: transformers ANDs the causal
    (or sliding-window) mask with a "same packed sequence" term computed from
    position ids (older releases compare key and query indices, newer ones
    the position ids read at them). The pass proves the whole mask causal or
    a window, so the op gets is_causal / the window and no mask tensor."""
    model, ref_model, n_attn = _training_pair(name)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    rec = Recorder("eager")
    backend = make_backend(compiler=rec, record=True)
    out = torch.compile(model, backend=backend)(input_ids=ids).logits
    ref = ref_model(input_ids=ids).logits
    assert rec.ops == n_attn
    for cand in backend.candidates:
        for key, value in {**facts, "mask": "none"}.items():
            assert cand.facts.get(key) == value, (key, cand.facts)
    calls = _op_calls(rec)
    assert len(calls) == n_attn
    for call in calls:
        assert call.kwargs.get("attn_mask") is None, call.kwargs
        for key, value in op_args.items():
            assert call.kwargs.get(key) == value, (key, call.kwargs)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_hf_packed_position_ids_keep_the_mask():
    """Near miss: position ids passed in (two sequences packed in each row)
    make transformers' mask block-diagonal, not causal, and their values are
    unknown at compile time: the mask must stay a tensor."""
    model, ref_model, n_attn = _training_pair("llama")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    half = SEQ // 2
    pos = torch.cat([torch.arange(half), torch.arange(SEQ - half)]).expand(2, -1)
    rec = Recorder("eager")
    backend = make_backend(compiler=rec, record=True)
    out = torch.compile(model, backend=backend)(input_ids=ids, position_ids=pos).logits
    ref = ref_model(input_ids=ids, position_ids=pos).logits
    assert rec.ops == n_attn
    for cand in backend.candidates:
        assert cand.facts.get("causal") is None and cand.facts.get("window") is None, cand.facts
        assert cand.facts.get("mask") != "none", cand.facts
    assert all(call.kwargs.get("attn_mask") is not None for call in _op_calls(rec))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_hf_output_attentions_left_alone():
    """Returned probabilities must not be rewritten away."""
    torch.manual_seed(0)
    model, _ = _bert()
    model.eval()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    rec = Recorder("eager")
    backend = make_backend(compiler=rec, record=True)
    out = torch.compile(model, backend=backend)(input_ids=ids, output_attentions=True)
    ref = model(input_ids=ids, output_attentions=True)
    assert rec.ops == 0
    assert all("other users" in c.reason for c in backend.candidates)
    for a, b in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(a, b)
