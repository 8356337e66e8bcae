"""Hugging Face ``generate()`` on the split-KV decoding kernels (interpreted
on CPU): a static cache and a padded batch hand every step a bool mask,
which must take the decode path and give eager's greedy tokens."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashfuse.hf as ffhf  # noqa: E402
from flashfuse.kernels import decode  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 64


@pytest.fixture
def decode_calls(monkeypatch):
    """The decode launches, recorded by query count and whether a mask came."""
    # The tiny cache would otherwise stay on the forward kernel.
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "2")
    calls = []
    real = decode.decode_forward

    def spy(q, *args, **kw):
        calls.append((q.shape[2], kw.get("attn_mask") is not None))
        return real(q, *args, **kw)

    monkeypatch.setattr(decode, "decode_forward", spy)
    return calls


# Left padding: prefill rows that see no key, and a mask with holes at both ends.
@pytest.mark.parametrize("cache,left_pad", [("static", 2), ("dynamic", 2)])
def test_generate_takes_decode_path_with_masks(decode_calls, cache, left_pad):
    # GQA 4 (4 query heads, 1 key/value head), head dim 16.
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :left_pad] = 0
    extra = dict(cache_implementation="static") if cache == "static" else {}
    tokens = {}
    for impl in ("eager", ffhf.ATTN_IMPLEMENTATION):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                      pad_token_id=0, **extra)
    assert torch.equal(tokens[ffhf.ATTN_IMPLEMENTATION], tokens["eager"])
    # Every one-token step of the one layer, each with its bool mask.
    steps = [c for c in decode_calls if c[0] == 1]
    assert len(steps) == 2 and all(masked for _, masked in steps)
