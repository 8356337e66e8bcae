"""Masks that hide keys the way models hide them, for the kernel tests."""

from __future__ import annotations

import torch

# How each kind of mask hides a key: bool False, or a float value at or
# below the dtype's lowest (what Hugging Face models build), or -inf.
HIDDEN = {
    "bool": (torch.bool, False),
    "float32-inf": (torch.float32, float("-inf")),
    "float32-min": (torch.float32, torch.finfo(torch.float32).min),
    "bfloat16-min": (torch.bfloat16, torch.finfo(torch.bfloat16).min),
    "float16-min": (torch.float16, torch.finfo(torch.float16).min),
}


def hiding_mask(hidden: torch.Tensor, kind: str, gen: torch.Generator, values: str = "bias") -> torch.Tensor:
    """A mask of ``kind`` (a HIDDEN key) that hides where ``hidden`` is True.

    Visible float entries are a random bias drawn from ``gen`` ("bias"), or
    zeros, as models build masks, with a random 0.3 % of biases among them
    ("zeros": the kernels skip reading the mask where a block is all zeros,
    so those blocks are computed without it).
    """
    dtype, value = HIDDEN[kind]
    if dtype == torch.bool:
        return ~hidden
    bias = torch.randn(hidden.shape, generator=gen)
    if values == "zeros":
        bias = bias * (torch.rand(hidden.shape, generator=gen) < 0.003)
    elif values != "bias":
        raise ValueError(f"values must be 'bias' or 'zeros', got {values!r}")
    return bias.to(dtype).masked_fill(hidden, value)
