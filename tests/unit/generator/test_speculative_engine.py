"""The reference engine's speculative mode: lossless output from block-sparse drafts and a dense verify.

Checked against the engine's own dense decode (groups marked dense), the trainer's teacher-forced
dense and sparse scoring (trainer.scoring), and a float64 recomputation of alpha from the very
distributions the verify step compared. The schedules are aggressive (3 of 4+ pages kept, every
layer sparse), so the lossy sparse mode really does decode other tokens.
"""

import random

import pytest
import torch

from services.generator import speculative_decode
from services.generator.engine import EngineError
from services.generator.reference_engine import ReferenceEngine
from sparrow import speculative
from sparrow.schedule import Schedule
from sparrow.work import PromptGroup, Sampling
from tests.stats import chi_square_pvalue
from tests.unit.generator.tiny_models import SMALL, TINY, chain_prompt
from trainer.model_io import load_model
from trainer.scoring import Scorer

GREEDY = 1e-6  # top_p this small keeps one token: greedy, on every path of the engine
TIE_EPS = 1e-4  # dense top-2 logit margins below this may flip under kernel rounding: exempt, counted
FALSE_ALARM = 1e-4
AGGRESSIVE = Schedule(budgets=(48, 64), bin_width=64, dense_layers=(), version=3)
OTHER = Schedule(budgets=(48, 64, 96), bin_width=128, dense_layers=(0,), version=4)


def _engine(decode: str, k: int = 6, **kw) -> ReferenceEngine:
    return ReferenceEngine(TINY, kernel_backend="torch", max_model_len=1024, decode=decode, speculative_tokens=k, **kw)


def _random_prompt(seed: int, n: int = 61) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(5, 500) for _ in range(n - 1)]


def _one(engine, prompt, gid="g", n=1, dense=False, **sampling) -> list:
    engine.submit(PromptGroup(gid, tuple(prompt), n, 0, Sampling(**sampling), dense=dense))
    return sorted(engine.step(), key=lambda s: s.sample_index)


def _argmax_misses(model_dir, prompt, tokens) -> tuple[int, int]:
    """Positions whose token is not the dense teacher-forced argmax: (misses, near-ties exempted)."""
    full = Scorer(load_model(model_dir), backend="torch").score([prompt + tokens], [len(prompt)], full=True)[0]
    top2 = full.full_logprobs.topk(2, dim=-1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    wrong = top2.indices[:, 0] != torch.tensor(tokens)
    return int((wrong & (margin >= TIE_EPS)).sum()), int((wrong & (margin < TIE_EPS)).sum())


def test_greedy_speculation_is_dense_greedy_token_for_token_across_schedule_and_policy_swaps():
    spec, lossy = _engine("speculative"), _engine("sparse")
    cases = [(TINY, AGGRESSIVE, _random_prompt(6)), (SMALL, OTHER, _random_prompt(1, 120))]
    for model_dir, schedule, prompt in cases:
        if model_dir == SMALL:  # a policy pushed between groups: both engines now serve the new weights
            spec.load_policy(SMALL, 7)
            lossy.load_policy(SMALL, 7)
        spec.set_schedule(schedule)
        lossy.set_schedule(schedule)
        settings = {"top_p": GREEDY, "max_new_tokens": 400}
        [fast] = _one(spec, prompt, **settings)
        [dense] = _one(spec, prompt, gid="d", dense=True, **settings)  # the same engine, decoding densely
        [sparse] = _one(lossy, prompt, **settings)
        assert len(fast.token_ids) >= 200, "a long decode"
        assert fast.token_ids == dense.token_ids
        assert sparse.token_ids != dense.token_ids  # lossy sparse decoding really differs under this schedule
        assert fast.kv_budgets == [0] * len(fast.token_ids) and fast.versions.schedule_version == schedule.version
        assert 0 < fast.accepted_tokens < fast.drafted_tokens and fast.drafted_tokens % 6 == 0
        misses, exempt = _argmax_misses(model_dir, prompt, fast.token_ids)
        print(f"{model_dir.name}: {len(fast.token_ids)} tokens, {exempt} near ties exempted (margin < {TIE_EPS})")
        assert misses == 0 and exempt <= len(fast.token_ids) // 100
    assert spec.versions.policy_version == 7


def _second_tokens(engine, prompt, n, temperature):
    samples = _one(engine, prompt, n=n, temperature=temperature, max_new_tokens=2)
    firsts = [s.token_ids[0] for s in samples]
    first = max(set(firsts), key=firsts.count)
    seconds = torch.tensor([s.token_ids[1] for s in samples if s.token_ids[0] == first and len(s.token_ids) == 2])
    return first, seconds, samples


def test_sampled_tokens_follow_the_dense_distribution_and_a_broken_rejection_step_is_caught(monkeypatch):
    # After this prefix the tiny model looks a name up; three pages of the sparse draft lose it (alpha about 0.13 at
    # temperature 1.5), so draft and dense distributions differ a lot at the first drafted position.
    prompt = chain_prompt(pairs=16, hops=8) + [16, 282, 301, 4, 15]
    temperature = 1.5
    scorer = Scorer(load_model(TINY), backend="torch")
    engine = _engine("speculative", k=2)
    engine.set_schedule(Schedule(budgets=(48,), bin_width=4096, dense_layers=()))
    first, seconds, samples = _second_tokens(engine, prompt, 2500, temperature)
    dense = scorer.score([prompt + [first, 0]], [len(prompt)], temperature=temperature, full=True)[0]
    p = dense.full_logprobs[1].exp()
    assert seconds.numel() > 1500
    assert chi_square_pvalue(torch.bincount(seconds, minlength=p.numel()), p) > FALSE_ALARM
    assert max(s.draft_alphas[0] for s in samples if s.token_ids[0] == first) < 0.5  # drafts often rejected
    # The one allowed patch: an acceptance rule that keeps every draft emits the draft's distribution instead.
    monkeypatch.setattr(speculative, "accepts", lambda pd, qd, u: torch.ones_like(u, dtype=torch.bool))
    _, broken, _ = _second_tokens(engine, prompt, 2500, temperature)
    assert chi_square_pvalue(torch.bincount(broken, minlength=p.numel()), p) < FALSE_ALARM


def test_alpha_is_a_float64_sum_min_of_the_verify_and_draft_distributions(monkeypatch):
    seen = []
    real = speculative_decode.verify_drafts

    def recording(p, q, drafts, generator=None):
        seen.append((p.clone(), q.clone()))
        return real(p, q, drafts, generator)

    monkeypatch.setattr(speculative_decode, "verify_drafts", recording)  # a spy: the real rule still runs
    engine = _engine("speculative", k=4)
    engine.set_schedule(AGGRESSIVE)
    prompt = chain_prompt(pairs=16, hops=8)
    samples = _one(engine, prompt, n=2, temperature=0.8, max_new_tokens=60)
    for i, s in enumerate(samples):
        cycles = len(s.draft_alphas) // 4
        want = torch.cat([torch.minimum(p[i, :4].double(), q[i].double()).sum(-1) for p, q in seen[:cycles]])
        torch.testing.assert_close(torch.tensor(s.draft_alphas, dtype=torch.float64), want, atol=1e-6, rtol=0)
        assert s.draft_kv_lens[:4] == [len(prompt) + 1 + j for j in range(4)] and len(s.draft_kv_lens) == 4 * cycles
    # The two distributions are the real ones: at the first drafted position (after the prefill's token) p is the
    # teacher-forced dense policy and q the teacher-forced block-sparse actor under the same schedule.
    scorer = Scorer(load_model(TINY), backend="torch")
    seq = [prompt + samples[0].token_ids]
    dense = scorer.score(seq, [len(prompt)], temperature=0.8, full=True)[0].full_logprobs[1].exp()
    sparse = scorer.score(seq, [len(prompt)], schedule=AGGRESSIVE, temperature=0.8, full=True)[0].full_logprobs[1]
    p0, q0 = seen[0]
    torch.testing.assert_close(p0[0, 0], dense, atol=1e-5, rtol=0)
    torch.testing.assert_close(q0[0, 0], sparse.exp(), atol=1e-5, rtol=0)
    assert min(a for s in samples for a in s.draft_alphas) < 0.9  # somewhere the drafts really were another model


def test_emitted_logprobs_and_top_lists_are_dense_scoring_and_budgets_read_dense():
    engine = _engine("speculative", k=3)
    engine.set_schedule(AGGRESSIVE)
    prompt = chain_prompt(pairs=16, hops=8)
    scorer = Scorer(load_model(TINY), backend="torch")
    for s in _one(engine, prompt, n=2, temperature=0.7, max_new_tokens=120, top_logprobs=20):
        seq = [prompt + s.token_ids]
        dense = scorer.score(seq, [len(prompt)], temperature=0.7)[0]
        torch.testing.assert_close(torch.tensor(s.logprobs), dense.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(s.top_logprobs), dense.top_logprobs, atol=1e-4, rtol=0)
        assert s.kv_budgets == [0] * len(s.token_ids)
        sparse = scorer.score(seq, [len(prompt)], schedule=AGGRESSIVE, temperature=0.7)[0]
        assert float((dense.logprobs - sparse.logprobs).abs().max()) > 1e-4  # the drafts' schedule was lossy here
        assert 0 <= s.accepted_tokens <= s.drafted_tokens and len(s.draft_alphas) == s.drafted_tokens


def test_the_engine_times_every_cycle_drafts_apart_from_the_verify():
    engine = _engine("speculative", k=4)
    engine.set_schedule(AGGRESSIVE)
    assert engine.take_cycle_times() == []
    prompt = _random_prompt(3)
    samples = _one(engine, prompt, n=2, max_new_tokens=40, top_p=GREEDY)
    times = engine.take_cycle_times()
    assert engine.take_cycle_times() == []  # handed out once
    # Each cycle emits at least one token per row, at most k + 1: the longer sample's tokens bound the count.
    longest = max(len(s.token_ids) for s in samples)
    assert (longest - 1) / 5 <= len(times) <= longest - 1
    assert all(t.rows == 2 and t.draft_seconds > 0 and t.verify_seconds > 0 for t in times)
    kv = [t.kv_len for t in times]
    assert kv[0] == len(prompt) + 1 and kv == sorted(kv) and kv[-1] <= len(prompt) + 40
    # A sparse engine drafts nothing: nothing timed.
    lossy = _engine("sparse")
    lossy.set_schedule(AGGRESSIVE)
    _one(lossy, prompt, max_new_tokens=8)
    assert lossy.take_cycle_times() == []


def test_refusals_are_one_line_and_leave_the_engine_serving(tmp_path):
    for bad in ({"speculative_tokens": 0}, {"speculative_tokens": 17}, {"decode": "lossy"}):
        with pytest.raises(EngineError, match="speculative_tokens must be in|decode must be one of") as info:
            ReferenceEngine(TINY, kernel_backend="torch", **bad)
        assert "\n" not in str(info.value)
    engine = _engine("speculative")
    engine.set_schedule(AGGRESSIVE)
    with pytest.raises(EngineError, match="needs a schedule with a sparse layer") as info:
        engine.set_schedule(Schedule(budgets=(48,), dense_layers=(0, 1, 2, 3), version=9))
    assert "\n" not in str(info.value) and engine.versions.schedule_version == 3
    with pytest.raises(EngineError, match="does not take DistillSparse adapters"):
        engine.load_adapter(tmp_path, 1)
    assert engine.versions.adapter_version == 0
    # A probe applies to sparse samples only: a lossless sample has no lossy tail to measure.
    import time

    from sparrow.probe import Probe

    engine.set_probe(Probe(3, 1.0, (48, 48), time.time() + 60))
    assert engine.probe_plan is not None
    assert not any(s.probe for s in _one(engine, chain_prompt(pairs=16, hops=8), n=2, max_new_tokens=10))
    engine.set_probe(None)
    # No schedule yet (dense until the controller publishes one): dense decoding, no drafts.
    engine.set_schedule(None)
    [s] = _one(engine, chain_prompt(), max_new_tokens=10)
    assert s.drafted_tokens == 0 and s.kv_budgets == [0] * len(s.token_ids)
    _engine("sparse").set_schedule(Schedule(budgets=(48,), dense_layers=(0, 1, 2, 3)))  # lossy mode takes it


def test_a_group_may_ask_for_speculation_from_a_sparse_engine_and_is_refused_under_an_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    engine = _engine("sparse")
    engine.set_schedule(AGGRESSIVE)
    prompt = _random_prompt(6)
    settings = Sampling(top_p=GREEDY, max_new_tokens=120)
    engine.submit(PromptGroup("s", tuple(prompt), 1, 0, settings, decode="speculative"))
    engine.submit(PromptGroup("d", tuple(prompt), 1, 0, settings, dense=True))
    engine.submit(PromptGroup("l", tuple(prompt), 1, 0, settings))
    [fast], [dense], [lossy] = engine.step(), engine.step(), engine.step()
    assert fast.token_ids == dense.token_ids != lossy.token_ids and fast.drafted_tokens > 0
    get_peft_model(load_model(TINY), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    engine.load_adapter(tmp_path / "a", 1)
    with pytest.raises(EngineError, match="asks for speculative decoding, which does not take"):
        engine.submit(PromptGroup("s2", tuple(prompt), 1, 0, settings, decode="speculative"))
    assert engine.in_flight == 0


def test_a_generator_in_speculative_mode_refuses_an_all_dense_start_schedule_in_one_line(tmp_path):
    from services.generator.config import GeneratorConfig
    from services.generator.main import Generator, SetupError, build_engine
    from sparrow.config import load_config

    dense_only = tmp_path / "dense.json"
    Schedule(budgets=(48,), dense_layers=(0, 1, 2, 3)).save(dense_only)
    engine = {"engine.kind": "reference", "engine.model_dir": str(TINY), "engine.kernel_backend": "torch"}
    config = load_config(
        GeneratorConfig, overrides={**engine, "engine.decode": "speculative", "schedule.initial": str(dense_only)}
    )
    built = build_engine(config)
    assert (built.decode, built.speculative_tokens) == ("speculative", 6)
    with pytest.raises(SetupError, match="schedule.initial: the engine refused it: decode speculative needs") as info:
        Generator(config, engine=built)  # nothing is contacted before the start schedule is applied
    assert "\n" not in str(info.value)
