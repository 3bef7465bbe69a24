"""One `[security]` and one `[redis]` for every service (services/common/sections.py), and the old spellings
(trainer `redis_url`, generator `queue.url`, controller `api.token`) read for one release with a warning."""

import pytest

from services.common.sections import GrpcSecurityConfig, RedisConfig, SecurityConfig
from services.controller.config import ControllerConfig
from services.generator.config import GeneratorConfig
from services.sandbox.config import SandboxConfig
from services.trainer.config import TrainerServiceConfig
from sparrow.config import ConfigError, load_config
from sparrow.config_set import parse_set_flags

SERVICES = (TrainerServiceConfig, GeneratorConfig, ControllerConfig, SandboxConfig)
WITH_REDIS = (TrainerServiceConfig, GeneratorConfig, ControllerConfig)
VARIABLES = (
    "SPARROW_SECURITY__TOKEN",
    "SPARROW_REDIS__URL",
    "SPARROW_REDIS_URL",
    "SPARROW_QUEUE__URL",
    "SPARROW_API__TOKEN",
)
# (config, old dotted key, old variable, new dotted key, new variable, a TOML file in the old spelling)
OLD = [
    (TrainerServiceConfig, "redis_url", "SPARROW_REDIS_URL", "redis.url", "SPARROW_REDIS__URL", 'redis_url = "{v}"\n'),
    (GeneratorConfig, "queue.url", "SPARROW_QUEUE__URL", "redis.url", "SPARROW_REDIS__URL", '[queue]\nurl = "{v}"\n'),
    (
        ControllerConfig,
        "api.token",
        "SPARROW_API__TOKEN",
        "security.token",
        "SPARROW_SECURITY__TOKEN",
        '[api]\ntoken = "{v}"\n',
    ),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in VARIABLES:
        monkeypatch.delenv(key, raising=False)


def _value(config, dotted: str) -> str:
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node.get_secret_value() if hasattr(node, "get_secret_value") else node


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sparrow.config"]


def test_every_service_has_the_one_security_section_and_the_gRPC_ones_add_TLS():
    for cls in SERVICES:
        assert issubclass(cls.model_fields["security"].annotation, SecurityConfig), cls.__name__
    assert TrainerServiceConfig.model_fields["security"].annotation is GrpcSecurityConfig
    assert GeneratorConfig.model_fields["security"].annotation is GrpcSecurityConfig
    assert SandboxConfig.model_fields["security"].annotation is SecurityConfig
    assert ControllerConfig.model_fields["security"].annotation is SecurityConfig
    for cls in WITH_REDIS:
        assert issubclass(cls.model_fields["redis"].annotation, RedisConfig), cls.__name__


def test_one_environment_sets_the_token_and_the_redis_url_of_every_service(monkeypatch):
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "shared")
    monkeypatch.setenv("SPARROW_REDIS__URL", "redis://shared:6379/3")
    for cls in SERVICES:
        config = load_config(cls)
        assert config.security.token_text() == "shared", cls.__name__
        if cls in WITH_REDIS:
            assert config.redis.url == "redis://shared:6379/3", cls.__name__


def test_the_controllers_old_admin_token_variable_never_stops_the_sandbox(monkeypatch, caplog):
    monkeypatch.setenv("SPARROW_API__TOKEN", "for-the-controller")
    with caplog.at_level("WARNING"):
        assert load_config(SandboxConfig).security.token is None  # not the sandbox's old spelling
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    ("cls", "old", "old_var", "new", "new_var", "toml"), OLD, ids=lambda v: getattr(v, "__name__", v)
)
def test_the_new_spelling_reads_without_a_warning(monkeypatch, caplog, tmp_path, cls, old, old_var, new, new_var, toml):
    with caplog.at_level("WARNING"):
        assert _value(load_config(cls, overrides={new: "v-flag"}), new) == "v-flag"
        monkeypatch.setenv(new_var, "v-env")
        assert _value(load_config(cls), new) == "v-env"
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    ("cls", "old", "old_var", "new", "new_var", "toml"), OLD, ids=lambda v: getattr(v, "__name__", v)
)
def test_an_old_spelling_is_read_with_one_warning_in_each_place(
    monkeypatch, caplog, tmp_path, cls, old, old_var, new, new_var, toml
):
    path = tmp_path / "old.toml"
    path.write_text(toml.format(v="v-file"))
    with caplog.at_level("WARNING"):
        assert _value(load_config(cls, path), new) == "v-file"
    assert _warnings(caplog) == [
        f"config key '{old}' in {path} is deprecated: use '{new}' (the old spelling is read until the next release)"
    ]
    caplog.clear()
    flags = parse_set_flags(cls, [f"{old}=v-set"])  # `--set OLD=...`, typed as the new key
    with caplog.at_level("WARNING"):
        assert _value(load_config(cls, overrides=flags), new) == "v-set"
    assert len(_warnings(caplog)) == 1 and f"'{old}' in overrides" in _warnings(caplog)[0]
    caplog.clear()
    monkeypatch.setenv(old_var, "v-env")
    with caplog.at_level("WARNING"):
        assert _value(load_config(cls), new) == "v-env"
    [line] = _warnings(caplog)
    assert line.startswith(f"{old_var} in the environment is deprecated: use {new_var}") and "v-env" not in line


@pytest.mark.parametrize(
    ("cls", "old", "old_var", "new", "new_var", "toml"), OLD, ids=lambda v: getattr(v, "__name__", v)
)
def test_old_and_new_spelling_together_are_refused_in_one_line(
    monkeypatch, tmp_path, cls, old, old_var, new, new_var, toml
):
    with pytest.raises(ConfigError, match=f"^config keys '{old}' and '{new}' are both given in overrides") as info:
        load_config(cls, overrides={old: "a", new: "b"})
    assert "\n" not in str(info.value)
    monkeypatch.setenv(old_var, "a")
    monkeypatch.setenv(new_var, "b")
    with pytest.raises(ConfigError, match=f"^{old_var} and {new_var} are both given in the environment"):
        load_config(cls)
