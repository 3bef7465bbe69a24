"""`--set KEY=VALUE` on `sparrow up` and the service commands: typed by the schema, one-line errors (exit 2)."""

import json

import pytest

from services.launcher.config import UpConfig, service_schemas
from services.trainer.config import TrainerServiceConfig
from sparrow.config import ConfigError, load_config
from sparrow.config_set import parse_set_flags
from tests.cli_runner import sparrow


def test_values_are_typed_by_the_field_they_set():
    flags = parse_set_flags(
        UpConfig,
        [
            "trainer.optim.lr=2e-6",
            "steps=3",
            "with_controller=false",
            "engine=reference",
            "run_dir=runs/a b",
            'model_dir="quoted/dir"',
            'tracking.backends=["wandb", "mlflow"]',
            "controller.interval_s=2",
            "generator.engine.max_num_seqs=16",
        ],
        service_schemas(),
    )
    assert flags == {
        "trainer.optim.lr": 2e-6,
        "steps": 3,
        "with_controller": False,
        "engine": "reference",
        "run_dir": "runs/a b",
        "model_dir": "quoted/dir",
        "tracking.backends": ["wandb", "mlflow"],
        "controller.interval_s": 2.0,
        "generator.engine.max_num_seqs": 16,
    }
    assert type(flags["controller.interval_s"]) is float and type(flags["steps"]) is int


def test_set_overrides_the_file_and_reaches_the_service_table(tmp_path):
    path = tmp_path / "up.toml"
    path.write_text("steps = 5\n[trainer.optim]\nlr = 0.001\nweight_decay = 0.1\n")
    flags = parse_set_flags(UpConfig, ["trainer.optim.lr=2e-6", "steps=7"], service_schemas())
    up = load_config(UpConfig, path, flags)
    assert up.steps == 7 and up.trainer["optim"] == {"lr": 2e-6, "weight_decay": 0.1}


@pytest.mark.parametrize(
    "item, message",
    [
        ("trainer.optim.lrr=1", "--set trainer.optim.lrr: unknown config key 'trainer.optim.lrr' (known: lr,"),
        ("stepz=3", "--set stepz: unknown config key 'stepz'"),
        ("trainer.optim.lr=fast", "--set trainer.optim.lr=fast: expected float > 0, got 'fast'"),
        ("steps=2.5", "--set steps=2.5: expected int >= 1, got '2.5'"),
        ("steps=0", "--set steps=0: expected int >= 1"),
        ("engine=vlm", "--set engine=vlm: expected one of 'vllm', 'reference', got 'vlm'"),
        ("with_controller=maybe", "--set with_controller=maybe: expected bool"),
        ('tracking.backends=["neptune"]', "expected a list of one of 'tensorboard', 'wandb', 'mlflow'"),
        ("trainer.optim.lr.x=1", "--set trainer.optim.lr.x: 'trainer.optim.lr' is float, it has no key 'x'"),
        ("steps", "--set 'steps': expected KEY=VALUE"),
    ],
)
def test_bad_keys_and_values_name_the_key_and_the_type(item, message):
    with pytest.raises(ConfigError) as err:
        parse_set_flags(UpConfig, [item], service_schemas())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_up_takes_set_flags_and_refuses_a_bad_one_in_one_line(tmp_path):
    ok = sparrow("up", "--set", "trainer.optim.lr=2e-6", "--set", "tau=0.9", "--print-config", timeout=60)
    assert ok.returncode == 0, ok.stderr
    config = json.loads(ok.stdout)
    assert config["trainer"] == {"optim": {"lr": 2e-6}} and config["tau"] == 0.9
    bad = sparrow("up", "--set", "trainer.optim.lr=fast", "--run-dir", tmp_path / "run", timeout=60)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("sparrow up: error: --set trainer.optim.lr=fast: expected float > 0")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "command, good, bad, expected",
    [
        ("trainer", "optim.lr=1e-5", "optim.lr=x", "expected float > 0"),
        ("generator", "engine.kind=reference", "engine.kind=tpu", "expected one of 'vllm', 'reference'"),
        ("controller", "interval_s=2", "interval_s=soon", "expected float > 0"),
    ],
)
def test_each_service_command_takes_set_flags(command, good, bad, expected):
    ok = sparrow(command, "--set", good, "--print-config", timeout=60)
    assert ok.returncode == 0, ok.stderr
    key, value = good.split("=")
    node = json.loads(ok.stdout)
    for part in key.split("."):
        node = node[part]
    assert str(node) in (value, str(float(value)) if value[0].isdigit() else value)
    wrong = sparrow(command, "--set", bad, "--print-config", timeout=60)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert wrong.stderr.startswith(f"sparrow {command}: error: --set {bad}: {expected}")


def test_a_set_flag_wins_over_the_command_flag_for_the_same_field():
    ok = sparrow("trainer", "--steps", "4", "--set", "steps=9", "--print-config", timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["steps"] == 9
    assert load_config(TrainerServiceConfig, None, parse_set_flags(TrainerServiceConfig, ["steps=9"])).steps == 9
