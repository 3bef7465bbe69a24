import json

import pytest
import torch

from sparrow.presets import PRESET_BINS, UnknownPresetError, get_preset, list_presets, resolve_schedule
from sparrow.schedule import Schedule, ScheduleError, format_compact, parse_compact


def test_defaults_match_the_paper():
    s = Schedule(budgets=(512, 1024))
    assert (s.bin_width, s.page_size, s.sink_blocks, s.local_blocks, s.dense_layers) == (2000, 16, 1, 2, (0, 1))
    assert s.version == 1 and s.name is None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"budgets": ()}, "at least one bin"),
        ({"budgets": (512, 0)}, "bin 1 must be positive"),
        ({"budgets": (512, -16)}, "bin 1 must be positive"),
        ({"budgets": (520,)}, "not a multiple of the page size 16"),
        ({"budgets": (1024, 512)}, "non-decreasing"),
        ({"budgets": (32,)}, "below the 48 tokens"),
        ({"budgets": (64,), "sink_blocks": 2, "local_blocks": 3}, "below the 80 tokens"),
        ({"budgets": (512,), "dense_layers": (0, -1)}, "must be >= 0"),
        ({"budgets": (512,), "dense_layers": (1, 1)}, "unique"),
        ({"budgets": (512,), "bin_width": 0}, "bin_width must be positive"),
        ({"budgets": (512,), "page_size": 0}, "page_size must be positive"),
        ({"budgets": (512,), "local_blocks": 0}, "local_blocks must be >= 1"),
        ({"budgets": (512.0,)}, "must be an integer"),
        ({"budgets": (512,), "version": -1}, "version must be >= 0"),
        ({"budgets": (512,), "bin_width": 2**31}, "bin_width must be at most 2147483647"),
        ({"budgets": (2**31,)}, "budget of bin 0 must be at most 2147483647"),
        ({"budgets": (512,), "version": 2**63}, "version must be at most 9223372036854775807"),
    ],
)
def test_invalid_schedules_raise_one_line(kwargs, fragment):
    with pytest.raises(ScheduleError, match=fragment) as info:
        Schedule(**kwargs)
    assert "\n" not in str(info.value)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_budget_lookup_at_bin_edges():
    s = Schedule(budgets=(512, 768, 1024), bin_width=2000)
    assert [s.budget_for(k) for k in (0, 1999, 2000, 3999, 4000, 10**6)] == [512, 512, 768, 768, 1024, 1024]
    assert s.bin_range(0) == (0, 2000) and s.bin_range(2) == (4000, None)
    kv = torch.tensor([[0, 1999, 2000], [3999, 4000, 10**6]])
    assert s.budget_tokens(kv).tolist() == [[512, 512, 768], [768, 1024, 1024]]
    assert s.budget_pages(kv).tolist() == [[32, 32, 48], [48, 64, 64]]
    with pytest.raises(ValueError):
        s.budget_for(-1)
    with pytest.raises(ValueError):
        s.budget_tokens(torch.tensor([-1]))


def test_json_round_trip(tmp_path):
    s = Schedule(budgets=(512, 512, 4096), bin_width=1000, dense_layers=(0, 3), version=7, name="mine")
    assert Schedule.from_json(s.to_json()) == s
    path = tmp_path / "s.json"
    s.save(path)
    assert Schedule.load(path) == s
    assert resolve_schedule(str(path)) == s


def test_json_fields_other_than_budgets_have_defaults():
    assert Schedule.from_json('{"budgets": [512, 1024]}') == Schedule(budgets=(512, 1024))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "malformed JSON"),
        ("[512, 1024]", "must be a JSON object"),
        ('{"name": "x"}', "missing field 'budgets'"),
        ('{"budgets": [512], "sinks": 1}', "unknown field(s) 'sinks'"),
        ('{"budgets": "512 x2"}', "field 'budgets' must be a list of integers"),
        ('{"budgets": [512, 1024.5]}', "field 'budgets' must be a list of integers"),
        ('{"budgets": [512], "version": "2"}', "field 'version' must be an integer"),
        ('{"budgets": [512], "page_size": true}', "field 'page_size' must be an integer"),
        ('{"budgets": [512], "name": 3}', "field 'name' must be a string or null"),
        ('{"budgets": [520]}', "not a multiple of the page size"),
    ],
)
def test_bad_json_is_a_schedule_error(text, fragment):
    with pytest.raises(ScheduleError) as info:
        Schedule.from_json(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_load_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"budgets": [600]}))
    with pytest.raises(ScheduleError, match="bad.json: budget of bin 0"):
        Schedule.load(path)
    with pytest.raises(ScheduleError, match="cannot read schedule file"):
        Schedule.load(tmp_path / "missing.json")


def test_with_budgets_makes_a_new_version():
    s = Schedule(budgets=(512, 1024), version=3, name="a")
    t = s.with_budgets([768, 1024])
    assert t.budgets == (768, 1024) and t.version == 4 and t.name == "a"
    assert s.budgets == (512, 1024)
    with pytest.raises(ScheduleError):
        s.with_budgets([1024, 512])


def test_compact_text_round_trips():
    budgets = [512, 512, 768, 1024, 1024, 1024]
    assert format_compact(budgets) == "512 x2, 768, 1024 x3"
    assert parse_compact("512 x2, 768, 1024 x3") == budgets
    for bad in ("512 x0", "512 y2", "abc", "512 x2 x3", ""):
        with pytest.raises(ScheduleError):
            parse_compact(bad)


def test_every_preset_has_twenty_valid_bins():
    names = list_presets()
    assert len(names) == 20
    for name in names:
        s = get_preset(name)
        assert s.num_bins == PRESET_BINS, name
        assert s.name == name
        assert parse_compact(s.compact()) == list(s.budgets)


def test_preset_values():
    assert get_preset("qwen3-1.7b-0.86").budgets == (512, 1024, 1536, 1536, 2048, 2560, 3072, 3584, 3584) + (4096,) * 11
    assert get_preset("qwen3-4b-0.75").budgets[:5] == (512, 512, 512, 512, 768)
    assert get_preset("qwen3-8b-0.86").budgets[-3:] == (6208, 7168, 7168)
    assert get_preset("qwen3-14b-0.86").budgets == (512, 768, 1280, 2048, 4096) + (6144,) * 10 + (
        8192,
        10240,
        10240,
        14336,
        14336,
    )
    assert get_preset("qwen3-4b-0.92").budgets[-1] == 18432


def test_unknown_preset_suggests_close_names():
    with pytest.raises(UnknownPresetError, match="did you mean qwen3-4b-0.86") as info:
        get_preset("qwen3-4b-086")
    assert isinstance(info.value, ScheduleError)
    with pytest.raises(UnknownPresetError, match="sparrow schedule list"):
        get_preset("zzz")
