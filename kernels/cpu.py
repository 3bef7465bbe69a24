"""The CPU extension: page scoring and sparse decode attention that read the paged cache in place.

Built on first use with torch's C++ extension loader (about a minute; cached afterwards). Where it
cannot be built, `cpu_extension()` returns None and callers use the torch reference instead. It
parallelises with torch's own thread pool (at::parallel_for), so `torch.set_num_threads` governs
it and no second OpenMP runtime competes with torch's; OpenMP is used for SIMD hints only.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import math
import os
import sys
from pathlib import Path

import torch

from .inputs import check_decode_inputs, check_prefill_inputs, check_selection_inputs, group_mean_query
from .layout import check_centroids, check_paged_cache

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_sparse_attention.cpp"


_NAME = "sparrow_cpu_sparse_attention"


@functools.cache
def cpu_extension():
    """The compiled extension module, or None when it cannot be built here (the reason is logged).

    torch's loader guards a build with a `lock` file that only the build removes: a process killed while it
    compiles (a test's timeout, an OOM kill, a pod stopped during its first start) leaves it behind, and every
    later load waits on it for ever, without a word. So the build runs under an flock of our own, which the
    kernel releases when its holder dies; whoever holds it is the only one that may be building, and removes
    a `lock` file it finds as left by a build that died.
    """
    if os.environ.get("SPARROW_NO_CPU_EXTENSION") == "1":
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        # One folder per checkout: the build's commands name the source's path, so two checkouts sharing one
        # folder would rebuild it each time the other loaded it.
        where = hashlib.sha256(str(_SOURCE).encode()).hexdigest()[:10]
        build = root / f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{where}" / _NAME
        build.mkdir(parents=True, exist_ok=True)
        with (build / "build.flock").open("a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build of the CPU extension that did not finish", stale)
                stale.unlink(missing_ok=True)
            return load(
                name=_NAME,
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                build_directory=str(build),
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


def paged_prefill_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `paged_prefill_attention_ref`, computed by the CPU extension (no gradients)."""
    check_paged_cache(k_cache, v_cache, block_table, seq_lens)
    check_prefill_inputs(q, k_cache, seq_lens, query_start_loc)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    out = cpu_extension().paged_prefill(
        q, k_cache.contiguous(), v_cache.contiguous(), block_table, seq_lens, query_start_loc, float(scale)
    )
    return out.to(q.dtype)
