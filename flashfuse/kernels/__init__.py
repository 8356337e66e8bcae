"""Triton flash-attention kernels and their launchers.

The kernel modules are imported on first use: importing flashfuse stays cheap,
and the Triton interpreter decision (made by Triton when a kernel is defined)
is recorded here so the ops layer knows which tensors the kernels can take.
"""

import os

# Triton decides when a kernel is *defined* whether it runs compiled or in the
# interpreter, so CPU tensors can use the kernels only if this was set then.
BUILT_FOR_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def attention_forward(*args, **kwargs):
    """See :func:`flashfuse.kernels.forward.attention_forward`."""
    from .forward import attention_forward as launch

    return launch(*args, **kwargs)


def attention_backward(*args, **kwargs):
    """See :func:`flashfuse.kernels.backward.attention_backward`."""
    from .backward import attention_backward as launch

    return launch(*args, **kwargs)


def launch_problem(q, k, v, attn_mask, *, dropout_p: float, window_left, window_right, bottom_right: bool,
                   backward: bool, **options) -> str | None:
    """Why the CUDA kernels cannot run attention on tensors like these, or
    None when they can (always None off CUDA: the interpreter and the
    blockwise path take any supported shape).

    The arguments are the op's, as fake or real tensors: (B, Hq, N, D)
    queries, (B, Hkv, M, D) keys, (B, Hkv, M, Dv) values, an optional mask
    broadcastable to (B, Hq, N, M); ``backward`` also asks for the gradient
    kernels (``mask_grad`` when the mask requires grad). The launchers run
    on fresh fake tensors of the same sizes (symbolic ones at their example
    values, without guards) with nothing launched, each finding the config
    it would take (``launch.dry_run``); the answer is the first launcher
    that finds none fitting the GPU. Used by the graph pass, so that a
    traced shape the kernels cannot serve is left unrewritten instead of
    failing the compile.
    """
    if q.device.type != "cuda":
        return None
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .launch import NoKernelConfig, dry_run, hint

    def like(t):
        return None if t is None else torch.empty([hint(s) for s in t.shape], dtype=t.dtype, device=t.device)

    try:
        with FakeTensorMode(allow_non_fake_inputs=True), dry_run():
            qf, kf, vf, mf = like(q), like(k), like(v), like(attn_mask)
            seed = torch.empty((), dtype=torch.int64, device=q.device) if dropout_p > 0 else None
            band = dict(dropout_p=float(dropout_p), scale=1.0, window_left=window_left,
                        window_right=window_right, bottom_right=bool(bottom_right))
            out, lse = attention_forward(qf, kf, vf, mf, seed, **band, **options)
            if backward:
                mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
                attention_backward(torch.empty_like(out), qf, kf, vf, mf, seed, out, lse, **band,
                                   mask_grad=mask_grad, **options)
    except NoKernelConfig as exc:
        return str(exc)
    return None
