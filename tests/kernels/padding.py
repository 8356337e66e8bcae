"""Inputs that expose reads past a tensor's edges, shared by the kernel tests."""

from __future__ import annotations

import torch


def in_nan_padding(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, L, D) as a view into a buffer whose rows past L and
    columns past D hold NaN: a load that reaches past the tensor's edges
    shows up as NaN in the results."""
    B, H, L, D = t.shape
    buf = torch.full((B, H, L + 40, D + 8), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[:, :, :L, :D]
    view.copy_(t)
    return view
