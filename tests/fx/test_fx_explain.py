"""explain(): one row per candidate, with where it is and what was recognised."""

from __future__ import annotations

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
