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


def hiding_mask(hidden: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A mask of ``kind`` (a HIDDEN key) that hides where ``hidden`` is True;
    visible float entries are a random bias drawn from ``gen``, not zeros."""
    dtype, value = HIDDEN[kind]
    if dtype == torch.bool:
        return ~hidden
    return torch.randn(hidden.shape, generator=gen).to(dtype).masked_fill(hidden, value)
