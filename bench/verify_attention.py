"""A speculative verify's attention on this machine: k + 1 query tokens a row, dense and causal over the row's
paged KV cache, two ways on the same data in one run.

`copy + SDPA` copies each row's prefix out of the pages and runs torch's SDPA (the plugin's path for long
prefill chunks and narrow keys); `in place` is the CPU extension's paged prefill kernel, which reads each page
once for all of a row's query tokens. Each timed iteration starts with a cold cache, as in `bench.attention`.
The plugin picks between the two by the width of a token's keys (`IN_PLACE_MIN_KV_WIDTH`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from bench.attention import _FLUSH_BYTES, _timed
from kernels import paged_prefill_attention, paged_prefill_attention_ref


@dataclass
class VerifyBenchResult:
    context: int
    batch: int
    query_tokens: int
    kv_heads: int
    q_heads: int
    head_dim: int
    threads: int
    copy_sdpa_ms: float
    in_place_ms: float
    speedup: float
    max_abs_diff: float

    def to_dict(self) -> dict:
        return asdict(self)


def run_verify_bench(
    context: int = 8192,
    batch: int = 8,
    query_tokens: int = 7,
    kv_heads: int = 8,
    q_heads: int = 32,
    head_dim: int = 128,
    iters: int = 5,
) -> VerifyBenchResult:
    """Time both ways of a verify's attention over `batch` rows of `context` cached tokens (float32)."""
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if not 1 <= query_tokens <= context:
        raise ValueError(f"query tokens must be in [1, context = {context}], got {query_tokens}")
    gen = torch.Generator().manual_seed(0)
    per_row = -(-context // 16)
    num_blocks = batch * per_row
    k_cache = torch.randn(num_blocks, kv_heads, 16, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, kv_heads, 16, head_dim, generator=gen)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, per_row).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(0, batch * query_tokens + 1, query_tokens, dtype=torch.int32)
    q = torch.randn(batch * query_tokens, q_heads, head_dim, generator=gen)

    def copy_sdpa() -> torch.Tensor:
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_table, seq_lens, starts)

    def in_place() -> torch.Tensor:
        return paged_prefill_attention(q, k_cache, v_cache, block_table, seq_lens, starts, backend="cpu")

    diff = float((copy_sdpa() - in_place()).abs().max())
    flush = torch.zeros(_FLUSH_BYTES // 4)
    copy_ms = _timed(copy_sdpa, iters, 1, flush)
    place_ms = _timed(in_place, iters, 1, flush)
    return VerifyBenchResult(
        context=context,
        batch=batch,
        query_tokens=query_tokens,
        kv_heads=kv_heads,
        q_heads=q_heads,
        head_dim=head_dim,
        threads=torch.get_num_threads(),
        copy_sdpa_ms=copy_ms,
        in_place_ms=place_ms,
        speedup=copy_ms / place_ms,
        max_abs_diff=diff,
    )
