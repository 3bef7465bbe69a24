"""Exact alpha of the trainer's sparse forward equals alpha_exact of the vLLM engine's own full distributions.

The `small` model's vocabulary (521 entries) fits under vLLM's logprob limit, so the engine (vLLM CPU,
the project's block-sparse plugin, every layer sparse) returns every entry's logprob at each decode
step: its whole sampling distribution q. The trainer's exact pass (trainer/exact_alpha.py), teacher-forced
under the budgets the engine reported, must give alpha_exact(q_engine, p_dense) per token, p_dense the
trainer's dense distribution; and it is never below the top-20 bound of the same tokens.
"""

import random

import pytest
import torch

from sparrow.acceptance import alpha_exact, alpha_topk
from sparrow.schedule import Schedule
from sparrow.tasks.chain import ChainTask
from sparrow.tasks.vocab import encode_words
from sparrow.work import PromptGroup, Sampling
from tests.integration.distill.adapter_push import as_rollouts
from tests.unit.generator.tiny_models import SMALL
from trainer.distill import BlockRule
from trainer.exact_alpha import ExactAlpha
from trainer.model_io import load_model
from trainer.rl_update import scores_and_exact
from trainer.scoring import Scorer

pytestmark = pytest.mark.slow

SCHEDULE = Schedule(budgets=(48, 64, 80, 96), bin_width=64, dense_layers=(), version=3, name="exact-vllm")
VOCAB = 521


def test_exact_alpha_equals_alpha_exact_of_the_engines_full_distributions():
    torch.set_num_threads(1)
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(
        VllmEngineConfig(model=str(SMALL), max_model_len=1024, max_num_seqs=4, top_logprobs=VOCAB), schedule=SCHEDULE
    )
    try:
        for i in range(2):
            prompt = [1, *encode_words(ChainTask(64, 40, 40).sample(random.Random(i)).prompt)]
            engine.submit(PromptGroup(f"g{i}", tuple(prompt), 1, 0, Sampling(max_new_tokens=50, top_logprobs=VOCAB)))
        done = []
        while engine.in_flight:
            done.extend(engine.step())
    finally:
        engine.close()
    samples = sorted(done, key=lambda s: s.group_id)
    rollouts = as_rollouts(samples)
    assert all(len(t) == VOCAB for r in rollouts for t in r.top_ids)  # the whole distribution, every token
    assert any(b > 0 for r in rollouts for b in r.kv_budgets)  # page selection happened
    model = load_model(SMALL)
    exact = ExactAlpha(model, lambda: BlockRule.of(SCHEDULE), 1.0, chunk=16)
    dense, got = scores_and_exact(Scorer(model, chunk=16), rollouts, 1.0, 2, exact=exact)
    for r, d, a in zip(rollouts, Scorer(model).score([r.sequence for r in rollouts], [r.prompt_len for r in rollouts],
                                                      full=True), got, strict=True):  # fmt: skip
        q = torch.full((len(r.token_ids), VOCAB), float("-inf"), dtype=torch.float64)
        q.scatter_(1, torch.tensor(r.top_ids), torch.tensor(r.top_logprobs, dtype=torch.float64))
        want = alpha_exact(q, d.full_logprobs)
        torch.testing.assert_close(a, want, atol=1e-4, rtol=0)
        bound = alpha_topk(torch.tensor(r.top_ids)[:, :20], torch.tensor(r.top_logprobs)[:, :20], d.top_ids,
                           d.top_logprobs)  # fmt: skip
        assert bool((a >= bound.double() - 1e-4).all())
    assert float(torch.cat(got).min()) < 0.999  # sparsity costs something here: not two dense passes compared
