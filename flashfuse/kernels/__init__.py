"""Triton flash-attention kernels and their launchers.

The kernel modules are imported on first use: importing flashfuse stays cheap,
and the Triton interpreter decision (made by Triton when a kernel is defined)
is recorded here so the ops layer knows which tensors the kernels can take.
"""

from .. import config

# Triton decides when a kernel is *defined* whether it runs compiled or in the
# interpreter, so CPU tensors can use the kernels only if this was set then.
BUILT_FOR_INTERPRETER = config.interpreter_on()


def attention_forward(q, k, v, attn_mask, seed, **kwargs):
    """See :func:`flashfuse.kernels.forward.attention_forward`. Few queries
    against many keys take the split-KV decoding kernels instead
    (:func:`flashfuse.kernels.decode.decode_suits`); their ``out`` and
    ``lse`` have the same layout and meaning."""
    from .decode import DecodeCall, decode_forward, decode_suits

    if decode_suits(DecodeCall(q, k, attn_mask, kwargs["dropout_p"], kwargs["window_left"], kwargs["window_right"],
                               kwargs["bottom_right"], kwargs.get("mask_fill"), kwargs.get("softcap"),
                               kwargs.get("sinks"))):
        return decode_forward(q, k, v, scale=kwargs["scale"], window_left=kwargs["window_left"],
                              window_right=kwargs["window_right"], bottom_right=kwargs["bottom_right"],
                              attn_mask=attn_mask)
    from .forward import attention_forward as launch

    return launch(q, k, v, attn_mask, seed, **kwargs)


def forward_kernel(q, k, v, attn_mask, seed, dropout_p: float, scale: float, window_left, window_right,
                   bottom_right: bool, mask_fill=None, mask_key_table=None, mask_query_table=None, softcap=None,
                   sinks=None) -> str:
    """Which forward kernel a CUDA call with these arguments (``_attention_forward``'s,
    on fake or real tensors) takes: ``"split-KV decode"``, ``"hopper"`` or
    ``"portable: <why not the Hopper kernel>"``. The Hopper kernel's layout
    rule is checked when a call runs (a fake tensor has no address); a call
    whose layout the copy engine cannot read takes the portable kernel."""
    from . import hopper
    from .decode import DecodeCall, decode_suits
    from .problem import AttentionProblem

    if decode_suits(DecodeCall(q, k, attn_mask, dropout_p, window_left, window_right, bottom_right, mask_fill,
                               softcap, sinks)):
        return "split-KV decode"
    p = AttentionProblem.build(q, k, v, attn_mask, dropout_p=dropout_p, scale=scale, window_left=window_left,
                               window_right=window_right, bottom_right=bottom_right, mask_fill=mask_fill,
                               softcap=softcap)
    why = hopper.problem_refusal(p, dropout_p, softcap, sinks)
    return "hopper" if why is None else f"portable: {why}"


def attention_backward(*args, **kwargs):
    """See :func:`flashfuse.kernels.backward.attention_backward`."""
    from .backward import attention_backward as launch

    return launch(*args, **kwargs)


def launch_problem(q, k, v, attn_mask, seed, dropout_p: float, scale: float, window_left, window_right,
                   bottom_right: bool, mask_fill, mask_key_table=None, mask_query_table=None, softcap=None,
                   sinks=None, *, backward: bool) -> str | None:
    """Why the CUDA kernels cannot run attention on tensors like these, or
    None when they can.

    The arguments are ``_attention_forward``'s (see ``ops.kernel_problem``,
    which makes them from the public op's), on fake or real CUDA tensors;
    ``backward`` also asks for the gradient kernels (``mask_grad`` when the
    mask requires grad). The launchers run on fresh fake tensors of the
    same sizes (symbolic ones at their example values, without guards) with
    nothing launched, each finding the config it would take
    (``launch.dry_run``); the answer is the first launcher that finds none
    fitting the GPU. A block mask's tables change no config (the dry run
    builds its own).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .launch import NoKernelConfig, dry_run, hint

    def like(t):
        return None if t is None else torch.empty([hint(s) for s in t.shape], dtype=t.dtype, device=t.device)

    band = dict(dropout_p=dropout_p, scale=scale, window_left=window_left, window_right=window_right,
                bottom_right=bottom_right, mask_fill=mask_fill)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), dry_run():
            qf, kf, vf, mf, sf, skf = (like(t) for t in (q, k, v, attn_mask, seed, sinks))
            out, lse = attention_forward(qf, kf, vf, mf, sf, **band, softcap=softcap, sinks=skf)
            if backward:
                mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
                attention_backward(torch.empty_like(out), qf, kf, vf, mf, sf, out, lse, **band, mask_grad=mask_grad,
                                   softcap=softcap)
    except NoKernelConfig as exc:
        return str(exc)
    return None
