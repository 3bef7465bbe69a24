"""The live view's predicted speedup in a speculative run: the lossless controller's own (its gauge, read through a
real Prometheus), never the lossy prediction of the same budgets, which speculative rollouts do not give."""

import math
from types import SimpleNamespace

from prometheus_client import start_http_server

from services.controller.metrics import ControllerMetrics
from services.launcher.run import speedup_function
from services.launcher.scrape import controller_speedup, promql_by_bin
from tests.servers import free_port, prometheus_server, wait_until

SCHEDULE = {"budgets": [128, 256, 512], "bin_width": 1024, "version": 3}


def test_a_speculative_run_shows_the_controllers_prediction_or_none():
    metrics = ControllerMetrics()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        with prometheus_server([f"127.0.0.1:{port}"]) as prom:
            plan = SimpleNamespace(
                up=SimpleNamespace(decode="speculative"),
                prometheus_url=prom.url,
                children=SimpleNamespace(controller=1),
            )
            speedup_of = speedup_function(plan)
            # A lossless controller before its first acceptance reading predicts nothing (NaN): no figure, not 0.
            metrics.show_schedule((128, 256, 512), 3, math.nan)
            wait_until(lambda: controller_speedup(prom.url) is None and prom_has_scraped(prom.url), 30, "a NaN scrape")
            assert speedup_of(SCHEDULE) is None
            metrics.show_schedule((128, 256, 512), 3, 1.32)
            wait_until(lambda: speedup_of(SCHEDULE) == 1.32, 30, "the controller's prediction through Prometheus")
            no_controller = SimpleNamespace(
                up=plan.up, prometheus_url=prom.url, children=SimpleNamespace(controller=None)
            )
            assert speedup_function(no_controller)(SCHEDULE) is None
    finally:
        server.shutdown()
        thread.join(5)
    assert controller_speedup(prom.url) is None  # Prometheus gone: no figure, no error


def prom_has_scraped(url: str) -> bool:
    return promql_by_bin(url, "max(sparrow_controller_schedule_version)").get("") == 3.0
