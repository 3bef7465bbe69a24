"""Block-sparse attention kernels over a paged KV cache: block scoring, top-k block selection with
sink and local pages, sparse decode attention, its teacher-forced (training-side) twin, and the dense
causal attention of several query tokens a row (prefill chunks, speculative verifies).

Every op has a plain-torch reference (`*_ref`, runs anywhere, differentiable where it matters) and
a Triton kernel (`*_triton`, for GPUs); scoring, selection and decode attention also have a C++
CPU extension (`kernels.cpu`) that reads the paged cache in place. The public names dispatch by
`backend` ("auto": Triton for CUDA tensors, the CPU extension for CPU tensors when it builds,
the reference otherwise). This package imports nothing else of the project.

The names load lazily, each from its module on first use: the core names the page size
(`kernels.pages`, plain Python) without paying for torch and Triton.
"""

from __future__ import annotations

import importlib

# Public name -> the module of this package that defines it.
_HOMES = {
    "BACKENDS": "backend",
    "resolve_backend": "backend",
    "new_centroids": "centroids",
    "update_centroids": "centroids",
    "update_centroids_at_slots_triton": "centroids",
    "update_centroids_ref": "centroids",
    "update_centroids_triton": "centroids",
    "block_sparse_decode": "decode",
    "sparse_decode_attention": "decode",
    "sparse_decode_attention_ref": "decode",
    "sparse_decode_attention_triton": "decode",
    "paged_prefill_attention": "prefill",
    "paged_prefill_attention_ref": "prefill",
    "PAGE_SIZE": "pages",
    "num_pages": "pages",
    "DecodeBounds": "inputs",
    "budget_pages": "select",
    "decode_bounds": "inputs",
    "group_mean_query": "inputs",
    "score_blocks": "select",
    "score_blocks_ref": "select",
    "score_blocks_triton": "select",
    "select_blocks": "select",
    "select_blocks_ref": "select",
    "select_blocks_triton": "select",
    "selection_mask_ref": "select",
    "as_paged_cache": "teacher_forced",
    "teacher_forced_attention": "teacher_forced",
    "teacher_forced_attention_ref": "teacher_forced",
    "teacher_forced_attention_triton": "teacher_forced",
    "teacher_forced_selection_ref": "teacher_forced",
    "Workspace": "workspace",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
