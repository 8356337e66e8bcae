"""explain(): one row per candidate, with where it is and what was recognised."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxutil import qkv
from flashfuse.fx import explain
from test_fx_spellings import NanoGPTAttention


class TwoHeads(nn.Module):
    """One attention the pass rewrites, one it must leave (probs returned)."""

    def __init__(self):
        super().__init__()
        self.causal = NanoGPTAttention()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        y = self.causal(x)
        q = self.proj(x).view(2, 12, 4, 16).transpose(1, 2)
        p = F.softmax(q @ q.transpose(-2, -1), dim=-1)
        return y, p @ q, p


def test_explain_rows(capsys):
    torch.manual_seed(0)
    m = TwoHeads().eval()
    result = explain(m, torch.randn(2, 12, 64))
    printed = capsys.readouterr().out
    assert len(result.rows) == 2 and result.rewritten == 1
    good, bad = result.rows
    assert good.rewritten and good.module == "causal" and good.causal == "top-left"
    assert good.scale == "0.25" and good.mask == "none"
    assert "test_fx_explain.py" not in good.source and "F.softmax(att" in good.source
    assert not bad.rewritten and "other users" in bad.reason
    assert "1 of 2 attention candidates rewritten" in printed
    assert "causal" in printed and "other users" in printed


def test_explain_function_and_no_print(capsys):
    def fn(q, k, v):
        return (q @ k.transpose(-2, -1)).softmax(-1) @ v

    result = explain(fn, *qkv(d=16, h=4, hkv=1, grad=False), print_table=False)
    assert capsys.readouterr().out == ""
    (row,) = result.rows
    assert row.rewritten and row.scale == "1" and row.gqa == "4q/1kv (broadcast)"
    assert "1 of 1" in str(result)


def test_explain_names_the_forward_kernel_on_cuda(monkeypatch):
    """On CUDA inputs each rewritten row says which forward kernel its call
    takes (kernels.forward_kernel); CPU inputs have no such column."""
    import importlib

    rewrite = importlib.import_module("flashfuse.fx.rewrite")
    torch.manual_seed(0)
    m = TwoHeads().eval()
    plain = explain(m, torch.randn(2, 12, 64), print_table=False)
    assert "forward kernel" not in plain.table() and plain.rows[0].kernel == ""
    seen = []

    def pretend(q, k, v, mask, kwargs):
        seen.append(tuple(q.meta["val"].shape) if "val" in q.meta else None)
        return "hopper"

    monkeypatch.setattr(rewrite, "_forward_kernel", pretend)
    result = explain(m, torch.randn(2, 12, 64), print_table=False)
    assert seen and result.rows[0].kernel == "hopper"
    assert "forward kernel" in result.table() and "hopper" in result.table()


class _Heads128(nn.Module):
    """Attention at head dim 128: on 2k tokens the Hopper kernel's case."""

    def forward(self, q, k, v):
        return F.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1) @ v


@pytest.mark.gpu
def test_gpu_explain_names_the_kernel():
    from flashfuse.kernels import hopper

    q, k, v = (torch.randn(2, 4, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    result = explain(_Heads128(), q, k, v, print_table=False)
    assert result.rewritten == 1
    kernel = result.rows[0].kernel
    if torch.cuda.get_device_capability()[0] == 9 and hopper.gluon_available():
        assert kernel == "hopper", kernel
    else:
        assert kernel.startswith("portable: "), kernel
    short = explain(_Heads128(), q[:, :, :256], k[:, :, :256], v[:, :, :256], print_table=False)
    assert short.rows[0].kernel.startswith("portable: ")  # rows too short for the Hopper kernel

