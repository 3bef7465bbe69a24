"""MLflow: a local file store RUN_DIR/mlruns by default, or any tracking URI (`mlflow ui --backend-store-uri`)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from services.launcher.tracking.base import Tracker
from services.launcher.tracking.names import flat_config

# MLflow's own limits: values per log_batch call, and the length of a parameter's value.
BATCH, PARAM_CHARS = 100, 500
# Characters MLflow refuses in a name (eval/pass@4): each becomes "_".
REFUSED = re.compile(r"[^\w./\- :]")


def mlflow_name(name: str) -> str:
    """A tracked name as MLflow accepts it (eval/pass@4 -> eval/pass_4)."""
    return REFUSED.sub("_", name)


RUN_KEY_TAG = "sparrow.run_key"


class MlflowTracker(Tracker):
    """A run in the experiment: tags, the config as params and config.json, metrics per step, plots as artifacts."""

    name = "mlflow"

    def __init__(
        self, *, tracking_uri: str, experiment: str, run_name: str, tags: list[str], run_key: str = ""
    ) -> None:
        self.tracking_uri, self.experiment, self.run_name, self.tags = tracking_uri, experiment, run_name, tags
        self.run_key = run_key  # tagged `sparrow.run_key`: a resumed run finds its run by it and logs on into it
        self._client = None
        self._run_id = ""

    def start(self, config: dict) -> None:
        if self.tracking_uri.startswith("file:"):
            # MLflow 3 refuses the file store unless asked for (it is in maintenance mode); it is what
            # a run folder without a database or a server can hold.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
        found_runs = []
        if self.run_key:
            query = f"tags.`{RUN_KEY_TAG}` = '{self.run_key}'"
            found_runs = self._client.search_runs([experiment_id], filter_string=query, max_results=1)
        if found_runs:  # a resumed run: its params are logged already (MLflow keeps a param's first value)
            self._run_id = found_runs[0].info.run_id
            self._client.update_run(self._run_id, status="RUNNING")
        else:
            run = self._client.create_run(experiment_id, run_name=self.run_name, tags={t: "" for t in self.tags})
            self._run_id = run.info.run_id
            params = [Param(mlflow_name(k), v[:PARAM_CHARS]) for k, v in flat_config(config).items()]
            for i in range(0, len(params), BATCH):
                self._client.log_batch(self._run_id, params=params[i : i + BATCH])
            tags = [RunTag("sparrow.run_name", self.run_name)]
            tags += [RunTag(RUN_KEY_TAG, self.run_key)] if self.run_key else []
            self._client.log_batch(self._run_id, tags=tags)
        self._client.log_dict(self._run_id, config, "config.json")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), BATCH):
            self._client.log_batch(self._run_id, metrics=items[i : i + BATCH])

    def log_images(self, step: int, images: dict[str, Path]) -> None:
        for path in images.values():
            self._client.log_artifact(self._run_id, str(path), "report")

    def close(self) -> None:
        if self._client is not None and self._run_id:
            self._client.set_terminated(self._run_id)
            self._run_id = ""
