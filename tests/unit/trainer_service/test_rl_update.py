"""The learning step on rollouts sampled from the tiny model: dense scores, alpha, and the GRPO + TIS update."""

import copy
from pathlib import Path

import pytest
import torch

from sparrow.tasks import ChainTask, ExampleStream, encode_words
from sparrow.tasks.vocab import BOS, EOS, TOKEN_TO_ID
from trainer.batch import Rollout
from trainer.grpo import GRPOConfig, group_advantages
from trainer.model_io import load_model
from trainer.reference_generate import generate
from trainer.rl_update import UpdateConfig, acceptance, dense_scores, grpo_update
from trainer.scoring import Scorer

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny"
N = 4
TEMP = 2.0  # the tiny model samples one answer per prompt at 1.0; at 2.0 the samples differ


@pytest.fixture(scope="module")
def sampled():
    """8 distinct rollouts (2 prompts x 4 samples) drawn by the reference sampler from the tiny model, dense."""
    model = load_model(TINY)
    examples = ExampleStream(ChainTask(4, 2), seed=3).take(2)
    prompts = [[TOKEN_TO_ID[BOS], *encode_words(ex.prompt)] for ex in examples for _ in range(N)]
    gens = generate(model, prompts, None, max_new_tokens=14, seed=1, eos_id=TOKEN_TO_ID[EOS], temperature=TEMP)
    rollouts = [
        Rollout(
            group_id=f"g{i // N}",
            sample_index=i % N,
            prompt_ids=tuple(p),
            token_ids=tuple(g.tokens),
            logprobs=tuple(g.scores.logprobs.tolist()),
            top_ids=tuple(map(tuple, g.scores.top_ids.tolist())),
            top_logprobs=tuple(map(tuple, g.scores.top_logprobs.tolist())),
        )
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]
    return model, rollouts


def _sum_logprob(model, rollouts):
    dense = dense_scores(Scorer(model), rollouts, TEMP, 8)
    return torch.stack([d.logprobs.sum() for d in dense])


def test_dense_scores_of_a_dense_rollout_agree_with_the_sampler(sampled):
    model, rollouts = sampled
    dense = dense_scores(Scorer(model), rollouts, temperature=TEMP, micro_batch_size=3)
    assert [len(d.logprobs) for d in dense] == [len(r.token_ids) for r in rollouts]
    for d, r in zip(dense, rollouts, strict=True):
        assert torch.allclose(d.logprobs, torch.tensor(r.logprobs), atol=1e-4)
    acc = acceptance(rollouts, dense)
    assert acc.alpha.shape == acc.kv_lens.shape == (sum(len(r.token_ids) for r in rollouts),)
    # Same model, both dense: the lists agree, so alpha is the top-20's whole mass (its lower bound's gap).
    mass = torch.cat([d.top_logprobs.exp().sum(-1) for d in dense])
    assert torch.allclose(acc.alpha, mass, atol=1e-4)
    assert acc.kv_lens[0].item() == rollouts[0].prompt_len


def test_alpha_falls_where_the_generator_reported_another_distribution(sampled):
    model, rollouts = sampled
    flat = [  # the generator claims a uniform 1/20 over the dense top-20: alpha = sum of min(p, 1/20)
        Rollout(
            **{**r.__dict__, "top_logprobs": tuple((float(torch.log(torch.tensor(0.05))),) * 20 for _ in r.top_ids)}
        )
        for r in rollouts
    ]
    dense = dense_scores(Scorer(model), rollouts, TEMP, 8)
    acc = acceptance(flat, dense)
    expected = torch.cat([d.top_logprobs.exp().clamp(max=0.05).sum(-1) for d in dense])
    assert torch.allclose(acc.alpha, expected, atol=1e-5) and float(acc.alpha.mean()) < 0.9


def test_update_climbs_the_grpo_objective(sampled):
    base, rollouts = sampled
    model = copy.deepcopy(base)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    adv = torch.cat([group_advantages(rewards[i : i + N], N) for i in range(0, len(rollouts), N)])
    dense = dense_scores(Scorer(model), rollouts, TEMP, 8)
    tokens = sum(len(r.token_ids) for r in rollouts)

    def objective(m):  # the token-mean surrogate at ratio 1: sum of A * logprob over tokens
        return float((adv * _sum_logprob(m, rollouts)).sum()) / tokens

    before = objective(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = UpdateConfig(temperature=TEMP, micro_batch_size=3)
    stats = grpo_update(model, opt, rollouts, [d.logprobs for d in dense], adv, config)
    assert stats["tokens"] == tokens
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # old = the policy before this update
    assert stats["ppo_clip_fraction"] == 0 and stats["tis_clip_fraction"] == 0
    assert stats["kl_rollout_dense"] == pytest.approx(0.0, abs=1e-5) and stats["grad_norm"] > 0
    lengths = torch.tensor([float(len(r.token_ids)) for r in rollouts])
    assert stats["loss"] == pytest.approx(float(-(adv * lengths).sum()) / tokens, abs=1e-5)  # ratio 1, weight 1
    assert objective(model) > before


def test_micro_batching_does_not_change_the_gradient(sampled):
    base, rollouts = sampled
    adv = torch.linspace(-1.5, 1.5, len(rollouts))
    dense = dense_scores(Scorer(base), rollouts, TEMP, 8)
    results = []
    # by rows, one and eight at a time; by a token budget (rows sorted by length), with a 3-token LM-head chunk
    for size, budget, chunk in ((1, 0, 1024), (8, 0, 1024), (8, 100, 3)):  # rows of 18-31 tokens: 3-5 a batch
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = UpdateConfig(
            grpo=GRPOConfig(), temperature=TEMP, micro_batch_size=size, max_grad_norm=0,
            max_tokens_per_microbatch=budget, lm_head_chunk=chunk,
        )  # fmt: skip
        grpo_update(model, opt, rollouts, [d.logprobs for d in dense], adv, cfg)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-5)
    assert torch.allclose(results[0], results[2], atol=1e-5)
    assert not torch.allclose(results[0], torch.cat([p.detach().flatten() for p in base.parameters()]))


def test_learn_on_one_process_is_scoring_acceptance_and_the_update(sampled):
    from trainer.rl_update import learn

    base, rollouts = sampled
    adv = torch.linspace(-1.0, 1.0, len(rollouts))
    cfg = UpdateConfig(temperature=TEMP, micro_batch_size=3, lm_head_chunk=4)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    dense = dense_scores(Scorer(a, chunk=4), rollouts, TEMP, 3)
    acc = acceptance(rollouts, dense)
    stats = grpo_update(a, torch.optim.SGD(a.parameters(), lr=0.1), rollouts, [d.logprobs for d in dense], adv, cfg)
    got_dense, got_acc, got_stats = learn(
        b, torch.optim.SGD(b.parameters(), lr=0.1), Scorer(b, chunk=4), rollouts, adv, cfg
    )
    assert [d.logprobs.tolist() for d in got_dense] == [d.logprobs.tolist() for d in dense]
    assert torch.equal(got_acc.alpha, acc.alpha) and torch.equal(got_acc.kv_lens, acc.kv_lens)
    assert got_stats == stats
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
