"""pass@k by the unbiased estimator, checked against brute force over every k-subset."""

from itertools import combinations

import pytest

from sparrow.evaluation import ks_reported, pass_at_k, summarize


@pytest.mark.parametrize("n, c", [(4, 0), (4, 1), (4, 3), (8, 2), (5, 5)])
def test_pass_at_k_matches_every_subset(n, c):
    samples = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_summarize_per_source():
    out = summarize([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert ks_reported(4) == [1, 2, 4]
    assert out["prompts"] == 3 and out["samples"] == 12
    assert out["avg@4"] == pytest.approx(5 / 12)
    assert out["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
