"""The trainer's config: the shipped TOML parses and spells out the defaults; overrides; one-line errors."""

import json
import tomllib
from pathlib import Path

import pytest

from services.trainer.config import TrainerServiceConfig
from sparrow.config import ConfigError, load_config
from tests.cli_runner import sparrow

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "services" / "trainer" / "trainer.toml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("SPARROW_OPTIM__LR", "SPARROW_SECURITY__TOKEN", "SPARROW_STEPS"):
        monkeypatch.delenv(key, raising=False)


def test_shipped_config_parses_and_spells_out_the_defaults():
    config = load_config(TrainerServiceConfig, SHIPPED)
    assert config == TrainerServiceConfig()
    written = tomllib.loads(SHIPPED.read_text())
    dumped = config.model_dump()
    for key, value in written.items():
        if isinstance(value, dict):
            for inner, v in value.items():
                assert dumped[key][inner] == v, f"{key}.{inner}"
        else:
            assert dumped[key] == value, key
    assert config.outstanding_groups == 16  # 2 steps of 8 groups


def test_environment_and_flags_override_and_the_token_is_masked(monkeypatch):
    monkeypatch.setenv("SPARROW_OPTIM__LR", "3e-5")
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "s3cret")
    config = load_config(TrainerServiceConfig, SHIPPED, {"steps": 7, "grpc.address": "127.0.0.1:0"})
    assert config.optim.lr == 3e-5 and config.steps == 7 and config.grpc.address == "127.0.0.1:0"
    assert config.security.grpc().token == "s3cret"
    assert "s3cret" not in config.dump() and json.loads(config.dump())["security"]["token"] == "**********"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"task.min_hops": 5, "task.max_hops": 3}, "task:"),
        ({"task.pairs": 1}, "task.pairs"),
        ({"weights.max_chunk_bytes": 64 << 20}, "below grpc.max_message_bytes"),
        ({"weights.default_chunk_bytes": 8 << 20}, "above weights.max_chunk_bytes"),
        ({"sampling.n": 1}, "sampling.n"),
        ({"sampling.top_logprobs": 21}, "sampling.top_logprobs"),
        ({"grpo.tis_cap": 0.5}, "grpo.tis_cap"),
        ({"device": "tpu"}, "device"),
        ({"optim.learning_rate": 1e-5}, "unknown config key 'optim.learning_rate'"),
        ({"eval.modes": []}, "eval.modes"),
        ({"eval.modes": ["sparse"]}, "eval.modes"),
        ({"eval.modes": ["dense", "dense"]}, "names a mode twice"),
        ({"eval.modes": ["dense", "schedule"], "eval.dense": True}, "keep eval.modes"),
        ({"memory.cpu_offload": True}, 'device = "cpu" has none to move'),
        ({"memory.activation_checkpointing": "always"}, "memory.activation_checkpointing"),
        ({"memory.checkpoint_min_tokens": 0}, "memory.checkpoint_min_tokens"),
        ({"task.filler": -1}, "task.filler"),
        (
            {"task.pairs": 64, "task.max_hops": 256, "task.filler": 30, "sampling.max_new_tokens": 4096},
            "task p64-h1..256-f30: its longest answer is 8708 tokens",
        ),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainerServiceConfig, overrides=override)


@pytest.mark.parametrize(("dense", "modes"), [(True, ["dense"]), (False, ["schedule"])])
def test_the_older_eval_dense_key_reads_as_its_modes(tmp_path, dense, modes):
    path = tmp_path / "trainer.toml"
    path.write_text(f"[eval]\ndense = {str(dense).lower()}\n")
    config = load_config(TrainerServiceConfig, path)
    assert config.eval.modes == modes and config.eval.dense is None
    # What a child's config file holds (written from the dump, TOML has no null) reads back the same.
    again = TrainerServiceConfig(**json.loads(config.model_dump_json()))
    assert again.eval == config.eval


def test_cli_prints_the_resolved_config_and_refuses_a_bad_one(tmp_path):
    done = sparrow("trainer", "--config", SHIPPED, "--steps", "3", "--run-dir", tmp_path, "--print-config")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["steps"] == 3 and printed["run_dir"] == str(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("groups_per_step = 0\n")
    done = sparrow("trainer", "--config", bad)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "groups_per_step" in done.stderr


@pytest.mark.slow
def test_cli_names_a_missing_model_in_one_line(tmp_path):
    done = sparrow("trainer", "--model-dir", tmp_path / "missing", "--run-dir", tmp_path / "run")
    last = done.stderr.strip().splitlines()[-1]  # after the logged config: the one-line error
    assert done.returncode == 2 and last.startswith("sparrow trainer: error:") and "no such model folder" in last


@pytest.mark.slow
def test_cli_names_a_run_dir_it_cannot_use_in_one_line(tmp_path):
    not_a_folder = tmp_path / "run"
    not_a_folder.write_text("")
    done = sparrow("trainer", "--run-dir", not_a_folder, "--redis-url", "redis://127.0.0.1:1/0")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("sparrow trainer: error:") and str(not_a_folder) in last
    assert "Traceback" not in done.stderr
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "run.json").write_text('{"run_')  # no checkpoint yet: the run id is read from here
    done = sparrow("trainer", "--run-dir", damaged, "--redis-url", "redis://127.0.0.1:1/0")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("sparrow trainer: error:") and "run.json" in last
    assert "Traceback" not in done.stderr


def test_the_long_task_must_fit_the_models_positions(tmp_path):
    from services.trainer.prechecks import PrecheckError, check_positions

    long = {"task.pairs": 64, "task.max_hops": 256, "task.filler": 30, "sampling.max_new_tokens": 8708}
    config = load_config(TrainerServiceConfig, overrides=long)
    check_positions(config, 16384)  # models/long's
    with pytest.raises(PrecheckError, match="prompt plus longest answer is 8905 tokens, past the 4096 positions"):
        check_positions(config, 4096)  # models/small's
    check_positions(load_config(TrainerServiceConfig, overrides={**long, "data.train_files": ["x.jsonl"]}), 4096)
