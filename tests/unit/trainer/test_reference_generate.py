"""The reference decode loop (paged cache, block_sparse_decode) against teacher-forced scoring."""

import pytest
import torch

from sparrow.acceptance import alpha_exact, alpha_topk
from sparrow.schedule import Schedule
from trainer.reference_generate import generate
from trainer.scoring import Scorer

PROMPTS = [list(range(5, 25)), [3, 8, 2] * 3, list(range(40, 73))]  # 20, 9 and 33 tokens
# 3 pages up to KV 63, then 4: with KV lengths up to ~110 (7 pages) selection really happens
SMALL = Schedule(budgets=(48, 64), bin_width=64)


@pytest.fixture(scope="module")
def sparse_run(tiny_model):
    return generate(tiny_model, PROMPTS, SMALL, max_new_tokens=75, seed=3, full=True)


def _sequences(gens):
    return [p + g.tokens for p, g in zip(PROMPTS, gens, strict=True)], [len(p) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_sparse_scoring_reproduces_the_decode_loop_token_by_token(tiny_model, scorer, backend):
    # "auto" is the CPU extension here; the loop and the scorer must score pages with the same backend
    sparse_run = generate(tiny_model, PROMPTS, SMALL, max_new_tokens=75, seed=3, full=True, backend=backend)
    seqs, plens = _sequences(sparse_run)
    sparse = Scorer(tiny_model, backend=backend).score(seqs, plens, schedule=SMALL, full=True)
    dense = scorer.score(seqs, plens, full=True)
    for g, s, d in zip(sparse_run, sparse, dense, strict=True):
        assert len(g.tokens) == 75 and not g.finished
        assert torch.equal(g.scores.kv_lens, s.kv_lens)
        torch.testing.assert_close(s.logprobs, g.scores.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(s.top_logprobs, g.scores.top_logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(s.full_logprobs, g.scores.full_logprobs, atol=1e-4, rtol=0)
        # selection really happened: the budget was below the KV length, and dense scores differ
        assert bool((g.budgets[1:] < g.scores.kv_lens[1:]).any())
        assert float((d.logprobs - g.scores.logprobs).abs().max()) > 1e-3


def test_loop_records_the_budget_of_each_step(sparse_run):
    g = sparse_run[1]
    assert g.budgets[0] == 9  # the first token comes from the dense prefill of the 9-token prompt
    kv = g.scores.kv_lens[1:]
    want = torch.where(kv < 64, 48, 64)
    assert torch.equal(g.budgets[1:], want)


def test_alpha_from_top20_lists_is_at_most_exact_alpha(scorer, sparse_run):
    seqs, plens = _sequences(sparse_run)
    dense = scorer.score(seqs, plens, full=True)
    for g, d in zip(sparse_run, dense, strict=True):
        exact = alpha_exact(g.scores.full_logprobs, d.full_logprobs)
        lower = alpha_topk(g.scores.top_ids, g.scores.top_logprobs, d.top_ids, d.top_logprobs)
        assert bool((lower <= exact + 1e-6).all())
        assert float((exact - lower).max()) > 1e-3  # vocabulary 100: the top 20 miss real mass


def test_dense_loop_matches_dense_scoring(tiny_model, scorer):
    gens = generate(tiny_model, PROMPTS, None, max_new_tokens=20, seed=1)
    seqs, plens = _sequences(gens)
    for g, s in zip(gens, scorer.score(seqs, plens), strict=True):
        torch.testing.assert_close(s.logprobs, g.scores.logprobs, atol=1e-4, rtol=0)
        assert torch.equal(g.budgets, g.scores.kv_lens)


def test_batched_decoding_equals_one_sequence_at_a_time(tiny_model):
    together = generate(tiny_model, PROMPTS, SMALL, max_new_tokens=40, greedy=True)
    for prompt, g in zip(PROMPTS, together, strict=True):
        (alone,) = generate(tiny_model, [prompt], SMALL, max_new_tokens=40, greedy=True)
        assert alone.tokens == g.tokens
        torch.testing.assert_close(alone.scores.logprobs, g.scores.logprobs, atol=1e-5, rtol=0)


def test_sampling_is_seeded_and_greedy_takes_the_top_token(tiny_model):
    a = generate(tiny_model, PROMPTS[:2], SMALL, max_new_tokens=30, seed=7)
    b = generate(tiny_model, PROMPTS[:2], SMALL, max_new_tokens=30, seed=7)
    c = generate(tiny_model, PROMPTS[:2], SMALL, max_new_tokens=30, seed=8)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]
    (greedy,) = generate(tiny_model, PROMPTS[:1], SMALL, max_new_tokens=30, greedy=True)
    assert greedy.tokens == greedy.scores.top_ids[:, 0].tolist()


def test_temperature_is_applied_alike_in_the_loop_and_in_scoring(tiny_model, scorer):
    gens = generate(tiny_model, PROMPTS, SMALL, max_new_tokens=30, temperature=0.5, seed=2)
    seqs, plens = _sequences(gens)
    for g, s in zip(gens, scorer.score(seqs, plens, schedule=SMALL, temperature=0.5), strict=True):
        torch.testing.assert_close(s.logprobs, g.scores.logprobs, atol=1e-4, rtol=0)
    at_one = scorer.score(seqs, plens, schedule=SMALL)
    assert float((at_one[0].logprobs - gens[0].scores.logprobs).abs().max()) > 1e-3


def test_generation_stops_after_eos(tiny_model):
    (free,) = generate(tiny_model, PROMPTS[:1], SMALL, max_new_tokens=30, greedy=True)
    eos = free.tokens[5]
    stop = free.tokens.index(eos) + 1
    (ended,) = generate(tiny_model, PROMPTS[:1], SMALL, max_new_tokens=30, greedy=True, eos_id=eos)
    assert ended.finished and ended.tokens == free.tokens[:stop]
    assert ended.scores.logprobs.shape == (stop,) and ended.budgets.shape == (stop,)


def test_bad_generation_inputs_are_clear(tiny_model):
    with pytest.raises(ValueError, match="no empty prompt"):
        generate(tiny_model, [[1, 2], []], SMALL, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_model, [[1, 2]], SMALL, max_new_tokens=0)
    with pytest.raises(ValueError, match="page_size"):
        generate(tiny_model, [[1, 2]], Schedule(budgets=(128,), page_size=32), max_new_tokens=4)
