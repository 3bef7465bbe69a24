"""The shipped sandbox.toml parses and says what the defaults are; limits that contradict each other are refused."""

from __future__ import annotations

import pytest

from services.sandbox.config import SandboxConfig
from sparrow.config import ConfigError, load_config
from tests.unit.deploy.chart_render import REPO


def test_the_shipped_file_is_the_defaults():
    assert load_config(SandboxConfig, REPO / "services/sandbox/sandbox.toml") == SandboxConfig()


def test_a_default_over_its_maximum_is_refused():
    with pytest.raises(ConfigError, match="must not exceed"):
        load_config(SandboxConfig, overrides={"limits.timeout_s": 60})
