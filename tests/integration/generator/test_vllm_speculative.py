"""Lossless self-speculative decoding on the vLLM engine (vLLM CPU, for real): the model drafts for itself through
the plugin's block-sparse attention over its own KV cache, vLLM verifies densely and rejection-samples.

The dense reference is the trainer's teacher-forced dense scoring of the engine's own tokens: under greedy
decoding every emitted token must be the dense argmax at its position (positions whose dense top-2 margin is
below EPS are exempt, counted), so the output is dense greedy decoding token for token; sampled tokens carry
the dense policy's logprobs. The same engine also decodes a lossy sparse schedule's drafts visibly: fewer
drafts are accepted than were made, so the drafts are not dense ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparrow.schedule import Schedule
from sparrow.work import PromptGroup, Sampling
from tests.stats import chi_square_pvalue

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SMALL = REPO / "models" / "small"
EPS = 1e-4  # a dense top-2 margin below this may flip between two dense kernels' rounding
# Aggressive budgets (layers 0-1 dense): a plain sparse decode of these prompts departs from dense greedy.
AGGRESSIVE = Schedule(budgets=(64, 64), bin_width=128, name="aggressive")
OTHER = Schedule(budgets=(48, 96), bin_width=128, name="other", version=2)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    config = VllmEngineConfig(model=str(SMALL), max_model_len=1024, max_num_seqs=16, speculative_tokens=4,
                              ignore_eos=True)  # fmt: skip
    eng = VllmEngine(config, schedule=AGGRESSIVE)
    yield eng
    eng.close()


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(t) for t in torch.randint(3, 500, (length,), generator=g))


def _dense_logprobs(samples) -> list[torch.Tensor]:
    from trainer.model_io import load_model

    model = load_model(SMALL).eval()
    rows = []
    for s in samples:
        seq = s.prompt_token_ids + s.token_ids
        plen = len(s.prompt_token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
        rows.append(torch.log_softmax(logits[plen - 1 : len(seq) - 1].double(), -1))
    return rows


def _drain(engine, steps: int | None = None) -> list:
    out = []
    while engine.in_flight and (steps is None or steps > 0):
        out.extend(engine.step())
        steps = None if steps is None else steps - 1
    return out


def test_greedy_output_is_dense_greedy_token_for_token_with_the_schedule_swapped_mid_decode(engine):
    before = engine.speculative_counts()
    # Counting prompts: on these a plain sparse decode under AGGRESSIVE leaves dense greedy within 30 tokens.
    for i in range(2):
        prompt = tuple(range(5 + i, 60 + i))
        engine.submit(PromptGroup(f"g{i}", prompt, 1, 0, Sampling(max_new_tokens=300, temperature=0.0)))
    out = _drain(engine, steps=20)
    engine.set_schedule(OTHER)  # between two engine steps, as the controller does
    out += _drain(engine)
    engine.set_schedule(AGGRESSIVE)
    assert len(out) == 2 and all(len(s.token_ids) == 300 for s in out)
    exempt = 0
    for s, lp in zip(out, _dense_logprobs(out), strict=True):
        top2 = lp.topk(2, dim=-1)
        margin = top2.values[:, 0] - top2.values[:, 1]
        emitted = torch.tensor(s.token_ids)
        wrong = (emitted != top2.indices[:, 0]) & (margin >= EPS)
        assert not bool(wrong.any()), f"{s.group_id}: not the dense argmax at {wrong.nonzero()[:5].tolist()}"
        exempt += int((margin < EPS).sum())
        assert all(b == 0 for b in s.kv_budgets)  # every emitted token is the dense policy's
        # Greedy: alpha is 1 where the draft is the verify's argmax, and only such a draft is accepted.
        assert set(s.draft_alphas) <= {0.0, 1.0}
        assert all(a == 1.0 for a, ok in zip(s.draft_alphas, s.draft_accepted, strict=True) if ok)
    assert exempt <= 6, exempt
    counts = {k: v - before[k] for k, v in engine.speculative_counts().items()}
    # The drafts ran under the schedule: some were rejected (dense drafts are all accepted), most accepted.
    assert 0 < counts["accepted"] < counts["drafted"] and counts["drafted"] == 4 * counts["cycles"]
    assert counts["accepted"] > 0.5 * counts["drafted"]


def test_the_engine_times_its_cycles_drafts_apart_from_the_verify(engine, monkeypatch):
    from services.generator import vllm_engine

    monkeypatch.setattr(vllm_engine, "CYCLE_TIMES_EVERY_S", 0.0)
    engine.take_cycle_times()  # what earlier tests left
    prompts = [tuple(range(5 + i, 200 + i)) for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.submit(PromptGroup(f"t{i}", prompt, 1, 0, Sampling(max_new_tokens=120, temperature=0.0)))
    steps, times = 0, []
    while engine.in_flight:
        engine.step()
        steps += 1
        times += engine.take_cycle_times()
    # Decodes alone are timed: every step but the prefill's and the ones where a row ends (fewer drafts).
    assert 0.6 * steps <= len(times) < steps, (len(times), steps)
    assert times[0].rows == 3 and all(1 <= t.rows <= 3 for t in times)  # rows end at different steps
    assert all(t.draft_seconds > 0 and t.verify_seconds > 0 for t in times)
    assert 196 <= times[0].kv_len < 210 and all(196 <= t.kv_len <= 195 + 120 + 4 + 2 for t in times)
    # Four draft steps of the small model cost more than its one verify forward, and not forty times more.
    ratio = sum(t.draft_seconds for t in times) / sum(t.verify_seconds for t in times)
    assert 0.5 < ratio < 10, ratio


def test_sampled_tokens_carry_the_dense_policys_logprobs(engine):
    engine.submit(PromptGroup("t1", _prompt(5, 80), 3, 0, Sampling(max_new_tokens=120, temperature=1.0)))
    out = _drain(engine)
    assert len(out) == 3
    for s, lp in zip(out, _dense_logprobs(out), strict=True):
        ref = lp.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        diff = (torch.tensor(s.logprobs, dtype=torch.float64) - ref).abs().max()
        assert float(diff) < 1e-4, f"{s.group_id}/{s.sample_index}: max |engine - dense| = {float(diff):.2e}"
        assert len(s.top_token_ids[0]) == 20  # the top-20 of the dense verify, as for any rollout
    # Every full cycle's drafts, noted in the engine: alpha from the verify's and the draft's distributions,
    # acceptance a prefix of each cycle, the draft steps' KV lengths consecutive within it.
    alphas, accepted = [], []
    for s in out:
        assert s.speculative_tokens == 4 and s.drafted_tokens == len(s.draft_alphas) > 0 and s.drafted_tokens % 4 == 0
        assert len(s.draft_accepted) == len(s.draft_kv_lens) == s.drafted_tokens
        assert s.accepted_tokens == sum(s.draft_accepted)
        for c in range(0, s.drafted_tokens, 4):
            flags, kv = s.draft_accepted[c : c + 4], s.draft_kv_lens[c : c + 4]
            assert flags == sorted(flags, reverse=True) and kv == list(range(kv[0], kv[0] + 4))
            assert len(s.prompt_token_ids) < kv[0] <= len(s.prompt_token_ids) + len(s.token_ids)
        assert all(0.0 <= a <= 1.0 + 1e-9 for a in s.draft_alphas)
        alphas += s.draft_alphas
        accepted += s.draft_accepted
    # A draft is accepted with probability alpha: over hundreds of drafts the two means agree closely.
    assert abs(sum(alphas) / len(alphas) - sum(accepted) / len(accepted)) < 0.06


FALSE_ALARM = 1e-3  # each chi-square check fails a correct sampler with this probability


def _second_tokens(engine, prompt, n: int) -> torch.Tensor:
    """The second token of n samples at T = 1: the first one a verify emits (the first comes from the prefill)."""
    engine.submit(PromptGroup("chi", prompt, n, 0, Sampling(max_new_tokens=2, temperature=1.0)))
    return torch.tensor([s.token_ids[1] for s in _drain(engine)])


def _dense_second_token_probs(prompt) -> torch.Tensor:
    """The dense policy's marginal of the second token: sum over first tokens t of p(t) p(. | t)."""
    from trainer.model_io import load_model

    model = load_model(SMALL).eval()
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
        keep = (first > 1e-7).nonzero()[:, 0]
        rows = torch.tensor([[*prompt, int(t)] for t in keep])
        second = torch.softmax(model(input_ids=rows).logits[:, -1].double(), -1)
    return (first[keep, None] * second).sum(0)


def test_sampled_tokens_follow_the_dense_distribution_and_a_broken_rejection_step_is_caught(engine, monkeypatch):
    from vllm.v1.sample import rejection_sampler

    prompt = tuple(range(5, 150))  # 145 tokens: the drafts' sparse layers keep 64 of them
    p = _dense_second_token_probs(prompt)
    before = engine.speculative_counts()
    n = 600
    seconds = _second_tokens(engine, prompt, n)
    counts = {k: v - before[k] for k, v in engine.speculative_counts().items()}
    assert counts["cycles"] >= n and counts["accepted"] < counts["drafted"]  # every second token was verified
    assert chi_square_pvalue(torch.bincount(seconds, minlength=p.numel()), p) > FALSE_ALARM
    # Broken on purpose: every draft accepted (uniform draws of 0), so the tokens follow the sparse drafts.
    monkeypatch.setattr(
        rejection_sampler, "generate_uniform_probs", lambda n, *a, **k: torch.zeros(n, dtype=torch.float64)
    )
    broken = _second_tokens(engine, prompt, n)
    assert chi_square_pvalue(torch.bincount(broken, minlength=p.numel()), p) < FALSE_ALARM


def test_what_a_speculative_vllm_engine_cannot_serve_is_refused_per_request(engine, tmp_path):
    from services.generator.engine import EngineError

    with pytest.raises(EngineError, match="a lossy sparse group needs an engine started with engine.decode = sparse"):
        engine.submit(PromptGroup("s", _prompt(1, 20), 1, 0, Sampling(max_new_tokens=8), decode="sparse"))
    with pytest.raises(EngineError, match="top_p 0.9 would make the drafts' distribution differ"):
        engine.submit(PromptGroup("p", _prompt(1, 20), 1, 0, Sampling(max_new_tokens=8, top_p=0.9)))
    with pytest.raises(EngineError, match="nothing to draft with"):
        engine.set_schedule(Schedule(budgets=(64, 64), bin_width=128, dense_layers=(0, 1, 2, 3), version=3))
    with pytest.raises(EngineError, match="does not take DistillSparse adapters"):
        engine.load_adapter(tmp_path, 2)
    assert engine.in_flight == 0  # nothing refused was kept
    # A dense group (evaluation) decodes in the same engine, the refused ones aside.
    engine.submit(PromptGroup("d", _prompt(2, 20), 1, 0, Sampling(max_new_tokens=8, temperature=0.0), dense=True))
    assert len(_drain(engine)) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"speculative_tokens": 17}, "speculative_tokens must be in [1, 16], got 17"),
        ({"speculative_tokens": 4, "enable_lora": True}, "does not combine with enable_lora"),
        ({"speculative_tokens": 4, "tensor_parallel_size": 2}, "does not combine with tensor_parallel_size > 1"),
    ],
)
def test_options_the_self_draft_cannot_combine_with_are_refused_at_start(change, message):
    from services.generator.engine import EngineError
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    with pytest.raises(EngineError) as caught:
        VllmEngine(VllmEngineConfig(model=str(SMALL), max_model_len=512, **change))
    assert message in str(caught.value)


def _perturbed_policy(folder: Path) -> Path:
    """`small` with every weight moved by noise: a policy version whose greedy text departs from small's."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(11)
    tensors = load_file(SMALL / "model.safetensors")
    moved = {k: (v + 0.4 * v.std() * torch.randn(v.shape, generator=g)).contiguous() for k, v in tensors.items()}
    folder.mkdir()
    save_file(moved, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _decode_with_push(engine, prompt, tokens: int, policy: Path | None, push_at) -> tuple[list[int], int]:
    """Greedy decode of `prompt` for `tokens` tokens, `policy` pushed between two engine steps once `push_at(n)`
    holds of the n tokens generated so far; returns the tokens and the n at the push."""
    engine.take_generated()  # what earlier decodes left
    engine.submit(PromptGroup("push", prompt, 1, 0, Sampling(max_new_tokens=tokens, temperature=0.0)))
    done, generated, pushed_at = [], 0, -1
    while engine.in_flight:
        done += engine.step()
        generated += sum(len(g.kv_budgets) for g in engine.take_generated() if g.group_id == "push")
        if policy is not None and pushed_at < 0 and push_at(generated):
            engine.load_policy(policy, 9)
            pushed_at = generated
    return done[0].token_ids, pushed_at


def test_a_policy_pushed_mid_decode_is_served_as_a_dense_engine_serves_it(engine, tmp_path):
    # The dense reference of a sequence whose policy changes mid-decode is a dense engine given the same push
    # after the same number of tokens (its KV from before the push stays, as the speculative engine's does).
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    from sparrow.tasks import ChainTask, ExampleStream, encode_words
    from sparrow.tasks.vocab import BOS, TOKEN_TO_ID

    new = _perturbed_policy(tmp_path / "v9")
    example = ExampleStream(ChainTask(32, 60, min_hops=60), seed=3, split="heldout").take(1)[0]
    prompt = (TOKEN_TO_ID[BOS], *encode_words(example.prompt))  # the task small solves: text, not a loop
    spec, at = _decode_with_push(engine, prompt, 240, new, lambda n: n >= 80)
    assert 80 <= at < 100 and engine.versions.policy_version == 9
    dense_engine = VllmEngine(VllmEngineConfig(model=str(SMALL), max_model_len=1024, max_num_seqs=4, ignore_eos=True))
    try:
        unpushed, _ = _decode_with_push(dense_engine, prompt, 240, None, None)
        dense, dense_at = _decode_with_push(dense_engine, prompt, 240, new, lambda n: n == at)
    finally:
        dense_engine.close()
    assert dense_at == at
    assert unpushed[:at] == dense[:at] and unpushed != dense  # the push changed what the dense policy writes
    assert spec == dense
    engine.load_policy(SMALL, 10)  # the module's other tests read small's distribution
