"""The run folder and the services of one run: everything decided and written before a process starts.

RUN_DIR/config.toml              the resolved `sparrow up` config
RUN_DIR/services/*.toml          each child's whole config (what it runs with; sandbox.toml when it is started)
RUN_DIR/prometheus/prometheus.yml  scrape jobs for the trainer, the generators, the controller and the sandbox
RUN_DIR/logs/<service>.log       one log per child
RUN_DIR/trainer/                 the trainer's store, ledger, checkpoints, policies, steps.jsonl
RUN_DIR/redis/                   the run's Redis, every write in its append-only file
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.faults import UP_PID_ENV
from services.controller.config import ControllerConfig
from services.generator.config import GeneratorConfig
from services.launcher import health
from services.launcher.cluster import ServiceSpec
from services.launcher.config import UpConfig, default_schedule
from services.launcher.ports import HOST, Ports, allocate
from services.launcher.sandbox import (
    SandboxSetupError,
    configured_rewards,
    plan_sandbox,
    sandbox_environment,
    trainer_environment,
)
from services.launcher.services import (
    ChildConfigs,
    child_environment,
    config_text,
    launcher_pythonpath,
    prometheus_url,
    resolve,
)
from services.launcher.toml_text import to_toml
from services.trainer.config import TrainerServiceConfig
from sparrow.config import environment_value
from sparrow.hardware import MEASURED, HardwareError, get_hardware
from sparrow.schedule import Schedule, ScheduleError

REPO_MODELS = Path(__file__).resolve().parents[2] / "models"


class SetupError(ValueError):
    """Bad input found before anything starts (a missing model, a busy port, a bad schedule); one line."""


@dataclass
class RunPlan:
    """A run, decided: its folder, config, children's configs and services."""

    up: UpConfig
    run_dir: Path
    model_dir: Path
    build_model: bool  # the own model of `model_size` is missing: `sparrow model build` first
    schedule: Schedule
    ports: Ports
    children: ChildConfigs
    token: str
    prometheus_url: str
    redis_url: str
    config_files: dict[str, str]  # file name under RUN_DIR/services -> its TOML text
    sandbox_url: str = ""  # the code sandbox the trainer's code reward calls ("" when none)
    sandbox_token: str = ""  # the started sandbox's token (a random one per run)
    warnings: tuple[str, ...] = ()  # shown at the start of the run (an unjailed sandbox)
    admin_token: str = ""  # the controller's admin API token (security.token)

    def services(self) -> list[ServiceSpec]:
        """Every child service of the run, in start order."""
        return _services(self)


def default_run_dir() -> Path:
    """runs/up-YYYYmmdd-HHMMSS under the current folder."""
    import time

    return Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")


def model_folder(up: UpConfig) -> tuple[Path, bool]:
    """(the policy folder, whether it must be built first). A missing --model folder is a SetupError."""
    if up.model_dir:
        folder = Path(up.model_dir).resolve()
        if not folder.is_dir():
            raise SetupError(f"model folder {up.model_dir}: no such folder")
        if not (folder / "config.json").is_file():
            raise SetupError(f"model folder {up.model_dir} holds no config.json (not an HF-format model)")
        return folder, False
    folder = REPO_MODELS / up.model_size
    return folder, not (folder / "config.json").is_file()


def load_schedule(up: UpConfig) -> tuple[Schedule, Path | None]:
    """The starting schedule (also the bins of a dense run's tail metrics) and its file, if it is one."""
    from sparrow.presets import resolve_schedule

    spec = up.schedule or str(default_schedule(up.model_size, up.model_dir))
    try:
        schedule = resolve_schedule(spec)
    except ScheduleError as exc:
        raise SetupError(f"schedule: {exc}") from None
    path = Path(spec)
    return schedule, (path.resolve() if path.is_file() else None)


def require_fresh_run_dir(run_dir: Path) -> None:
    """SetupError unless `run_dir` is absent or an empty folder: a run never writes over another's files."""
    if run_dir.exists() and not run_dir.is_dir():
        raise SetupError(f"run folder {run_dir} is a file; choose another --run-dir")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SetupError(f"run folder {run_dir} exists and is not empty; choose another --run-dir")


def check_training_data(trainer: TrainerServiceConfig, model_dir: Path) -> set[str]:
    """Load, template and check the trainer's datasets and rewards as it will: SetupError (one line) now,
    before any service starts, rather than a trainer that exits after Redis and the generators are up.
    Returns the reward names its sources use."""
    from services.trainer.training_data import DataInputError, build_training_data
    from trainer.model_io import ModelLoadError, load_tokenizer

    try:
        return set(build_training_data(trainer, load_tokenizer(model_dir), model_dir).rewards.values())
    except (DataInputError, ModelLoadError) as exc:
        raise SetupError(str(exc)) from None


def check_trainer_start(trainer: TrainerServiceConfig, procs: int, build: bool) -> None:
    """What `sparrow trainer` checks before its ranks start (services/trainer/prechecks.py), checked now, before any
    service starts: the world size; and unless the model is built at start, its folder. SetupError (one line)."""
    from services.trainer.prechecks import PrecheckError, check_start
    from services.trainer.ranks import RankSetupError, check_world

    try:
        check_world(trainer, procs) if build else check_start(trainer, procs)
    except (RankSetupError, PrecheckError) as exc:
        raise SetupError(str(exc)) from None


def make_plan(up: UpConfig, run_dir: Path | None = None, resume: bool = False) -> RunPlan:
    """Check the input and decide the run; SetupError/ConfigError (one line) before anything is written.

    `resume`: the run folder is a run's, carried on (services/launcher/resume.py); otherwise it must be new or empty.
    """
    run_dir = (run_dir or Path(up.run_dir or default_run_dir())).resolve()
    for binary, needed in (("redis-server", not up.redis_url), ("prometheus", not up.prometheus_url)):
        if needed and shutil.which(binary) is None:
            raise SetupError(f"{binary} is not installed (scripts/setup.sh installs it), or give its URL in the config")
    if not resume:
        require_fresh_run_dir(run_dir)
    from services.launcher.tracking.factory import missing_backends

    for missing in missing_backends(up.tracking):  # a tracker named but not installed: told before the run
        raise SetupError(missing)
    model_dir, build = model_folder(up)
    schedule, schedule_file = load_schedule(up)
    if up.cost_hardware.lower() not in MEASURED:  # those are measured when first needed; the presets are known now
        try:
            get_hardware(up.cost_hardware)
        except HardwareError as exc:
            raise SetupError(f"cost_hardware: {exc}") from None
    try:
        ports = allocate(up)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    children = resolve(up, run_dir, model_dir, schedule, schedule_file, ports)
    rewards = configured_rewards(children)
    check_trainer_start(children.trainer, up.trainer_procs, build)
    if not build:  # the own model is built at start; its chain rows need no check
        rewards |= check_training_data(children.trainer, model_dir)
    try:
        sandbox = plan_sandbox(up, children, ports, rewards)
    except SandboxSetupError as exc:
        raise SetupError(str(exc)) from None
    children, ports = sandbox.children, sandbox.ports
    note = "Written by sparrow up for this run; the service token comes from the environment."
    files = {"trainer.toml": config_text(children.trainer, "trainer", note)}
    files.update({f"{g.generator_id}.toml": config_text(g, "generator", note) for g in children.generators})
    if children.controller is not None:
        files["controller.toml"] = config_text(children.controller, "controller", note)
    if children.sandbox is not None:
        files["sandbox.toml"] = config_text(children.sandbox, "sandbox", note)
    token = up.cluster_token() or secrets.token_urlsafe(24)
    redis_url = up.redis_url or f"redis://{HOST}:{ports.redis}/0"
    prom = prometheus_url(up, ports)
    return RunPlan(
        up,
        run_dir,
        model_dir,
        build,
        schedule,
        ports,
        children,
        token,
        prom,
        redis_url,
        files,
        sandbox.url,
        secrets.token_urlsafe(24) if children.sandbox is not None else "",
        sandbox.warnings,
        admin_token=admin_token() if children.controller is not None else "",
    )


def admin_token() -> str:
    """The controller's admin API token: the user's (to call POST /override and friends), else one nobody holds.

    The user's is SPARROW_SECURITY__TOKEN in sparrow up's environment, read as the controller reads its own
    (SPARROW_API__TOKEN, its old name, with a deprecation line); the trainer and generators get the run's token.
    """
    token = environment_value(ControllerConfig, "security.token")
    return token.get_secret_value() if token is not None else secrets.token_urlsafe(24)


def write_run_files(plan: RunPlan) -> None:
    """config.toml, the children's configs and Prometheus' scrape config."""
    run_dir = plan.run_dir
    for sub in ("logs", "services", "trainer"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    header = "sparrow up: the resolved config of this run (the token is never written)."
    (run_dir / "config.toml").write_text(to_toml(plan.up.dump_public(), header))
    for name, text in plan.config_files.items():
        (run_dir / "services" / name).write_text(text)
    if not plan.up.prometheus_url:
        prom = run_dir / "prometheus"
        prom.mkdir(exist_ok=True)
        (prom / "prometheus.yml").write_text(prometheus_yaml(plan))


def prometheus_yaml(plan: RunPlan) -> str:
    """Scrape config of the run's Prometheus: one job per service kind."""
    interval = f"{round(plan.up.scrape_interval_s * 1000)}ms"  # Prometheus durations take no fractions
    jobs = plan.ports.metrics_targets(plan.children.controller is not None)
    return yaml.safe_dump(
        {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "scrape_timeout": interval, "static_configs": [{"targets": targets}]}
                for job, targets in jobs.items()
            ],
        },
        sort_keys=False,
    )


def _sparrow(command: str, config: Path) -> list[str]:
    return [sys.executable, "-m", "sparrow_cli.main", command, "--config", str(config)]


def _services(plan: RunPlan) -> list[ServiceSpec]:
    run_dir, logs, cfg = plan.run_dir, plan.run_dir / "logs", plan.run_dir / "services"
    base = dict(os.environ)
    base["PYTHONPATH"] = launcher_pythonpath(base)
    base[UP_PID_ENV] = str(os.getpid())  # the launcher a fault point kills (services/common/faults.py)
    specs: list[ServiceSpec] = []
    if not plan.up.redis_url:
        data = run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        port = plan.ports.redis
        # Every write reaches the append-only file before Redis answers it: the prompt stream, its pending
        # entries and the controller's schedule survive a kill of the whole run (`sparrow up --resume`).
        argv = ["redis-server", "--port", str(port), "--bind", HOST, "--save", ""]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(data), "--protected-mode", "yes"]
        specs.append(
            ServiceSpec(
                "redis", "store", argv, logs / "redis.log", health.redis_ready(plan.redis_url), ports={"port": port}
            )
        )
    if not plan.up.prometheus_url:
        prom, port = run_dir / "prometheus", plan.ports.prometheus
        argv = [
            "prometheus",
            f"--config.file={prom / 'prometheus.yml'}",
            f"--storage.tsdb.path={prom / 'data'}",
            f"--web.listen-address={HOST}:{port}",
            "--storage.tsdb.retention.time=30d",
            "--log.level=warn",
        ]
        ready = health.http_ok(f"{plan.prometheus_url}/-/ready")
        specs.append(ServiceSpec("prometheus", "monitor", argv, logs / "prometheus.log", ready, ports={"port": port}))
    if plan.children.sandbox is not None:
        port = plan.ports.sandbox
        specs.append(
            ServiceSpec(
                "sandbox",
                "sandbox",
                _sparrow("sandbox", cfg / "sandbox.toml"),
                logs / "sandbox.log",
                health.http_ok(f"{plan.sandbox_url}/readyz"),
                sandbox_environment(base, plan.sandbox_token),
                ports={"api": port},
            )
        )
    env = child_environment(base, TrainerServiceConfig, {"SPARROW_SECURITY__TOKEN": plan.token})
    # The code reward's sandbox; an external one's token is the user's CODE_SANDBOX_TOKEN, passed through.
    env.update(trainer_environment(plan.sandbox_url, plan.sandbox_token))
    ready = health.all_of(
        health.grpc_serving(f"{HOST}:{plan.ports.trainer_grpc}", "sparrow.v1.RolloutService"),
        health.http_ok(f"http://{HOST}:{plan.ports.trainer_metrics}/metrics"),
    )
    ports = {"grpc": plan.ports.trainer_grpc, "metrics": plan.ports.trainer_metrics}
    specs.append(
        ServiceSpec(
            "trainer",
            "trainer",
            # Several processes: it starts its ranks itself (trainer.toml's [distributed]), and starts them again
            # after a failure, trainer_restarts times, never after a setup error (exit 2).
            _sparrow("trainer", cfg / "trainer.toml"),
            logs / "trainer.log",
            ready,
            env,
            ports=ports,
        )
    )
    for i, g in enumerate(plan.children.generators):
        env = child_environment(base, GeneratorConfig, {"SPARROW_SECURITY__TOKEN": plan.token})
        control, metrics = plan.ports.generator_control[i], plan.ports.generator_metrics[i]
        ready = health.all_of(
            health.grpc_serving(f"{HOST}:{control}", "sparrow.v1.GeneratorControl"),
            health.http_ok(f"http://{HOST}:{metrics}/metrics"),
        )
        name = g.generator_id
        argv = _sparrow("generator", cfg / f"{name}.toml")
        specs.append(
            ServiceSpec(
                name,
                "generator",
                argv,
                logs / f"{name}.log",
                ready,
                env,
                ports={"control": control, "metrics": metrics},
            )
        )
    if plan.children.controller is not None:
        env = child_environment(base, ControllerConfig, {"SPARROW_SECURITY__TOKEN": plan.admin_token})
        port = plan.ports.controller
        ready = health.http_ok(f"http://{HOST}:{port}/healthz")
        argv = _sparrow("controller", cfg / "controller.toml")
        specs.append(
            ServiceSpec("controller", "controller", argv, logs / "controller.log", ready, env, ports={"api": port})
        )
    return specs
