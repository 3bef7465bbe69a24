"""The one config system of every Sparrow process: typed, documented, validated fields.

Values come from, lowest precedence first: field defaults, a TOML file, environment variables
(`SPARROW_` prefix, `__` between nesting levels: `SPARROW_TRAINER__LR=1e-5`), then explicit
overrides (command-line flags, dotted keys allowed: `{"trainer.lr": 1e-5}`). Unknown keys in a file
or in overrides are errors; in the environment, which every process of a deployment shares, they are
another process's and are left alone; every field must carry a description (Field(description=...) or a
docstring under it), checked when the class is defined.

    class TrainerConfig(SparrowConfig):
        lr: float = Field(1e-6, gt=0, description="Learning rate of the dense policy.")

    config = load_config(TrainerConfig, "trainer.toml", overrides={"lr": 1e-5})
    log.info("config %s", config.dump())
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, SettingsError


class ConfigError(ValueError):
    """A config that cannot be read or does not validate; one line naming the key."""


def _require_descriptions(cls: type[BaseModel]) -> None:
    # Enforced at class definition so an undocumented field never reaches a running service.
    bare = [name for name, info in cls.model_fields.items() if not info.description]
    if bare:
        raise TypeError(f"{cls.__name__}: config fields need a description: {', '.join(bare)}")


class ConfigSection(BaseModel):
    """A nested group of config fields (a table in the TOML file)."""

    # No config number is meant to be NaN or infinite ("interval_s = inf" would stall a loop for ever).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True, allow_inf_nan=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _require_descriptions(cls)


class SparrowConfig(BaseSettings):
    """Base class of every process's config."""

    model_config = SettingsConfigDict(
        env_prefix="SPARROW_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _require_descriptions(cls)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        """Arguments, then this config's own SPARROW_* variables (`_OwnEnv`); no .env or secrets files."""
        return init_settings, _OwnEnv(settings_cls)

    def dump(self) -> str:
        """The resolved config as one line of JSON, for the log at start (secrets come out masked)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


C = TypeVar("C", bound=SparrowConfig)


def load_config(cls: type[C], path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> C:
    """Resolve `cls` from defaults < TOML file `path` < SPARROW_* environment < `overrides`."""
    file_data = _read_toml(Path(path)) if path is not None else {}
    _check_keys(cls, file_data, f"in {path}")
    flags = _expand_dotted(overrides or {})
    _check_keys(cls, flags, "in overrides")
    env_data = _read_env(cls)
    merged = _merge(_merge(file_data, env_data), flags)
    try:
        return cls(**merged)
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib decodes before it parses
        raise ConfigError(f"cannot read config file {path}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML: {exc}") from None


class _OwnEnv(EnvSettingsSource):
    """The SPARROW_* variables this config has fields for. Every process of a deployment reads one
    environment: a variable meant for another service's section (SPARROW_API__TOKEN for the
    controller's `api.token`) is not this one's to refuse."""

    def __call__(self) -> dict[str, Any]:
        return _known_only(self.settings_cls, super().__call__())


def _read_env(cls: type[SparrowConfig]) -> dict[str, Any]:
    try:
        return _OwnEnv(cls)()
    except SettingsError as exc:  # a section given whole (SPARROW_OPTIM='{...}') must be JSON
        field = re.search(r'field "([^"]+)"', str(exc))
        name = f"{cls.model_config.get('env_prefix', '')}{field.group(1).upper()}" if field else "a SPARROW_ variable"
        raise ConfigError(f"cannot read {name} from the environment: not valid JSON ({exc.__cause__ or exc})") from None


def _expand_dotted(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} conflicts with a value given for {part!r}")
        node[leaf] = _merge(node[leaf], value) if isinstance(node.get(leaf), dict) else value
    return out


def _merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    # `Section | None` and friends: look inside the union for the model.
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _check_keys(model: type[BaseModel], data: dict[str, Any], where: str, prefix: str = "") -> None:
    for key, value in data.items():
        info = model.model_fields.get(key)
        if info is None:
            known = ", ".join(model.model_fields) or "none"
            raise ConfigError(f"unknown config key '{prefix}{key}' {where} (known here: {known})")
        section = _section_type(info.annotation)
        if section is not None and isinstance(value, dict):
            _check_keys(section, value, where, f"{prefix}{key}.")


def _known_only(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """`data` less the keys, at any depth, that `model` has no field for."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        info = model.model_fields.get(key)
        if info is None:
            continue
        section = _section_type(info.annotation)
        out[key] = _known_only(section, value) if section is not None and isinstance(value, dict) else value
    return out


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    loc = ".".join(str(part) for part in first["loc"]) or "(root)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"invalid config value for '{loc}': {first['msg']}, got {first.get('input')!r}{more}"
