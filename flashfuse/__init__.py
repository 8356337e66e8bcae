"""flashfuse: FlashAttention for unchanged PyTorch models.

Public API:

* :func:`attention` - exact flash attention, the ``torch.ops.flashfuse.attention`` op;
* :data:`backend` - ``torch.compile(model, backend=flashfuse.backend)``: rewrite
  attention into the op, compile the rest with Inductor;
* :func:`make_backend` - the same with another post-rewrite compiler
  (``"aot_eager"``, ``"eager"``) or Inductor options;
* :func:`explain` - which attentions a model has, which were rewritten, and why not;
* :func:`ring_attention` / :func:`context_parallel` - attention over a sequence
  sharded across a ``torch.distributed`` process group (``flashfuse.parallel``).

The Hugging Face hook (``attn_implementation="ffuse"``) lives in
``flashfuse.hf`` and is imported on demand, so that importing flashfuse never
imports transformers.
"""

from .backend import backend, make_backend
from .fx.explain import explain
from .ops import attention
from .parallel import context_parallel, ring_attention

__all__ = ["attention", "backend", "context_parallel", "explain", "make_backend", "ring_attention"]
__version__ = "0.1.0"
