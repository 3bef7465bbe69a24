"""The plain-torch references against the naive oracle in `kernel_oracle`."""

import kernel_oracle as oracle
import pytest
import torch

from kernels import (
    PAGE_SIZE,
    block_sparse_decode,
    new_centroids,
    score_blocks_ref,
    selection_mask_ref,
    sparse_decode_attention_ref,
    teacher_forced_attention_ref,
    teacher_forced_selection_ref,
    update_centroids_ref,
)

# Rows of 1, 3, 7 and 11 pages: dense, exactly at the budget, sparse with 2 and with 3 top-k pages.
LENS = [5, 37, 100, 161]
BUDGETS = [3, 3, 5, 6]


def _query(rows, q_heads, head_dim, seed=1):
    return torch.randn(rows, q_heads, head_dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block_size", [16, 64])
def test_centroids_match_oracle_full_and_incremental(block_size):
    k_cache, _, table, lens = oracle.random_paged_cache(LENS, 2, 8, block_size)
    full = new_centroids(k_cache)
    update_centroids_ref(k_cache, full, table, lens)
    # Appending one token at a time rewrites the touched page only; it must end where a full pass does.
    step = new_centroids(k_cache)
    prev = torch.ones_like(lens)
    update_centroids_ref(k_cache, step, table, prev)
    for length in range(2, max(LENS) + 1):
        now = torch.minimum(torch.full_like(lens, length), lens)
        update_centroids_ref(k_cache, step, table, now, prev)
        prev = now
    per_block = block_size // PAGE_SIZE
    for row, n in enumerate(LENS):
        for head in range(2):
            for page in range(oracle.pages_of(n)):
                block = int(table[row, page // per_block])
                want = oracle.centroid(k_cache, table, row, head, page, n).float()
                torch.testing.assert_close(full[block, head, page % per_block], want, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(step[block, head, page % per_block], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_scores_match_oracle(block_size, group):
    k_cache, _, table, lens = oracle.random_paged_cache(LENS, 2, 8, block_size)
    cents = new_centroids(k_cache)
    update_centroids_ref(k_cache, cents, table, lens)
    q = _query(len(LENS), 2 * group, 8)
    got = score_blocks_ref(q, cents, k_cache, table, lens)
    want = oracle.scores(q, k_cache, table, lens)
    assert got.shape == (len(LENS), 2, oracle.pages_of(max(LENS)))
    for row, n in enumerate(LENS):
        n_pages = oracle.pages_of(n)
        for head in range(2):
            torch.testing.assert_close(
                got[row, head, :n_pages].double(),
                torch.tensor(want[row][head], dtype=torch.float64),
                atol=1e-5,
                rtol=1e-5,
            )
            assert torch.isneginf(got[row, head, n_pages:]).all()


@pytest.mark.parametrize("sink,local", [(1, 2), (0, 1), (2, 3)])
def test_selection_matches_oracle_with_ties(sink, local):
    gen = torch.Generator().manual_seed(7)
    rows, heads, max_pages = 300, 2, 40
    # Few distinct values, so most rows hold ties at the k-th score.
    scores = torch.randint(0, 4, (rows, heads, max_pages), generator=gen).float()
    lens = torch.randint(1, max_pages * PAGE_SIZE + 1, (rows,), generator=gen)
    budgets = torch.randint(sink + local, 24, (rows,), generator=gen)
    mask = selection_mask_ref(scores, lens, budgets, sink, local)
    for row in range(rows):
        for head in range(heads):
            want = oracle.select(scores[row, head].tolist(), int(lens[row]), int(budgets[row]), sink, local)
            assert mask[row, head].nonzero().flatten().tolist() == want, (row, head)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_sparse_decode_matches_oracle(block_size, group):
    k_cache, v_cache, table, lens = oracle.random_paged_cache(LENS, 2, 8, block_size)
    cents = new_centroids(k_cache)
    update_centroids_ref(k_cache, cents, table, lens)
    q = _query(len(LENS), 2 * group, 8)
    budgets = torch.tensor(BUDGETS)
    out, pages = block_sparse_decode(q, k_cache, v_cache, cents, table, lens, budgets, backend="torch")
    want, want_pages = oracle.sparse_decode(q, k_cache, v_cache, table, lens, budgets)
    assert oracle.as_index_lists(pages) == want_pages
    assert pages.shape[2] == max(min(oracle.pages_of(n), k) for n, k in zip(LENS, BUDGETS, strict=True))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 64])
def test_dense_decode_matches_oracle(block_size):
    k_cache, v_cache, table, lens = oracle.random_paged_cache(LENS, 2, 8, block_size)
    q = _query(len(LENS), 4, 8)
    out = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens, scale=0.3)
    torch.testing.assert_close(
        out.double(), oracle.decode(q, k_cache, v_cache, table, lens, scale=0.3), atol=1e-5, rtol=1e-5
    )


def _sequences(b, t, q_heads, kv_heads, d, seed=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, q_heads, d, generator=gen, dtype=dtype)
    k = torch.randn(b, t, kv_heads, d, generator=gen, dtype=dtype)
    v = torch.randn(b, t, kv_heads, d, generator=gen, dtype=dtype)
    return q, k, v


def _schedule(b, t):
    """Per-position budgets in pages: a different non-decreasing schedule per sequence."""
    pos = torch.arange(t)
    return torch.stack([torch.where(pos < 40, 3, 4), torch.where(pos < 60, 3, 5)][:b])


@pytest.mark.parametrize("group", [1, 2])
def test_teacher_forced_matches_oracle(group):
    q, k, v = _sequences(2, 90, 2 * group, 2, 8)
    budgets = _schedule(2, 90)
    out = teacher_forced_attention_ref(q, k, v, budgets, chunk=32)
    torch.testing.assert_close(out.double(), oracle.teacher_forced(q, k, v, budgets), atol=1e-5, rtol=1e-5)


def test_budget_covering_the_sequence_is_dense():
    k_cache, v_cache, table, lens = oracle.random_paged_cache(LENS, 2, 8, 16)
    cents = new_centroids(k_cache)
    update_centroids_ref(k_cache, cents, table, lens)
    q = _query(len(LENS), 4, 8)
    dense = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens)
    for budgets in (torch.tensor([oracle.pages_of(n) for n in LENS]), torch.full((len(LENS),), 10_000)):
        out, _ = block_sparse_decode(q, k_cache, v_cache, cents, table, lens, budgets, backend="torch")
        torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)

    q, k, v = _sequences(2, 50, 4, 2, 8)
    out = teacher_forced_attention_ref(q, k, v, torch.full((2, 50), 4))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_teacher_forced_gradients_match_a_masked_dense_attention():
    q, k, v = _sequences(2, 70, 4, 2, 8, dtype=torch.float64)
    budgets = _schedule(2, 70)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    weights = torch.randn(2, 70, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (teacher_forced_attention_ref(*leaves, budgets, chunk=16) * weights).sum().backward()

    # The same selection spelled out as a token mask, then plain masked softmax attention.
    selected = teacher_forced_selection_ref(q, k, budgets)  # [b, t, kv_heads, pages]
    allowed = selected[..., torch.arange(70) // PAGE_SIZE]  # [b, t, kv_heads, keys]
    allowed &= torch.ones(70, 70, dtype=torch.bool).tril()[None, :, None, :]
    allowed = allowed.repeat_interleave(2, dim=2)  # per query head
    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    kk, vv = (x.repeat_interleave(2, dim=2) for x in plain[1:])
    logits = torch.einsum("bthd,bshd->bths", plain[0], kk) / 8**0.5
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    (torch.einsum("bths,bshd->bthd", probs, vv) * weights).sum().backward()
    for got, want in zip(leaves, plain, strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-10, rtol=1e-8)


def test_teacher_forced_gradcheck_tiny():
    # 5 pages under a budget of 4 from position 64 on: one page chosen by score.
    q, k, v = _sequences(1, 70, 2, 1, 4, dtype=torch.float64)
    budgets = torch.full((1, 70), 4)
    inputs = tuple(x.requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a, b, c: teacher_forced_attention_ref(a, b, c, budgets), inputs, fast_mode=True
    )
