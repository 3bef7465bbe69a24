"""`sparrow generator`: help, config resolution and one-line errors before anything starts."""

import json

from sparrow_cli.main import main
from tests.cli_runner import sparrow


def test_help_lists_the_flags():
    result = sparrow("generator", "--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--config", "--redis-url", "--trainer", "--engine", "--model", "--print-config"):
        assert flag in result.stdout


def test_print_config_applies_file_then_flags(capsys, tmp_path):
    path = tmp_path / "g.toml"
    path.write_text('max_in_flight_groups = 3\n[queue]\nclaim_idle_s = 9.0\n[engine]\nkind = "reference"\n')
    flags = ["--redis-url", "redis://h:1/0", "--trainer", "t:5", "--generator-id", "g-7", "--print-config"]
    assert main(["generator", "--config", str(path), *flags]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["max_in_flight_groups"] == 3 and config["queue"]["claim_idle_s"] == 9.0
    assert config["redis"]["url"] == "redis://h:1/0" and config["trainer"]["address"] == "t:5"
    assert config["generator_id"] == "g-7" and config["engine"]["kind"] == "reference"


def test_the_old_queue_url_in_a_set_flag_still_works_with_a_deprecation_line(capsys, caplog):
    with caplog.at_level("WARNING", logger="sparrow.config"):
        assert main(["generator", "--set", "queue.url=redis://old:1/0", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["redis"]["url"] == "redis://old:1/0"
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "config key 'queue.url' in overrides is deprecated: use 'redis.url'"
    ]
    err = _one_line_error(capsys, ["generator", "--set", "queue.url=redis://a", "--redis-url", "redis://b"])
    assert "config keys 'queue.url' and 'redis.url' are both given" in err


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparrow generator: error: ") and "\n" not in err
    return err


def test_bad_configs_are_one_line_and_exit_2(capsys, tmp_path):
    path = tmp_path / "g.toml"
    path.write_text("[queue]\nclaim_idle = 3\n")
    assert "unknown config key 'queue.claim_idle'" in _one_line_error(capsys, ["generator", "--config", str(path)])
    path.write_text("[queue\n")
    assert "malformed TOML" in _one_line_error(capsys, ["generator", "--config", str(path)])
    assert "cannot read config file" in _one_line_error(capsys, ["generator", "--config", str(tmp_path / "none")])
    err = _one_line_error(capsys, ["generator", "--engine", "reference", "--model", str(tmp_path / "missing")])
    assert "engine.model_dir" in err and "no such folder" in err


def test_an_unknown_initial_schedule_is_one_line(capsys, tmp_path):
    path = tmp_path / "g.toml"
    path.write_text('[schedule]\ninitial = "qwen3-1.7b-0.99"\n[engine]\nkind = "reference"\n')
    assert "unknown schedule preset 'qwen3-1.7b-0.99'" in _one_line_error(capsys, ["generator", "--config", str(path)])


def test_a_tensor_parallel_size_that_does_not_divide_the_kv_heads_is_one_line(capsys, tmp_path):
    # models/small has 4 attention heads and 2 KV heads: 3 workers could not each hold whole heads.
    path = tmp_path / "g.toml"
    path.write_text('[engine]\nkind = "vllm"\nmodel_dir = "models/small"\ntensor_parallel_size = 3\n')
    err = _one_line_error(capsys, ["generator", "--config", str(path)])
    assert "engine.tensor_parallel_size 3 does not divide the model's 4 attention heads" in err
    path.write_text('[engine]\nkind = "vllm"\nmodel_dir = "models/small"\ntensor_parallel_size = 4\n')
    assert "does not divide the model's 2 KV heads" in _one_line_error(capsys, ["generator", "--config", str(path)])
    path.write_text('[engine]\nkind = "reference"\nmodel_dir = "models/small"\ntensor_parallel_size = 2\n')
    assert "the reference engine runs on one device" in _one_line_error(capsys, ["generator", "--config", str(path)])
