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
    """The decode calls (the op's route to the decode kernels, or the fast
    path's decode lane), recorded by query count and whether a mask came."""
    # The tiny cache would otherwise stay on the forward kernel.
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "2")
    calls = []
    real, real_lane = decode.decode_forward, decode.lane_forward

    def spy(q, *args, **kw):
        calls.append((q.shape[2], kw.get("attn_mask") is not None))
        return real(q, *args, **kw)

    def lane_spy(token, q, k, v, attn_mask, *args, **kw):  # the fast path's decode lane
        calls.append((q.shape[2], attn_mask is not None))
        return real_lane(token, q, k, v, attn_mask, *args, **kw)

    monkeypatch.setattr(decode, "decode_forward", spy)
    monkeypatch.setattr(decode, "lane_forward", lane_spy)
    return calls


# Left padding: prefill rows that see no key, and a mask with holes at both ends.
@pytest.mark.parametrize("cache,left_pad", [("static", 2), ("dynamic", 2)])
def test_generate_takes_decode_path_with_masks(monkeypatch, decode_calls, cache, left_pad):
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
    tables = []  # the query counts of the calls that got a mask's block tables
    real_tables = ffhf._shared_tables

    def tables_spy(mask, q, k, v, call):
        got = real_tables(mask, q, k, v, call)
        if got:
            tables.append(q.shape[2])
        return got

    monkeypatch.setattr(ffhf, "_shared_tables", tables_spy)
    tokens = {}
    for impl in ("eager", ffhf.ATTN_IMPLEMENTATION):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                      pad_token_id=0, **extra)
    assert torch.equal(tokens[ffhf.ATTN_IMPLEMENTATION], tokens["eager"])
    # Every one-token step of the one layer, each with its bool mask.
    steps = [c for c in decode_calls if c[0] == 1]
    assert len(steps) == 2 and all(masked for _, masked in steps)
    # The decode kernels never read a block mask's tables: none are built for their calls.
    assert 1 not in tables, tables


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_takes_the_layers_lane_sites_bitwise(monkeypatch, batch):
    """Greedy decoding on a dynamic cache without padding: after its first
    decode steps every layer's call takes its lane site
    (``fastpath.lane_call_at``), and the logits are bitwise those of the
    same generation without sites (every call through
    ``attention_op_not_compiling``)."""
    monkeypatch.setattr(decode, "MIN_KEYS", 1)
    monkeypatch.setenv("FLASHFUSE_DECODE_SPLITS", "2")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(ffhf.ATTN_IMPLEMENTATION)
    ids = torch.randint(1, VOCAB, (batch, 5), generator=torch.Generator().manual_seed(2))
    taken = []
    real = ffhf._lane_call_at
    monkeypatch.setattr(ffhf, "_lane_call_at", lambda *a: taken.append(real(*a) is not None) or real(*a))

    def generate():
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)

    with_sites = generate()
    # Prefill, then five decode steps: the first decode call of the
    # signature makes the lane (the op), a call that takes the lane makes
    # its layer's site; from the third step on both layers take their sites.
    assert all(taken) and len(taken) >= 6, taken
    monkeypatch.setattr(ffhf._fastpath, "lane_site", lambda *a: None)
    ffhf._LAYER_READS.clear()
    taken.clear()
    without = generate()
    assert not any(taken)
    assert torch.equal(with_sites.sequences, without.sequences)
    assert all(torch.equal(a, b) for a, b in zip(with_sites.logits, without.logits))


@pytest.mark.gpu
def test_gpu_generate_takes_the_layers_lane_sites_bitwise(monkeypatch):
    """On the GPU (bf16, a prompt past the decode kernels' threshold): the
    layers' lane sites and the lane steps' direct launches give bitwise
    the logits of the same generation without sites or direct launches."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation(ffhf.ATTN_IMPLEMENTATION)
    ids = torch.randint(1, VOCAB, (2, 700), generator=torch.Generator().manual_seed(2)).cuda()
    taken, direct = [], []
    real_site, real_direct = ffhf._lane_call_at, decode._launch_direct

    def site_spy(*args):
        out = real_site(*args)
        taken.append(out is not None)
        return out

    def direct_spy(*args):
        out = real_direct(*args)
        direct.append(out is not None)
        return out

    monkeypatch.setattr(ffhf, "_lane_call_at", site_spy)
    monkeypatch.setattr(decode, "_launch_direct", direct_spy)

    def generate():
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)

    with_sites = generate()
    assert taken.count(True) >= 16, taken
    # Direct launches where Triton's launcher is the C launch's known wrapper (3.6's).
    from flashfuse.kernels import launch

    c_launch = any(launch._C_LAUNCH_CLASSES.values())
    assert direct.count(True) >= 16 if c_launch else not any(direct), direct
    monkeypatch.setattr(ffhf._fastpath, "lane_site", lambda *a: None)
    monkeypatch.setattr(decode, "_launch_direct", lambda *a: None)
    ffhf._LAYER_READS.clear()
    without = generate()
    assert torch.equal(with_sites.sequences, without.sequences)
    assert all(torch.equal(a, b) for a, b in zip(with_sites.logits, without.logits))
