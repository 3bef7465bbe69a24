"""`sparrow up --dry-run`: every launch check by name, the plan, the first error in one line; nothing starts."""

import json
import shutil
import socket

import pytest

from services.launcher.config import UpConfig, service_schemas
from services.launcher.dry_run import CHECKS, Check, DryRunError, dry_run, processes, text
from sparrow.config import load_config
from sparrow.config_set import parse_set_flags
from tests.cli_runner import REPO, sparrow

TINY = REPO / "models" / "tiny"


def _up(**fields) -> UpConfig:
    sets = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in fields.pop("set", {}).items()]
    base = {"model_size": "tiny", "engine": "reference", **fields}
    return load_config(UpConfig, None, base | parse_set_flags(UpConfig, sets, service_schemas()))


def test_the_dry_run_passes_every_check_prints_the_plan_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = sparrow("up", "--dry-run", "--json", "--model-size", "tiny", "--engine", "reference", "--steps", "2",
                     "--run-dir", run_dir, "--set", 'tracking.backends=["tensorboard"]', timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [c["check"] for c in out["checks"]] == [c.name for c in CHECKS]
    assert all(c["ok"] for c in out["checks"])
    model = next(c for c in out["checks"] if c["check"] == "model")["detail"]
    assert "qwen3" in model and "4 layers" in model
    procs = {p["process"]: p for p in out["processes"]}
    assert set(procs) == {"redis", "prometheus", "gen-0", "controller", "trainer"}
    assert procs["trainer"]["device"] == "cpu" and procs["gen-0"]["device"] == "reference engine, cpu"
    assert set(procs["trainer"]["ports"]) == {"grpc", "metrics"} and all(procs["trainer"]["ports"].values())
    assert out["steps"] == 2 and out["run_dir"] == str(run_dir)
    assert not run_dir.exists()  # nothing written


def test_the_plan_as_text(tmp_path):
    lines = text(dry_run(_up(generators=2, with_controller=False), tmp_path / "run"))
    assert lines[-1] == "dry run: every check passed; nothing was started"
    assert [line.split()[1] for line in lines[: len(CHECKS)]] == [c.name.split()[0] for c in CHECKS]
    procs = [line.split()[0] for line in lines[len(CHECKS) + 2 : -1]]
    assert procs == ["redis", "prometheus", "gen-0", "gen-1", "trainer"]


def test_a_missing_model_folder_is_the_first_error_in_one_line(tmp_path):
    result = sparrow("up", "--dry-run", "--model", tmp_path / "no-such-model", "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr == f"sparrow up: error: model: model folder {tmp_path / 'no-such-model'}: no such folder\n"


@pytest.mark.parametrize(
    "item, message",
    [
        ("trainer.optim.lrr=1", "--set trainer.optim.lrr: unknown config key 'trainer.optim.lrr'"),
        ("trainer.optim.lr=fast", "--set trainer.optim.lr=fast: expected float > 0, got 'fast'"),
        ("generator.metrics.port=9000", "services: generator.metrics.port is set by sparrow up; use ports."),
    ],
)
def test_a_mistyped_key_or_a_wrong_typed_value_stops_the_dry_run(tmp_path, item, message):
    result = sparrow("up", "--dry-run", "--model-size", "tiny", "--set", item, "--run-dir", tmp_path / "run")
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result
    assert result.stderr.startswith("sparrow up: error: ") and message in result.stderr, result.stderr


def _model_copy(tmp_path, skip=()):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in TINY.iterdir():
        if f.name not in skip:
            shutil.copy(f, folder / f.name)
    return folder


def test_model_folders_that_a_launch_would_fail_on_hours_in(tmp_path):
    no_weights = _model_copy(tmp_path, skip=("model.safetensors",))
    with pytest.raises(DryRunError, match=r"^model: model folder .*: missing model weights"):
        dry_run(_up(model_dir=str(no_weights)), tmp_path / "run")
    (tmp_path / "model").rename(tmp_path / "m1")
    misfit = _model_copy(tmp_path)
    config = json.loads((misfit / "config.json").read_text())
    config["intermediate_size"] *= 2
    (misfit / "config.json").write_text(json.dumps(config))
    with pytest.raises(DryRunError, match=r"^model: model folder .*: weights do not fit config.json: .*mlp"):
        dry_run(_up(model_dir=str(misfit)), tmp_path / "run")
    (tmp_path / "model").rename(tmp_path / "m2")
    no_tokenizer = _model_copy(tmp_path, skip=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(DryRunError, match=r"^model: model folder .*missing tokenizer files"):
        dry_run(_up(model_dir=str(no_tokenizer)), tmp_path / "run")


def test_run_folder_ports_and_trackers_are_checked(tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    with pytest.raises(DryRunError, match=r"^run folder: run folder .* exists and is not empty"):
        dry_run(_up(), used)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(DryRunError, match=rf"^ports: port {port} \(trainer_grpc\) is in use"):
            dry_run(_up(set={"ports.trainer_grpc": port}), tmp_path / "run")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    up = _up(set={"tracking.backends": ["tensorboard"], "tracking.tensorboard.dir": str(blocker / "tb")})
    with pytest.raises(DryRunError, match=rf"^tracking: tracking.tensorboard: cannot write .*: {blocker} is not a"):
        dry_run(up, tmp_path / "run")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="needs a machine without CUDA")
def test_a_cuda_device_that_is_not_there(tmp_path):
    with pytest.raises(DryRunError, match="^devices: trainer.device is cuda, but no CUDA device is visible here"):
        dry_run(_up(set={"trainer.device": "cuda"}), tmp_path / "run")


def test_one_more_check_sees_what_the_checks_before_it_found(tmp_path):
    seen = {}

    def check_prompts(ctx):
        # What a dataset or reward check does: read the trainer's resolved config, then refuse or describe.
        seen["pairs"] = ctx.children.trainer.task.pairs
        if ctx.children.trainer.task.pairs > 4:
            raise ValueError("never raised: only SetupError/ConfigError are input errors")
        return f"{ctx.children.trainer.task.pairs} pairs"

    ctx = dry_run(_up(set={"trainer.task.pairs": 3}), tmp_path / "run", [*CHECKS, Check("prompts", check_prompts)])
    assert ctx.results[-1] == {"check": "prompts", "ok": True, "detail": "3 pairs"} and seen == {"pairs": 3}
    assert [p["process"] for p in processes(ctx)][-1] == "trainer"


def test_a_sharded_bf16_checkpoint_passes_and_a_missing_shard_is_named(tmp_path):
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    sharded = tmp_path / "qwen3-sharded"
    model = Qwen3ForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16)
    model.save_pretrained(sharded, max_shard_size="20KB")  # how a Qwen3 checkpoint arrives: index + shards
    AutoTokenizer.from_pretrained(TINY).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("model-*"))) > 2
    ctx = dry_run(_up(model_dir=str(sharded)), tmp_path / "run")
    assert ctx.results[2]["check"] == "model" and "4 layers" in ctx.results[2]["detail"]
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(DryRunError, match=rf"^model: model folder .*: missing weight shard {shard.name}"):
        dry_run(_up(model_dir=str(sharded)), tmp_path / "run")


def test_the_data_check_counts_a_users_rows_and_names_the_rewards(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"question": f"what is {i} + {i}?", "answer": str(2 * i)} for i in range(5)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    sets = {"trainer.data.prompt_key": "question", "trainer.data.answer_key": "answer",
            "trainer.data.chat_template": "none", "trainer.reward.name": "boxed"}  # fmt: skip
    ctx = dry_run(_up(set={"trainer.data.train_files": [str(data)], **sets}), tmp_path / "run")
    detail = next(r["detail"] for r in ctx.results if r["check"] == "data")
    assert "train source" in detail and "5 prompts" in detail, detail
    assert "-> boxed" in detail, detail


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"trainer.data.train_files": ["no-such.jsonl"]}, "no-such.jsonl"),
        ({"trainer.reward.name": "no_such_reward"}, "unknown reward 'no_such_reward'"),
    ],
)
def test_a_missing_dataset_or_an_unknown_reward_fails_the_data_check(tmp_path, extra, message):
    with pytest.raises(DryRunError) as err:
        dry_run(_up(set=extra), tmp_path / "run")
    assert str(err.value).startswith("data: ") and message in str(err.value), err.value
    assert "\n" not in str(err.value)


def test_the_code_reward_is_a_built_in_name():
    from services.sandbox.reward import code_score
    from sparrow.reward_registry import resolve_reward

    assert resolve_reward("code") is code_score
