"""Candidate lists leave every supported shape a config to fall back on."""

from __future__ import annotations

import pytest
import torch

from flashfuse.kernels import backward, forward
from flashfuse.kernels.launch import config_tuple


@pytest.mark.parametrize("d", [160, 200, 256])
def test_fp32_forward_ends_with_small_tiles_past_head_dim_128(d):
    q = torch.empty(1, dtype=torch.float32)
    meta = dict(BLOCK_D=max(16, 1 << (d - 1).bit_length()), BLOCK_DV=max(16, 1 << (d - 1).bit_length()),
                MASK_KIND=0, DROPOUT=False)
    kept = [config_tuple(c) for c in forward._prune_configs(forward._FWD_CONFIGS, {"Q": q, "Mask": q}, **meta)]
    assert kept[-2:] == [(32, 32, 4, 2), (32, 32, 4, 1)], kept
    meta16 = dict(meta)
    kept16 = [config_tuple(c) for c in forward._prune_configs(forward._FWD_CONFIGS, {"Q": q.half(), "Mask": q}, **meta16)]
    assert (32, 32, 4, 1) not in kept16, "16-bit inputs keep their own list"


@pytest.mark.parametrize("kind,last", [("dkdv", (16, 32, 4, 1)), ("dq", (32, 32, 4, 1))])
def test_fp32_backward_keeps_a_single_stage_fallback_at_large_head_dims(kind, last, monkeypatch):
    monkeypatch.setattr(backward, "_max_shared_mem", lambda device: 232448)
    args = {"Q": torch.empty(1, dtype=torch.float32), "BLOCK_D": 256, "BLOCK_DV": 256}
    kept = [config_tuple(c) for c in backward._prune(kind)(backward._CONFIGS[kind], args)]
    assert last in kept, kept


def test_kernel_problem_asks_the_launchers_with_the_ops_own_arguments(monkeypatch):
    """The pass's probe normalises the public op's arguments as the op does
    (default scale, is_causal as window_right = 0, alignment, a seed only
    when dropout draws) before asking the launchers; off CUDA it asks
    nothing."""
    import flashfuse.kernels
    from flashfuse import ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    monkeypatch.setattr(flashfuse.kernels, "launch_problem", lambda *a, **kw: seen.append((a, kw)) or "why")
    with FakeTensorMode():
        q = torch.empty(2, 4, 33, 64, device="cuda", dtype=torch.bfloat16)
        assert ops.kernel_problem(q, q, q, None, 0.1, True, alignment="bottom_right", backward=True) == "why"
        assert ops.kernel_problem(q, q, q) == "why"
    (a, kw), (a0, _) = seen
    assert a[4] is not None and a[4].dtype == torch.int64 and a[5:11] == (0.1, 0.125, None, 0, True, None)
    assert kw == {"backward": True}
    assert a0[4] is None and a0[5:11] == (0.0, 0.125, None, None, False, None)
    assert ops.kernel_problem(torch.empty(1, 1, 4, 16), torch.empty(1, 1, 4, 16), torch.empty(1, 1, 4, 16)) is None


def test_kernel_problem_runs_the_launchers_on_fake_cuda_tensors():
    """The probe end to end on fake CUDA tensors, in a fresh process with
    the tracing harness's stand-in Hopper driver (tests/trace_cuda_graph.py):
    forward and backward launchers, masks and dropout, nothing launched.
    The stand-in cannot compile, so each launcher takes its first candidate
    and the answer is None; a broken probe raises instead."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = """
import sys
sys.path.insert(0, sys.argv[1])
import trace_cuda_graph
trace_cuda_graph._pretend_hopper()
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from flashfuse import ops
with FakeTensorMode(allow_non_fake_inputs=True):
    q = torch.randn(2, 4, 80, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    masks = [None, torch.randn(2, 1, 80, 80, device="cuda", dtype=torch.bfloat16),
             torch.ones(2, 1, 1, 80, device="cuda", dtype=torch.bool)]
    print([ops.kernel_problem(q, q, q, m, 0.1 if m is None else 0.0, m is None, backward=True,
                              mask_fill=-1e4 if m is not None and m.dtype == torch.bool else None)
           for m in masks])
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(tests),
                                                                    os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, tests], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[None, None, None]"
