"""Every Triton kernel against its torch reference, float32 (under TRITON_INTERPRET=1 without a GPU).

Tolerances: centroids 1e-6, scores and attention outputs 1e-5 (absolute and relative); selection
must be identical for the same scores.
"""

import kernel_oracle as oracle
import pytest
import torch

from kernels import (
    PAGE_SIZE,
    DecodeBounds,
    Workspace,
    block_sparse_decode,
    decode_bounds,
    new_centroids,
    score_blocks_ref,
    score_blocks_triton,
    select_blocks,
    select_blocks_ref,
    select_blocks_triton,
    sparse_decode_attention,
    sparse_decode_attention_ref,
    sparse_decode_attention_triton,
    teacher_forced_attention,
    teacher_forced_attention_ref,
    teacher_forced_attention_triton,
    update_centroids_at_slots_triton,
    update_centroids_ref,
    update_centroids_triton,
)

LENS = [5, 37, 100, 161]
BUDGETS = [3, 3, 5, 6]
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _setup(block_size, group, head_dim=24, kv_heads=2, lens=LENS, seed=0):
    k_cache, v_cache, table, seq_lens = oracle.random_paged_cache(lens, kv_heads, head_dim, block_size, seed)
    cents = new_centroids(k_cache)
    update_centroids_ref(k_cache, cents, table, seq_lens)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return q, k_cache, v_cache, cents, table, seq_lens


@pytest.mark.parametrize("block_size", [16, 64])
def test_update_centroids(block_size):
    _, k_cache, _, want, table, lens = _setup(block_size, 1)
    got = torch.full_like(want, 7.0)
    update_centroids_triton(k_cache, got, table, lens)
    torch.testing.assert_close(got, torch.where(want == 0, 7.0, want), atol=1e-6, rtol=1e-6)

    # Incremental: rows grow by different amounts, from the middle of a page and across pages.
    prev = torch.tensor([3, 20, 96, 150], dtype=torch.int32)
    ref, tri = new_centroids(k_cache), new_centroids(k_cache)
    update_centroids_ref(k_cache, ref, table, prev)
    update_centroids_triton(k_cache, tri, table, prev)
    update_centroids_ref(k_cache, ref, table, lens, prev)
    update_centroids_triton(k_cache, tri, table, lens, prev.long())
    torch.testing.assert_close(tri, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_size", [16, 64])
def test_update_centroids_at_slots(block_size):
    # The engine's upkeep: the last slot written to each page (vLLM's slot_mapping, -1 padding).
    _, k_cache, _, want, table, lens = _setup(block_size, 1)
    rows = torch.arange(len(LENS)).repeat_interleave(lens.long())
    positions = torch.cat([torch.arange(n) for n in LENS])
    slots = table.long()[rows, positions // block_size] * block_size + positions % block_size
    last_of_page = (positions % PAGE_SIZE == PAGE_SIZE - 1) | (positions == lens.long()[rows] - 1)
    got = torch.full_like(want, 7.0)
    update_centroids_at_slots_triton(k_cache, got, torch.cat([slots[last_of_page], torch.full((3,), -1)]))
    torch.testing.assert_close(got, torch.where(want == 0, 7.0, want), atol=1e-6, rtol=1e-6)

    # A decode step: one slot per row, mid-page; only those pages change, to their keys so far.
    before = got.clone()
    at = torch.tensor([2, 17, 90, 150])
    step = table.long()[torch.arange(4), at // block_size] * block_size + at % block_size
    update_centroids_at_slots_triton(k_cache, got, step.to(torch.int32))
    grown = new_centroids(k_cache)
    update_centroids_ref(k_cache, grown, table, (at + 1).to(torch.int32), (at // PAGE_SIZE * PAGE_SIZE).to(torch.int32))
    changed = torch.zeros(got.shape[:3], dtype=torch.bool)
    changed[step // block_size, :, (step % block_size) // PAGE_SIZE] = True
    torch.testing.assert_close(got[changed], grown[changed], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[~changed], before[~changed])
    with pytest.raises(ValueError, match="1-D integer"):
        update_centroids_at_slots_triton(k_cache, got, step.float())


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_score_blocks(block_size, group):
    q, k_cache, _, cents, table, lens = _setup(block_size, group)
    want = score_blocks_ref(q, cents, k_cache, table, lens)
    got = score_blocks_triton(q, cents, k_cache, table, lens.long())
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], **TOL)


def _tied_scores(rows, heads, max_pages, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-2, 3, (rows, heads, max_pages), generator=gen).float()
    # Both zeros compare equal as floats and must tie; -inf and huge values must order too.
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    scores[scores == 2] = float("-inf")
    scores[scores == -2] = -3.0e38
    return scores


@pytest.mark.parametrize("sink,local", [(1, 2), (0, 1), (2, 3)])
def test_select_blocks_bit_identical(sink, local):
    gen = torch.Generator().manual_seed(11)
    rows, heads, max_pages = 48, 2, 40
    scores = _tied_scores(rows, heads, max_pages, 12)
    lens = torch.randint(1, max_pages * PAGE_SIZE + 1, (rows,), generator=gen)
    budgets = torch.randint(sink + local, 30, (rows,), generator=gen)
    lens[:4] = max_pages * PAGE_SIZE  # the longest rows
    budgets[:4] = torch.tensor([sink + local, 1000, max_pages, max_pages - 1])
    want = select_blocks_ref(scores, lens, budgets, sink, local)
    got = select_blocks_triton(scores, lens.int(), budgets, sink, local)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_select_blocks_many_pages_and_random_scores():
    gen = torch.Generator().manual_seed(13)
    rows, heads, max_pages = 6, 2, 700
    scores = torch.randn(rows, heads, max_pages, generator=gen)
    scores[:, :, ::7] = scores[:, :, 3:4]  # ties spread over the row
    lens = torch.tensor([max_pages * PAGE_SIZE, 5000, 3000, 700, 16, 1])
    budgets = torch.tensor([256, 32, 300, 10, 3, 3])
    assert torch.equal(select_blocks_triton(scores, lens, budgets), select_blocks_ref(scores, lens, budgets))


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_sparse_decode_attention(block_size, group):
    q, k_cache, v_cache, cents, table, lens = _setup(block_size, group)
    scores = score_blocks_ref(q, cents, k_cache, table, lens)
    pages = select_blocks_ref(scores, lens, torch.tensor(BUDGETS))
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens, pages)
    for num_splits, block_n in [(1, 64), (3, 16), (8, 32)]:
        got = sparse_decode_attention_triton(
            q, k_cache, v_cache, table, lens, pages, num_splits=num_splits, block_n=block_n
        )
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("block_size", [16, 64])
def test_dense_decode_attention(block_size):
    q, k_cache, v_cache, _, table, lens = _setup(block_size, 2)
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens, scale=0.25)
    for num_splits in (1, 4):
        got = sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, scale=0.25, num_splits=num_splits)
        torch.testing.assert_close(got, want, **TOL)


def test_half_precision_cache():
    # float16 exercises the 16-bit path (operands cast for tl.dot, probabilities rounded to the cache
    # dtype, output in q's dtype); bfloat16 is broken in the interpreter. Against float32 on the same
    # rounded inputs, so the tolerance is float16 rounding of the probabilities and the output.
    q, k_cache, v_cache, cents, table, lens = _setup(16, 2, head_dim=32)
    q, k_cache, v_cache = q.half(), k_cache.half(), v_cache.half()
    pages = select_blocks_ref(score_blocks_ref(q, cents, k_cache, table, lens), lens, torch.tensor(BUDGETS))
    want = sparse_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), table, lens, pages)
    got = sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, pages, num_splits=2)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_decode_skips_padding_anywhere_and_reuses_workspace():
    q, k_cache, v_cache, _, table, lens = _setup(16, 2)
    pages = torch.tensor([[0, -1, -1], [2, -1, 0], [6, 3, 1], [-1, 10, 4]]).int()[:, None].expand(4, 2, 3)
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens, pages)
    ws = Workspace()
    for _ in range(2):
        got = sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, pages.long(), workspace=ws, num_splits=2)
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("group", [1, 4])
def test_block_sparse_decode(group):
    q, k_cache, v_cache, cents, table, lens = _setup(64, group)
    budgets = torch.tensor(BUDGETS)
    want, want_pages = block_sparse_decode(q, k_cache, v_cache, cents, table, lens, budgets, backend="torch")
    got, got_pages = block_sparse_decode(q, k_cache, v_cache, cents, table, lens, budgets, backend="triton")
    assert torch.equal(got_pages, want_pages)
    torch.testing.assert_close(got, want, **TOL)


def test_host_bounds_give_the_same_step_and_upper_bounds_are_safe():
    # What the CUDA engine passes so that a step reads nothing back from the GPU: exact bounds give
    # the very same scores, selection and output; bounds above the data only widen the padding.
    q, k_cache, v_cache, cents, table, lens = _setup(64, 2)
    budgets = torch.tensor(BUDGETS)
    want, want_pages = block_sparse_decode(q, k_cache, v_cache, cents, table, lens, budgets, backend="triton")
    exact = decode_bounds(LENS, BUDGETS, 1, 2)
    assert exact == DecodeBounds(max(LENS), max(min(oracle.pages_of(n), k) for n, k in zip(LENS, BUDGETS, strict=True)))
    assert exact.width == want_pages.shape[2]
    got, got_pages = block_sparse_decode(
        q, k_cache, v_cache, cents, table, lens, budgets, backend="triton", bounds=exact
    )
    assert torch.equal(got_pages, want_pages) and torch.equal(got, want)

    loose = DecodeBounds(table.shape[1] * 64, exact.width + 4)  # as long as the block table allows
    assert oracle.pages_of(loose.max_seq_len) > oracle.pages_of(max(LENS))
    scores = score_blocks_triton(q, cents, k_cache, table, lens, loose)
    assert scores.shape[2] == oracle.pages_of(loose.max_seq_len)
    assert torch.equal(scores[..., : oracle.pages_of(max(LENS))], score_blocks_triton(q, cents, k_cache, table, lens))
    assert bool((scores[..., oracle.pages_of(max(LENS)) :] == float("-inf")).all())
    got, got_pages = block_sparse_decode(
        q, k_cache, v_cache, cents, table, lens, budgets, backend="triton", bounds=loose
    )
    assert torch.equal(got_pages[..., : exact.width], want_pages)
    assert bool((got_pages[..., exact.width :] == -1).all())
    torch.testing.assert_close(got, want, **TOL)
    dense = sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, bounds=loose)
    torch.testing.assert_close(dense, sparse_decode_attention_ref(q, k_cache, v_cache, table, lens), **TOL)


def test_each_row_costs_what_it_selects_under_the_widest_bounds():
    # Static decode sizes every step for the longest sequence admitted: with the budgets, a row the
    # budget covers whole is not scored, and a row attends over its own min(pages, budget) slots,
    # not the width of the selection.
    q, k_cache, v_cache, cents, table, lens = _setup(16, 2)
    budgets = torch.tensor([4, 3, 5, 6])  # rows 0 and 1 fit their budgets: dense
    scores = score_blocks_triton(q, cents, k_cache, table, lens, budgets=budgets)
    want = score_blocks_ref(q, cents, k_cache, table, lens)
    whole = torch.tensor([oracle.pages_of(n) <= int(k) for n, k in zip(LENS, budgets, strict=True)])
    assert whole.tolist() == [True, True, False, False]
    assert bool((scores[whole] == float("-inf")).all())
    torch.testing.assert_close(scores[~whole], want[~whole], **TOL)

    # Slots past a row's min(pages, budget) hold pages that would change the output if read.
    pages = select_blocks_ref(want, lens, budgets, 1, 2)
    widest = table.shape[1]
    filled = torch.arange(widest, dtype=torch.int32).expand(4, 2, widest).clone()
    filled[..., : pages.shape[2]] = torch.where(pages >= 0, pages, filled[..., : pages.shape[2]])
    counts = [min(oracle.pages_of(n), int(k)) for n, k in zip(LENS, budgets, strict=True)]
    assert any(oracle.pages_of(n) > c for n, c in zip(LENS, counts, strict=True))
    want_out = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens, pages)
    got = sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, filled, budgets=budgets, num_splits=3)
    torch.testing.assert_close(got, want_out, **TOL)
    unbounded = sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, filled, num_splits=3)
    assert not torch.allclose(unbounded, want_out, **TOL)  # without the budgets the extra slots count

    bounds = DecodeBounds(widest * 16, widest)  # as wide as the block table
    out, got_pages = block_sparse_decode(
        q, k_cache, v_cache, cents, table, lens, budgets, backend="triton", bounds=bounds
    )
    ref_out, ref_pages = block_sparse_decode(q, k_cache, v_cache, cents, table, lens, budgets, backend="torch")
    assert torch.equal(got_pages[..., : ref_pages.shape[2]], ref_pages)
    torch.testing.assert_close(out, ref_out, **TOL)
    with pytest.raises(ValueError, match="budgets must be integers"):
        score_blocks_triton(q, cents, k_cache, table, lens, budgets=budgets[:2])
    with pytest.raises(ValueError, match="budgets must be integers"):
        sparse_decode_attention_triton(q, k_cache, v_cache, table, lens, pages, budgets=budgets.float())


def test_decode_bounds_check_the_rows_as_the_kernels_do():
    assert decode_bounds([], [], 1, 2) == DecodeBounds(0, 0)
    assert decode_bounds([16, 17, 500], [3, 3, 100], 1, 2) == DecodeBounds(500, 32)
    with pytest.raises(ValueError, match="at least one cached token"):
        decode_bounds([0, 20], [4, 4], 1, 2)
    with pytest.raises(ValueError, match="fewer than 3 pages"):
        decode_bounds([20, 100], [4, 2], 1, 2)
    assert decode_bounds([20], [2], 1, 2).width == 2  # two pages fit a budget of two: dense, no sink needed
    with pytest.raises(ValueError, match="2 lengths but 1 budgets"):
        decode_bounds([20, 30], [4], 1, 2)
    q, k_cache, v_cache, cents, table, lens = _setup(16, 2)
    too_long = DecodeBounds(table.shape[1] * 16 + 1, 4)
    with pytest.raises(ValueError, match="room for"):
        score_blocks_triton(q, cents, k_cache, table, lens, too_long)
    scores = score_blocks_ref(q, cents, k_cache, table, lens)
    with pytest.raises(ValueError, match="scores hold"):
        select_blocks_triton(scores, lens, torch.tensor(BUDGETS), 1, 2, DecodeBounds(max(LENS) + 16, 4))


def test_budget_covering_the_sequence_is_dense():
    q, k_cache, v_cache, cents, table, lens = _setup(16, 2)
    dense = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens)
    for budgets in (torch.tensor([oracle.pages_of(n) for n in LENS]), torch.full((len(LENS),), 10_000)):
        out, _ = block_sparse_decode(q, k_cache, v_cache, cents, table, lens, budgets, backend="triton")
        torch.testing.assert_close(out, dense, **TOL)

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 40, h, 16, generator=gen) for h in (4, 2, 2))
    out = teacher_forced_attention_triton(q, k, v, torch.full((1, 40), 3))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, want, **TOL)


def _sequences(b, t, q_heads, kv_heads, d, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, t, h, d, generator=gen) for h in (q_heads, kv_heads, kv_heads))


def test_teacher_forced_attention():
    # One KV head (GQA is covered above) keeps the interpreter's program count down.
    q, k, v = _sequences(2, 70, 2, 1, 16)
    pos = torch.arange(70)
    budgets = torch.stack([torch.where(pos < 40, 3, 4), torch.where(pos < 60, 3, 5)])
    want = teacher_forced_attention_ref(q, k, v, budgets)
    torch.testing.assert_close(teacher_forced_attention_triton(q, k, v, budgets, chunk=64), want, **TOL)


def test_dispatchers_pick_the_backend():
    q, k_cache, v_cache, cents, table, lens = _setup(16, 2)
    scores = score_blocks_ref(q, cents, k_cache, table, lens)
    budgets = torch.tensor(BUDGETS)
    # "torch" is the reference, bit for bit; "auto" on CPU tensors is the CPU extension.
    assert torch.equal(select_blocks(scores, lens, budgets, backend="torch"), select_blocks_ref(scores, lens, budgets))
    assert torch.equal(select_blocks(scores, lens, budgets), select_blocks_ref(scores, lens, budgets))
    want = sparse_decode_attention_ref(q, k_cache, v_cache, table, lens)
    assert torch.equal(sparse_decode_attention(q, k_cache, v_cache, table, lens, backend="torch"), want)
    torch.testing.assert_close(sparse_decode_attention(q, k_cache, v_cache, table, lens), want, **TOL)
    torch.testing.assert_close(sparse_decode_attention(q, k_cache, v_cache, table, lens, backend="triton"), want, **TOL)


def test_teacher_forced_dispatcher_falls_back_to_the_reference_for_gradients():
    q, k, v = _sequences(1, 40, 2, 1, 16)
    budgets = torch.full((1, 40), 3)
    leaf = q.clone().requires_grad_()
    out = teacher_forced_attention(leaf, k, v, budgets, backend="triton")
    assert out.requires_grad
    out.sum().backward()
    ref_leaf = q.clone().requires_grad_()
    teacher_forced_attention_ref(ref_leaf, k, v, budgets).sum().backward()
    assert torch.equal(leaf.grad, ref_leaf.grad)
    with torch.no_grad():
        torch.testing.assert_close(teacher_forced_attention(leaf, k, v, budgets, backend="triton"), out, **TOL)
