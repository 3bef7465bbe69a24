"""`sparrow up`'s config: the run's shape, where its servers live, and overrides for each service.

The launcher resolves one config per child process from three layers: the service's own
defaults, the launcher's defaults for a local run (`services/launcher/services.py`), then the
`[trainer]`, `[generator]`, `[controller]` and `[sandbox]` tables here (keys exactly as in the service's own
TOML file). What wires the cluster together (ports, addresses, run folders, the model, the step
count) is the launcher's alone; setting it in a table is an error that names the field to use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from services.launcher.tracking.config import TrackingConfig
from sparrow.config import ConfigSection, SparrowConfig

log = logging.getLogger(__name__)

LAUNCHER_DIR = Path(__file__).resolve().parent
# The budgets `sparrow calibrate` fitted on `small` (small-calibrated.json, every layer sparse), with
# layers 0-1 dense as in the paper: with every layer sparse, rollouts lose half their accuracy on the
# chain task while p5 reads 1.000 (docs/results.md, "Dense vs sparse rollouts in the RL loop").
DEFAULT_SCHEDULE = LAUNCHER_DIR / "schedules" / "small-default.json"
# The long model's: `sparrow calibrate` on models/long (layers 0-1 dense), its 3K-4K bin raised to the
# budget whose held-out p5 held tau (docs/results.md, "The long-context policy and the long task").
LONG_SCHEDULE = LAUNCHER_DIR / "schedules" / "long-calibrated.json"


def default_schedule(model_size: str, model_dir: str = "") -> Path:
    """The schedule a run starts from when it names none: the long model's own, else `small`'s."""
    return LONG_SCHEDULE if model_size == "long" and not model_dir else DEFAULT_SCHEDULE


class PortsConfig(ConfigSection):
    """Loopback ports; 0 picks a free one at start. A fixed port that is in use stops the launch before it starts."""

    redis: int = Field(0, ge=0, le=65535, description="redis-server (when the launcher starts it).")
    prometheus: int = Field(0, ge=0, le=65535, description="Prometheus (when the launcher starts it).")
    trainer_grpc: int = Field(0, ge=0, le=65535, description="The trainer's RolloutService and WeightService.")
    trainer_metrics: int = Field(0, ge=0, le=65535, description="The trainer's /metrics.")
    generator_metrics: int = Field(
        0, ge=0, le=65535, description="The first generator's /metrics; generator i uses this + i."
    )
    generator_control: int = Field(
        0, ge=0, le=65535, description="The first generator's GeneratorControl gRPC; generator i uses this + i."
    )
    controller: int = Field(0, ge=0, le=65535, description="The controller's admin API and /metrics.")
    sandbox: int = Field(0, ge=0, le=65535, description="The code sandbox's API and /metrics (when it is started).")


class TimeoutsConfig(ConfigSection):
    """How long the launcher waits, and how often it looks."""

    start_s: float = Field(900.0, gt=0, description="Every service must be healthy within this many seconds.")
    step_s: float = Field(
        1800.0, gt=0, description="The run is stopped as stuck when no training step finishes for this long."
    )
    stop_grace_s: float = Field(
        30.0, gt=0, description="After SIGTERM a service's process group gets this long before SIGKILL."
    )
    poll_s: float = Field(0.5, gt=0, description="Seconds between looks at the services and the step history.")


class UpConfig(SparrowConfig):
    """A whole local RL run: Redis, Prometheus, N generators, the trainer and the controller."""

    run_dir: str = Field(
        "", description="Folder of the run (configs, logs, history, checkpoints, report); empty: runs/up-<time>."
    )
    model_size: Literal["tiny", "small", "long"] = Field(
        "small",
        description=(
            "The project's own model to train (models/<size>, built first when missing); long also sets the "
            "long task (trainer.task.filler) and the response length it needs."
        ),
    )
    model_dir: str = Field("", description="HF-format policy folder to start from instead of model_size's.")
    steps: int = Field(20, ge=1, description="Training steps of the run.")
    generators: int = Field(1, ge=1, le=64, description="Generator processes.")
    trainer_procs: int = Field(
        1,
        ge=1,
        le=64,
        description="Trainer processes on this machine (`sparrow trainer` starts them as torchrun ranks; rank 0 "
        "serves, all train).",
    )
    trainer_restarts: int = Field(
        3,
        ge=0,
        description="Times a crashed trainer is started again before the run fails (it resumes from its last "
        "checkpoint): with one process by sparrow up, with several by the trainer's launcher, every rank after one "
        "fails; never after a setup error (exit 2).",
    )
    with_controller: bool = Field(True, description="Run the controller (closed-loop schedule); false: fixed schedule.")
    engine: Literal["vllm", "reference"] = Field(
        "vllm", description="Generator engine: vllm (vLLM + sparse plugin) or reference (own torch loop, slow)."
    )
    schedule: str = Field(
        "", description="Starting schedule, preset name or JSON file; empty: the calibrated one of the own models."
    )
    tau: float = Field(0.86, gt=0, lt=1, description="Stability threshold on each bin's p5 of alpha.")
    cost_hardware: str = Field(
        "auto",
        description=(
            "Hardware the cost model prices the predicted speedup on: auto (this machine's: its GPU's preset, or "
            "this CPU measured), h200, h100 or cpu."
        ),
    )
    token: SecretStr | None = Field(
        None, description="Service token of the cluster's gRPC links; unset: a random one per run. Set SPARROW_TOKEN."
    )
    redis_url: str = Field("", description="Use this Redis instead of starting one (its database is written to).")
    prometheus_url: str = Field(
        "", description="Use this Prometheus instead of starting one (it must scrape the services itself)."
    )
    with_sandbox: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Start the code sandbox as a child: auto when a reward of the run is `code`, always (a reward "
        "of your own that calls it, through CODE_SANDBOX_URL), never. sandbox_url set: never started.",
    )
    sandbox_url: str = Field(
        "", description="Use this sandbox service instead of starting one (its token: CODE_SANDBOX_TOKEN)."
    )
    sandbox_restarts: int = Field(
        5, ge=0, description="A started sandbox that exits is restarted this many times at most; one exit more fails."
    )
    scrape_interval_s: float = Field(1.0, ge=0.05, description="Scrape interval of the Prometheus the launcher starts.")
    promql_window_s: float = Field(
        30.0, gt=0, description="Range of rate(...) in the PromQL p5 the launcher records beside the exact one."
    )
    ports: PortsConfig = Field(default_factory=PortsConfig, description="Loopback ports.")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Waits and polling.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Experiment trackers (TensorBoard, W&B, MLflow) of the run."
    )
    trainer: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the trainer's config (services/trainer/trainer.toml keys)."
    )
    generator: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of every generator's config (generator.toml keys)."
    )
    controller: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the controller's config (controller.toml keys)."
    )
    sandbox: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the started sandbox's config (sandbox.toml keys)."
    )

    @model_validator(mode="before")
    @classmethod
    def _dense_is_a_decode_mode(cls, data: Any) -> Any:
        # `dense = true` (before engine.decode existed) is generator.engine.decode = "dense".
        if not isinstance(data, dict) or "dense" not in data:
            return data
        data = dict(data)
        dense = data.pop("dense")
        if dense in (True, "true", "True", "1", 1):
            generator = dict(data.get("generator") or {})
            engine = dict(generator.get("engine") or {})
            if engine.setdefault("decode", "dense") != "dense":
                raise ValueError(
                    f"dense = true and generator.engine.decode = {engine['decode']!r} disagree; "
                    "keep generator.engine.decode (dense is its old spelling)"
                )
            data["generator"] = generator | {"engine": engine}
        log.warning(
            "config key 'dense' is deprecated: use generator.engine.decode = \"dense\" (--dense) "
            "(the old spelling is read until the next release)"
        )
        return data

    @property
    def decode(self) -> str:
        """How the generators decode (`generator.engine.decode`): sparse, speculative or dense."""
        engine = self.generator.get("engine")
        return str(engine.get("decode", "sparse")) if isinstance(engine, dict) else "sparse"

    @property
    def dense(self) -> bool:
        """Dense rollouts: the generators run without a schedule (`--dense`: generator.engine.decode dense)."""
        return self.decode == "dense"

    def with_decode(self, mode: str) -> UpConfig:
        """This config with the generators' decode mode set to `mode`."""
        generator = dict(self.generator)
        generator["engine"] = dict(generator.get("engine") or {}) | {"decode": mode}
        return self.model_copy(update={"generator": generator})

    @property
    def uses_controller(self) -> bool:
        """Sparse rollouts have a tail to hold, speculative ones draft budgets to tune for throughput (the
        controller's lossless mode); a dense run has no schedule to tune."""
        return self.with_controller and self.decode in ("sparse", "speculative")

    def cluster_token(self) -> str | None:
        """The configured service token, or None (the launcher makes one)."""
        return self.token.get_secret_value() if self.token is not None else None

    def dump_public(self) -> dict[str, Any]:
        """The config as plain data with the token left out (for RUN_DIR/config.toml)."""
        data = self.model_dump(mode="json")
        data.pop("token", None)
        return data


def service_schemas() -> dict[str, type]:
    """The schema of each service table ([trainer], [generator], [controller], [sandbox]), by which
    `--set trainer.x=v` is typed."""
    from services.controller.config import ControllerConfig
    from services.generator.config import GeneratorConfig
    from services.sandbox.config import SandboxConfig
    from services.trainer.config import TrainerServiceConfig

    return {
        "trainer": TrainerServiceConfig,
        "generator": GeneratorConfig,
        "controller": ControllerConfig,
        "sandbox": SandboxConfig,
    }
