"""Convergence check: a small character-level GPT trained eagerly and under
``torch.compile(model, backend=flashfuse.backend)`` from the same seed.

The model (written below, nanoGPT-style) computes attention explicitly:
``q @ k^T``, a causal mask from a registered lower-triangular buffer,
softmax, attention dropout, ``@ v``. The flashfuse backend should rewrite
each layer's attention into the flash op; this script checks that training
then follows the same loss curve. The two runs see the same initial weights
and the same batches; their dropout masks come from different random streams
(PyTorch's dropout vs the kernel's Philox stream), so the curves agree
statistically, not bit for bit.

The corpus is the text this repository ships (README, ARCHITECTURE and the
Python sources, in sorted order), so the run needs no download.

    python bench/bench_convergence.py               # GPU, a few hundred steps
    python bench/bench_convergence.py --smoke --out /tmp/x
"""

from __future__ import annotations

import glob
import math
import os
import time

import common
import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], budget_s=65)
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 300; smoke 12)")
    p.add_argument("--batch", type=int, default=None, help="sequences per batch (default 32)")
    p.add_argument("--block", type=int, default=None, help="context length (default 256)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 4)")
    p.add_argument("--embd", type=int, default=None, help="embedding width (default 256)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    p.add_argument("--dropout", type=float, default=0.1, help="attention and residual dropout (default 0.1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="fp32", choices=list(common.DTYPES), help="model dtype (default fp32)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smooth", type=int, default=20, help="moving-average window for the loss comparison")
    p.add_argument("--repeat", action="store_true",
                   help="train the flashfuse model a second time from the same seeds and report how far the two "
                        "loss curves differ (0 = reproducible bit for bit)")
    return p.parse_args()


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------

def load_corpus() -> str:
    """Text shipped with the repository, concatenated in a fixed order."""
    root = common.REPO_ROOT
    paths = [os.path.join(root, n) for n in ("README.md", "ARCHITECTURE.md")]
    for pattern in ("flashfuse/**/*.py", "bench/*.py", "examples/*.py"):
        paths += sorted(glob.glob(os.path.join(root, pattern), recursive=True))
    parts = []
    for p in paths:
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    text = "\n".join(parts)
    if len(text) < 10_000:
        raise SystemExit("corpus too small: run from a full checkout of the repository")
    return text


def encode(text: str) -> tuple[torch.Tensor, int]:
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, written out as matmul-softmax-matmul."""

    def __init__(self, embd: int, heads: int, block: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(embd, 3 * embd)
        self.proj = nn.Linear(embd, embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.register_buffer("tril", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.tril[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, embd, heads, block, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(embd)
        self.attn = CausalSelfAttention(embd, heads, block, dropout)
        self.ln2 = nn.LayerNorm(embd)
        self.mlp = nn.Sequential(nn.Linear(embd, 4 * embd), nn.GELU(), nn.Linear(4 * embd, embd), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A character-level GPT: token and position embeddings, pre-norm blocks, tied head."""

    def __init__(self, vocab, embd, heads, layers, block, dropout):
        super().__init__()
        self.tok = nn.Embedding(vocab, embd)
        self.pos = nn.Embedding(block, embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(embd, heads, block, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(embd)
        self.head = nn.Linear(embd, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        # GPT-2's small-normal initialisation; PyTorch's default N(0, 1)
        # embeddings would start the tied head at a loss far above log(vocab).
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(T, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

def batches(data: torch.Tensor, steps: int, batch: int, block: int, seed: int):
    """The same list of (x, y) batches for both runs, drawn from their own generator."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + block] for s in starts])
        y = torch.stack([data[s + 1:s + block + 1] for s in starts])
        out.append((x, y))
    return out


def train(kind, args, vocab, data_batches, device, dtype, budget):
    """Train one model; return (losses, seconds, first-step seconds,
    attention rewrites or None)."""
    torch.manual_seed(args.seed)
    model = TinyGPT(vocab, args.embd, args.heads, args.layers, args.block, args.dropout).to(device=device, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    runner, backend = model, None
    if kind == "flashfuse":
        from flashfuse.backend import make_backend

        # Inductor on GPU; the CPU smoke run keeps to seconds with aot_eager.
        backend = make_backend(compiler="aot_eager" if args.smoke else "inductor", record=True)
        runner = torch.compile(model, backend=backend)
    torch.manual_seed(args.seed + 1)  # same dropout seed for both runs
    losses = []
    sync_every = 10
    t0 = time.perf_counter()
    first_s = math.nan
    for i, (x, y) in enumerate(data_batches):
        loss = runner(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if i == 0:  # the first step includes compilation
            common.sync(device)
            first_s = time.perf_counter() - t0
        if (i + 1) % sync_every == 0:
            common.sync(device)
            if budget.exceeded():
                print(f"{kind}: time budget reached after {i + 1} steps", flush=True)
                break
    common.sync(device)
    seconds = time.perf_counter() - t0
    rewrites = None
    if backend is not None:
        rewrites = (sum(c.rewritten for c in backend.candidates), len(backend.candidates))
    return [float(v) for v in torch.stack(losses).cpu()], seconds, first_s, rewrites


def smooth(xs: list[float], w: int) -> list[float]:
    """Trailing moving average over ``w`` steps (shorter at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def main():
    args = parse_args()
    common.quiet_warnings()
    common.interrupt_on_sigterm()
    device = common.pick_device(args)
    defaults = dict(steps=(12, 300), batch=(4, 32), block=(32, 256), layers=(1, 4), embd=(32, 256), heads=(2, 4))
    for name, (smoke_v, full_v) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke_v if args.smoke else full_v)
    dtype = common.DTYPES[args.dtype]
    data, vocab = encode(load_corpus())
    data_batches = batches(data, args.steps, args.batch, args.block, args.seed)
    env = common.env_info(device)
    results = common.Results(args.out, "convergence.csv", env)
    budget = common.make_budget(args)

    curves, summary = {}, []
    runs = [("eager", "eager"), ("flashfuse", "flashfuse")]
    if args.repeat:
        runs.append(("flashfuse", "flashfuse_repeat"))
    for kind, label in runs:
        try:
            losses, seconds, first_s, rewrites = train(kind, args, vocab, data_batches, device, dtype, budget)
        except KeyboardInterrupt:
            print("interrupted")
            break
        except Exception as exc:
            print(f"{label}: {common.short_error(exc)}")
            summary.append([label, "error", common.short_error(exc), "", "", ""])
            continue
        curves[label] = losses
        rw = f"{rewrites[0]} of {rewrites[1]}" if rewrites else "-"
        summary.append([label, f"{losses[0]:.3f}", f"{sum(losses[-args.smooth:]) / min(len(losses), args.smooth):.3f}",
                        f"{seconds:.1f}", f"{first_s:.1f}", rw])

    # One CSV row per step with both curves side by side.
    sm = {k: smooth(v, args.smooth) for k, v in curves.items()}
    steps = max((len(v) for v in curves.values()), default=0)
    for i in range(steps):
        row = dict(step=i + 1, corpus_chars=len(data), vocab=vocab, layers=args.layers, embd=args.embd,
                   heads=args.heads, block=args.block, batch=args.batch, dropout=args.dropout, dtype=args.dtype)
        for k in curves:
            if i < len(curves[k]):
                row[f"loss_{k}"] = curves[k][i]
                row[f"smoothed_{k}"] = sm[k][i]
        results.rows.append({**row, **env})
    if results.rows:
        results._write()

    common.tables_header()
    common.print_table(summary, ["run", "first loss", f"last {args.smooth}-step mean", "train s",
                                 "first step s (compile)", "attention rewritten"],
                       f"Char-level GPT, {args.layers} layers, {args.steps} steps, corpus {len(data)} chars")
    if "flashfuse" in curves and "flashfuse_repeat" in curves:
        a, b = curves["flashfuse"], curves["flashfuse_repeat"]
        n = min(len(a), len(b))
        print(f"flashfuse run repeated from the same seeds: max |loss difference| over {n} steps "
              f"{max(abs(x - y) for x, y in zip(a[:n], b[:n])):.3g}")
    if "eager" in curves and "flashfuse" in curves:
        n = min(len(curves["eager"]), len(curves["flashfuse"]))
        diffs = [abs(a - b) for a, b in zip(sm["eager"][:n], sm["flashfuse"][:n])]
        late = diffs[n // 2:] or diffs
        print(f"max |smoothed loss difference| (window {args.smooth}): {max(diffs):.4f} over all steps, "
              f"{max(late):.4f} over the second half")
    if not args.no_plot and curves:
        shown = [k for k in curves if k != "flashfuse_repeat"]  # it lies on the flashfuse curve
        panels = {"training loss (raw)": {k: (list(range(1, len(curves[k]) + 1)), curves[k]) for k in shown},
                  f"training loss ({args.smooth}-step moving average)":
                      {k: (list(range(1, len(sm[k]) + 1)), sm[k]) for k in shown}}
        path = common.plot_panels(os.path.join(args.out, "convergence.png"), panels, "step", "loss", logx=False,
                                  title=f"eager vs flashfuse backend, {env['gpu']}")
        if path:
            print(f"plot: {path}")
    print(f"-> {results.path}")


if __name__ == "__main__":
    main()
