"""The TOML writer the launcher uses for child configs: what it writes, tomllib reads back unchanged."""

import math
import tomllib

import pytest

from services.launcher.toml_text import to_toml


def test_nested_tables_scalars_and_lists_round_trip():
    data = {
        "name": 'quote " backslash \\ tab \t newline \n del \x7f unicode é 🐦',
        "count": 3,
        "ratio": 0.1,
        "big": 1e300,
        "on": True,
        "off": False,
        "sizes": [1, 2, 3],
        "names": ["a", "b c"],
        "odd key": 1,
        "outer": {"x": 1, "inner": {"y": [0.5], "deeper": {"z": "w"}}},
        "only_tables": {"t": {"k": 1}},
        "empty": {},
    }
    assert tomllib.loads(to_toml(data)) == data


def test_none_is_left_out_and_infinities_survive():
    back = tomllib.loads(to_toml({"a": None, "b": math.inf, "c": -math.inf, "t": {"d": None, "e": 1}}))
    assert back == {"b": math.inf, "c": -math.inf, "t": {"e": 1}}
    assert math.isnan(tomllib.loads(to_toml({"n": math.nan}))["n"])


def test_header_lines_become_comments():
    text = to_toml({"a": 1}, "first\n\nthird")
    assert text.splitlines()[:3] == ["# first", "#", "# third"]
    assert tomllib.loads(text) == {"a": 1}


def test_values_toml_cannot_hold_are_refused():
    with pytest.raises(TypeError, match="cannot write object"):
        to_toml({"a": object()})
