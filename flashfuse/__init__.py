"""flashfuse: FlashAttention for unchanged PyTorch models.

Public API:

* :func:`attention` - exact flash attention, ``torch.ops.flashfuse.attention``.
"""

from .ops import attention

__all__ = ["attention"]
__version__ = "0.1.0"
