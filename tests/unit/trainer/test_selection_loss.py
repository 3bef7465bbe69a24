"""The selection loss: KL from the dense attention mass per candidate page to the softmax of the pages' scores."""

import pytest
import torch

from kernels import PAGE_SIZE, as_paged_cache, new_centroids, score_blocks_ref, update_centroids_ref
from trainer.sparse_attention import selection_loss

torch.set_num_threads(1)


def reference(q, k, budgets, sink, local, scale):
    """Position by position: scores from the kernels' own page scoring, candidates from the selection's rule."""
    b, hq, t, d = q.shape
    h = k.shape[1]
    cache, table = as_paged_cache(k.transpose(1, 2))
    cents = new_centroids(cache)
    update_centroids_ref(cache, cents, table, torch.full((b,), t))
    total, count = 0.0, 0
    for bi in range(b):
        for pos in range(t):
            n = pos // PAGE_SIZE + 1
            if n <= int(budgets[bi, pos]) or n - local <= sink:
                continue
            count += 1
            scores = score_blocks_ref(q[bi, :, pos][None], cents, cache, table[bi : bi + 1], torch.tensor([pos + 1]))[0]
            kk = k[bi].repeat_interleave(hq // h, dim=0)[:, : pos + 1]
            probs = ((q[bi, :, pos, None, :] * kk).sum(-1) * scale).softmax(-1)  # [hq, pos + 1]
            pages = torch.zeros(hq, n).index_add_(1, torch.arange(pos + 1) // PAGE_SIZE, probs)
            mass = pages.view(h, hq // h, n).mean(1)[:, sink : n - local]
            held = mass.sum(-1)
            target = mass / held[:, None]
            logp = (scores[:, sink : n - local] * scale).log_softmax(-1)
            kl = (target * (target.log() - logp)).sum(-1)
            total += float((kl * held).sum())
    return total / (count * h)


@pytest.mark.parametrize("chunk_elements", [1 << 25, 300], ids=["one-chunk", "many-chunks"])
def test_it_matches_a_position_by_position_reference_built_on_the_kernels_scoring(chunk_elements):
    g = torch.Generator().manual_seed(0)
    b, hq, h, t, d = 2, 4, 2, 150, 16
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, h, t, d, generator=g)
    budgets = torch.tensor([[5] * t, [4] * 100 + [100] * 50])  # row 1 ends dense: those positions do not count
    got = selection_loss(q, k, budgets, sink=1, local=2, scaling=0.25, chunk_elements=chunk_elements)
    assert float(got) == pytest.approx(reference(q, k, budgets, 1, 2, 0.25), rel=1e-4)


def test_gradients_reach_queries_and_keys_and_no_selecting_position_gives_zero():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 96, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 96, 16, generator=g, requires_grad=True)
    loss = selection_loss(q, k, torch.full((1, 96), 4), sink=1, local=2)
    loss.backward()
    assert float(loss.detach()) > 0
    assert float(q.grad.abs().sum()) > 0 and float(k.grad.abs().sum()) > 0
    assert bool(torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all())  # positions that do not select too
    # Budgets covering every page: nothing is selected, nothing to learn.
    assert float(selection_loss(q, k, torch.full((1, 96), 6), sink=1, local=2)) == 0.0
