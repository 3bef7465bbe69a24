"""`sparrow up` refuses bad input with one line and exit 2 before anything starts (no run folder is made)."""

import json
import socket

import pytest

from tests.cli_runner import sparrow


def _up(tmp_path, *args, config: str | None = None):
    run_dir = tmp_path / "run"
    extra = []
    if config is not None:
        (tmp_path / "up.toml").write_text(config)
        extra = ["--config", str(tmp_path / "up.toml")]
    result = sparrow("up", *extra, "--model-size", "tiny", "--run-dir", run_dir, "--json", *args, timeout=60)
    return result, run_dir


def _one_line_error(result, fragment: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.startswith("sparrow up: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize(
    "config, fragment",
    [
        ("bogus = 1\n", "unknown config key 'bogus'"),
        ("[ports]\nredis_port = 1\n", "unknown config key 'ports.redis_port'"),
        ("[trainer.optim]\nlrr = 0.1\n", "unknown config key 'trainer.optim.lrr'"),
        ("[generator]\nmetrics = { port = 9000 }\n", "generator.metrics.port is set by sparrow up; use ports."),
        ("steps = 0\n", "invalid config value for 'steps'"),
        ('schedule = "no-such-preset"\n', "schedule: unknown schedule preset 'no-such-preset'"),
        ("generators = [\n", "malformed TOML"),
        ("[trainer]\ndataset = 'x'\n", "unknown config key 'trainer.dataset'"),
    ],
)
@pytest.mark.parametrize("mode", [(), ("--print-config",), ("--print-config", "--compare")])
def test_bad_config_files(tmp_path, config, fragment, mode):
    # --print-config runs the launch's checks: it never prints a config that the launch would refuse.
    result, run_dir = _up(tmp_path, *mode, config=config)
    _one_line_error(result, fragment)
    assert not run_dir.exists()


def test_a_fixed_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result, run_dir = _up(tmp_path, config=f"[ports]\nprometheus = {port}\n")
    _one_line_error(result, f"port {port} (prometheus) is in use")
    assert not run_dir.exists()


def test_a_missing_model_folder(tmp_path):
    result, run_dir = _up(tmp_path, "--model", str(tmp_path / "no-model"))
    _one_line_error(result, "no-model: no such folder")
    assert not run_dir.exists()
    (tmp_path / "not-a-model").mkdir()
    result, _ = _up(tmp_path, "--model", str(tmp_path / "not-a-model"))
    _one_line_error(result, "holds no config.json")


def test_a_run_folder_in_use_and_contradicting_flags(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "old.txt").write_text("a previous run")
    result, _ = _up(tmp_path)
    _one_line_error(result, "exists and is not empty")
    result, _ = _up(tmp_path, "--compare", "--dense")
    _one_line_error(result, "--compare runs dense and sparse itself")
    (tmp_path / "run" / "old.txt").rename(tmp_path / "old.txt")
    (tmp_path / "run").rmdir()
    (tmp_path / "run").write_text("a file where the run folder would be")
    for compare in ((), ("--compare",)):
        result, _ = _up(tmp_path, *compare)
        _one_line_error(result, "run folder")
        assert "is a file" in result.stderr
    assert (tmp_path / "run").read_text() == "a file where the run folder would be"


def test_print_config_shows_the_resolved_config_without_the_token(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARROW_TOKEN", "very-secret")
    result, run_dir = _up(tmp_path, "--steps", "3", "--no-controller", "--print-config")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert (config["steps"], config["with_controller"], config["model_size"]) == (3, False, "tiny")
    assert "very-secret" not in result.stdout and not run_dir.exists()
