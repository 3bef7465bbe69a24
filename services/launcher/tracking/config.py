"""`[tracking]` in `sparrow up`'s config: which experiment trackers get the run, and where they write."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from sparrow.config import ConfigSection

Backend = Literal["tensorboard", "wandb", "mlflow"]


class TensorBoardConfig(ConfigSection):
    """TensorBoard event files."""

    dir: str = Field("", description="Folder of the event files; empty: RUN_DIR/tensorboard.")


class WandbConfig(ConfigSection):
    """Weights & Biases."""

    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: no network, the run is kept under dir (upload later with `wandb sync`)."
    )
    dir: str = Field("", description="Folder W&B writes its run into (dir/wandb/...); empty: RUN_DIR.")
    entity: str = Field("", description="W&B entity (team or user) of an online run; empty: the account's default.")


class MlflowConfig(ConfigSection):
    """MLflow."""

    tracking_uri: str = Field(
        "", description="MLflow tracking URI (http://..., sqlite:///..., file:...); empty: a file store RUN_DIR/mlruns."
    )
    experiment: str = Field("", description="Experiment the run goes into; empty: tracking.project.")


class TrackingConfig(ConfigSection):
    """Experiment trackers that get every step of the run, its resolved config and the report's plots."""

    backends: list[Backend] = Field(
        default_factory=list, description='Any of "tensorboard", "wandb", "mlflow"; none by default.'
    )
    project: str = Field("sparrow", description="Project (W&B) or experiment (MLflow) name.")
    run_name: str = Field("", description="Name of the run in the trackers; empty: the run folder's name.")
    tags: list[str] = Field(default_factory=list, description="Tags of the run (W&B tags, MLflow tags).")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard options.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="W&B options.")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow options.")

    @field_validator("backends")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"a backend is named twice: {value}")
        return value
