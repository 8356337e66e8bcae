"""An unchanged Hugging Face model (eager attention) compiled with flashfuse.

Builds a small random LLaMA (grouped-query attention: 8 query heads, 2
key/value heads) with ``attn_implementation="eager"``, so its attention is the
plain matmul-softmax-matmul in transformers' code. ``torch.compile`` with the
flashfuse backend rewrites every layer's attention (the ``repeat_kv`` copy of
keys and values is folded into the op's grouped heads). The script prints the
attention lines of one layer before and after, the explain table (with the
padding mask, and without it, where the mask is proven causal), and checks
logits and gradients against eager. Pass ``gpt2`` as argument for GPT-2.
"""

import copy
import sys

import torch

import flashfuse
from flashfuse.fx import rewrite

try:
    import transformers
except ImportError:  # pragma: no cover
    sys.exit("this example needs transformers: pip install transformers")


def build(name):
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, n_positions=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8,
                                   num_key_value_heads=2, intermediate_size=512, vocab_size=1000,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg)


def around(code, marker, before, after):
    """The lines of ``code`` around the first line containing ``marker``."""
    lines = [ln.split(";")[0].rstrip() for ln in code.splitlines()]
    i = next(i for i, ln in enumerate(lines) if marker in ln)
    return "\n".join(lines[max(0, i - before) : i + after + 1])


def show_rewrite(gm, example_inputs):
    print("=== attention of the first layer, before ===")
    print(around(gm.code, "softmax", 8, 3))
    rewrite(gm, example_inputs)
    print("=== after ===")
    print(around(gm.code, "flashfuse", 4, 2))
    return gm.forward


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "llama"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build(name).to(device)
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 1000, (2, 64), device=device)
    mask = torch.ones_like(ids)
    mask[1, 48:] = 0  # right padding in the second sequence

    torch.compile(model, backend=show_rewrite)(input_ids=ids, attention_mask=mask)
    torch._dynamo.reset()
    print()
    flashfuse.explain(model, input_ids=ids, attention_mask=mask)
    # Without padding, the mask transformers builds in the graph is causal
    # (AND a packed-sequence term that position ids from an arange make all
    # True): the pass proves it, and the op runs is_causal with no mask tensor.
    print("\nwithout the padding mask:")
    flashfuse.explain(model, input_ids=ids)

    compiled = torch.compile(model, backend=flashfuse.backend)
    logits = compiled(input_ids=ids, attention_mask=mask).logits
    expected = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)
    logits.float().logsumexp(-1).mean().backward()
    expected.float().logsumexp(-1).mean().backward()
    for (pname, p), (_, pr) in zip(model.named_parameters(), reference.named_parameters()):
        if pr.grad is not None:
            torch.testing.assert_close(p.grad, pr.grad, atol=1e-3, rtol=1e-3, msg=pname)
    print(f"\n{name}: logits and gradients match eager on {device}")


if __name__ == "__main__":
    main()
