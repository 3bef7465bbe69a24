"""The CPU extension: page scoring and sparse decode attention that read the paged cache in place.

Built on first use with torch's C++ extension loader (about a minute; cached afterwards). Where it
cannot be built, `cpu_extension()` returns None and callers use the torch reference instead. It
parallelises with torch's own thread pool (at::parallel_for), so `torch.set_num_threads` governs
it and no second OpenMP runtime competes with torch's; OpenMP is used for SIMD hints only.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path

import torch

from .inputs import check_decode_inputs, check_selection_inputs, group_mean_query
from .layout import check_centroids, check_paged_cache

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_sparse_attention.cpp"


@functools.cache
def cpu_extension():
    """The compiled extension module, or None when it cannot be built here (the reason is logged)."""
    if os.environ.get("SPARROW_NO_CPU_EXTENSION") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="sparrow_cpu_sparse_attention",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja must not take the torch path down with it
        log.warning("CPU sparse-attention extension unavailable, using the torch path: %s", exc)
        return None


def score_blocks_cpu(
    q: torch.Tensor,
    centroids: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `score_blocks_ref`, computed by the CPU extension."""
    check_paged_cache(k_cache, None, block_table, seq_lens)
    check_centroids(centroids, k_cache)
    qm = group_mean_query(q, centroids.shape[1])
    return cpu_extension().score_pages(qm, centroids.contiguous(), block_table, seq_lens, k_cache.shape[2])


def sparse_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_indices: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `sparse_decode_attention_ref`, computed by the CPU extension (no gradients)."""
    check_paged_cache(k_cache, v_cache, block_table, seq_lens)
    check_decode_inputs(q, k_cache, page_indices)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    out = cpu_extension().sparse_decode(
        q,
        k_cache.contiguous(),
        v_cache.contiguous(),
        block_table,
        seq_lens,
        page_indices,
        float(scale),
    )
    return out.to(q.dtype)


def select_blocks_cpu(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
) -> torch.Tensor:
    """Same contract as `select_blocks_ref` (bit-identical selection), computed by the CPU extension."""
    check_selection_inputs(scores, seq_lens, budgets, sink, local)
    return cpu_extension().select_pages(scores.float(), seq_lens, budgets, sink, local)
