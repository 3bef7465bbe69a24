"""The reference engine: sampling settings, budgets per position, refusals, in-place policy and LoRA swaps.

Its outputs are checked against teacher-forced scoring of the same tokens (trainer.scoring), so the
logprobs and budgets it reports are the ones the trainer would recompute.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.generator.engine import FINISH_LENGTH, FINISH_STOP, EngineError
from sparrow import metrics_contract as mc
from sparrow.schedule import Schedule
from sparrow.timing import PhaseTimer
from sparrow.work import PromptGroup, Sampling
from tests.unit.generator.tiny_models import SMALL, TINY, chain_prompt
from trainer.model_io import load_model
from trainer.scoring import Scorer

EOS = 2


def _group(gid="g", n=3, prompt=None, **sampling) -> PromptGroup:
    sampling.setdefault("max_new_tokens", 40)
    return PromptGroup(gid, tuple(prompt or chain_prompt()), n, 0, Sampling(**sampling))


def _logits(model, ids=(1, 40, 50, 60, 7)) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits


def test_a_group_yields_n_complete_samples_that_stop_at_eos(engine):
    engine.submit(_group(n=3, top_logprobs=5))
    assert engine.in_flight == 3 and engine.has_work()
    samples = engine.step()
    assert engine.in_flight == 0 and not engine.has_work() and engine.step() == []
    assert sorted(s.sample_index for s in samples) == [0, 1, 2]
    for s in samples:
        n = len(s.token_ids)
        assert 0 < n <= 40 and len(s.logprobs) == len(s.kv_budgets) == len(s.top_token_ids) == n
        assert all(len(ids) == len(lps) == 5 for ids, lps in zip(s.top_token_ids, s.top_logprobs, strict=True))
        assert all(lps == sorted(lps, reverse=True) for lps in s.top_logprobs)
        assert all(lp <= top[0] + 1e-6 for lp, top in zip(s.logprobs, s.top_logprobs, strict=True))
        assert s.finish_reason == (FINISH_STOP if s.token_ids[-1] == EOS else FINISH_LENGTH)
        assert EOS not in s.token_ids[:-1]
        assert s.kv_budgets == [0] * n  # no schedule: dense everywhere
    assert any(s.finish_reason == FINISH_STOP for s in samples)  # the tiny model answers and ends


def test_a_steps_tokens_are_taken_as_generated_and_its_time_splits_into_prefill_decode_sampling(engine):
    timer = PhaseTimer(mc.GENERATOR_PHASES)
    engine.time_phases(timer)
    engine.take_generated()  # whatever earlier tests generated
    try:
        engine.submit(_group("timed", n=2, max_new_tokens=30))
        with timer.phase("decode"):  # as the service calls it: engine time not told apart is decode
            samples = engine.step()
        split = timer.take()
        generated = engine.take_generated()
    finally:
        engine.time_phases(None)
    # The group is generated whole in its step: every token is taken from the step that generated it, once.
    assert sorted((g.group_id, g.sample_index, g.first, g.kv_budgets) for g in generated) == sorted(
        (s.group_id, s.sample_index, 0, s.kv_budgets) for s in samples
    )
    assert all(g.prompt_len == len(samples[0].prompt_token_ids) for g in generated)
    assert engine.take_generated() == []
    assert split["prefill"] > 0 and split["decode"] > 0 and split["sampling"] > 0
    assert split["weight_sync"] == split["idle"] == 0


def test_budgets_follow_the_schedule_and_scores_match_teacher_forced_scoring(engine):
    # 53-token prompts answered in about 36 tokens: 4 to 6 pages of KV against 3, then 4 kept
    schedule = Schedule(budgets=(48, 64), bin_width=64, dense_layers=(), version=3)
    engine.set_schedule(schedule)
    prompt = chain_prompt(pairs=16, hops=8)
    engine.submit(_group(n=2, prompt=prompt, temperature=0.7, max_new_tokens=60))
    samples = engine.step()
    scorer = Scorer(load_model(TINY), backend="torch")
    for s in samples:
        assert s.versions.schedule_version == 3
        assert s.kv_budgets[0] == 0  # the first token comes from the dense prefill
        plen = len(prompt)
        scheduled = [schedule.budget_for(plen + i) for i in range(1, len(s.token_ids))]
        assert s.kv_budgets[1:] == [b if b < plen + i else 0 for i, b in enumerate(scheduled, start=1)]
        assert 48 in s.kv_budgets and 64 in s.kv_budgets  # both bins were really sparse
        sparse = scorer.score([prompt + s.token_ids], [plen], schedule=schedule, temperature=0.7)[0]
        torch.testing.assert_close(torch.tensor(s.logprobs), sparse.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(s.top_logprobs)[:, :5], sparse.top_logprobs[:, :5], atol=1e-4, rtol=0)
        dense = scorer.score([prompt + s.token_ids], [plen], temperature=0.7)[0]
        assert float((dense.logprobs - sparse.logprobs).abs().max()) > 1e-4  # the schedule really was sparse


def test_a_dense_group_decodes_densely_under_a_sparse_schedule(engine):
    # Evaluation groups (dense) attend to everything whatever the schedule; the trainer's dense scoring agrees.
    schedule = Schedule(budgets=(48, 64), bin_width=64, dense_layers=(), version=3)
    engine.set_schedule(schedule)
    prompt = chain_prompt(pairs=16, hops=8)
    engine.submit(PromptGroup("dense", tuple(prompt), 2, 0, Sampling(temperature=0.7, max_new_tokens=40), dense=True))
    samples = engine.step()
    scorer = Scorer(load_model(TINY), backend="torch")
    for s in samples:
        assert s.kv_budgets == [0] * len(s.token_ids) and not s.probe
        dense = scorer.score([prompt + s.token_ids], [len(prompt)], temperature=0.7)[0]
        torch.testing.assert_close(torch.tensor(s.logprobs), dense.logprobs, atol=1e-4, rtol=0)
        sparse = scorer.score([prompt + s.token_ids], [len(prompt)], schedule=schedule, temperature=0.7)[0]
        assert float((dense.logprobs - sparse.logprobs).abs().max()) > 1e-4  # the schedule would have mattered


def test_tiny_top_p_is_greedy_and_max_new_tokens_cuts(engine):
    engine.submit(_group(n=3, top_p=1e-6, max_new_tokens=6))
    samples = engine.step()
    assert len({tuple(s.token_ids) for s in samples}) == 1
    for s in samples:
        assert len(s.token_ids) == 6 and s.finish_reason == FINISH_LENGTH
        assert [ids[0] for ids in s.top_token_ids] == s.token_ids


def test_abort_drops_a_queued_group_and_refusals_name_the_problem(engine):
    engine.submit(_group("a", n=2))
    engine.submit(_group("b", n=1))
    with pytest.raises(EngineError, match="already in the batch"):
        engine.submit(_group("a"))
    engine.abort("a")
    assert engine.in_flight == 1
    assert {s.group_id for s in engine.step()} == {"b"}
    with pytest.raises(EngineError, match="outside the model's vocabulary"):
        engine.submit(_group("v", prompt=[1, 5, 100000]))
    with pytest.raises(EngineError, match="max_model_len 256"):
        engine.submit(_group("long", prompt=[5] * 300))
    with pytest.raises(EngineError, match="page"):
        engine.set_schedule(Schedule(budgets=(96,), page_size=32))


def test_load_policy_swaps_weights_in_place_and_refuses_what_does_not_fit(engine, tmp_path):
    before = _logits(engine.model)
    engine.load_policy(SMALL, 7)
    assert engine.versions.policy_version == 7
    torch.testing.assert_close(_logits(engine.model), _logits(load_model(SMALL)))
    assert not torch.allclose(before, _logits(engine.model))
    engine.submit(_group())
    assert all(s.versions.policy_version == 7 for s in engine.step())

    nan = tmp_path / "nan"
    shutil.copytree(SMALL, nan)
    weights = load_file(nan / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, nan / "model.safetensors")
    other = tmp_path / "other"
    shutil.copytree(SMALL, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (other / "config.json").write_text(json.dumps(config))
    now = _logits(engine.model)
    with pytest.raises(EngineError, match="NaN"):
        engine.load_policy(nan, 8)
    with pytest.raises(EngineError, match="policy v9"):
        engine.load_policy(other, 9)
    with pytest.raises(EngineError, match="no such model folder"):
        engine.load_policy(tmp_path / "missing", 10)
    assert engine.versions.policy_version == 7
    torch.testing.assert_close(_logits(engine.model), now)


def _adapter(folder, r, targets, seed, rank_in_config=None, base=TINY):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # the same seed draws the same LoRA weights on either base model
    peft_model = get_peft_model(
        load_model(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    )
    peft_model.save_pretrained(folder)
    if rank_in_config is not None:
        config = json.loads((folder / "adapter_config.json").read_text())
        config["r"] = rank_in_config
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return peft_model


def test_lora_adapters_load_replace_each_other_and_bad_ones_leave_the_old_serving(engine, tmp_path):
    one = _adapter(tmp_path / "a1", 4, ["q_proj", "v_proj"], seed=1)
    two = _adapter(tmp_path / "a2", 8, ["k_proj", "o_proj"], seed=2)
    base = _logits(engine.model)
    engine.load_adapter(tmp_path / "a1", 1)
    assert engine.versions.adapter_version == 1
    torch.testing.assert_close(_logits(engine.model), _logits(one))
    assert not torch.allclose(_logits(engine.model), base)
    engine.load_adapter(tmp_path / "a2", 2)  # other rank, other layers: v1 is gone entirely
    torch.testing.assert_close(_logits(engine.model), _logits(two))
    engine.submit(_group())
    assert all(s.versions.adapter_version == 2 for s in engine.step())

    _adapter(tmp_path / "big", 16, ["q_proj"], seed=3)
    _adapter(tmp_path / "lying", 4, ["q_proj"], seed=4, rank_in_config=2)
    nan = tmp_path / "nan"
    _adapter(nan, 4, ["q_proj"], seed=5)
    weights = load_file(nan / "adapter_model.safetensors")
    next(iter(weights.values()))[0, 0] = float("inf")
    save_file(weights, nan / "adapter_model.safetensors")
    serving = _logits(engine.model)
    with pytest.raises(EngineError, match="rank 16, above max_lora_rank 8"):
        engine.load_adapter(tmp_path / "big", 3)
    with pytest.raises(EngineError, match=r"needs A \[2, 64\]"):
        engine.load_adapter(tmp_path / "lying", 4)
    with pytest.raises(EngineError, match="NaN or infinite"):
        engine.load_adapter(nan, 5)
    with pytest.raises(EngineError, match="cannot read"):
        engine.load_adapter(tmp_path / "missing", 6)
    assert engine.versions.adapter_version == 2
    torch.testing.assert_close(_logits(engine.model), serving)

    engine.load_policy(SMALL, 3)  # a policy swap under an adapter keeps the adapter on top of the new weights
    expected = _adapter(tmp_path / "on-small", 8, ["k_proj", "o_proj"], seed=2, base=SMALL)
    torch.testing.assert_close(_logits(engine.model), _logits(expected))
    assert engine.versions == type(engine.versions)(3, 2, 0)


def test_probe_samples_decode_at_the_probe_budgets_and_score_like_them(engine):
    import time

    from sparrow.probe import Probe

    schedule = Schedule(budgets=(48, 80), bin_width=64, dense_layers=(), version=4)
    engine.set_schedule(schedule)
    with pytest.raises(EngineError, match="multiple of the page size"):
        engine.set_probe(Probe(4, 0.5, (40, None), time.time() + 60))
    engine.set_probe(Probe(4, 0.5, (None, 48), time.time() + 60))  # every other sample, bin 1 at 48
    prompt = chain_prompt(pairs=16, hops=8)
    engine.submit(_group(n=2, prompt=prompt, temperature=0.7, max_new_tokens=60))
    plain, probe = sorted(engine.step(), key=lambda s: s.sample_index)
    # An evaluation group under the schedule (eval.modes "schedule") is never probed: its samples are the schedule's.
    g = _group("ev", n=2, prompt=prompt, temperature=0.7, max_new_tokens=60)
    engine.submit(PromptGroup(**{**g.__dict__, "evaluation": True}))
    evaluated = engine.step()
    engine.set_probe(None)
    engine.set_schedule(None)
    assert (plain.probe, probe.probe) == (False, True)
    plen = len(prompt)
    for s in evaluated:
        assert (
            not s.probe
            and 80 in s.kv_budgets
            and s.kv_budgets[1:]
            == [
                b if b < plen + i else 0
                for i, b in ((i, schedule.budget_for(plen + i)) for i in range(1, len(s.token_ids)))
            ]
        )
    probe_schedule = schedule.with_budgets((48, 48))  # the probe's budgets as a schedule, for the scorer
    scorer = Scorer(load_model(TINY), backend="torch")
    for s, rule in ((plain, schedule), (probe, probe_schedule)):
        want = [0] + [
            b if b < plen + i else 0 for i, b in ((i, rule.budget_for(plen + i)) for i in range(1, len(s.token_ids)))
        ]
        assert s.kv_budgets == want
        scored = scorer.score([prompt + s.token_ids], [plen], schedule=rule, temperature=0.7)[0]
        torch.testing.assert_close(torch.tensor(s.logprobs), scored.logprobs, atol=1e-4, rtol=0)
    assert 80 in plain.kv_budgets and probe.kv_budgets[-1] == 48  # the probe ran below the schedule
    # The probe sample's logprobs are not the schedule's: the override mattered.
    as_scheduled = scorer.score([prompt + probe.token_ids], [plen], schedule=schedule, temperature=0.7)[0]
    assert float((as_scheduled.logprobs - torch.tensor(probe.logprobs)).abs().max()) > 1e-4


def test_a_probe_for_another_schedule_version_or_expired_runs_no_probe_samples(engine):
    import time

    from sparrow.probe import Probe

    schedule = Schedule(budgets=(64, 96), bin_width=64, dense_layers=(), version=5)
    engine.set_schedule(schedule)
    for probe in (Probe(4, 1.0, (48, 48), time.time() + 60), Probe(5, 1.0, (48, 48), time.time() - 1)):
        engine.set_probe(probe)
        assert engine.probe_plan is None
        engine.submit(_group(n=2, max_new_tokens=8))
        assert not any(s.probe for s in engine.step())
    engine.set_probe(None)
    engine.set_schedule(None)


def test_generation_stops_at_every_eos_id_of_generation_config_and_the_groups(tmp_path):
    from services.generator.reference_engine import ReferenceEngine
    from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint

    folder = build_qwen3_checkpoint(tmp_path / "qwen3")
    engine = ReferenceEngine(folder, kernel_backend="torch", max_model_len=256, max_lora_rank=8)
    assert engine.eos_ids == [2, 0]  # config.json has <|im_end|> alone; generation_config.json adds <|endoftext|>
    # Every id a stop id: each sample ends at its first token, as "stop".
    vocab = tuple(range(engine.vocab_size))
    engine.submit(PromptGroup("g", (1, 5, 6), 3, 0, Sampling(max_new_tokens=20, stop_token_ids=vocab)))
    samples = engine.step()
    assert [(len(s.token_ids), s.finish_reason) for s in samples] == [(1, FINISH_STOP)] * 3
