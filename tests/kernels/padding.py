"""Inputs and allocations that expose reads past a tensor's edges and
unwritten outputs, shared by the kernel tests."""

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


def poison_empty(monkeypatch) -> None:
    """Make every floating tensor allocated with ``torch.empty`` /
    ``torch.empty_like`` / ``torch.empty_strided`` (the op's outputs) NaN
    until the test ends, so an element an implementation forgets to write
    shows up as NaN in the comparison."""
    for name in ("empty_like", "empty", "empty_strided"):
        real = getattr(torch, name)

        def poisoned(*args, _real=real, **kwargs):
            t = _real(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, name, poisoned)
