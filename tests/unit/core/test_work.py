"""The work contract: prompt groups round-trip through a stream entry; bad ones name their first bad field."""

import json

import pytest

from sparrow.work import GROUP_FIELD, MAX_SAMPLES, PromptGroup, Sampling, WorkItemError


def _group(**kw) -> PromptGroup:
    base = dict(group_id="g-1", prompt_token_ids=(1, 5, 9), n=4, policy_version=3)
    return PromptGroup(**{**base, **kw})


def test_a_group_round_trips_through_its_stream_entry_with_bytes_or_str_keys():
    g = _group(sampling=Sampling(temperature=0.7, top_p=0.9, max_new_tokens=64, top_logprobs=5), prompt_text="A B ;")
    fields = g.to_fields()
    assert set(fields) == {GROUP_FIELD}
    assert PromptGroup.from_fields(fields) == g
    assert PromptGroup.from_fields({GROUP_FIELD.encode(): fields[GROUP_FIELD].encode()}) == g


def test_retried_advances_only_the_attempt():
    g = _group(attempt=1)
    r = g.retried()
    assert r.attempt == 2 and r.group_id == g.group_id and r.prompt_token_ids == g.prompt_token_ids
    assert g.attempt == 1  # frozen: the original is untouched


def test_defaults_fill_in_and_integers_become_floats_in_sampling():
    g = PromptGroup.from_json(json.dumps({"group_id": "x", "prompt_token_ids": [3], "n": 1, "policy_version": 0}))
    assert g.sampling == Sampling() and g.attempt == 0 and g.created_at == 0.0
    s = PromptGroup.from_json(
        json.dumps(
            {"group_id": "x", "prompt_token_ids": [3], "n": 1, "policy_version": 0, "sampling": {"temperature": 1}}
        )
    ).sampling
    assert isinstance(s.temperature, float)


def _bad(**kw):
    d = json.loads(_group().to_json())
    d.update(kw)
    return json.dumps(d)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        (_bad(colour="red"), "unknown fields: colour"),
        (_bad(group_id=""), "group_id"),
        (_bad(group_id="x" * 257), "group_id"),
        (_bad(prompt_token_ids=[]), "prompt_token_ids must be a non-empty list"),
        (_bad(prompt_token_ids=[1, -2]), "non-negative integers"),
        (_bad(prompt_token_ids=[1, True]), "non-negative integers"),
        (_bad(prompt_token_ids=[1, 2.5]), "non-negative integers"),
        (_bad(n=0), "n must be"),
        (_bad(n=MAX_SAMPLES + 1), "n must be"),
        (_bad(n=True), "n must be"),
        (_bad(policy_version=-1), "policy_version"),
        (_bad(attempt=-1), "attempt"),
        (_bad(created_at="yesterday"), "created_at"),
        (_bad(prompt_text=5), "prompt_text"),
        (_bad(sampling=[1]), "sampling must be an object"),
        (_bad(sampling={"top_k": 5}), "sampling has unknown fields: top_k"),
        (_bad(sampling={"temperature": 0}), r"temperature must be in \(0, 10\]"),
        (_bad(sampling={"top_p": 1.5}), "top_p"),
        (_bad(sampling={"max_new_tokens": 0}), "max_new_tokens"),
        (_bad(sampling={"top_logprobs": 21}), "top_logprobs"),
        (_bad(sampling={"stop_token_ids": [1, -2]}), "stop_token_ids"),
        (_bad(sampling={"stop_token_ids": 5}), "stop_token_ids"),
    ],
)
def test_bad_groups_are_refused_naming_the_field(text, message):
    with pytest.raises(WorkItemError, match=message) as info:
        PromptGroup.from_json(text)
    assert "\n" not in str(info.value)


def test_an_entry_without_the_group_field_is_refused():
    with pytest.raises(WorkItemError, match="no 'group' field"):
        PromptGroup.from_fields({b"other": b"{}"})


def test_stop_token_ids_round_trip():
    group = PromptGroup("g", (1, 2), 2, 0, Sampling(stop_token_ids=(151645, 151643)))
    assert PromptGroup.from_json(group.to_json()).sampling.stop_token_ids == (151645, 151643)


def test_a_dense_group_round_trips_and_a_training_group_carries_no_dense_field():
    g = _group(dense=True)
    assert json.loads(g.to_json())["dense"] is True and PromptGroup.from_json(g.to_json()) == g
    plain = _group()
    assert "dense" not in json.loads(plain.to_json())  # as before the field: older generators read it
    assert PromptGroup.from_json(plain.to_json()).dense is False
    with pytest.raises(WorkItemError, match="dense must be true or false"):
        PromptGroup.from_json(json.dumps({**json.loads(plain.to_json()), "dense": 1}))


def test_an_evaluation_group_round_trips_and_a_training_group_carries_no_evaluation_field():
    g = _group(evaluation=True)
    assert json.loads(g.to_json())["evaluation"] is True and PromptGroup.from_json(g.to_json()) == g
    assert "evaluation" not in json.loads(_group().to_json())
    with pytest.raises(WorkItemError, match="evaluation must be true or false"):
        PromptGroup.from_json(json.dumps({**json.loads(_group().to_json()), "evaluation": "yes"}))


def test_a_group_asking_for_a_decode_mode_round_trips_and_others_carry_no_decode_field():
    g = _group(decode="speculative")
    assert json.loads(g.to_json())["decode"] == "speculative" and PromptGroup.from_json(g.to_json()) == g
    assert "decode" not in json.loads(_group().to_json())
    for bad in ("lossless", "dense", 1):
        with pytest.raises(WorkItemError, match="decode must be one of sparse, speculative"):
            PromptGroup.from_json(json.dumps({**json.loads(_group().to_json()), "decode": bad}))
