"""The graph pass: find matmul-softmax-matmul attention, rewrite it into
``torch.ops.flashfuse.attention``.

* :mod:`.match` - what a match is (:class:`Candidate`, :class:`Plan`);
* :mod:`.find` - structural detection on Dynamo FX graphs;
* :mod:`.masks` - proving that in-graph masks are causal or windows;
* :mod:`.mha` - `nn.MultiheadAttention`'s one-call attention;
* :mod:`.rewrite` - the graph surgery (:class:`FlashAttentionPass`);
* :mod:`.explain` - the candidate report.
"""

from .explain import Explanation, ExplainRow, explain
from .find import find
from .match import Candidate, Plan
from .rewrite import FlashAttentionPass, rewrite

__all__ = [
    "Candidate",
    "ExplainRow",
    "Explanation",
    "FlashAttentionPass",
    "Plan",
    "explain",
    "find",
    "rewrite",
]
