"""The CPU plugin's attention over a step that mixes a decoding row, a speculative verify (k + 1 query tokens,
in place through the paged prefill kernel) and a long prefill chunk (SDPA over its copied prefix): each row's
output is plain causal attention over its own tokens (needs vLLM's import only, no engine)."""

import math
from types import SimpleNamespace

import pytest
import torch

from services.generator.plugin.sparse_impl import IN_PLACE_QUERY_TOKENS, SparrowAttentionImpl


@pytest.mark.parametrize("kv_heads,d", [(2, 16), (4, 64)])
def test_a_mixed_step_is_causal_attention_row_by_row(kv_heads, d):
    heads, bs = 2 * kv_heads, 16
    seq_lens = [300, 123, 500]
    q_lens = [1, 7, IN_PLACE_QUERY_TOKENS + 16]  # decode, verify, prefill chunk
    gen = torch.Generator().manual_seed(0)
    per_row = -(-max(seq_lens) // bs)
    num_blocks = len(seq_lens) * per_row + 4
    table = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * per_row].view(len(seq_lens), per_row)
    kv_cache = torch.randn(num_blocks, kv_heads, bs, 2 * d, generator=gen)
    tokens = sum(q_lens)
    query = torch.randn(tokens, heads * d, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = SimpleNamespace(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=starts, block_table=table.int(),
        num_actual_tokens=tokens,
    )  # fmt: skip
    impl = SparrowAttentionImpl(heads, d, 1 / math.sqrt(d), kv_heads, None, None, "auto")
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn")
    output = torch.zeros(tokens, heads * d)
    impl.forward(layer, query, None, None, kv_cache, metadata, output)

    keys, values = kv_cache.view(2, num_blocks, kv_heads, bs, d)  # the plugin's layout: all keys, then all values
    for r, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k = keys[table[r]].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :n]
        v = values[table[r]].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :n]
        for i in range(q_len):
            pos, t = n - q_len + i, int(starts[r]) + i
            for h in range(heads):
                kv = h // (heads // kv_heads)
                w = torch.softmax(k[kv, : pos + 1] @ query[t, h * d : (h + 1) * d] / math.sqrt(d), dim=0)
                want = w @ v[kv, : pos + 1]
                assert torch.allclose(output[t, h * d : (h + 1) * d], want, atol=1e-5), (r, i, h)
