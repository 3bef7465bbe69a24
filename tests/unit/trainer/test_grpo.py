"""GRPO + TIS: advantages, the clipped objective, TIS weights and the statistics, by hand."""

import math

import pytest
import torch

from trainer.grpo import GRPOConfig, group_advantages, grpo_tis_loss, sampled_logprobs


def test_group_advantages_normalise_within_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))  # no signal in a group that agrees


def test_group_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="multiple of 8"):
        group_advantages(torch.ones(7), group_size=8)


def test_loss_is_token_mean_of_clipped_objective_times_tis_weight():
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.5, 0.8, 0.2]])).requires_grad_()
    rollout = torch.log(torch.tensor([[0.5, 0.1, 0.5]]))  # token 1: pi_old / pi_rollout = 5 -> capped at 2
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    loss, stats = grpo_tis_loss(new, old, rollout, torch.tensor([1.0]), mask, cfg)
    # ratios 1, 1.6 (clipped to 1.28 for A > 0), 0.4 (min picks 0.4); weights 1, 2, 1
    expected = -(1.0 * 1 + 1.28 * 2 + 0.4 * 1) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["tis_clip_fraction"] == pytest.approx(1 / 3)
    assert stats["ppo_clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    assert new.grad[0, 1] == 0  # clipped token carries no gradient
    assert new.grad[0, 0] != 0 and new.grad[0, 2] != 0


def test_negative_advantage_clips_below():
    cfg = GRPOConfig()
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(0.5)).requires_grad_()  # ratio 0.5 < 0.8
    loss, _ = grpo_tis_loss(new, old, old, torch.tensor([-1.0]), torch.ones(1, 1), cfg)
    assert loss.item() == pytest.approx(0.8)  # -min(0.5 * -1, 0.8 * -1)
    loss.backward()
    assert new.grad.item() == 0


def test_masked_tokens_do_not_count():
    cfg = GRPOConfig()
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = grpo_tis_loss(lp, lp, lp, torch.tensor([1.0, 1.0]), mask, cfg)
    assert loss.item() == pytest.approx(-1.0)
    assert stats["tokens"] == 3 and stats["kl_rollout_dense"] == 0


def test_kl_estimate_is_positive_when_policies_differ():
    old = torch.log(torch.tensor([[0.5, 0.2]]))
    rollout = torch.log(torch.tensor([[0.4, 0.3]]))
    _, stats = grpo_tis_loss(old, old, rollout, torch.tensor([0.0]), torch.ones(1, 2), GRPOConfig())
    assert stats["kl_rollout_dense"] > 0


def test_sampled_logprobs_apply_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    got = sampled_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert got.item() == pytest.approx(torch.log_softmax(logits / 2.0, -1)[0, 0, 0].item())


def test_config_validation():
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(tis_cap=0.5)
    with pytest.raises(ValueError, match="clip range"):
        GRPOConfig(clip_low=1.5)
