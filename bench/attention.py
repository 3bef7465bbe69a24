"""Dense vs block-sparse decode attention on this machine: same data, one run.

A batch of sequences sits in a paged KV cache with a shuffled block table, as an engine leaves it.
Dense attends over every cached key, timed two ways, and the faster one is the baseline: torch's
SDPA over a contiguous copy (the most favourable layout for dense: no paging) and the sparse
backend's own decode kernel with every page selected (the paged cache read in place). Sparse runs
the whole decode-time path: the centroid update for the token just written, block scoring, top-k
selection with sink and local blocks, and attention over the selected pages. The bound is the
ratio of KV bytes each reads (centroids counted on the sparse side): what a purely memory-bound
implementation could reach.

Every timed iteration starts with a cold cache (a buffer larger than the last-level cache is
touched first, untimed): in an engine, all the other layers run between two decode steps of a
layer, so nothing of it is still cached. Without this the sparse side, whose working set fits in a
large L3, would look better than it is.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kernels import (
    PAGE_SIZE,
    Workspace,
    block_sparse_decode,
    new_centroids,
    resolve_backend,
    sparse_decode_attention,
    update_centroids,
)


@dataclass
class AttentionBenchResult:
    context: int
    budget: int
    batch: int
    kv_heads: int
    q_heads: int
    head_dim: int
    dtype: str
    threads: int
    dense_ms: float
    dense_sdpa_ms: float
    dense_paged_ms: float
    sparse_ms: float
    speedup: float
    kv_bytes_dense: int
    kv_bytes_sparse: int
    bound: float
    fraction_of_bound: float
    max_abs_diff_full_budget: float
    backend: str

    def to_dict(self) -> dict:
        return asdict(self)


_FLUSH_BYTES = 512 * 2**20  # more than the largest last-level cache of the machines this runs on


def _timed(fn, iters: int, warmup: int, flush: torch.Tensor) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_attention_bench(
    context: int = 32768,
    budget: int = 2048,
    batch: int = 8,
    kv_heads: int = 8,
    q_heads: int = 16,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    iters: int = 10,
    warmup: int = 2,
    seed: int = 0,
    backend: str = "auto",
) -> AttentionBenchResult:
    """Time dense and sparse decode attention for one decode step of `batch` sequences of `context` tokens."""
    if budget % PAGE_SIZE or budget <= 0:
        raise ValueError(f"budget must be a positive multiple of {PAGE_SIZE} tokens, got {budget}")
    if context % block_size:
        raise ValueError(f"context must be a multiple of the block size {block_size}")
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} KV heads evenly")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, q_heads, head_dim, generator=gen, dtype=dtype)
    group = q_heads // kv_heads

    # Dense reads a contiguous [batch, kv_heads, context, head_dim] copy in place.
    order = block_table.long()
    k_dense = k_cache[order].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, context, head_dim).contiguous()
    v_dense = v_cache[order].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, context, head_dim).contiguous()
    qg = q.view(batch, kv_heads, group, head_dim)
    scale = head_dim**-0.5

    def dense_sdpa() -> torch.Tensor:
        # The group's query heads are the "query length" of one SDPA call per KV head: no repeat of K/V.
        out = torch.nn.functional.scaled_dot_product_attention(qg, k_dense, v_dense, scale=scale)
        return out.reshape(batch, q_heads, head_dim)

    def dense_paged() -> torch.Tensor:
        return sparse_decode_attention(q, k_cache, v_cache, block_table, seq_lens, None, scale, backend=backend)

    centroids = new_centroids(k_cache)
    backend = resolve_backend(backend, q)
    update_centroids(k_cache, centroids, block_table, seq_lens, backend=backend)
    workspace = Workspace()
    budgets = torch.full((batch,), budget // PAGE_SIZE, dtype=torch.int32)
    prev_lens = seq_lens - 1

    def sparse(pages: torch.Tensor = budgets) -> torch.Tensor:
        update_centroids(k_cache, centroids, block_table, seq_lens, prev_lens, backend=backend)
        out, _ = block_sparse_decode(
            q, k_cache, v_cache, centroids, block_table, seq_lens, pages, workspace=workspace, backend=backend
        )
        return out

    full = torch.full((batch,), blocks_per_seq * block_size // PAGE_SIZE, dtype=torch.int32)
    reference = dense_sdpa()
    diff = max((impl - reference).abs().max().item() for impl in (sparse(full), dense_paged()))

    flush = torch.zeros(_FLUSH_BYTES // 4)
    dense_sdpa_ms = _timed(dense_sdpa, iters, warmup, flush)
    dense_paged_ms = _timed(dense_paged, iters, warmup, flush)
    dense_ms = min(dense_sdpa_ms, dense_paged_ms)
    sparse_ms = _timed(sparse, iters, warmup, flush)

    elt = k_cache.element_size()
    per_head_dense = context * head_dim * elt * 2
    per_head_sparse = min(budget, context) * head_dim * elt * 2 + (context // PAGE_SIZE) * head_dim * 4
    kv_dense = batch * kv_heads * per_head_dense
    kv_sparse = batch * kv_heads * per_head_sparse
    bound = kv_dense / kv_sparse
    speedup = dense_ms / sparse_ms
    return AttentionBenchResult(
        context=context,
        budget=budget,
        batch=batch,
        kv_heads=kv_heads,
        q_heads=q_heads,
        head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        dense_ms=round(dense_ms, 3),
        dense_sdpa_ms=round(dense_sdpa_ms, 3),
        dense_paged_ms=round(dense_paged_ms, 3),
        sparse_ms=round(sparse_ms, 3),
        speedup=round(speedup, 3),
        kv_bytes_dense=kv_dense,
        kv_bytes_sparse=kv_sparse,
        bound=round(bound, 3),
        fraction_of_bound=round(speedup / bound, 3),
        max_abs_diff_full_budget=diff,
        backend=backend,
    )
