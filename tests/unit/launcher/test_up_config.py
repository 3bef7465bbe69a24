"""`sparrow up`'s config and how each child's config is resolved from it, written and read back."""

import logging
import tomllib
from pathlib import Path

import pytest
from pydantic import SecretStr

from services.controller.config import ControllerConfig
from services.generator.config import GeneratorConfig
from services.launcher.config import DEFAULT_SCHEDULE, LAUNCHER_DIR, UpConfig
from services.launcher.plan import admin_token, make_plan
from services.launcher.ports import Ports
from services.launcher.services import child_environment, config_text, resolve
from services.trainer.config import TrainerServiceConfig
from sparrow.config import ConfigError, load_config
from sparrow.schedule import Schedule

PORTS = Ports(6000, 6001, 6002, 6003, (6010, 6011), (6020, 6021), 6030)
MODEL = Path("/models/tiny")


def _resolve(up: UpConfig, tmp_path: Path):
    schedule = Schedule.load(DEFAULT_SCHEDULE)
    return resolve(up, tmp_path, MODEL, schedule, DEFAULT_SCHEDULE, PORTS)


def test_the_shipped_config_spells_out_the_defaults():
    assert load_config(UpConfig, LAUNCHER_DIR / "up.toml") == UpConfig()


def test_children_get_the_wiring_the_local_defaults_and_the_users_overrides(tmp_path):
    up = UpConfig(
        steps=7,
        generators=2,
        engine="reference",
        trainer={"sampling": {"n": 4}, "groups_per_step": 3},
        generator={"engine": {"max_num_seqs": 8}},
        controller={"interval_s": 2.0},
    )
    c = _resolve(up, tmp_path)
    t = c.trainer
    assert (t.steps, t.run_dir, t.model_dir) == (7, str(tmp_path / "trainer"), str(MODEL))
    assert t.grpc.address == "127.0.0.1:6002" and t.metrics.port == 6003 and t.redis.url == "redis://127.0.0.1:6000/0"
    assert (t.sampling.n, t.groups_per_step) == (4, 3)  # the user's table wins over the launcher's defaults
    assert t.sampling.max_new_tokens == 300  # the launcher's local default
    assert (t.metrics.bin_width, t.metrics.num_bins) == (128, 8)  # the schedule's bins
    assert [g.generator_id for g in c.generators] == ["gen-0", "gen-1"]
    g1 = c.generators[1]
    assert (g1.metrics.port, g1.control.port, g1.trainer.address) == (6011, 6021, "127.0.0.1:6002")
    assert (g1.engine.kind, g1.engine.max_num_seqs, g1.engine.model_dir) == ("reference", 8, str(MODEL))
    assert g1.schedule.initial == str(DEFAULT_SCHEDULE) and g1.schedule.follow_redis
    assert g1.engine.gpu_memory_utilization == pytest.approx(0.425)  # two engines share one accelerator
    assert c.controller.interval_s == 2.0 and c.controller.api.port == 6030
    assert c.controller.prometheus.url == "http://127.0.0.1:6001"
    assert c.controller.cost.prompt_len == 3 * t.task.pairs + 5 and c.controller.cost.samples == 4


def test_the_long_model_runs_the_long_task_with_room_for_its_answers(tmp_path):
    c = _resolve(UpConfig(model_size="long"), tmp_path)
    chain = c.trainer.task.chain()
    assert chain.filler == 30 and (chain.min_hops, chain.max_hops) == (96, 128)
    assert c.trainer.sampling.max_new_tokens >= chain.sequence_tokens() - chain.prompt_tokens()
    assert c.generators[0].engine.max_model_len >= chain.sequence_tokens()
    # a user's own model (model_dir) keeps the short default, whatever model_size says
    assert _resolve(UpConfig(model_size="long", model_dir="/models/mine"), tmp_path).trainer.task.filler == 0
    with pytest.raises(ConfigError, match="longest answer is 8708 tokens"):
        _resolve(UpConfig(model_size="long", trainer={"task": {"max_hops": 256}}), tmp_path)


def test_the_long_model_starts_from_its_own_calibrated_schedule():
    from services.launcher.plan import load_schedule

    schedule, path = load_schedule(UpConfig(model_size="long"))
    assert path == LAUNCHER_DIR / "schedules" / "long-calibrated.json"
    assert schedule.budgets == (128, 128, 128, 256, 512) and schedule.dense_layers == (0, 1)
    assert load_schedule(UpConfig(model_size="long", model_dir="/models/mine"))[1] == DEFAULT_SCHEDULE
    assert load_schedule(UpConfig())[1] == DEFAULT_SCHEDULE
    named = LAUNCHER_DIR / "schedules" / "small-calibrated.json"
    assert load_schedule(UpConfig(model_size="long", schedule=str(named)))[1] == named


def test_dense_runs_have_no_schedule_and_no_controller(tmp_path):
    up = UpConfig(generator={"engine": {"decode": "dense"}})  # what --dense sets
    assert up.dense and up.decode == "dense"
    c = _resolve(up, tmp_path)
    assert c.controller is None and c.generators[0].engine.decode == "dense"
    assert c.generators[0].schedule.initial == "" and not c.generators[0].schedule.follow_redis
    assert _resolve(UpConfig(with_controller=False), tmp_path).controller is None


def test_one_decode_switch_the_old_dense_key_reads_as_it_with_a_deprecation_line(caplog):
    with caplog.at_level(logging.WARNING):
        old = UpConfig(dense=True, generator={"engine": {"max_num_seqs": 8}})
    assert old.decode == "dense" and old.generator["engine"] == {"max_num_seqs": 8, "decode": "dense"}
    assert "'dense' is deprecated: use generator.engine.decode" in caplog.text
    assert UpConfig(dense=False).decode == "sparse"
    with pytest.raises(ValueError, match="disagree"):
        UpConfig(dense=True, generator={"engine": {"decode": "speculative"}})
    speculative = UpConfig(engine="reference", generator={"engine": {"decode": "speculative"}})
    assert speculative.uses_controller and not speculative.dense and UpConfig().uses_controller
    assert speculative.with_decode("dense").dense and speculative.with_decode("dense").engine == "reference"
    assert not speculative.with_decode("dense").uses_controller


def test_a_speculative_run_gets_the_lossless_controller_with_the_generators_k(tmp_path):
    up = UpConfig(engine="reference", generator={"engine": {"decode": "speculative", "speculative_tokens": 4}})
    controller = _resolve(up, tmp_path).controller
    assert controller.mode == "lossless" and controller.lossless.speculative_tokens == 4
    assert _resolve(UpConfig(), tmp_path).controller.mode == "tail"


def test_generators_load_adapters_only_when_the_trainer_trains_them(tmp_path):
    assert not _resolve(UpConfig(), tmp_path).generators[0].engine.enable_lora
    c = _resolve(UpConfig(trainer={"distill": {"enabled": True, "rank": 16}}, generators=2), tmp_path)
    assert all(g.engine.enable_lora and g.engine.max_lora_rank == 16 for g in c.generators)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"trainer": {"optim": {"lrr": 1}}}, "unknown config key 'trainer.optim.lrr'"),
        (
            {"trainer": {"distill": {"enabled": True}}, "generator": {"engine": {"enable_lora": False}}},
            "generator.engine.enable_lora is false",
        ),
        (
            {"trainer": {"distill": {"enabled": True, "rank": 32}}, "generator": {"engine": {"max_lora_rank": 16}}},
            "max_lora_rank 16 is below trainer.distill.rank 32",
        ),
        (
            {
                "engine": "reference",
                "trainer": {"distill": {"enabled": True}},
                "generator": {"engine": {"decode": "speculative"}},
            },
            "generator.engine.decode speculative cannot take yet",
        ),
        (
            {
                "engine": "vllm",
                "trainer": {"sampling": {"top_p": 0.9}},
                "generator": {"engine": {"decode": "speculative"}},
            },
            "trainer.sampling.top_p 0.9: vLLM's speculative decoding samples its drafts at the temperature only",
        ),
        ({"generator": {"bogus": 1}}, "unknown config key 'generator.bogus'"),
        ({"trainer": {"steps": 3}}, "trainer.steps is set by sparrow up; use steps / --steps"),
        ({"generator": {"metrics": {"port": 9}}}, "use ports.generator_metrics"),
        ({"controller": {"retune": {"tau": 0.9}}}, "controller.retune.tau is set by sparrow up; use tau"),
        ({"trainer": {"optim": {"lr": -1}}}, "invalid config value for 'trainer.optim.lr'"),
        # Old spellings are read in the tables too, and then named as they are now spelled.
        ({"trainer": {"redis_url": "redis://x"}}, "trainer.redis.url is set by sparrow up; use redis_url"),
        ({"generator": {"queue": {"url": "redis://x"}}}, "generator.redis.url is set by sparrow up; use redis_url"),
        (
            {"controller": {"api": {"token": "t"}}},
            "controller.security.token is set by sparrow up; use SPARROW_SECURITY__TOKEN in sparrow up's environment",
        ),
        (
            {"generator": {"queue": {"url": "a"}, "redis": {"url": "b"}}},
            "config keys 'queue.url' and 'redis.url' are both given in ",
        ),
    ],
)
def test_bad_service_tables_are_one_line_errors_naming_the_key(tmp_path, table, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as info:
        _resolve(UpConfig(**table), tmp_path)
    assert "\n" not in str(info.value)


def test_the_environment_is_for_up_not_for_its_children(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARROW_STEPS", "3")
    monkeypatch.setenv("SPARROW_RUN_DIR", "elsewhere")
    monkeypatch.setenv("SPARROW_TRAINER__OPTIM__LR", "0.01")
    up = load_config(UpConfig)
    assert up.steps == 3 and up.run_dir == "elsewhere"
    c = _resolve(up, tmp_path)
    assert c.trainer.steps == 3 and c.trainer.run_dir == str(tmp_path / "trainer")  # not "elsewhere"
    assert c.trainer.optim.lr == 0.01  # reached the trainer through up's [trainer] table


def test_child_configs_are_written_whole_without_secrets_and_read_back_the_same(tmp_path):
    c = _resolve(UpConfig(engine="reference"), tmp_path)
    token = "s3cret-token"
    secret = c.trainer.security.model_copy(update={"token": SecretStr(token)})
    t = c.trainer.model_copy(update={"security": secret})
    text = config_text(t, "trainer", "a header")
    (tmp_path / "trainer.toml").write_text(text)
    assert token not in text and text.startswith("# a header\n")
    back = load_config(TrainerServiceConfig, tmp_path / "trainer.toml")
    assert back.model_dump(exclude={"security"}) == c.trainer.model_dump(exclude={"security"})
    (tmp_path / "gen.toml").write_text(config_text(c.generators[0], "generator", ""))
    assert load_config(GeneratorConfig, tmp_path / "gen.toml").generator_id == "gen-0"


def test_a_value_toml_cannot_carry_is_refused(tmp_path):
    c = _resolve(UpConfig(), tmp_path)
    # num_bins None means "open-ended", but TOML has no null and the file would mean the default 20.
    t = c.trainer.model_copy(update={"metrics": c.trainer.metrics.model_copy(update={"num_bins": None})})
    with pytest.raises(ConfigError, match="does not survive TOML.*metrics"):
        config_text(t, "trainer", "")


def test_child_environment_drops_config_variables_keeps_switches_and_adds_the_token():
    base = {
        "PATH": "/bin",
        "SPARROW_STEPS": "5",
        "SPARROW_OPTIM__LR": "1",
        "SPARROW_NO_CPU_EXTENSION": "1",
        "OMP_NUM_THREADS": "2",
    }
    env = child_environment(base, TrainerServiceConfig, {"SPARROW_SECURITY__TOKEN": "t"})
    assert "SPARROW_STEPS" not in env and "SPARROW_OPTIM__LR" not in env
    assert env["SPARROW_NO_CPU_EXTENSION"] == "1" and env["PATH"] == "/bin"
    assert env["SPARROW_SECURITY__TOKEN"] == "t" and env["OMP_NUM_THREADS"] == "2" and env["PYTHONUNBUFFERED"] == "1"
    assert child_environment({}, TrainerServiceConfig, {})["OMP_NUM_THREADS"] == "1"


def test_child_environment_drops_the_old_spellings_of_the_childs_keys_too():
    base = {"SPARROW_REDIS_URL": "redis://old", "SPARROW_QUEUE__URL": "redis://old", "SPARROW_API__TOKEN": "t"}
    assert "SPARROW_REDIS_URL" not in child_environment(base, TrainerServiceConfig, {})
    assert "SPARROW_QUEUE__URL" not in child_environment(base, GeneratorConfig, {})
    env = child_environment(base, ControllerConfig, {"SPARROW_SECURITY__TOKEN": "admin"})
    assert "SPARROW_API__TOKEN" not in env and env["SPARROW_SECURITY__TOKEN"] == "admin"


def test_the_controllers_admin_token_is_the_users_security_token_or_its_old_name(monkeypatch, caplog):
    monkeypatch.delenv("SPARROW_API__TOKEN", raising=False)
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "mine")
    assert admin_token() == "mine"
    monkeypatch.delenv("SPARROW_SECURITY__TOKEN")
    first, second = admin_token(), admin_token()
    assert first != second and len(first) > 20  # nobody's: a random one per run
    monkeypatch.setenv("SPARROW_API__TOKEN", "old-name")
    with caplog.at_level("WARNING", logger="sparrow.config"):
        assert admin_token() == "old-name"
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("SPARROW_API__TOKEN in the environment is deprecated: use SPARROW_SECURITY__TOKEN")
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "mine")
    with pytest.raises(ConfigError, match="SPARROW_API__TOKEN and SPARROW_SECURITY__TOKEN are both given"):
        admin_token()


def test_the_plan_gives_the_controller_the_users_admin_token_and_the_others_the_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARROW_API__TOKEN", raising=False)
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "admin-of-the-user")
    monkeypatch.setenv("SPARROW_TOKEN", "the-runs")
    plan = make_plan(load_config(UpConfig, None, {"model_size": "tiny", "engine": "reference"}), tmp_path / "run")
    specs = {s.name: s for s in plan.services()}
    assert specs["controller"].env["SPARROW_SECURITY__TOKEN"] == "admin-of-the-user"
    assert "SPARROW_API__TOKEN" not in specs["controller"].env
    assert (
        specs["trainer"].env["SPARROW_SECURITY__TOKEN"] == specs["gen-0"].env["SPARROW_SECURITY__TOKEN"] == "the-runs"
    )
    assert "admin-of-the-user" not in plan.config_files["controller.toml"]


def test_the_run_config_never_holds_the_token():
    up = UpConfig(token="abc")
    assert up.cluster_token() == "abc"
    assert "token" not in up.dump_public()
    assert tomllib.loads((LAUNCHER_DIR / "up.toml").read_text()).get("token") is None


def test_the_own_model_is_built_when_missing_and_a_given_folder_must_exist(tmp_path, monkeypatch):
    from services.launcher import plan

    monkeypatch.setattr(plan, "REPO_MODELS", tmp_path)  # a checkout whose models/ holds only `small`
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text("{}")
    assert plan.model_folder(UpConfig(model_size="small")) == (tmp_path / "small", False)
    assert plan.model_folder(UpConfig(model_size="tiny")) == (tmp_path / "tiny", True)
    assert plan.model_folder(UpConfig(model_dir=str(tmp_path / "small"))) == (tmp_path / "small", False)
    with pytest.raises(plan.SetupError, match="no such folder"):
        plan.model_folder(UpConfig(model_dir=str(tmp_path / "tiny")))
