"""Scoring, the GRPO update and DistillSparse on the chunked LM head equal the full-logits path, at Qwen3's vocabulary.

The model is a random Qwen3 with the 151,936-entry vocabulary on a hidden size of 16, so a full
[tokens, vocab] tensor is what the chunks avoid; the chunk (5) is shorter than every response.
"""

import copy

import pytest
import torch

from trainer.batch import Rollout, micro_batches
from trainer.grpo import GRPOConfig, global_token_count, grpo_tis_loss, sampled_logprobs
from trainer.rl_update import UpdateConfig, dense_scores, grpo_update
from trainer.scoring import Scorer, scaled_logprobs

VOCAB = 151_936
CHUNK = 5
TEMP = 0.8


@pytest.fixture(scope="module")
def policy():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer import sparse_attention

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=256,
    )  # fmt: skip
    return sparse_attention.install(Qwen3ForCausalLM(config).float().eval())


def _rollouts(count: int = 5):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        prompt = torch.randint(0, VOCAB, (4 + i,), generator=g).tolist()
        tokens = torch.randint(0, VOCAB, (7 + 3 * i,), generator=g).tolist()
        lps = (-torch.rand(len(tokens), generator=g) * 12).tolist()  # the generator's claims, near the policy's
        out.append(Rollout(f"g{i // 2}", i % 2, tuple(prompt), tuple(tokens), tuple(lps), (), ()))
    return out


def _full_logits(model, mb):
    return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]


def test_scoring_equals_full_logits(policy):
    rollouts = _rollouts()
    scores = dense_scores(Scorer(policy, chunk=CHUNK), rollouts, TEMP, micro_batch_size=2, max_tokens=40)
    for r, s in zip(rollouts, scores, strict=True):
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([r.sequence])).logits[0]
        want = scaled_logprobs(logits[r.prompt_len - 1 : -1], TEMP)
        assert s.token_ids.tolist() == list(r.token_ids)
        torch.testing.assert_close(s.logprobs, want.gather(1, s.token_ids[:, None])[:, 0], atol=5e-5, rtol=0)
        top = torch.topk(want, 20, dim=-1)
        torch.testing.assert_close(s.top_logprobs, top.values, atol=5e-5, rtol=0)
        assert (s.top_ids == top.indices).float().mean() > 0.99  # near-ties may swap places


def test_the_update_equals_one_on_full_logits(policy):
    rollouts = _rollouts()
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75])
    old = [torch.tensor(r.logprobs) + 0.05 for r in rollouts]  # ratio != 1 and TIS weight != 1
    config = UpdateConfig(grpo=GRPOConfig(), temperature=TEMP, micro_batch_size=2, max_grad_norm=0, lm_head_chunk=CHUNK)

    chunked = copy.deepcopy(policy).train()
    stats = grpo_update(chunked, torch.optim.SGD(chunked.parameters(), lr=1.0), rollouts, old, advantages, config)

    full = copy.deepcopy(policy).train()
    num_tokens = global_token_count(torch.tensor([float(sum(len(r.token_ids) for r in rollouts))]))
    loss_sum = 0.0
    for mb in micro_batches(rollouts, advantages, 2):
        lp = sampled_logprobs(_full_logits(full, mb), mb.targets, TEMP)
        old_mb = mb.place([old[r] for r in mb.rows])
        loss, _ = grpo_tis_loss(lp, old_mb, mb.rollout_logprobs, mb.advantages, mb.mask, config.grpo, num_tokens)
        loss.backward()
        loss_sum += float(loss.detach())
    assert stats["loss"] == pytest.approx(loss_sum, rel=1e-5)
    before = dict(policy.named_parameters())
    for name, p in full.named_parameters():
        q = dict(chunked.named_parameters())[name]
        # SGD at lr 1 moved each parameter by minus its gradient: compare the steps.
        torch.testing.assert_close(before[name] - q, p.grad, atol=1e-6, rtol=1e-4, msg=name)
        assert p.grad.abs().max() > 0, name
