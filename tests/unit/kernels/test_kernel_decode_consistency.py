"""Token-by-token sparse decode against one teacher-forced pass: the training side must see the
selection the engine made. Tokens are appended one at a time into a paged cache with a shuffled
block table, centroids updated incrementally, rows of different lengths decoding side by side.
"""

import pytest
import torch

from kernels import block_sparse_decode, new_centroids, teacher_forced_attention, update_centroids


def _budgets(t):
    """Per-position budgets in pages, a non-decreasing schedule per sequence."""
    pos = torch.arange(t)
    return torch.stack([torch.where(pos < 64, 3, torch.where(pos < 112, 4, 6)), torch.full((t,), 4)])


def _decode_token_by_token(q, k, v, lens, budgets, backend, block_size=32, prompt=0):
    """Outputs [b, t, q_heads, d] (zeros past a row's length) of decoding each position after a dense prompt."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    per_row = -(-t // block_size)
    gen = torch.Generator().manual_seed(9)
    num_blocks = b * per_row + 3
    table = torch.randperm(num_blocks, generator=gen)[: b * per_row].view(b, per_row).to(torch.int32)
    k_cache = torch.zeros(num_blocks, h, block_size, d)
    v_cache = torch.zeros(num_blocks, h, block_size, d)
    cents = new_centroids(k_cache)

    def write(rows, pos):
        blocks = table[rows, pos // block_size].long()
        k_cache[blocks, :, pos % block_size] = k[rows, pos]
        v_cache[blocks, :, pos % block_size] = v[rows, pos]

    everyone = torch.arange(b)
    for pos in range(prompt):
        write(everyone, pos)
    if prompt:
        update_centroids(k_cache, cents, table, torch.full((b,), prompt, dtype=torch.int32), backend=backend)
    out = torch.zeros_like(q)
    for pos in range(prompt, t):
        rows = everyone[torch.tensor(lens) > pos]
        write(rows, pos)
        seq_lens = torch.full((len(rows),), pos + 1, dtype=torch.int32)
        update_centroids(k_cache, cents, table[rows], seq_lens, seq_lens - 1, backend=backend)
        out[rows, pos], _ = block_sparse_decode(
            q[rows, pos], k_cache, v_cache, cents, table[rows], seq_lens, budgets[rows, pos], backend=backend
        )
    return out


def _check(lens, q_heads, kv_heads, backend, prompt):
    t = max(lens)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, t, h, 16, generator=gen) for h in (q_heads, kv_heads, kv_heads))
    budgets = _budgets(t)
    decoded = _decode_token_by_token(q, k, v, lens, budgets, backend, prompt=prompt)
    # Causal: the first positions of a longer pass are those of the shorter sequence.
    forced = teacher_forced_attention(q, k, v, budgets, backend=backend)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    for row, n in enumerate(lens):
        diff = (decoded[row, prompt:n] - forced[row, prompt:n]).abs().max().item()
        assert diff <= 1e-5, f"row {row}: token-by-token decode and teacher forcing differ by {diff}"
        # Guard against a vacuous pass: the schedule must have made these rows sparse.
        assert (forced[row, prompt:n] - dense[row, prompt:n]).abs().max() > 1e-2


def test_reference_decode_matches_teacher_forcing():
    _check([160, 121], q_heads=4, kv_heads=2, backend="torch", prompt=0)


@pytest.mark.slow
def test_triton_decode_matches_teacher_forcing():
    # Under the interpreter every program costs milliseconds: one KV head, a dense prompt of 48.
    _check([96, 81], q_heads=2, kv_heads=1, backend="triton", prompt=48)


def test_cpu_extension_decode_matches_teacher_forcing():
    # The training side scores pages with the CPU extension too, so selections agree exactly.
    _check([160, 121], q_heads=4, kv_heads=2, backend="cpu", prompt=16)
