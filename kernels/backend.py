"""Which implementation an op runs: the torch reference, the CPU extension or the Triton kernel."""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "torch", "cpu", "triton")


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (on CPU it can only run under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter rather than on a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Resolve `backend` for an op whose data lives where `tensor` does: "torch", "cpu" or "triton".

    "auto" picks Triton for CUDA tensors, the CPU extension for CPU tensors when it builds here,
    and the torch reference otherwise. "triton" insists on Triton (a CPU tensor then needs
    TRITON_INTERPRET=1); "cpu" insists on the extension; "torch" always runs the reference.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if tensor.is_cuda:
            return "triton" if triton_available() else "torch"
        return "cpu" if cpu_extension_available() else "torch"
    if backend == "cpu":
        if tensor.is_cuda:
            raise RuntimeError("the cpu backend runs on CPU tensors only")
        if not cpu_extension_available():
            raise RuntimeError("the cpu backend was requested but its C++ extension could not be built here")
        return "cpu"
    if not triton_available():
        raise RuntimeError("the triton backend was requested but triton does not import")
    if not tensor.is_cuda and not triton_interpreted():
        raise RuntimeError("Triton kernels need a CUDA device, or TRITON_INTERPRET=1 to run on CPU")
    return "triton"


def cpu_extension_available() -> bool:
    """True when the CPU extension is built (building it on first call)."""
    from .cpu import cpu_extension

    return cpu_extension() is not None


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError unless every given tensor (None skipped) lives on one device."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_unit_stride(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError unless each given tensor's last dimension is contiguous (coalesced loads need it)."""
    for name, t in tensors.items():
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
