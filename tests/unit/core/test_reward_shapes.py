"""Reward functions are called by the shape they declare (Sparrow's, verl's, verl's batch, TRL's, the verifiers
library's), async ones awaited; a function of no shape is refused in one line; names come from entry points too."""

import asyncio
from importlib import metadata

import pytest

from sparrow import reward_registry
from sparrow.reward_registry import RewardError, load_reward, register_reward, reward_target
from sparrow.reward_shapes import TRL, VERIFIERS, VERL, VERL_BATCH, RewardCaller, RewardInput, signature_of

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


def _input(response="5", truth="5", prompt=CHAT, **columns) -> RewardInput:
    extra_info = {"split": "train", "index": 7}
    row = {"data_source": "arith", "reward_model": {"ground_truth": truth}, "extra_info": extra_info, **columns}
    extras = {**extra_info, "data_source": "arith", "columns": row, "options": {"scale": 2.0}}
    return RewardInput(response, truth, extras, prompt, "arith", extra_info, row, (11, 12, 13), {"scale": 2.0})


def _score(fn, inputs):
    return RewardCaller().score(fn, signature_of(fn, "test"), inputs)


def test_verl_compute_score_is_called_by_keyword_with_the_options_as_reward_kwargs():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        seen.append((data_source, solution_str, ground_truth, extra_info, scale))
        return {"score": float(solution_str.strip() == ground_truth) * scale, "acc": 1.0}

    assert signature_of(compute_score, "t").shape == VERL
    assert _score(compute_score, [_input(" 5")]) == [(2.0, {"acc": 1.0}, None, "")]
    assert seen == [("arith", " 5", "5", {"split": "train", "index": 7}, 2.0)]


def test_verl_batch_form_gets_lists_and_a_wrong_length_fails_the_whole_call():
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        assert data_sources == ["arith"] * 3 and extra_infos[0]["index"] == 7 and kwargs == {"scale": 2.0}
        return [float(s == t) for s, t in zip(solution_strs, ground_truths, strict=True)]

    assert signature_of(compute_score, "t").shape == VERL_BATCH
    out = _score(compute_score, [_input("5"), _input("6"), _input("5")])
    assert [o[0] for o in out] == [1.0, 0.0, 1.0] and all(o[2] is None for o in out)

    def short(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    out = _score(short, [_input(), _input()])
    assert [o[2] for o in out] == ["bad_value", "bad_value"] and "returned 1 scores for 2 completions" in out[0][3]


def test_trl_batched_reward_gets_the_group_as_conversations_with_every_column():
    calls = []

    def reward(prompts, completions, completion_ids, difficulty, **kwargs):
        calls.append(len(completions))
        assert prompts == [CHAT, CHAT]
        assert completions == [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "4"}]]
        assert completion_ids == [[11, 12, 13], [11, 12, 13]] and difficulty == [3, 3]
        assert kwargs["data_source"] == ["arith", "arith"] and kwargs["reward_model"][0] == {"ground_truth": "5"}
        assert "prompt" not in kwargs
        return [1.0 if c[0]["content"] == "5" else 0.0 for c in completions]

    assert signature_of(reward, "t").shape == TRL
    out = _score(reward, [_input("5", difficulty=3), _input("4", difficulty=3)])
    assert calls == [2] and [o[0] for o in out] == [1.0, 0.0] and all(o[2] is None for o in out)

    def text(prompts, completions, **kwargs):
        assert prompts == ["2 + 3 ="] and completions == ["5"]
        return [None]  # TRL's "does not apply": no score, counted as a bad value

    assert [o[2] for o in _score(text, [_input(prompt="2 + 3 =")])] == ["bad_value"]


def test_verifiers_style_any_combination_and_async_functions_are_awaited():
    async def judged(completion, answer):
        await asyncio.sleep(0)
        return float(completion[-1]["content"] == answer)

    def info_only(prompt, info, **kwargs):
        return float(prompt[-1]["role"] == "user" and info["index"] == 7 and kwargs["task"] == "arith")

    assert signature_of(judged, "t").shape == signature_of(info_only, "t").shape == VERIFIERS
    assert _score(judged, [_input("5"), _input("4")]) == [(1.0, {}, None, ""), (0.0, {}, None, "")]
    assert _score(info_only, [_input()])[0][0] == 1.0

    async def sparrow_async(response, ground_truth, extras):
        return float(extras["columns"]["reward_model"]["ground_truth"] == ground_truth == response)

    assert _score(sparrow_async, [_input()])[0][0] == 1.0


def test_a_raising_or_garbage_reward_scores_zero_with_its_reason():
    def raises(prompts, completions, **kwargs):
        raise KeyError("solution")

    def garbage(data_source, solution_str, ground_truth, extra_info):
        return "five"

    out = _score(raises, [_input(), _input()])
    assert [o[2] for o in out] == ["raised", "raised"] and "KeyError" in out[0][3]
    assert _score(garbage, [_input()])[0][:3] == (0.0, {}, "bad_value")


@pytest.mark.parametrize(
    "source, why",
    [
        ("def f(text, answer, extras): pass", "fits none"),
        ("def f(*args, **kwargs): pass", "fits none"),
        ("def f(solution_str, ground_truth, completion): pass", "fits none"),  # verl and verifiers names mixed
        ("def f(response, completion): pass", "fits none"),
    ],
)
def test_a_function_of_no_shape_is_refused_in_one_line(source, why):
    scope: dict = {}
    exec(source, scope)
    with pytest.raises(RewardError) as err:
        signature_of(scope["f"], "'my.py:f'")
    message = str(err.value)
    assert "\n" not in message and why in message
    assert message.startswith("reward 'my.py:f': f must take (response, ground_truth, extras); verl's (data_source")
    assert "TRL's (prompts, completions, **kwargs)" in message and "verifiers" in message


def test_names_come_from_entry_points_and_registrations(monkeypatch, tmp_path):
    (tmp_path / "my_plugin.py").write_text("def score(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    group = reward_registry.ENTRY_POINT_GROUP
    installed = metadata.EntryPoints([metadata.EntryPoint("judge", "my_plugin:score", group)])
    monkeypatch.setattr(
        reward_registry.metadata,
        "entry_points",
        lambda **kw: installed if kw.get("group") == group else metadata.EntryPoints([]),
    )
    assert reward_target("judge") == "my_plugin:score"
    fn, sig = load_reward("judge")
    assert fn(prompt="", completion="", answer="") == 1.0 and sig.shape == VERIFIERS
    assert "judge" in reward_registry.reward_names()
    with pytest.raises(RewardError, match="unknown reward 'nope': use one of .*judge"):
        reward_target("nope")
    # The services register theirs by import path; the same again is a no-op, another target for a name an error.
    import services  # noqa: F401

    assert reward_target("code") == "services.sandbox.reward:code_score"
    register_reward("code", "services.sandbox.reward:code_score")
    with pytest.raises(ValueError, match="taken"):
        register_reward("code", "elsewhere:fn")


def test_the_core_names_no_service():
    from pathlib import Path

    core = Path(reward_registry.__file__).parent
    for path in core.rglob("*.py"):
        assert "services." not in path.read_text(), f"{path.name} names a service"


def test_a_trl_reward_says_which_of_its_parameters_are_columns():
    def reward(completions, solution, difficulty=1, **kwargs):
        return [1.0] * len(completions)

    sig = signature_of(reward, "t")
    assert sig.missing_columns({"solution", "data_source"}) == []
    assert sig.missing_columns({"data_source"}) == ["solution"]
