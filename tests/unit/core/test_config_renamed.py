"""Renamed config keys (sparrow/config.py `renamed`): the old spelling is read for one release, in a file, in
overrides and in the environment, with one warning line naming old and new; both given in one place is refused."""

from typing import ClassVar

import pytest
from pydantic import Field

from sparrow.config import ConfigError, ConfigSection, SparrowConfig, environment_value, load_config, rename_keys
from sparrow.config_set import parse_set_flags


class Store(ConfigSection):
    url: str = Field("redis://default", description="Where.")


class Queue(ConfigSection):
    stream: str = Field("s", description="Stream name.")


class Moved(SparrowConfig):
    renamed: ClassVar[dict[str, str]] = {"store_url": "store.url", "queue.url": "store.url"}

    store: Store = Field(default_factory=Store, description="The store.")
    queue: Queue = Field(default_factory=Queue, description="The queue.")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("SPARROW_STORE_URL", "SPARROW_STORE__URL", "SPARROW_QUEUE__URL", "SPARROW_QUEUE__STREAM"):
        monkeypatch.delenv(key, raising=False)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sparrow.config"]


def _toml(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_new_spelling_reads_without_a_warning(tmp_path, caplog, monkeypatch):
    assert load_config(Moved, _toml(tmp_path, '[store]\nurl = "redis://file"\n')).store.url == "redis://file"
    assert load_config(Moved, overrides={"store.url": "redis://flag"}).store.url == "redis://flag"
    monkeypatch.setenv("SPARROW_STORE__URL", "redis://env")
    assert load_config(Moved).store.url == "redis://env"
    assert _warnings(caplog) == []


def test_old_spelling_in_a_file_is_read_with_one_line_naming_old_and_new(tmp_path, caplog):
    path = _toml(tmp_path, 'store_url = "redis://flat"\n[queue]\nstream = "t"\n')
    with caplog.at_level("WARNING"):
        config = load_config(Moved, path)
    assert config.store.url == "redis://flat" and config.queue.stream == "t"
    [line] = _warnings(caplog)
    assert line.startswith(f"config key 'store_url' in {path} is deprecated: use 'store.url'") and "\n" not in line


def test_old_nested_spelling_in_overrides(caplog):
    with caplog.at_level("WARNING"):
        config = load_config(Moved, overrides={"queue.url": "redis://flag", "queue.stream": "u"})
    assert config.store.url == "redis://flag" and config.queue.stream == "u"
    assert _warnings(caplog) == [
        "config key 'queue.url' in overrides is deprecated: use 'store.url' (the old spelling is read until the next "
        "release)"
    ]


@pytest.mark.parametrize(("old", "variable"), [("store_url", "SPARROW_STORE_URL"), ("queue.url", "SPARROW_QUEUE__URL")])
def test_old_spelling_in_the_environment_names_the_variables(monkeypatch, caplog, old, variable):
    monkeypatch.setenv(variable, "redis://env")
    with caplog.at_level("WARNING"):
        assert load_config(Moved).store.url == "redis://env"
    [line] = _warnings(caplog)  # read once, though load_config and pydantic-settings both look at the environment
    assert line.startswith(f"{variable} in the environment is deprecated: use SPARROW_STORE__URL")


def test_both_spellings_in_one_place_are_refused_in_one_line(tmp_path, monkeypatch):
    both = _toml(tmp_path, 'store_url = "a"\n[store]\nurl = "b"\n')
    with pytest.raises(ConfigError, match=r"^config keys 'store_url' and 'store.url' are both given in"):
        load_config(Moved, both)
    with pytest.raises(
        ConfigError, match="^config keys 'queue.url' and 'store.url' are both given in overrides: they are one setting"
    ):
        load_config(Moved, overrides={"queue.url": "a", "store.url": "b"})
    monkeypatch.setenv("SPARROW_QUEUE__URL", "a")
    monkeypatch.setenv("SPARROW_STORE__URL", "b")
    with pytest.raises(
        ConfigError, match="SPARROW_QUEUE__URL and SPARROW_STORE__URL are both given in the environment"
    ):
        load_config(Moved)


def test_two_old_spellings_of_one_key_are_refused_too():
    with pytest.raises(ConfigError, match="both given in overrides"):
        load_config(Moved, overrides={"queue.url": "a", "store_url": "b"})


def test_each_layer_is_renamed_on_its_own_so_precedence_holds(tmp_path, monkeypatch, caplog):
    """A file in the old spelling and a flag in the new one are two places: the flag wins, as it always does."""
    path = _toml(tmp_path, 'store_url = "file"\n')
    assert load_config(Moved, path, {"store.url": "flag"}).store.url == "flag"
    monkeypatch.setenv("SPARROW_QUEUE__URL", "env")
    assert load_config(Moved, path).store.url == "env"
    assert load_config(Moved, path, {"queue.url": "flag"}).store.url == "flag"


def test_set_flags_type_an_old_key_as_its_new_one():
    assert parse_set_flags(Moved, ["queue.url=redis://x"]) == {"queue.url": "redis://x"}
    with pytest.raises(ConfigError, match="unknown config key 'queue.urls'"):
        parse_set_flags(Moved, ["queue.urls=redis://x"])


def test_rename_keys_leaves_its_input_alone_and_a_config_without_renames_untouched():
    data = {"queue": {"url": "a", "stream": "s"}}
    assert rename_keys(Moved, data, "here") == {"queue": {"stream": "s"}, "store": {"url": "a"}}
    assert data == {"queue": {"url": "a", "stream": "s"}}
    assert rename_keys(Store, {"url": "a"}, "here") == {"url": "a"}


def test_environment_value_reads_one_key_as_the_config_would(monkeypatch, caplog):
    assert environment_value(Moved, "store.url") is None
    monkeypatch.setenv("SPARROW_QUEUE__URL", "redis://old")
    with caplog.at_level("WARNING"):
        assert environment_value(Moved, "store.url") == "redis://old"
    assert len(_warnings(caplog)) == 1


def test_a_rename_must_lead_to_a_field_and_away_from_none():
    with pytest.raises(TypeError, match="'a' is renamed to 'store.nope', which is no field"):

        class ToNothing(SparrowConfig):
            renamed: ClassVar[dict[str, str]] = {"a": "store.nope"}
            store: Store = Field(default_factory=Store, description="The store.")

    with pytest.raises(TypeError, match="'store.url' is still a field"):

        class StillThere(SparrowConfig):
            renamed: ClassVar[dict[str, str]] = {"store.url": "other"}
            store: Store = Field(default_factory=Store, description="The store.")
            other: str = Field("", description="Other.")
