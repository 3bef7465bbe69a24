"""Dense causal attention of several query tokens a row over the paged cache (prefill chunks, speculative
verifies): the CPU extension against the torch reference, and the reference against plain causal attention."""

import math

import pytest
import torch

from kernels import paged_prefill_attention, paged_prefill_attention_ref
from kernels.cpu import paged_prefill_attention_cpu


def _paged(lens, kv_heads, block_size, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_row + 3
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_row].view(len(lens), per_row).int()
    k_cache = torch.randn(num_blocks, kv_heads, block_size, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, d, generator=gen).to(dtype)
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def _starts(q_lens):
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group,d", [(1, 16), (2, 16), (4, 32), (2, 64)])  # d 32 and 64 take the AVX-512 path
def test_cpu_extension_matches_the_reference(block_size, group, d):
    lens, q_lens = [1, 7, 300, 129, 1000], [1, 7, 17, 5, 0]  # a whole prompt, verifies, a row with no query
    k_cache, v_cache, table, seq_lens = _paged(lens, 2, block_size, d)
    q = torch.randn(sum(q_lens), 2 * group, d, generator=torch.Generator().manual_seed(1))
    starts = _starts(q_lens)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, table, seq_lens, starts)
    got = paged_prefill_attention_cpu(q, k_cache, v_cache, table, seq_lens, starts)
    assert (got - want).abs().max() <= 1e-5
    assert torch.equal(paged_prefill_attention(q, k_cache, v_cache, table, seq_lens, starts, backend="cpu"), got)


def test_bf16_cache():
    k_cache, v_cache, table, seq_lens = _paged([200, 45], 2, 16, 16, dtype=torch.bfloat16)
    q = torch.randn(9, 4, 16, generator=torch.Generator().manual_seed(2))
    starts = _starts([7, 2])
    want = paged_prefill_attention_ref(q, k_cache.float(), v_cache.float(), table, seq_lens, starts)
    got = paged_prefill_attention_cpu(q, k_cache, v_cache, table, seq_lens, starts)
    assert (got - want).abs().max() <= 1e-5


def test_reference_is_causal_attention_over_the_row():
    # One row stored in order: the last q_len positions of plain causal attention over its whole sequence.
    seq_len, q_len, h, g, d = 70, 6, 2, 2, 16
    k_cache, v_cache, table, seq_lens = _paged([seq_len], h, 16, d)
    k = k_cache[table[0].long()].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :seq_len]
    v = v_cache[table[0].long()].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :seq_len]
    q = torch.randn(q_len, h * g, d, generator=torch.Generator().manual_seed(3))
    out = paged_prefill_attention_cpu(q, k_cache, v_cache, table, seq_lens, _starts([q_len]))
    for i in range(q_len):
        pos = seq_len - q_len + i
        for head in range(h * g):
            kv = head // g
            w = torch.softmax(k[kv, : pos + 1] @ q[i, head] / math.sqrt(d), dim=0)
            assert torch.allclose(out[i, head], w @ v[kv, : pos + 1], atol=1e-5)


def test_refuses_spans_that_do_not_fit():
    k_cache, v_cache, table, seq_lens = _paged([10, 20], 2, 16, 16)
    q = torch.randn(4, 4, 16)
    with pytest.raises(ValueError, match="no longer than the row"):
        paged_prefill_attention_cpu(q, k_cache, v_cache, table, torch.tensor([2, 20]), _starts([3, 1]))
    with pytest.raises(ValueError, match="rows \\+ 1"):
        paged_prefill_attention_cpu(q, k_cache, v_cache, table, seq_lens, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="matching the cache"):
        paged_prefill_attention_cpu(torch.randn(4, 3, 16), k_cache, v_cache, table, seq_lens, _starts([3, 1]))
