"""`sparrow controller`: config resolution and one-line errors (serving is covered by the integration tests)."""

import json

from sparrow_cli.main import main


def test_print_config_applies_flags(capsys, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("interval_s = 7.0\n[retune]\ntau = 0.9\n")
    flags = ["--port", "9999", "--redis-url", "redis://h:1/0", "--print-config"]
    assert main(["controller", "--config", str(path), *flags]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["interval_s"] == 7.0 and config["retune"]["tau"] == 0.9
    assert config["api"]["port"] == 9999 and config["redis"]["url"] == "redis://h:1/0"


def test_bad_config_is_one_line_and_exit_2(capsys, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[retune]\ntaux = 0.9\n")
    assert main(["controller", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparrow controller: error: unknown config key 'retune.taux'") and "\n" not in err


def test_unknown_initial_schedule_is_one_line_and_exit_2(capsys, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('initial_schedule = "qwen3-1.7b-0.99"\n')
    assert main(["controller", "--config", str(path)]) == 2
    assert "unknown schedule preset 'qwen3-1.7b-0.99'" in capsys.readouterr().err
