"""Every SPARROW_* variable the chart and docker-compose.yml set names a real field of that service's
config, and the services' configs load with exactly those values.

A misspelt nested name fails a service at start; a misspelt top-level one would be ignored silently
(pydantic-settings drops unknown top-level variables), which is why each name is walked here.
"""

from __future__ import annotations

import importlib
import os

import pytest
import yaml
from pydantic import BaseModel

from sparrow.config import load_config
from tests.unit.deploy.chart_render import ALL_ON_HPA, REPO, SEVERAL_NODES, container, objects

CONFIGS = {
    "generator": "services.generator.config:GeneratorConfig",
    "trainer": "services.trainer.config:TrainerServiceConfig",
    "controller": "services.controller.config:ControllerConfig",
}


def config_class(component: str) -> type[BaseModel]:
    module, name = CONFIGS[component].split(":")
    return getattr(importlib.import_module(module), name)


def field_of(model: type[BaseModel], env_name: str) -> str | None:
    """The dotted field an environment variable sets, or None when it names no field."""
    path = env_name.removeprefix("SPARROW_").lower().split("__")
    node: type[BaseModel] | None = model
    for part in path:
        if node is None or part not in node.model_fields:
            return None
        annotation = node.model_fields[part].annotation
        node = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return ".".join(path)


def _chart_env(values: dict, component: str) -> dict[str, str]:
    # A secret reference gets a stand-in value; a pod field (the trainer's node rank: a completion index), pod 0's.
    def value(e: dict) -> str:
        return e.get("value", "0" if "fieldRef" in e.get("valueFrom", {}) else "secret-from-a-Secret")

    return {e["name"]: value(e) for e in container(objects(values), component)["env"]}


def environments(component: str) -> dict[str, dict[str, str]]:
    """Where the variables come from -> {name: value} (secret references get a stand-in value)."""
    service = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"][component]
    compose = {
        k: ("secret-from-.env" if str(v).startswith("${") else str(v)) for k, v in service["environment"].items()
    }
    out = {"chart": _chart_env(ALL_ON_HPA, component), "compose": compose}
    if component == "trainer":
        out["chart, several nodes"] = _chart_env(SEVERAL_NODES, component)
    return out


@pytest.mark.parametrize("component", sorted(CONFIGS))
def test_every_variable_names_a_config_field(component):
    model = config_class(component)
    for source, env in environments(component).items():
        unknown = [name for name in env if name.startswith("SPARROW_") and field_of(model, name) is None]
        assert not unknown, f"{source} sets {unknown}, which {model.__name__} does not have"


@pytest.mark.parametrize("component", sorted(CONFIGS))
def test_config_loads_with_the_deployment_environment(component, monkeypatch):
    for source, env in environments(component).items():
        for name in [n for n in os.environ if n.startswith("SPARROW_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        config = load_config(config_class(component))
        dumped = config.model_dump(mode="json")
        for name, value in env.items():
            if not name.startswith("SPARROW_"):
                continue  # read by something else in the process (the code reward's CODE_SANDBOX_*)
            node = dumped
            for part in field_of(config_class(component), name).split("."):
                node = node[part]
            if "secret" not in value:  # the value arrived as typed (ports as ints, tau as a float)
                assert node == yaml.safe_load(value) or node == value, (source, name, node)
