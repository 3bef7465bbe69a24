"""The loop counts trainer steps whose readings no tick saw. Only the step counter is exercised here, so the
loop gets no Redis and no Prometheus (the integration tests run it against both)."""

import logging

from services.controller.config import ControllerConfig
from services.controller.loop import ControlLoop
from sparrow.schedule import Schedule


def loop():
    return ControlLoop(
        ControllerConfig(), publisher=None, source=None, initial=Schedule(budgets=(512,)), speedup_of=lambda s: 1.0
    )


def test_steps_between_two_ticks_are_counted_logged_once_and_exported(caplog):
    c = loop()
    with caplog.at_level(logging.WARNING, logger="sparrow.controller"):
        for steps in (None, 3, 3, 4, 7, 8, 12):
            c._count_steps(steps)
    assert c.steps_unseen == 2 + 3 and c.trainer_steps == 12
    assert len([r for r in caplog.records if "went unseen" in r.getMessage()]) == 1
    assert b"sparrow_controller_trainer_steps_unseen_total 5.0" in c.metrics.exposition()
    status = c.status()
    assert status["trainer_steps"] == 12 and status["trainer_steps_unseen"] == 5


def test_a_restarted_trainer_or_a_missing_counter_is_not_a_gap():
    c = loop()
    for steps in (40, 41, 2, None, 3):  # restart: counts from 0 again; None: the counter was not readable
        c._count_steps(steps)
    assert c.steps_unseen == 0 and c.trainer_steps == 3
