"""Snapshots of a few rewritten graphs (what the pass emits, node by node).

Graphs are rendered in a compact form that does not depend on FX's node
naming: inputs by their Dynamo source names, call results ``%0, %1, ...``.
Regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/fx/test_fx_snapshots.py``.
"""

from __future__ import annotations

import math

import expecttest
import torch
import torch.nn.functional as F

from fxutil import Recorder, qkv
from flashfuse.backend import make_backend
from flashfuse.fx.nodes import describe
from test_fx_spellings import NanoGPTAttention, RepeatKV, einsum_bnhd
from test_fx_spellings_layouts import grouped_5d
from test_fx_spellings_views import alibi_baddbmm, per_head_logit_scale


def render(gm: torch.fx.GraphModule) -> str:
    names: dict = {}
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            names[node] = str(node.target)
            continue

        def fmt(a):
            if isinstance(a, torch.fx.Node):
                return names[a]
            if isinstance(a, (list, tuple)):
                inner = ", ".join(fmt(x) for x in a)
                return f"({inner})" if isinstance(a, tuple) else f"[{inner}]"
            if isinstance(a, float):
                return f"{a:.6g}"
            return str(a)

        args = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
        if node.op == "output":
            lines.append(f"return {', '.join(args)}")
            continue
        names[node] = f"%{len(lines)}"
        target = describe(node)
        if "flashfuse.attention" in target:
            target = "flashfuse.attention"
        if "flashfuse.block_mask" in target:
            target = "flashfuse.block_mask"
        lines.append(f"{names[node]} = {target}({', '.join(args)})")
    return "\n".join(lines)


def rewritten(fn, *args) -> str:
    torch._dynamo.reset()
    rec = Recorder("eager")
    torch.compile(fn, backend=make_backend(compiler=rec))(*args)
    return render(rec.graphs[0])


class TestSnapshots(expecttest.TestCase):
    def setUp(self):
        import os

        self._env = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "0"

    def tearDown(self):
        import os

        if self._env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = self._env

    def test_plain(self):
        def fn(q, k, v):
            return F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v

        self.assertExpectedInline(rewritten(fn, *qkv(d=16, grad=False)), """\
%0 = flashfuse.attention(L_q_, L_k_, L_v_, attn_mask=None, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left)
return (%0)""")

    def test_nanogpt_causal_buffer(self):
        torch.manual_seed(0)
        self.assertExpectedInline(rewritten(NanoGPTAttention().eval(), torch.randn(2, 12, 64)), """\
%0 = torch._C._nn.linear(L_x_, L_self_modules_c_attn_parameters_weight_, L_self_modules_c_attn_parameters_bias_)
%1 = .split()(%0, 64, dim=2)
%2 = operator.getitem(%1, 0)
%3 = operator.getitem(%1, 1)
%4 = operator.getitem(%1, 2)
%5 = .view()(%3, 2, 12, 4, 16)
%6 = .transpose()(%5, 1, 2)
%7 = .view()(%2, 2, 12, 4, 16)
%8 = .transpose()(%7, 1, 2)
%9 = .view()(%4, 2, 12, 4, 16)
%10 = .transpose()(%9, 1, 2)
%11 = flashfuse.attention(%8, %6, %10, attn_mask=None, dropout_p=0, is_causal=True, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left)
%12 = .transpose()(%11, 1, 2)
%13 = .contiguous()(%12)
%14 = .view()(%13, 2, 12, 64)
%15 = torch._C._nn.linear(%14, L_self_modules_c_proj_parameters_weight_, L_self_modules_c_proj_parameters_bias_)
return (%15)""")

    def test_einsum_bnhd_layout(self):
        self.assertExpectedInline(rewritten(einsum_bnhd, *qkv(d=16, grad=False)), """\
%0 = .transpose()(L_q_, 1, 2)
%1 = .transpose()(L_k_, 1, 2)
%2 = .transpose()(L_v_, 1, 2)
%3 = .permute()(%0, 0, 2, 1, 3)
%4 = .permute()(%1, 0, 2, 1, 3)
%5 = .permute()(%2, 0, 2, 1, 3)
%6 = flashfuse.attention(%3, %4, %5, attn_mask=None, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left)
%7 = .permute()(%6, 0, 2, 1, 3)
return (%7)""")

    def test_repeat_kv_folded(self):
        self.assertExpectedInline(rewritten(RepeatKV(2), *qkv(h=4, hkv=2, d=16, grad=False)), """\
%0 = flashfuse.attention(L_q_, L_k_, L_v_, attn_mask=None, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=True, window_left=None, window_right=None, alignment=top_left)
return (%0)""")

    def test_padding_mask_passed_through(self):
        def fn(q, k, v, pad):
            s = q @ k.transpose(-2, -1) * 0.25
            s = s + (1.0 - pad[:, None, None, :]) * -10000.0
            return s.softmax(-1) @ v

        self.assertExpectedInline(rewritten(fn, *qkv(d=16, grad=False), torch.ones(2, 8)), """\
%0 = operator.getitem(L_pad_, (slice(None, None, None), None, None, slice(None, None, None)))
%1 = operator.sub(1, %0)
%2 = operator.mul(%1, -10000)
%3 = flashfuse.block_mask(%2, 8, 8, window_left=None, window_right=None, bottom_right=False, mask_fill=None, queries=False)
%4 = operator.getitem(%3, 0)
%5 = operator.getitem(%3, 1)
%6 = flashfuse.attention(L_q_, L_k_, L_v_, attn_mask=%2, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%4, mask_query_table=%5)
return (%6)""")

    def test_alibi_baddbmm_batch_views(self):
        self.assertExpectedInline(rewritten(alibi_baddbmm, *qkv(d=16, grad=False)), """\
%0 = .reshape()(L_q_, 8, -1, 16)
%1 = .reshape()(L_k_, 8, -1, 16)
%2 = .reshape()(L_v_, 8, -1, 16)
%3 = torch.linspace(0.1, 0.5, 4)
%4 = .repeat()(%3, 2)
%5 = operator.getitem(%4, (slice(None, None, None), None, None))
%6 = torch.arange(8, dtype=torch.float32)
%7 = operator.getitem(%6, (None, None, slice(None, None, None)))
%8 = operator.mul(%5, %7)
%9 = .unflatten()(%0, 0, (-1, 4))
%10 = .unflatten()(%1, 0, (-1, 4))
%11 = .unflatten()(%2, 0, (-1, 4))
%12 = .unflatten()(%8, 0, (-1, 4))
%13 = operator.add(%12, G_BIAS4_)
%14 = flashfuse.block_mask(%13, 8, 8, window_left=None, window_right=None, bottom_right=False, mask_fill=None, queries=False)
%15 = operator.getitem(%14, 0)
%16 = operator.getitem(%14, 1)
%17 = flashfuse.attention(%9, %10, %11, attn_mask=%13, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%15, mask_query_table=%16)
%18 = .flatten()(%17, 0, 1)
return (%18)""")

    def test_per_head_logit_scale(self):
        ls = torch.rand(4, 1, 1) + 0.5
        self.assertExpectedInline(rewritten(per_head_logit_scale, *qkv(d=16, grad=False), ls), """\
%0 = torch.nn.functional.normalize(L_q_, dim=-1)
%1 = torch.nn.functional.normalize(L_k_, dim=-1)
%2 = torch.clamp(L_logit_scale_, max=4.60517)
%3 = .exp()(%2)
%4 = operator.mul(%0, %3)
%5 = flashfuse.block_mask(G_BIAS4_, 8, 8, window_left=None, window_right=None, bottom_right=False, mask_fill=None, queries=False)
%6 = operator.getitem(%5, 0)
%7 = operator.getitem(%5, 1)
%8 = flashfuse.attention(%4, %1, L_v_, attn_mask=G_BIAS4_, dropout_p=0, is_causal=False, scale=1, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%6, mask_query_table=%7)
return (%8)""")

    def test_one_block_mask_for_layers_sharing_a_mask(self):
        # Three layers, each slicing the same additive mask as Hugging Face's
        # eager attention does, and two layers hiding the same bool padding:
        # one mask and one block_mask node per distinct mask, read by every
        # layer that uses it.
        def fn(q, k, v, mask, pad):
            x = q
            for _ in range(3):
                s = x @ k.transpose(-2, -1) * 0.25
                s = s + mask[:, :, :, : k.shape[-2]]
                x = s.softmax(-1) @ v
            for _ in range(2):
                s = (x @ k.transpose(-2, -1) * 0.25).masked_fill(~pad[:, None, None, :], float("-inf"))
                x = s.softmax(-1) @ v
            return x

        q, k, v = qkv(d=16, grad=False)
        mask = torch.zeros(2, 1, 8, 8)
        pad = torch.ones(2, 8, dtype=torch.bool)
        self.assertExpectedInline(rewritten(fn, q, k, v, mask, pad), """\
%0 = operator.getitem(L_mask_, (slice(None, None, None), slice(None, None, None), slice(None, None, None), slice(None, 8, None)))
%1 = flashfuse.block_mask(%0, 8, 8, window_left=None, window_right=None, bottom_right=False, mask_fill=None, queries=False)
%2 = operator.getitem(%1, 0)
%3 = operator.getitem(%1, 1)
%4 = flashfuse.attention(L_q_, L_k_, L_v_, attn_mask=%0, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%2, mask_query_table=%3)
%5 = flashfuse.attention(%4, L_k_, L_v_, attn_mask=%0, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%2, mask_query_table=%3)
%6 = flashfuse.attention(%5, L_k_, L_v_, attn_mask=%0, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%2, mask_query_table=%3)
%7 = operator.getitem(L_pad_, (slice(None, None, None), None, None, slice(None, None, None)))
%8 = operator.invert(%7)
%9 = torch.logical_not(%8)
%10 = flashfuse.block_mask(%9, 8, 8, window_left=None, window_right=None, bottom_right=False, mask_fill=None, queries=False)
%11 = operator.getitem(%10, 0)
%12 = operator.getitem(%10, 1)
%13 = flashfuse.attention(%6, L_k_, L_v_, attn_mask=%9, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%11, mask_query_table=%12)
%14 = flashfuse.attention(%13, L_k_, L_v_, attn_mask=%9, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%11, mask_query_table=%12)
return (%14)""")

    def test_grouped_5d_broadcast(self):
        self.assertExpectedInline(rewritten(grouped_5d, *qkv(h=4, hkv=2, m=12, d=16, grad=False)), """\
%0 = flashfuse.attention(L_q_, L_k_, L_v_, attn_mask=None, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=True, window_left=None, window_right=None, alignment=top_left)
%1 = .unflatten()(%0, 1, (-1, 2))
%2 = .view()(%1, 2, 4, 8, -1)
return (%2)""")

    def test_batch_dims_folded(self):
        # (B, windows, heads, N, D) with a per-window bias: q, k and v lose
        # their window dim into the batch (views), the bias is expanded over
        # the samples (a copy) and the result regains it.
        from test_fx_batch_fold import qkv5, windows_5d_group_bias

        self.assertExpectedInline(rewritten(windows_5d_group_bias, *qkv5(grad=False)), """\
%0 = .flatten()(L_q_, 0, 1)
%1 = .flatten()(L_k_, 0, 1)
%2 = .flatten()(L_v_, 0, 1)
%3 = .unsqueeze()(G_BIAS_GROUP_, 0)
%4 = .expand()(%3, 2, -1, -1, -1, -1)
%5 = .flatten()(%4, 0, 1)
%6 = flashfuse.block_mask(%5, 5, 7, window_left=None, window_right=None, bottom_right=False, mask_fill=None, queries=False)
%7 = operator.getitem(%6, 0)
%8 = operator.getitem(%6, 1)
%9 = flashfuse.attention(%0, %1, %2, attn_mask=%5, dropout_p=0, is_causal=False, scale=0.25, enable_gqa=False, window_left=None, window_right=None, alignment=top_left, mask_key_table=%7, mask_query_table=%8)
%10 = .unflatten()(%9, 0, (-1, 3))
return (%10)""")
