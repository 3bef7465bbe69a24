"""Exact alpha from the trainer's teacher-forced sparse forward (trainer/exact_alpha.py), paired with dense scoring.

The sparse side's reference is the block-sparse reference decode loop (trainer/reference_generate.py),
the CPU decoder whose full distributions can always be taken: it decodes under the schedule and
records, per token, its whole log-distribution and the budget it used. The exact pass, teacher-forced
under those recorded budgets, must give alpha_exact of the loop's own full distributions against the
dense policy's, and never less than the top-k bound of the same step. (The vLLM engine's full
distributions, on a model whose vocabulary fits its logprob limit, are compared in
tests/integration/generator/test_exact_alpha_vllm.py.)
"""

import dataclasses

import torch

from sparrow.acceptance import alpha_exact
from tests.unit.distill.conftest import SCHEDULE, perturb_adapter, tiny_policy
from trainer.batch import Rollout
from trainer.distill import BlockRule, DistillConfig, DistillSparse, rollout_of
from trainer.exact_alpha import ExactAlpha
from trainer.reference_generate import generate
from trainer.rl_update import UpdateConfig, acceptance, learn, scores_and_exact
from trainer.scoring import Scorer

RULE = BlockRule.of(SCHEDULE)
TEMP = 0.9


def _sampled(model, count: int = 4, new_tokens: int = 40):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (70 + 3 * i,), generator=g).tolist() for i in range(count)]
    gens = generate(model, prompts, SCHEDULE, new_tokens, TEMP, seed=0, backend="torch", full=True)
    rollouts = [rollout_of(p, gen, f"g{i // 2}", i % 2) for i, (p, gen) in enumerate(zip(prompts, gens, strict=True))]
    return rollouts, [gen.scores.full_logprobs for gen in gens]


def _dense_full(model, rollouts):
    """The dense policy's full log-distribution of every response position, from its own plain forward."""
    out = []
    with torch.no_grad():
        for r in rollouts:
            logits = model(input_ids=torch.tensor([r.sequence]), use_cache=False).logits[0]
            out.append(torch.log_softmax(logits[r.prompt_len - 1 : -1].float() / TEMP, dim=-1))
    return out


def _exact(model, **kw) -> ExactAlpha:
    return ExactAlpha(model, lambda: RULE, TEMP, chunk=7, backend="torch", **kw)


def test_exact_alpha_equals_alpha_exact_of_the_decode_loops_full_distributions_and_bounds_the_topk():
    policy = tiny_policy()
    rollouts, sparse_full = _sampled(policy)
    assert any(0 < b for r in rollouts for b in r.kv_budgets)  # page selection happened
    # Chunk 7 and micro-batches of 3 rows: chunks straddle rows and micro-batches differ in width.
    dense, exact = scores_and_exact(Scorer(policy, chunk=7), rollouts, TEMP, 3, exact=_exact(policy))
    bound = acceptance(rollouts, dense).alpha
    want = torch.cat([alpha_exact(q, p) for q, p in zip(sparse_full, _dense_full(policy, rollouts), strict=True)])
    got = torch.cat(exact)
    assert got.dtype == torch.float64 and got.shape == bound.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert bool((got >= bound.double() - 2e-5).all())
    assert float((got - bound.double()).max()) > 1e-3  # the bound is loose somewhere, so the check has teeth
    assert float(got.min()) < 0.999  # sparsity costs something: not a comparison of two dense passes


def test_learn_carries_the_exact_alpha_of_the_policy_before_its_update_and_refuses_none():
    policy = tiny_policy()
    rollouts, _ = _sampled(policy, count=3)
    # A rollout whose budgets the teacher-forced forward cannot reproduce gets no exact alpha; the rest do.
    odd = dataclasses.replace(rollouts[1], kv_budgets=tuple(b + 3 if b else 0 for b in rollouts[1].kv_budgets))
    batch = [rollouts[0], odd, rollouts[2]]
    _, before = scores_and_exact(Scorer(policy, chunk=7), batch, TEMP, 8, exact=_exact(policy))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    config = UpdateConfig(temperature=TEMP, micro_batch_size=2, lm_head_chunk=7)
    _, acc, _ = learn(policy, opt, Scorer(policy, chunk=7), batch, torch.tensor([1.0, -1.0, 0.5]), config,
                      exact=_exact(policy))  # fmt: skip
    n0, n1 = len(batch[0].token_ids), len(batch[1].token_ids)
    assert bool(acc.exact[n0 : n0 + n1].isnan().all())
    keep = ~acc.exact.isnan()
    torch.testing.assert_close(acc.exact[keep], torch.cat([before[0], before[2]]), atol=1e-6, rtol=0)


def test_a_rollout_served_with_the_adapter_is_scored_through_it():
    policy = tiny_policy()
    distill = DistillSparse(policy, DistillConfig(backend="torch", temperature=TEMP, lm_head_chunk=7))
    perturb_adapter(distill)
    with distill.adapter.on():
        rollouts, _ = _sampled(policy, count=4)
    served = [dataclasses.replace(r, adapter_version=1 if i % 2 else 0) for i, r in enumerate(rollouts)]
    _, exact = scores_and_exact(Scorer(policy, chunk=7), served, TEMP, 4, exact=_exact(policy, adapter=distill.adapter))
    probe = distill.probe(rollouts, RULE)
    sizes = [len(r.token_ids) for r in rollouts]
    with_adapter = torch.split(probe.with_adapter, sizes)
    without = torch.split(probe.without_adapter, sizes)
    for i, got in enumerate(exact):
        want = with_adapter[i] if i % 2 else without[i]
        torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=0)
    assert float((with_adapter[1] - without[1]).abs().max()) > 1e-3  # the adapter changes alpha


def test_the_pad_rollout_of_a_rank_with_nothing_to_score_runs_the_sparse_forward_too():
    policy = tiny_policy()
    pad = Rollout("", 0, (0,), (0,), (0.0,), (), ())
    _, exact = scores_and_exact(Scorer(policy, chunk=7), [pad], TEMP, 1, exact=_exact(policy))
    assert exact[0].shape == (1,) and abs(float(exact[0][0]) - 1.0) < 1e-6  # dense vs dense: alpha 1


def test_a_half_read_log_distributions_leaves_gradients_on():
    from trainer import lm_head

    chunks = lm_head.log_distributions(torch.randn(10, 4), torch.randn(6, 4), chunk=3)
    next(chunks)
    assert torch.is_grad_enabled()
    assert (torch.ones(1, requires_grad=True) * 2).requires_grad


def test_the_float32_chunk_reduction_is_within_1e_7_of_float64_alpha_at_qwen3s_vocabulary():
    from trainer.exact_alpha import chunk_alpha

    g = torch.Generator().manual_seed(0)
    vocab = 151_936
    # Flat, peaked and nearly equal pairs: the normaliser error of a float32 softmax over 151,936
    # entries (~1e-6) would show in every kind; a float32 running sum would too.
    base = torch.randn(6, vocab, generator=g, dtype=torch.float64) * torch.tensor([0.5, 1, 3, 8, 3, 1.0])[:, None]
    base[3, 7] += 30.0  # one token holds nearly all the mass
    noise = torch.randn(6, vocab, generator=g, dtype=torch.float64) * torch.tensor([0.5, 1, 1, 1, 1e-3, 1e-5])[:, None]
    sparse, dense = base + noise, base
    want = alpha_exact(sparse, dense)  # float64 logits throughout
    dense_logp = torch.log_softmax(dense.float(), dim=-1)  # what the scorer hands over: float32 log-probs
    got = chunk_alpha(sparse.float().clone(), dense_logp)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
    # The float64 log-softmax route on the same float32 inputs (what the pass computed before) agrees as closely.
    before = alpha_exact(torch.log_softmax(sparse.float(), dim=-1), dense_logp)
    torch.testing.assert_close(got, before, atol=1e-7, rtol=0)
    assert float(want.min()) < 0.7 and float(want.max()) > 0.99999  # the cases span the range


def test_rows_attended_densely_so_far_get_alpha_1_and_the_rest_their_exact_value():
    from trainer.exact_alpha import sparse_rows
    from trainer.sparse_attention import recorded_plan

    # Row 0: prompt 40, the first budgets cover the context (0), then 32 tokens = 2 pages from response token 3;
    # row 1: no budgets (dense), but served with the adapter.
    plan = recorded_plan([40, 20], [(0, 0, 0, 32, 0, 32), ()], 46)
    mask = torch.zeros(2, 45, dtype=torch.bool)
    mask[0, 39:45] = True
    mask[1, 19:23] = True
    got = sparse_rows(plan.budgets, mask, torch.tensor([False, True]))
    # Response token 3 of row 0 is produced at position 42 (3 pages held, budget 2): it and all after it differ,
    # even token 4, whose own budget is dense, since earlier positions attended sparsely.
    assert got.tolist() == [False, False, False, True, True, True] + [True] * 4
    assert not bool(sparse_rows(plan.budgets, mask, torch.tensor([False, False]))[6:].any())


def test_learn_times_the_exact_pass_apart_from_the_rest_of_the_step():
    import time

    class Slow(ExactAlpha):  # each micro-batch's sparse forward takes 50 ms more: the clock must count them
        def pair(self, rollouts):
            time.sleep(0.05)
            return super().pair(rollouts)

    policy = tiny_policy()
    rollouts, _ = _sampled(policy, count=3)
    config = UpdateConfig(temperature=TEMP, micro_batch_size=2, lm_head_chunk=7)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    adv = torch.tensor([1.0, -1.0, 0.5])
    _, plain, _ = learn(policy, opt, Scorer(policy, chunk=7), rollouts, adv, config)
    assert plain.exact_seconds == 0.0
    start = time.perf_counter()
    _, acc, _ = learn(policy, opt, Scorer(policy, chunk=7), rollouts, adv, config,
                      exact=Slow(policy, lambda: RULE, TEMP, chunk=7, backend="torch"))  # fmt: skip
    wall = time.perf_counter() - start
    assert 2 * 0.05 <= acc.exact_seconds < wall  # two micro-batches of 2 rows; the update is not the pass's
