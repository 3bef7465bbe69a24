"""Dense and teacher-forced sparse scoring against a plain transformers forward."""

import pytest
import torch

from sparrow.schedule import Schedule
from trainer.sparse_attention import teacher_forced_plan

SEQS = [list(range(3, 53)), [7, 1, 9] * 12 + [4]]  # 50 and 37 tokens: a right-padded batch
PROMPTS = [10, 7]


@pytest.fixture(scope="module")
def plain_sdpa(tiny_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa", dtype=torch.float32).eval()


def _plain_logprobs(model, seq, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0]
    return torch.log_softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_dense_scoring_equals_plain_transformers_forward(scorer, plain_sdpa, temperature):
    scores = scorer.score(SEQS, PROMPTS, temperature=temperature, full=True)
    for seq, plen, s in zip(SEQS, PROMPTS, scores, strict=True):
        want = _plain_logprobs(plain_sdpa, seq, temperature)[plen - 1 : len(seq) - 1]
        tokens = torch.tensor(seq[plen:])
        assert s.token_ids.tolist() == seq[plen:]
        assert s.kv_lens.tolist() == list(range(plen, len(seq)))
        torch.testing.assert_close(s.full_logprobs, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(s.logprobs, want.gather(1, tokens[:, None])[:, 0], atol=1e-5, rtol=0)
        top = torch.topk(want, 20, dim=-1)
        torch.testing.assert_close(s.top_logprobs, top.values, atol=1e-5, rtol=0)
        assert s.top_ids.shape == (len(seq) - plen, 20)


def test_sparse_scoring_with_a_budget_covering_the_sequence_equals_dense(scorer):
    dense = scorer.score(SEQS, PROMPTS)
    sparse = scorer.score(SEQS, PROMPTS, schedule=Schedule(budgets=(64,)))  # 4 pages >= every length here
    for d, s in zip(dense, sparse, strict=True):
        torch.testing.assert_close(s.logprobs, d.logprobs, atol=1e-5, rtol=0)
        assert torch.equal(s.top_ids, d.top_ids)


def test_small_budgets_change_the_scores(scorer):
    dense = scorer.score(SEQS, PROMPTS)
    sparse = scorer.score(SEQS, PROMPTS, schedule=Schedule(budgets=(48,)))
    assert max(float((d.logprobs - s.logprobs).abs().max()) for d, s in zip(dense, sparse, strict=True)) > 1e-3


def test_plan_keeps_prompt_positions_dense_and_schedules_the_rest():
    schedule = Schedule(budgets=(48, 64, 96), bin_width=20)
    plan = teacher_forced_plan(schedule, torch.tensor([5, 30]), 50)
    assert plan.budgets.shape == (2, 50)
    assert plan.dense_layers == frozenset({0, 1}) and (plan.sink, plan.local) == (1, 2)
    every_page = 4  # ceil(50 / 16)
    assert plan.budgets[0, :5].tolist() == [every_page] * 5
    assert plan.budgets[1, :30].tolist() == [every_page] * 30
    # position t has KV length t + 1: 19 -> bin 1 starts at KV 20, bin 2 at KV 40
    assert plan.budgets[0, 5:].tolist() == [3] * 14 + [4] * 20 + [6] * 11
    assert plan.budgets[1, 39:].tolist() == [6] * 11


def test_bad_scoring_inputs_are_clear(scorer):
    with pytest.raises(ValueError, match="prompt length 0"):
        scorer.score([[1, 2, 3]], [0])
    with pytest.raises(ValueError, match="prompt length 4"):
        scorer.score([[1, 2, 3]], [4])
    with pytest.raises(ValueError, match="2 prompt lengths"):
        scorer.score([[1, 2, 3]], [1, 2])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        scorer.score([[1, 2, 3]], [1], temperature=0.0)
    assert scorer.score([], []) == []


def test_the_dense_path_is_stock_sdpa_inside_the_registered_function(tiny_model, plain_sdpa):
    # With no plan, our attention function must reproduce the sdpa model bit for bit (same masks).
    ids = torch.tensor(SEQS[0])[None]
    with torch.no_grad():
        ours = tiny_model(input_ids=ids, use_cache=False).logits
        stock = plain_sdpa(input_ids=ids, use_cache=False).logits
    assert tiny_model.config._attn_implementation == "sparrow_block_sparse"
    assert torch.equal(ours, stock)


def test_right_padded_batches_attend_causally_without_their_mask_and_other_masks_are_kept(scorer, monkeypatch):
    from trainer import lm_head

    assert lm_head.forward_mask(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])) is None
    assert lm_head.forward_mask(torch.tensor([[1, 1], [1, 1]])) is None
    for kept in ([[0, 1, 1, 1], [1, 1, 1, 1]], [[1, 0, 1, 1]]):  # left padding, a hole
        mask = torch.tensor(kept)
        assert lm_head.forward_mask(mask) is mask
    # The scorer's right-padded batch reaches the model with no mask (its scores equal the unpadded
    # forwards': test_dense_scoring_equals_plain_transformers_forward).
    seen = []
    model = scorer.model
    original = type(model).forward

    def forward(self, **kw):
        seen.append(kw["attention_mask"])
        return original(self, **kw)

    monkeypatch.setattr(type(model), "forward", forward)
    scorer.score(SEQS, PROMPTS)
    assert seen == [None]
