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
