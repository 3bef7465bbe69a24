"""Block-sparse attention kernels over a paged KV cache: block scoring, top-k block selection with
sink and local pages, sparse decode attention, and its teacher-forced (training-side) twin.

Every op has a plain-torch reference (`*_ref`, runs anywhere, differentiable where it matters) and
a Triton kernel (`*_triton`, for GPUs); scoring, selection and decode attention also have a C++
CPU extension (`kernels.cpu`) that reads the paged cache in place. The public names dispatch by
`backend` ("auto": Triton for CUDA tensors, the CPU extension for CPU tensors when it builds,
the reference otherwise). This package imports nothing else of the project.
"""

from .backend import BACKENDS, resolve_backend
from .centroids import (
    new_centroids,
    update_centroids,
    update_centroids_at_slots_triton,
    update_centroids_ref,
    update_centroids_triton,
)
from .decode import (
    block_sparse_decode,
    sparse_decode_attention,
    sparse_decode_attention_ref,
    sparse_decode_attention_triton,
)
from .layout import PAGE_SIZE, num_pages
from .select import (
    DecodeBounds,
    budget_pages,
    decode_bounds,
    group_mean_query,
    score_blocks,
    score_blocks_ref,
    score_blocks_triton,
    select_blocks,
    select_blocks_ref,
    select_blocks_triton,
    selection_mask_ref,
)
from .teacher_forced import (
    as_paged_cache,
    teacher_forced_attention,
    teacher_forced_attention_ref,
    teacher_forced_attention_triton,
    teacher_forced_selection_ref,
)
from .workspace import Workspace

__all__ = [
    "BACKENDS",
    "DecodeBounds",
    "PAGE_SIZE",
    "resolve_backend",
    "Workspace",
    "as_paged_cache",
    "block_sparse_decode",
    "budget_pages",
    "decode_bounds",
    "group_mean_query",
    "new_centroids",
    "num_pages",
    "score_blocks",
    "score_blocks_ref",
    "score_blocks_triton",
    "select_blocks",
    "select_blocks_ref",
    "select_blocks_triton",
    "selection_mask_ref",
    "sparse_decode_attention",
    "sparse_decode_attention_ref",
    "sparse_decode_attention_triton",
    "teacher_forced_attention",
    "teacher_forced_attention_ref",
    "teacher_forced_attention_triton",
    "teacher_forced_selection_ref",
    "update_centroids",
    "update_centroids_at_slots_triton",
    "update_centroids_ref",
    "update_centroids_triton",
]
