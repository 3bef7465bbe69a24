"""A deliberately naive oracle of block-sparse attention, written straight from the rule in DESIGN.md.

Python loops over rows, heads, pages and tokens, float64 arithmetic, no vectorisation and nothing
shared with `kernels` beyond the page size: slow on purpose, so that it is easy to believe. Also
the builders of random paged caches the kernel tests share.
"""

from __future__ import annotations

import math

import torch

PAGE = 16


def pages_of(seq_len: int) -> int:
    return (seq_len + PAGE - 1) // PAGE


def cached_key(cache: torch.Tensor, block_table: torch.Tensor, row: int, head: int, pos: int) -> torch.Tensor:
    """The vector cached for token `pos` of `row` (K or V), looked up through the block table."""
    block_size = cache.shape[2]
    block = int(block_table[row, pos // block_size])
    return cache[block, head, pos % block_size].double()


def centroid(k_cache: torch.Tensor, block_table: torch.Tensor, row: int, head: int, page: int, seq_len: int):
    """Mean of the keys of `page` that are among the row's first `seq_len` tokens."""
    positions = [p for p in range(page * PAGE, (page + 1) * PAGE) if p < seq_len]
    total = sum(cached_key(k_cache, block_table, row, head, p) for p in positions)
    return total / len(positions)


def scores(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens) -> list:
    """scores[row][head][page]: dot(mean of the group's query heads, page centroid), as python floats."""
    rows, hq, _ = q.shape
    h = k_cache.shape[1]
    group = hq // h
    out = []
    for row in range(rows):
        n = int(seq_lens[row])
        per_head = []
        for head in range(h):
            q_mean = sum(q[row, head * group + i].double() for i in range(group)) / group
            per_head.append(
                [float(q_mean @ centroid(k_cache, block_table, row, head, p, n)) for p in range(pages_of(n))]
            )
        out.append(per_head)
    return out


def select(page_scores: list, seq_len: int, budget: int, sink: int = 1, local: int = 2) -> list[int]:
    """Pages kept, ascending: all when they fit the budget, else sink + local + best of the rest."""
    n = pages_of(seq_len)
    if n <= budget:
        return list(range(n))
    middle = list(range(sink, n - local))
    best_first = sorted(middle, key=lambda p: (-page_scores[p], p))
    return sorted(list(range(sink)) + best_first[: budget - sink - local] + list(range(n - local, n)))


def attend(q_vec, keys: list, values: list, scale: float) -> torch.Tensor:
    """softmax(q . k * scale) @ v over explicit lists of vectors, in float64."""
    logits = [float(q_vec.double() @ k) * scale for k in keys]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return sum(w / total * v for w, v in zip(weights, values, strict=True))


def decode(q, k_cache, v_cache, block_table, seq_lens, selected=None, scale=None) -> torch.Tensor:
    """[rows, q_heads, d] float64; `selected[row][head]` lists pages, None for every page."""
    rows, hq, d = q.shape
    h = k_cache.shape[1]
    group = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(rows, hq, d, dtype=torch.float64)
    for row in range(rows):
        n = int(seq_lens[row])
        for qh in range(hq):
            head = qh // group
            pages = range(pages_of(n)) if selected is None else selected[row][head]
            positions = [p for page in pages for p in range(page * PAGE, (page + 1) * PAGE) if p < n]
            keys = [cached_key(k_cache, block_table, row, head, p) for p in positions]
            values = [cached_key(v_cache, block_table, row, head, p) for p in positions]
            out[row, qh] = attend(q[row, qh], keys, values, scale)
    return out


def sparse_decode(q, k_cache, v_cache, block_table, seq_lens, budgets, sink=1, local=2, scale=None):
    """One block-sparse decode step: (output [rows, q_heads, d] float64, selected[row][head] page lists)."""
    page_scores = scores(q, k_cache, block_table, seq_lens)
    selected = [
        [select(s, int(seq_lens[row]), int(budgets[row]), sink, local) for s in page_scores[row]]
        for row in range(q.shape[0])
    ]
    return decode(q, k_cache, v_cache, block_table, seq_lens, selected, scale), selected


def teacher_forced(q, k, v, budgets, sink=1, local=2, scale=None) -> torch.Tensor:
    """[batch, seq, q_heads, d] float64: position t decoded alone over a cache of its first t + 1 tokens."""
    b, t, hq, d = q.shape
    out = torch.zeros(b, t, hq, d, dtype=torch.float64)
    for bi in range(b):
        k_cache = k[bi].transpose(0, 1)[None]  # one block holding the whole sequence
        v_cache = v[bi].transpose(0, 1)[None]
        for pos in range(t):
            lens = torch.tensor([pos + 1])
            table = torch.zeros(1, 1, dtype=torch.int32)
            o, _ = sparse_decode(
                q[bi, pos][None], k_cache, v_cache, table, lens, budgets[bi, pos][None], sink, local, scale
            )
            out[bi, pos] = o[0]
    return out


def as_index_lists(page_indices: torch.Tensor) -> list:
    """int [rows, heads, width] (-1 padded) -> lists of page indices per row and head."""
    return [[[int(p) for p in head if p >= 0] for head in row] for row in page_indices]


def random_paged_cache(seq_lens, kv_heads, head_dim, block_size, seed=0, dtype=torch.float32, spare_blocks=3):
    """k_cache, v_cache, a shuffled block table and seq_lens for rows of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(seq_lens)
    per_row = max(-(-n // block_size) for n in seq_lens)
    total = rows * per_row + spare_blocks
    table = torch.randperm(total, generator=gen)[: rows * per_row].view(rows, per_row).to(torch.int32)
    k_cache = torch.randn(total, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(total, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32)
