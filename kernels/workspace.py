"""Reusable scratch buffers for the CPU decode path.

Allocating a fresh multi-megabyte tensor per call costs page faults that, on CPU, dwarf the copy
itself; a workspace hands out views of buffers that only ever grow.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named scratch buffers, grown on demand and reused across calls (not thread-safe)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `shape` backed by the buffer `name`; its contents are undefined."""
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)
