"""The C++ CPU extension against the torch references: scores to float rounding, selection bit for
bit (ties included), attention to 1e-5, over block sizes, GQA groups, lengths and budgets."""

import pytest
import torch

from kernels import new_centroids, resolve_backend, update_centroids_ref
from kernels.cpu import score_blocks_cpu, select_blocks_cpu, sparse_decode_attention_cpu
from kernels.decode import sparse_decode_attention_ref
from kernels.select import score_blocks_ref, select_blocks_ref


def _cache(lens, kv_heads, block_size, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_row + 2
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_row].view(len(lens), per_row).int()
    k_cache = torch.randn(num_blocks, kv_heads, block_size, d, generator=gen)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cents = new_centroids(k_cache)
    update_centroids_ref(k_cache, cents, table, seq_lens)
    return k_cache, v_cache, table, seq_lens, cents


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_cpu_extension_matches_reference(block_size, group):
    lens = [1, 17, 300, 129]
    k_cache, v_cache, table, seq_lens, cents = _cache(lens, 2, block_size, 32)
    q = torch.randn(len(lens), 2 * group, 32, generator=torch.Generator().manual_seed(1))
    ref = score_blocks_ref(q, cents, k_cache, table, seq_lens)
    got = score_blocks_cpu(q, cents, k_cache, table, seq_lens)
    assert torch.equal(ref.isinf(), got.isinf())
    assert torch.allclose(ref.nan_to_num(neginf=0), got.nan_to_num(neginf=0), atol=1e-5)
    budgets = torch.tensor([3, 4, 6, 9], dtype=torch.int32)
    pages = select_blocks_ref(got, seq_lens, budgets)
    assert torch.equal(select_blocks_cpu(got, seq_lens, budgets), pages)
    for selection in (pages, None):
        want = sparse_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, selection)
        out = sparse_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, selection)
        assert (out - want).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [16, 32])
def test_a_half_precision_cache_decodes_as_its_float32_copy(dtype, d):
    # The engine's cache is bf16 (vLLM's `auto` on CPU): its pages are widened once per page, exactly.
    lens = [1, 17, 300, 129]
    k32, v32, table, seq_lens, cents = _cache(lens, 2, 16, d)
    k_cache, v_cache = k32.to(dtype), v32.to(dtype)
    q = torch.randn(len(lens), 4, d, generator=torch.Generator().manual_seed(1))
    scores = score_blocks_ref(q, cents, k32, table, seq_lens)
    pages = select_blocks_ref(scores, seq_lens, torch.tensor([3, 4, 6, 9], dtype=torch.int32))
    for selection in (pages, None):
        want = sparse_decode_attention_ref(q, k_cache.float(), v_cache.float(), table, seq_lens, selection)
        out = sparse_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, selection)
        assert (out - want).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,group", [(8, 1), (20, 2), (24, 3), (128, 2)])
def test_decode_equals_the_reference_for_every_head_width_and_group(dtype, d, group):
    # Widths that are multiples of 8 take the AVX2 routine where the machine has it (all of a GQA group's queries
    # against each page at once); 20 takes the generic per-token loop; 128 in float32 the AVX-512 one where it exists.
    lens = [1, 16, 17, 300, 129]
    k32, v32, table, seq_lens, cents = _cache(lens, 2, 16, d)
    k_cache, v_cache = k32.to(dtype), v32.to(dtype)
    q = torch.randn(len(lens), 2 * group, d, generator=torch.Generator().manual_seed(2))
    scores = score_blocks_ref(q, cents, k32, table, seq_lens)
    pages = select_blocks_ref(scores, seq_lens, torch.tensor([3, 1, 4, 6, 9], dtype=torch.int32))
    for selection in (pages, None):
        want = sparse_decode_attention_ref(q, k_cache.float(), v_cache.float(), table, seq_lens, selection)
        out = sparse_decode_attention_cpu(q, k_cache, v_cache, table, seq_lens, selection)
        assert (out - want).abs().max() <= 1e-5


def test_cpu_selection_breaks_ties_like_the_reference():
    gen = torch.Generator().manual_seed(3)
    for _ in range(100):
        lens = torch.randint(1, 700, (5,), generator=gen)
        pages = int(((lens + 15) // 16).max())
        scores = torch.randint(0, 4, (5, 3, pages), generator=gen).float()  # many equal scores
        budgets = torch.randint(3, 30, (5,), generator=gen)
        assert torch.equal(select_blocks_cpu(scores, lens, budgets), select_blocks_ref(scores, lens, budgets))


def test_cpu_extension_refuses_bad_input():
    k_cache, v_cache, table, seq_lens, cents = _cache([40], 2, 16, 8)
    with pytest.raises(ValueError, match="sink and local"):
        select_blocks_cpu(torch.zeros(1, 2, 3), seq_lens, torch.tensor([2]))
    with pytest.raises(ValueError):
        sparse_decode_attention_cpu(torch.randn(1, 3, 8), k_cache, v_cache, table, seq_lens)


def test_auto_backend_uses_the_cpu_extension_on_cpu():
    assert resolve_backend("auto", torch.zeros(1)) == "cpu"
    assert resolve_backend("torch", torch.zeros(1)) == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        resolve_backend("fast", torch.zeros(1))
