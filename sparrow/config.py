"""The one config system of every Sparrow process: typed, documented, validated fields.

Values come from, lowest precedence first: field defaults, a TOML file, environment variables
(`SPARROW_` prefix, `__` between nesting levels: `SPARROW_TRAINER__LR=1e-5`), then explicit
overrides (command-line flags, dotted keys allowed: `{"trainer.lr": 1e-5}`). Unknown keys in a file
or in overrides are errors; in the environment, which every process of a deployment shares, they are
another process's and are left alone; every field must carry a description (Field(description=...) or a
docstring under it), checked when the class is defined.

A key that moved is declared in its config's `renamed` ({old dotted key: new dotted key}): the old
spelling is still read, for one release, in a file, in overrides and in the environment
(SPARROW_OLD__KEY for `old.key`), with one warning line naming old and new; the two given together
in one place are refused.

    class TrainerConfig(SparrowConfig):
        lr: float = Field(1e-6, gt=0, description="Learning rate of the dense policy.")

    config = load_config(TrainerConfig, "trainer.toml", overrides={"lr": 1e-5})
    log.info("config %s", config.dump())
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import tomllib
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, SettingsError

log = logging.getLogger(__name__)

# Set while load_config builds a config from values that already hold the environment's.
_ENV_MERGED: ContextVar[bool] = ContextVar("sparrow_config_env_merged", default=False)


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

    renamed: ClassVar[dict[str, str]] = {}
    """Keys that moved, {old dotted key: new dotted key}: the old one is read for one release, with a warning."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _require_descriptions(cls)
        _check_renamed(cls)

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
    file_data = rename_keys(cls, _read_toml(Path(path)), f"in {path}") if path is not None else {}
    _check_keys(cls, file_data, f"in {path}")
    flags = rename_keys(cls, _expand_dotted(overrides or {}), "in overrides")
    _check_keys(cls, flags, "in overrides")
    env_data = _read_env(cls)
    merged = _merge(_merge(file_data, env_data), flags)
    merged_env = _ENV_MERGED.set(True)  # read once above, in its place between the file and the flags
    try:
        return cls(**merged)
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None
    finally:
        _ENV_MERGED.reset(merged_env)


def new_spelling(cls: type[BaseModel], key: str) -> str | None:
    """The key that old dotted `key` of `cls` is now spelled as; None when `key` is not an old spelling."""
    return getattr(cls, "renamed", {}).get(key)


def rename_keys(cls: type[BaseModel], data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` (nested tables) with `cls`'s old keys moved to their new spelling, one warning line each.

    `where` ends the messages ("in trainer.toml"); old and new both in `data` is a ConfigError.
    """
    return _rename(cls, data, where, lambda key: f"'{key}'", ("config key ", "config keys "))


def env_name(cls: type[SparrowConfig], key: str) -> str:
    """The environment variable of dotted `key`: SPARROW_A__B for a.b."""
    return f"{cls.model_config.get('env_prefix', '')}{key.replace('.', '__').upper()}"


def _rename(
    cls: type[BaseModel],
    data: dict[str, Any],
    where: str,
    spell: Callable[[str], str],
    nouns: tuple[str, str] = ("", ""),
) -> dict[str, Any]:
    renamed = getattr(cls, "renamed", {})
    if not any(_lookup(data, old)[0] for old in renamed):
        return data
    data = copy.deepcopy(data)
    for old, new in renamed.items():
        found, value = _lookup(data, old, pop=True)
        if not found:
            continue
        if _lookup(data, new)[0]:
            raise ConfigError(
                f"{nouns[1]}{spell(old)} and {spell(new)} are both given {where}: they are one setting, "
                f"{spell(old)} its old spelling; keep {spell(new)}"
            )
        _put(data, new, value, where)
        log.warning(
            "%s%s %s is deprecated: use %s (the old spelling is read until the next release)",
            nouns[0],
            spell(old),
            where,
            spell(new),
        )
    return data


def _lookup(data: dict[str, Any], key: str, pop: bool = False) -> tuple[bool, Any]:
    *parents, leaf = key.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part)
        if not isinstance(node, dict):
            return False, None
    if leaf not in node:
        return False, None
    return True, node.pop(leaf) if pop else node[leaf]


def _put(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key '{key}' {where} conflicts with a value given for '{part}'")
    node[leaf] = value


def _field_path(model: type[BaseModel] | None, key: str) -> bool:
    for part in key.split("."):
        info = model.model_fields.get(part) if model is not None else None
        if info is None:
            return False
        model = _section_type(info.annotation)
    return True


def _check_renamed(cls: type[SparrowConfig]) -> None:
    # Checked at class definition, like the descriptions: a rename must lead to a field and away from none.
    for old, new in cls.renamed.items():
        if not _field_path(cls, new):
            raise TypeError(f"{cls.__name__}.renamed: '{old}' is renamed to '{new}', which is no field")
        if _field_path(cls, old):
            raise TypeError(f"{cls.__name__}.renamed: '{old}' is still a field; an old spelling must not be one")


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
    """The SPARROW_* variables this config has fields for, old spellings (`renamed`) included. Every
    process of a deployment reads one environment: a variable meant for another service (a section this
    config lacks, or a key its own section lacks) is not this one's to refuse."""

    def __call__(self) -> dict[str, Any]:
        if _ENV_MERGED.get():
            return {}
        cls = self.settings_cls
        data = super().__call__()
        renamed = getattr(cls, "renamed", {})
        if renamed:
            environ = {key.upper(): value for key, value in os.environ.items()}
            for old in renamed:  # pydantic-settings gathers an old key only while its section is still a field
                value = environ.get(env_name(cls, old))
                if value is not None and not _lookup(data, old)[0]:
                    _put(data, old, value, "in the environment")
            data = _rename(cls, data, "in the environment", lambda key: env_name(cls, key))
        return _known_only(cls, data)


def environment_value(cls: type[SparrowConfig], key: str) -> Any:
    """Dotted `key`'s value in this process's SPARROW_* environment as `cls` reads it, validated; None when unset.

    Old spellings count, with their warning: the launcher hands a child a value its user exported for it.
    """
    found, value = _lookup(_read_env(cls), key)
    if not found:
        return None
    info: Any = None
    model: type[BaseModel] | None = cls
    for part in key.split("."):
        info = model.model_fields[part] if model is not None else None
        model = _section_type(info.annotation) if info is not None else None
    try:
        return TypeAdapter(Annotated[info.annotation, info]).validate_python(value)
    except ValidationError as exc:
        raise ConfigError(f"invalid value for '{key}' in the environment: {exc.errors()[0]['msg']}") from None


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
