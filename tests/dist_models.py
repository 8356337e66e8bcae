"""Small transformer models for the data-parallel tests, written the way
model code spells attention (matmul, mask, softmax, matmul), so that the
backend has something to rewrite."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class GPT2Block(nn.Module):
    def __init__(self, width, heads, block_size):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RMSNorm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    """Grouped heads (repeat_kv), rotary embeddings, an additive causal mask."""

    def __init__(self, width, heads, kv_heads, block_size):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.gate, self.up = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.norm_1, self.norm_2 = RMSNorm(width), RMSNorm(width)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(block_size).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def attn(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[:T], self.sin[:T]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(B, self.kv_heads, rep, T, self.hd).reshape(B, self.heads, T, self.hd)
        v = v[:, :, None].expand(B, self.kv_heads, rep, T, self.hd).reshape(B, self.heads, T, self.hd)
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd) + mask
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(p, v).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(y)

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        return x + self.down(F.silu(self.gate(self.norm_2(x))) * self.up(self.norm_2(x)))


class ParamInChainBlock(nn.Module):
    """Parameters used inside the attention chain: a learned temperature on
    the scores, a learned bias added to them, and the value projection
    computed after the softmax. Each is a point where Dynamo's DDP optimiser
    may start a new subgraph."""

    def __init__(self, width, heads, block_size):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.v_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.temperature = nn.Parameter(torch.tensor(0.25))
        self.rel_bias = nn.Parameter(0.1 * torch.randn(heads, block_size, block_size))

    def forward(self, x):
        B, T, C = x.shape

        def split(t):
            return t.view(B, T, self.heads, C // self.heads).transpose(1, 2)

        q, k = split(self.q_proj(x)), split(self.k_proj(x))
        s = (q @ k.transpose(-2, -1)) * self.temperature + self.rel_bias[:, :T, :T]
        p = F.softmax(s, dim=-1)
        y = p @ split(self.v_proj(x))
        return x + self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class TinyLM(nn.Module):
    def __init__(self, kind="gpt2", vocab=64, width=64, heads=4, kv_heads=2, layers=2, block_size=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block_size, width)
        if kind == "gpt2":
            blocks = [GPT2Block(width, heads, block_size) for _ in range(layers)]
        elif kind == "llama":
            blocks = [LlamaBlock(width, heads, kv_heads, block_size) for _ in range(layers)]
        elif kind == "param_in_chain":
            blocks = [ParamInChainBlock(width, heads, block_size) for _ in range(layers)]
        else:
            raise ValueError(kind)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


MODELS = {
    "gpt2": dict(kind="gpt2", width=64, heads=4),
    # Head dim 32 with grouped heads (4 query heads over 2 key/value heads).
    "llama": dict(kind="llama", width=128, heads=4, kv_heads=2),
    "param_in_chain": dict(kind="param_in_chain", width=64, heads=4),
}


def make_model(name: str, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**MODELS[name])


def loss_fn(model, idx):
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
