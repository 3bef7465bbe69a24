"""Every Grafana panel's PromQL against the Prometheus of a live end-to-end run (`sparrow up`).

`sparrow up` (tiny model, reference engine, 2 generators, the controller, a sparse schedule) runs in
the background with its Prometheus on a port chosen here; once a few steps are done, every panel's
query (with `$bin` as ".*" and as a populated bin) must be accepted by Prometheus and return data.
The test owns the run's lifetime: its step count is out of reach, so the run (and its Prometheus)
stays up until the last panel is checked, however fast the machine, and the test then stops it.
Panels about events that a healthy short run does not produce are named in `QUIET_IN_A_HEALTHY_RUN`
with the reason; their queries must still run.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.deploy.test_dashboards_live import finite_values, instant_query, panel_queries, substitute
from tests.integration.launcher.helpers import UpProcess, tiny_config
from tests.servers import free_port

pytestmark = pytest.mark.slow

SCHEDULE = {"name": "live", "bin_width": 16, "budgets": [48, 48, 48, 64], "dense_layers": []}
# Never reached: a fast machine would otherwise end the run (and stop Prometheus) mid-walk; SIGINT ends it.
UNREACHED_STEPS = 1_000_000

# Counters that only move when something goes wrong or is swapped; a healthy run has no samples.
QUIET_IN_A_HEALTHY_RUN = {
    "dead_lettered": "no group is dead-lettered in a healthy run",
    "groups_dead": "no group is dead-lettered in a healthy run",
    "dropped_stale": "no group is too stale in a short run",
    "refused": "no swap is refused in a healthy run",
    "rejected": "the trainer rejects nothing in a healthy run",
    "adapter": "DistillSparse is off by default: no adapter is ever loaded",
    "policy_fetch_failures": "no policy fetch fails in a healthy run",
    # This run has no held-out set; test_trainer_eval.py checks the gauges and test_dashboards_live.py the panels.
    "sparrow_trainer_eval_": "no evaluation runs without a held-out set (eval_files)",
    "sparrow_trainer_alpha_exact": 'the exact-alpha series exist only with alpha = "exact" (test_dashboards_live.py)',
    "draft": 'the speculative series exist only with engine.decode = "speculative" (test_dashboards_live.py)',
    "speculative_cycles": 'the speculative series exist only with engine.decode = "speculative"',
    "timed_cycles": 'the speculative series exist only with engine.decode = "speculative"',
    "sparrow_controller_bin_predicted_gain": "the controller's lossless mode runs only for speculative rollouts",
}


def _quiet_reason(expr: str) -> str | None:
    return next((why for key, why in QUIET_IN_A_HEALTHY_RUN.items() if key in expr), None)


def test_every_panel_query_returns_data_from_a_live_sparrow_up_run(tmp_path):
    prom_port = free_port()
    config = tiny_config(
        tmp_path / "up.toml",
        schedule=SCHEDULE,
        pairs=16,
        top={"scrape_interval_s": 0.5, "steps": UNREACHED_STEPS},
        extra=f"[ports]\nprometheus = {prom_port}\n",
    )
    up = UpProcess("--config", str(config), "--generators", "2", "--run-dir", str(tmp_path / "run"), "--json")
    try:
        for _ in range(4):  # a few steps: every service has exported and been scraped several times
            row = up.next_object(timeout=300)
            assert row["type"] == "step", row
        url = f"http://127.0.0.1:{prom_port}"
        bins = sorted(row["p5"], key=int)
        failures, quiet = [], []
        for dashboard, title, expr in panel_queries():
            for bin_value in (".*", bins[-1]):
                query = substitute(expr, bin_value, "30s")
                answer = instant_query(url, query)
                assert answer["status"] == "success", f"{dashboard} / {title}: {query}: {answer}"
                why = _quiet_reason(expr)
                if why:
                    quiet.append(title)
                    continue
                deadline = time.monotonic() + 60  # rates need a few scrapes; the controller ticks every few s
                while not finite_values(instant_query(url, query)) and time.monotonic() < deadline:
                    _still_running(up)
                    time.sleep(0.5)
                if not finite_values(instant_query(url, query)):
                    failures.append(f"{dashboard} / {title}: {query}")
        assert not failures, "panels without data in a live run:\n" + "\n".join(failures)
        assert len(quiet) < len(panel_queries())  # the exemptions stay exceptions
        _still_running(up)
        up.proc.send_signal(signal.SIGINT)
        assert up.wait(120) == 130, up.stderr_so_far()  # interrupted by the user, as Ctrl-C would
    finally:
        up.kill()


def _still_running(up: UpProcess) -> None:
    """The run must outlive the walk: it only ends when the test stops it."""
    if up.proc.poll() is not None:
        raise AssertionError(f"sparrow up ended on its own (exit {up.proc.returncode}): {up.stderr_so_far()}")
