"""flashfuse: FlashAttention for unchanged PyTorch models.

Public API:

* :func:`attention` - exact flash attention, the ``torch.ops.flashfuse.attention`` op;
* :func:`block_mask` - a mask's tables built once (:class:`BlockMask`), for
  every attention call that uses the mask; :func:`find_band`, the band
  (:class:`MaskBand`) a mask tensor is written as, if any;
* :data:`backend` - ``torch.compile(model, backend=flashfuse.backend)``: rewrite
  attention into the op, compile the rest with Inductor;
* :func:`make_backend` - the same with another post-rewrite compiler
  (``"aot_eager"``, ``"eager"``) or Inductor options;
* :func:`explain` - which attentions a model has, which were rewritten, and why not;
* :func:`attention_with_lse` - :func:`attention` that also returns each row's
  log-sum-exp (differentiable);
* :func:`attention_with_kvcache` - new queries against a contiguous (per-row
  lengths) or paged key/value cache, on the split-KV decoding kernels.
* :func:`ring_attention` / :func:`context_parallel` - attention over a sequence
  sharded across a ``torch.distributed`` process group (``flashfuse.parallel``).

The Hugging Face hook (``attn_implementation="ffuse"``) lives in
``flashfuse.hf`` and is imported on demand, so that importing flashfuse never
imports transformers.
"""

from .backend import backend, make_backend
from .block_mask import BlockMask, MaskBand, block_mask, find_band
from .fx.explain import explain
from .kvcache import attention_with_kvcache, attention_with_lse
from .ops import attention
from .parallel import context_parallel, ring_attention

__all__ = ["BlockMask", "MaskBand", "attention", "attention_with_kvcache", "attention_with_lse", "backend",
           "block_mask", "context_parallel", "explain", "find_band", "make_backend", "ring_attention"]
__version__ = "0.1.0"
