"""Inputs a caller can get wrong raise ValueError with a message that says what is wrong."""

import kernel_oracle as oracle
import pytest
import torch

from kernels import (
    block_sparse_decode,
    budget_pages,
    new_centroids,
    score_blocks,
    select_blocks,
    sparse_decode_attention,
    sparse_decode_attention_triton,
    teacher_forced_attention,
    update_centroids,
)

BACKENDS = ["torch", "triton"]


def _cache(block_size=16, kv_heads=2, head_dim=16):
    return oracle.random_paged_cache([20, 70], kv_heads, head_dim, block_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_rejects_bad_shapes(backend):
    k_cache, v_cache, table, lens = _cache()
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="q must be"):
        sparse_decode_attention(q[0], k_cache, v_cache, table, lens, backend=backend)
    with pytest.raises(ValueError, match="cannot share"):
        sparse_decode_attention(torch.randn(2, 3, 16), k_cache, v_cache, table, lens, backend=backend)
    with pytest.raises(ValueError, match="rows but seq_lens"):
        sparse_decode_attention(torch.randn(3, 4, 16), k_cache, v_cache, table, lens, backend=backend)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, table, lens, backend=backend)
    with pytest.raises(ValueError, match="k_cache must be"):
        sparse_decode_attention(q, k_cache[0], v_cache[0], table, lens, backend=backend)
    with pytest.raises(ValueError, match="v_cache shape"):
        sparse_decode_attention(q, k_cache, v_cache[:, :1], table, lens, backend=backend)
    with pytest.raises(ValueError, match="page_indices must be"):
        sparse_decode_attention(q, k_cache, v_cache, table, lens, torch.zeros(2, 3, 1).int(), backend=backend)
    with pytest.raises(ValueError, match="room for"):
        sparse_decode_attention(q, k_cache, v_cache, table, torch.tensor([20, 500]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_size_must_be_a_multiple_of_the_page(backend):
    k_cache = torch.randn(4, 2, 24, 16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple of the page size"):
        sparse_decode_attention(torch.randn(1, 2, 16), k_cache, k_cache, table, torch.tensor([30]), backend=backend)
    with pytest.raises(ValueError, match="not a multiple of the page size"):
        update_centroids(k_cache, torch.zeros(4, 2, 1, 16), table, torch.tensor([30]), backend=backend)


def test_budgets_in_tokens_must_be_page_aligned():
    assert budget_pages(torch.tensor([512, 4096])).tolist() == [32, 256]
    with pytest.raises(ValueError, match="multiples of 16"):
        budget_pages(torch.tensor([512, 100]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_selection_rejects_bad_budgets(backend):
    scores = torch.randn(2, 2, 5)
    lens = torch.tensor([80, 20])
    with pytest.raises(ValueError, match="cannot hold the sink and local pages"):
        select_blocks(scores, lens, torch.tensor([2, 2]), backend=backend)
    # A row that fits its budget is dense, so a small budget is fine there.
    assert select_blocks(scores, lens, torch.tensor([3, 2]), backend=backend).shape == (2, 2, 3)
    with pytest.raises(ValueError, match="must match"):
        select_blocks(scores, lens, torch.tensor([3, 3, 3]), backend=backend)
    with pytest.raises(ValueError, match="scores hold 5 pages"):
        select_blocks(scores, torch.tensor([200, 20]), torch.tensor([3, 3]), backend=backend)
    with pytest.raises(ValueError, match=">= 0"):
        select_blocks(scores, lens, torch.tensor([3, 3]), sink=-1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scoring_rejects_mismatched_heads(backend):
    k_cache, v_cache, table, lens = _cache()
    cents = new_centroids(k_cache)
    with pytest.raises(ValueError, match="cannot share"):
        score_blocks(torch.randn(2, 3, 16), cents, k_cache, table, lens, backend=backend)
    with pytest.raises(ValueError, match="centroids must have shape"):
        score_blocks(torch.randn(2, 4, 16), cents[:, :1], k_cache, table, lens, backend=backend)
    with pytest.raises(ValueError, match="q must be"):
        score_blocks(torch.randn(3, 4, 16), cents, k_cache, table, lens, backend=backend)
    with pytest.raises(ValueError, match="cannot share"):
        block_sparse_decode(
            torch.randn(2, 3, 16), k_cache, v_cache, cents, table, lens, torch.tensor([3, 3]), backend=backend
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_forced_rejects_bad_inputs(backend):
    q, k, v = torch.randn(1, 40, 4, 16), torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
    budgets = torch.full((1, 40), 4)
    with pytest.raises(ValueError, match="budgets must be"):
        teacher_forced_attention(q, k, v, budgets[:, :10], backend=backend)
    with pytest.raises(ValueError, match="cannot share"):
        teacher_forced_attention(torch.randn(1, 40, 3, 16), k, v, budgets, backend=backend)
    with pytest.raises(ValueError, match="must be \\[batch"):
        teacher_forced_attention(q[0], k[0], v[0], budgets, backend=backend)
    with pytest.raises(ValueError, match="local >= 1"):
        teacher_forced_attention(q, k, v, budgets, local=0, backend=backend)
    with pytest.raises(ValueError, match="cannot hold the sink and local pages"):
        teacher_forced_attention(q, k, v, torch.full((1, 40), 2), backend=backend)


def test_unknown_backend():
    k_cache, v_cache, table, lens = _cache()
    with pytest.raises(ValueError, match="unknown kernel backend"):
        sparse_decode_attention(torch.randn(2, 4, 16), k_cache, v_cache, table, lens, backend="cuda")


def test_triton_wrappers_check_dtypes_and_strides():
    k_cache, v_cache, table, lens = _cache()
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="share one dtype"):
        sparse_decode_attention_triton(q, k_cache, v_cache.half(), table, lens)
    with pytest.raises(ValueError, match="share one dtype"):
        sparse_decode_attention_triton(q, k_cache.int(), v_cache.int(), table, lens)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        sparse_decode_attention_triton(torch.randn(2, 16, 4).transpose(1, 2), k_cache, v_cache, table, lens)
    with pytest.raises(ValueError, match="page_indices must be int32 or int64"):
        sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, torch.zeros(2, 2, 1))
    with pytest.raises(ValueError, match="num_splits"):
        sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, num_splits=0)
    with pytest.raises(ValueError, match="block_n"):
        sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, block_n=24)
    with pytest.raises(ValueError, match="float32"):
        score_blocks(q, new_centroids(k_cache).double(), k_cache, table, lens, backend="triton")
    with pytest.raises(ValueError, match="float32"):
        update_centroids(k_cache, new_centroids(k_cache).half(), table, lens, backend="triton")
    with pytest.raises(ValueError, match="prev_lens must be >= 0"):
        update_centroids(k_cache, new_centroids(k_cache), table, lens, torch.tensor([-1, 0]), backend="triton")
    with pytest.raises(ValueError, match="float32"):
        select_blocks(torch.randn(2, 2, 5).double(), lens, torch.tensor([3, 3]), backend="triton")
