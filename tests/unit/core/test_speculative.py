"""Exact speculative sampling on a small synthetic vocabulary: emitted tokens follow p whatever q is.

Every chi-square check uses a false-alarm rate of 1e-4 per check (p-value below it fails) and fixed
seeds, so the outcome is deterministic; the same check is shown to fail when the acceptance rule is
broken on purpose (always accept), which samples q instead.
"""

import pytest
import torch

from sparrow import speculative
from sparrow.speculative import expected_tokens, nucleus, verify_drafts
from tests.stats import chi_square_pvalue

FALSE_ALARM = 1e-4
V, K, N = 8, 3, 40_000


def _dists(seed: int, rows: int, positions: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(positions, V, generator=g), -1)[None].expand(rows, positions, V)


def _cycle(p, q, seed=1):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(q.shape[1])], 1)
    return drafts, verify_drafts(p, q, drafts, g)


def _first_tokens(drafts, verdict):
    return torch.where(verdict.accepted >= 1, drafts[:, 0], verdict.next_token)


def test_emitted_tokens_follow_p_at_every_position_and_the_bonus():
    p, q = _dists(0, N, K + 1), _dists(7, N, K)
    drafts, verdict = _cycle(p, q)
    first = _first_tokens(drafts, verdict)
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p[0, 0]) > FALSE_ALARM
    # Given draft 1 kept, the second token is draft 2 (kept) or the correction at position 2.
    kept = verdict.accepted >= 1
    second = torch.where(verdict.accepted[kept] >= 2, drafts[kept, 1], verdict.next_token[kept])
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p[0, 1]) > FALSE_ALARM
    bonus = verdict.next_token[verdict.accepted == K]
    assert bonus.numel() > 500 and chi_square_pvalue(torch.bincount(bonus, minlength=V), p[0, K]) > FALSE_ALARM
    # Draft 1 is kept with probability alpha = sum min(p, q): within 5 binomial sigmas.
    alpha = float(torch.minimum(p[0, 0], q[0, 0]).sum())
    assert abs(float(kept.double().mean()) - alpha) < 5 * (alpha * (1 - alpha) / N) ** 0.5
    assert 0.2 < alpha < 0.9  # p and q really differ, and drafts are often kept
    # The q the drafts came from is far from p: sampling it would fail the same check.
    assert chi_square_pvalue(torch.bincount(drafts[:, 0], minlength=V), p[0, 0]) < FALSE_ALARM


def test_the_check_fails_when_the_rejection_step_always_accepts(monkeypatch):
    p, q = _dists(0, N, K + 1), _dists(7, N, K)
    monkeypatch.setattr(speculative, "accepts", lambda pd, qd, u: torch.ones_like(u, dtype=torch.bool))
    drafts, verdict = _cycle(p, q)
    assert bool((verdict.accepted == K).all())
    assert chi_square_pvalue(torch.bincount(_first_tokens(drafts, verdict), minlength=V), p[0, 0]) < FALSE_ALARM


def test_alpha_is_sum_min_p_q_in_float64_and_tokens_per_cycle_match_the_formula():
    p, q = _dists(3, N, K + 1), _dists(3, N, K).roll(1, dims=-1) * 0.5 + _dists(3, N, K) * 0.5
    q = q / q.sum(-1, keepdim=True)
    p = torch.cat([p[:, :1].expand(N, K + 1, V)], 1)  # the same p and q at every position: i.i.d. acceptance
    q = q[:, :1].expand(N, K, V)
    drafts, verdict = _cycle(p, q, seed=2)
    want = torch.minimum(p[:, :K].double(), q.double()).sum(-1)
    torch.testing.assert_close(verdict.alpha.double(), want, atol=1e-6, rtol=0)
    a = float(want[0, 0])
    emitted = (verdict.accepted + 1).double()
    assert abs(float(emitted.mean()) - expected_tokens(a, K)) < 5 * float(emitted.std()) / N**0.5
    assert expected_tokens(1.0, 6) == 7.0 and expected_tokens(0.0, 6) == 1.0
    assert expected_tokens(0.97, 6) == pytest.approx((1 - 0.97**7) / 0.03)
    for bad in ((1.2, 6), (0.5, 0), (0.5, 17)):
        with pytest.raises(ValueError):
            expected_tokens(*bad)


def test_one_hot_distributions_keep_a_draft_only_when_it_is_p_s_argmax():
    eye = torch.eye(V)
    p = eye[torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4]])]  # row 1's second draft disagrees with p
    q = eye[torch.tensor([[1, 2, 3], [1, 2, 3]])]
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    verdict = verify_drafts(p, q, drafts, torch.Generator().manual_seed(0))
    assert verdict.accepted.tolist() == [3, 1]
    assert verdict.next_token.tolist() == [4, 5]  # the bonus; the dense argmax at the rejection
    assert verdict.alpha.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]


def test_nucleus_keeps_the_smallest_top_set_reaching_top_p_on_both_sides_alike():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]])
    out = nucleus(probs, 0.7)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 0.625, 0.375, 0.0]))
    assert int((out[1] > 0).sum()) == 3 and float(out[1].sum()) == pytest.approx(1.0)
    assert torch.equal(nucleus(probs, 1.0), probs)
    assert nucleus(probs, 1e-6).max(-1).values.tolist() == [1.0, 1.0]
