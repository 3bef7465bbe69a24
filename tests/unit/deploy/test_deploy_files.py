"""The shipped deployment files are valid: Prometheus accepts its configuration, and the compose
file's services point at files that exist."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]


def test_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool (Debian package prometheus) is missing: scripts/setup.sh installs it")
    done = subprocess.run(
        [promtool, "check", "config", str(REPO / "deploy/prometheus/prometheus.yml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_mounts_existing_files():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert {"redis", "prometheus"} <= set(compose["services"])
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{source} is mounted but missing"
