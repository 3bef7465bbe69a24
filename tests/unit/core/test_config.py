import json

import pytest
from pydantic import Field, SecretStr

from sparrow.config import ConfigError, ConfigSection, SparrowConfig, load_config


class Optim(ConfigSection):
    lr: float = Field(1e-6, gt=0, description="Learning rate.")
    steps: int = 10
    """Optimizer steps."""


class Demo(SparrowConfig):
    name: str = Field("default", description="Run name.")
    optim: Optim = Field(default_factory=Optim, description="Optimizer settings.")
    token: SecretStr = Field(SecretStr("hunter2"), description="Admin token.")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("SPARROW_NAME", "SPARROW_OPTIM__LR", "SPARROW_OPTIM__STEPS"):
        monkeypatch.delenv(key, raising=False)


def _toml(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults():
    c = load_config(Demo)
    assert (c.name, c.optim.lr, c.optim.steps) == ("default", 1e-6, 10)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path, monkeypatch):
    path = _toml(tmp_path, 'name = "file"\n[optim]\nlr = 0.1\nsteps = 3\n')
    c = load_config(Demo, path)
    assert (c.name, c.optim.lr, c.optim.steps) == ("file", 0.1, 3)
    monkeypatch.setenv("SPARROW_OPTIM__LR", "0.2")
    monkeypatch.setenv("SPARROW_NAME", "env")
    c = load_config(Demo, path)
    assert (c.name, c.optim.lr, c.optim.steps) == ("env", 0.2, 3)
    c = load_config(Demo, path, overrides={"optim.lr": 0.3, "name": "flag"})
    assert (c.name, c.optim.lr, c.optim.steps) == ("flag", 0.3, 3)
    c = load_config(Demo, path, overrides={"optim": {"steps": 9}})
    assert (c.optim.lr, c.optim.steps) == (0.2, 9)  # a nested override keeps the sibling keys


def test_unknown_key_in_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr' in .*c.toml"):
        load_config(Demo, _toml(tmp_path, "[optim]\nlrr = 0.1\n"))
    with pytest.raises(ConfigError, match="unknown config key 'nme'"):
        load_config(Demo, _toml(tmp_path, 'nme = "x"\n'))
    with pytest.raises(ConfigError, match="in overrides"):
        load_config(Demo, overrides={"optim.bogus": 1})


def test_validation_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="'optim.lr'.*greater than 0") as info:
        load_config(Demo, overrides={"optim.lr": -1})
    assert "\n" not in str(info.value)
    monkeypatch.setenv("SPARROW_OPTIM__STEPS", "many")
    with pytest.raises(ConfigError, match="'optim.steps'"):
        load_config(Demo)
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_config(Demo, _toml(tmp_path, "name = \n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Demo, tmp_path / "missing.toml")


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xff\xfename = 1\n")
    with pytest.raises(ConfigError, match=r"cannot read config file .*c.toml: not UTF-8") as info:
        load_config(Demo, path)
    assert "\n" not in str(info.value)


def test_a_section_from_the_environment_that_is_not_json_is_one_line(monkeypatch):
    monkeypatch.setenv("SPARROW_OPTIM", "{lr: 1")
    with pytest.raises(ConfigError, match=r"SPARROW_OPTIM.*JSON") as info:
        load_config(Demo)
    assert "\n" not in str(info.value)


class Paced(Demo):
    interval_s: float = Field(30.0, gt=0, description="Seconds between ticks.")


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_number_that_is_not_finite_is_refused_anywhere(tmp_path, monkeypatch, value):
    # `gt=0` alone lets inf through: a loop paced by it would never tick again.
    with pytest.raises(ConfigError, match="'interval_s'.*finite"):
        load_config(Paced, _toml(tmp_path, f"interval_s = {value}\n"))
    with pytest.raises(ConfigError, match="'optim.lr'.*finite"):
        load_config(Paced, overrides={"optim.lr": float(value)})
    monkeypatch.setenv("SPARROW_INTERVAL_S", value)
    with pytest.raises(ConfigError, match="'interval_s'.*finite"):
        load_config(Paced)


def test_dump_is_json_with_secrets_masked():
    dumped = json.loads(load_config(Demo, overrides={"name": "x"}).dump())
    assert dumped == {"name": "x", "optim": {"lr": 1e-6, "steps": 10}, "token": "**********"}


def test_every_field_needs_a_description():
    with pytest.raises(TypeError, match="need a description: bare"):

        class Bad(SparrowConfig):
            bare: int = 1

    with pytest.raises(TypeError, match="need a description: x"):

        class BadSection(ConfigSection):
            x: int = 1


def test_a_variable_meant_for_another_service_never_stops_this_one(monkeypatch):
    """One environment for every service: the controller's SPARROW_API__TOKEN (a section this config does not
    have) and a key another service's `optim` has are left alone; this config's own variables still apply."""
    monkeypatch.setenv("SPARROW_API__TOKEN", "for-the-controller")
    monkeypatch.setenv("SPARROW_OPTIM__MOMENTUM", "0.9")
    monkeypatch.setenv("SPARROW_OPTIM__LR", "0.3")
    c = load_config(Demo)
    assert c.optim.lr == 0.3 and not hasattr(c, "api")
    with pytest.raises(ConfigError, match="unknown config key 'optim.momentum' in overrides"):
        load_config(Demo, overrides={"optim.momentum": 0.9})  # a flag, unlike the environment, is this one's
