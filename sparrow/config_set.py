"""`--set KEY=VALUE` flags: dotted keys typed by the config's schema, before the config is resolved.

    parse_set_flags(TrainerServiceConfig, ["optim.lr=2e-6", "sampling.n=8"])
    -> {"optim.lr": 2e-06, "sampling.n": 8}

A value is read as the field's type would read it from text ("2e-6" for a float, "true" for a bool,
"vllm" for a choice), else as a TOML value ([1, 2], {a = 1}, "quoted text"). A field whose type is a
free-form table (`sparrow up`'s [trainer], [generator], [controller]) is typed by the schema given for
it in `tables`, so `trainer.optim.lr=x` is checked against the trainer's own config. Errors are one
line naming the key and the type it expects (ConfigError).
"""

from __future__ import annotations

import tomllib
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from sparrow.config import ConfigError, _section_type, new_spelling


def type_name(annotation: Any) -> str:
    """A field's type as a user reads it: float, int, bool, one of 'a', 'b', list of int, a table."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None)) + (
            " (or none)" if type(None) in args else ""
        )
    if origin is list or origin is tuple:
        return f"a list of {type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a table"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"a table ({annotation.__name__})"
    if origin is Annotated:
        return type_name(args[0])
    return getattr(annotation, "__name__", str(annotation))


def _constraints(info: FieldInfo) -> str:
    parts = []
    for meta in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sign} {getattr(meta, attr)}")
    return f" {', '.join(parts)}" if parts else ""


def _split(item: str) -> tuple[str, str]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE (a dotted key, e.g. trainer.optim.lr=2e-6)")
    return key, raw.strip()


def _typed_as(model: type[BaseModel], key: str, tables: dict[str, type[BaseModel]]) -> str:
    """`key`, or the key an old spelling of it now is (in `model`, or in the table it falls in)."""
    for prefix, table in [("", model), *((f"{path}.", schema) for path, schema in tables.items())]:
        if key.startswith(prefix) and (new := new_spelling(table, key[len(prefix) :])) is not None:
            return prefix + new
    return key


def _leaf(model: type[BaseModel], key: str, tables: dict[str, type[BaseModel]]) -> tuple[Any, FieldInfo | None]:
    """The annotation and field of a dotted key, walking sections and typed tables; ConfigError when unknown.

    An old spelling is typed as its new key; the key itself is kept, for load_config to warn about.
    """
    parts = _typed_as(model, key, tables).split(".")
    node: type[BaseModel] | None = model
    annotation: Any = None
    info: FieldInfo | None = None
    path = ""
    for i, part in enumerate(parts):
        if node is None:  # inside a table of free keys: its values' type governs
            args = typing.get_args(annotation)
            annotation, info = (args[1] if len(args) == 2 else Any), None
            path += f".{part}"
            continue
        info = node.model_fields.get(part)
        if info is None:
            known = ", ".join(node.model_fields) or "none"
            raise ConfigError(f"--set {key}: unknown config key '{path + '.' if path else ''}{part}' (known: {known})")
        path = f"{path}.{part}" if path else part
        annotation = info.annotation
        last = i == len(parts) - 1
        if path in tables:
            node = tables[path]
            if last:
                annotation, info = node, None
            continue
        node = _section_type(annotation)
        if node is None and not last and typing.get_origin(annotation) is not dict:
            raise ConfigError(f"--set {key}: '{path}' is {type_name(annotation)}, it has no key '{parts[i + 1]}'")
    return annotation, info


def _candidates(raw: str) -> list[Any]:
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return [raw]
    if isinstance(value, str):  # quoted text: the quotes are TOML's, not the value's
        return [value]
    return [raw, value]


def parse_set_flags(
    model: type[BaseModel], items: list[str] | None, tables: dict[str, type[BaseModel]] | None = None
) -> dict[str, Any]:
    """`KEY=VALUE` strings -> {dotted key: typed value}, each checked against `model` (and `tables`)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, raw = _split(item)
        annotation, info = _leaf(model, key, tables or {})
        target = Annotated[annotation, info] if info is not None else annotation
        adapter = TypeAdapter(target)
        error: ValidationError | None = None
        for candidate in _candidates(raw):
            try:
                value = adapter.validate_python(candidate)
            except ValidationError as exc:
                error = exc  # the last reading's (the TOML value's) says most
                continue
            out[key] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            error = None
            break
        if error is not None:
            expected = type_name(annotation) + (_constraints(info) if info is not None else "")
            detail = error.errors()[0]["msg"]
            raise ConfigError(f"--set {key}={raw}: expected {expected}, got {raw!r} ({detail})")
    return out
