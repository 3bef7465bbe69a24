import math

import numpy as np
import pytest
import torch

from sparrow.acceptance import AlphaAccumulator, alpha_exact, alpha_topk, binned_stats, quantile


def _random_pair(tokens=64, vocab=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 3
    sparse = dense + torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 0.5
    return sparse, dense


def _topk(logits, k):
    lp = torch.log_softmax(logits, dim=-1)
    vals, ids = lp.topk(k, dim=-1)
    return ids, vals


def test_exact_alpha_by_hand():
    q = torch.tensor([[0.5, 0.3, 0.2]]).log()
    p = torch.tensor([[0.2, 0.3, 0.5]]).log()
    assert alpha_exact(q, p).item() == pytest.approx(0.2 + 0.3 + 0.2)


def test_exact_alpha_accepts_raw_logits():
    sparse, dense = _random_pair()
    a = alpha_exact(sparse * 1.0 + 7.0, dense)  # a constant shift does not change the distribution
    b = alpha_exact(torch.log_softmax(sparse, -1), torch.log_softmax(dense, -1))
    assert torch.allclose(a, b)


def test_identical_distributions_have_alpha_one():
    _, dense = _random_pair()
    assert torch.allclose(alpha_exact(dense, dense), torch.ones(dense.shape[0], dtype=dense.dtype))
    ids, lps = _topk(dense, dense.shape[1])  # the full vocabulary as "top-k": nothing is lost
    assert torch.allclose(alpha_topk(ids, lps, ids, lps), torch.ones(dense.shape[0]), atol=1e-6)


def test_topk_alpha_by_hand():
    # sparse top-3: ids 1, 2, 3 with 0.5, 0.3, 0.1; dense top-3: ids 2, 1, 4 with 0.6, 0.2, 0.1.
    q_ids, q = torch.tensor([[1, 2, 3]]), torch.tensor([[0.5, 0.3, 0.1]]).log()
    p_ids, p = torch.tensor([[2, 1, 4]]), torch.tensor([[0.6, 0.2, 0.1]]).log()
    assert alpha_topk(q_ids, q, p_ids, p).item() == pytest.approx(min(0.5, 0.2) + min(0.3, 0.6))


def test_topk_alpha_with_padding_and_disjoint_lists():
    q_ids = torch.tensor([[1, 2], [5, 6]])
    q = torch.tensor([[math.log(0.7), -math.inf], [math.log(0.5), math.log(0.5)]])
    p_ids = torch.tensor([[1, 2], [7, 8]])
    p = torch.tensor([[math.log(0.6), math.log(0.4)], [math.log(0.5), math.log(0.5)]])
    assert alpha_topk(q_ids, q, p_ids, p).tolist() == pytest.approx([0.6, 0.0])


def test_topk_alpha_is_a_lower_bound_of_exact():
    for seed in range(5):
        sparse, dense = _random_pair(seed=seed)
        exact = alpha_exact(sparse, dense).float()
        for k in (1, 5, 20):
            lower = alpha_topk(*_topk(sparse, k), *_topk(dense, k))
            assert bool((lower <= exact + 1e-6).all())
        # More of each list can only add shared mass.
        wide = alpha_topk(*_topk(sparse, 20), *_topk(dense, 20))
        narrow = alpha_topk(*_topk(sparse, 5), *_topk(dense, 5))
        assert bool((wide >= narrow - 1e-6).all())


def test_topk_alpha_rejects_bad_shapes():
    ids = torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="tokens, k"):
        alpha_topk(ids, torch.zeros(3, 5), ids, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="token counts differ"):
        alpha_topk(ids, torch.zeros(3, 4), ids[:2], torch.zeros(2, 4))


@pytest.mark.parametrize("q", [0.0, 0.05, 0.1, 0.5, 0.95, 1.0])
def test_quantile_matches_numpy_percentile(q):
    x = np.random.default_rng(1).random(1001)
    assert quantile(torch.from_numpy(x), q) == pytest.approx(np.percentile(x, 100 * q))


def test_binned_p5_matches_numpy_per_bin():
    rng = np.random.default_rng(2)
    kv = rng.integers(0, 10_000, size=5000)
    alpha = 1 - rng.beta(0.5, 20, size=5000)
    stats = binned_stats(torch.from_numpy(alpha), torch.from_numpy(kv), bin_width=2000)
    assert [s.index for s in stats] == [0, 1, 2, 3, 4]
    for s in stats:
        sel = alpha[(kv >= s.kv_start) & (kv < s.kv_end)]
        assert s.count == sel.size
        assert s.q == 0.05
        assert s.quantile == pytest.approx(np.percentile(sel, 5))
        assert s.mean == pytest.approx(sel.mean())


def test_binned_stats_with_a_last_open_bin_and_other_q():
    kv = torch.tensor([0, 100, 2500, 9000, 50_000])
    alpha = torch.tensor([0.9, 1.0, 0.8, 0.7, 0.5])
    stats = binned_stats(alpha, kv, bin_width=2000, q=0.5, num_bins=3)
    assert [(s.index, s.kv_start, s.kv_end, s.count) for s in stats] == [
        (0, 0, 2000, 2),
        (1, 2000, 4000, 1),
        (2, 4000, None, 2),
    ]
    assert stats[0].quantile == pytest.approx(0.95)
    assert stats[2].quantile == pytest.approx(0.6)


def test_accumulator_equals_one_shot_stats():
    rng = np.random.default_rng(3)
    kv = torch.from_numpy(rng.integers(0, 40_000, size=3000))
    alpha = torch.from_numpy(1 - rng.beta(0.5, 20, size=3000)).float()
    acc = AlphaAccumulator(bin_width=2000, num_bins=20)
    for start in range(0, 3000, 700):
        acc.add(alpha[start : start + 700], kv[start : start + 700])
    assert acc.count == 3000
    assert acc.stats() == binned_stats(alpha, kv, bin_width=2000, num_bins=20)
    assert acc.stats(q=0.5) == binned_stats(alpha, kv, bin_width=2000, q=0.5, num_bins=20)
    acc.reset()
    assert acc.count == 0 and acc.stats() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_alpha_is_float64_accurate_at_a_qwen3_vocabulary(dtype):
    # 151,936 entries (Qwen3): a softmax normaliser in the input's dtype drifts by ~1e-5 at this size.
    vocab = 151_936
    g = torch.Generator().manual_seed(3)
    dense = (torch.randn(4, vocab, generator=g) * 4).to(dtype)
    sparse = (dense.double() + torch.randn(4, vocab, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    got = alpha_exact(sparse, dense)
    # The reference: the same (rounded) inputs, in numpy float64, with an explicit normaliser per row.
    s, d = sparse.double().numpy(), dense.double().numpy()
    log_q = s - (np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)) + s.max(-1, keepdims=True))
    log_p = d - (np.log(np.exp(d - d.max(-1, keepdims=True)).sum(-1, keepdims=True)) + d.max(-1, keepdims=True))
    want = np.exp(np.minimum(log_q, log_p)).sum(-1)
    assert got.dtype == torch.float64
    assert np.abs(got.numpy() - want).max() < 1e-9
