"""flashfuse in one screen: an unchanged attention function, compiled.

The function below is the textbook attention, written the way models write
it. ``torch.compile(..., backend=flashfuse.backend)`` finds it in the graph
and replaces it with one call of ``torch.ops.flashfuse.attention``; the rest
of the graph goes to Inductor as usual. The script prints the graph before
and after the rewrite, what ``flashfuse.explain`` recognised, and checks the
compiled output (and gradients) against eager.

Runs on a CPU-only machine; uses the GPU when there is one.
"""

import math

import torch
import torch.nn.functional as F

import flashfuse
from flashfuse.fx import rewrite


def attention(q, k, v):
    """Causal self-attention, the textbook way: scores, mask, softmax, mix."""
    n = q.size(-2)
    mask = torch.tril(torch.ones(n, n, device=q.device))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask == 0, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def show_rewrite(gm, example_inputs):
    """A throwaway backend that prints the graph before and after the pass."""
    print("=== graph Dynamo traced ===")
    print(gm.code.strip())
    rewrite(gm, example_inputs)
    print("\n=== after the flashfuse rewrite ===")
    print(gm.code.strip())
    return gm.forward


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    B, H, N, D = 2, 8, 256, 64
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    torch.compile(attention, backend=show_rewrite)(q, k, v)
    torch._dynamo.reset()

    print("\n=== flashfuse.explain ===")
    flashfuse.explain(attention, q, k, v)

    compiled = torch.compile(attention, backend=flashfuse.backend)
    out = compiled(q, k, v)
    ref = attention(q, k, v)
    grad = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, grad)
    (dq_ref,) = torch.autograd.grad(ref, q, grad)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(dq, dq_ref, **tol)
    err = (out - ref).abs().max().item()
    print(f"\ncompiled output and dq match eager on {device} ({dtype}); max |diff| = {err:.2e}")


if __name__ == "__main__":
    main()
