"""A nanoGPT-style causal self-attention block, unchanged, compiled with flashfuse.

The block keeps its causal mask in a registered ``tril`` buffer and slices it
to the sequence length, as nanoGPT does. The pass proves the slice is causal
and passes ``is_causal=True`` instead of a mask tensor. The script prints the
attention part of the graph before and after, then trains a few steps with
both the compiled and the eager block and checks they agree.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashfuse
from flashfuse.fx import rewrite


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=128, n_head=4, block_size=256, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def show_rewrite(gm, example_inputs):
    """Print the graph lines between the projections, before and after."""
    def body(code):
        skip = ("linear", "= L_", "def forward", "return")
        return "\n".join(ln.split(";")[0] for ln in code.splitlines() if ln.strip() and not any(s in ln for s in skip))

    print("=== before ===\n" + body(gm.code))
    rewrite(gm, example_inputs)
    print("=== after ===\n" + body(gm.code))
    return gm.forward


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    block = CausalSelfAttention().to(device)
    eager = CausalSelfAttention().to(device)
    eager.load_state_dict(block.state_dict())
    x = torch.randn(4, 64, 128, device=device)

    torch.compile(block, backend=show_rewrite)(x)
    torch._dynamo.reset()

    compiled = torch.compile(block, backend=flashfuse.backend)
    opt_c = torch.optim.SGD(block.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        target = torch.randn(4, 64, 128, device=device)
        loss_c = F.mse_loss(compiled(x), target)
        loss_e = F.mse_loss(eager(x), target)
        for loss, opt in ((loss_c, opt_c), (loss_e, opt_e)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"step {step}: loss compiled {loss_c.item():.6f}  eager {loss_e.item():.6f}")
        torch.testing.assert_close(loss_c, loss_e, atol=1e-4, rtol=1e-4)
    print(f"compiled and eager training agree on {device}")


if __name__ == "__main__":
    main()
