"""Starts the controller: resolves its pieces from the config, logs the config, serves until SIGTERM."""

from __future__ import annotations

import logging
import signal

from services.controller.config import ControllerConfig
from services.controller.loop import ControlLoop

log = logging.getLogger("sparrow.controller")


class SetupError(ValueError):
    """The config names something that does not exist (a preset, a model, hardware); one line."""


def build_loop(config: ControllerConfig) -> ControlLoop:
    """The control loop with its Redis publisher, Prometheus source, initial schedule and cost model."""
    import redis.asyncio as aioredis

    from services.controller.prometheus_source import DraftSource, PrometheusSource
    from services.controller.publisher import SchedulePublisher
    from sparrow.cost import predict, predict_speculative
    from sparrow.hardware import HardwareError, get_hardware
    from sparrow.models import ModelSpecError, resolve_model
    from sparrow.presets import resolve_schedule
    from sparrow.schedule import ScheduleError

    cost = config.cost
    try:
        initial = resolve_schedule(config.initial_schedule)
        model = resolve_model(cost.model)
        hardware = get_hardware(cost.hardware)  # "cpu" measures once, here, not at every publish
    except (ScheduleError, ModelSpecError, HardwareError) as exc:
        raise SetupError(str(exc)) from None
    if config.retune.budget_quantum % initial.page_size:
        raise SetupError(f"retune.budget_quantum is not a multiple of the schedule's page size {initial.page_size}")

    def speedup_of(schedule):
        return predict(model, schedule, hardware, cost.prompt_len, cost.gen_len, cost.samples,
                       step_overhead=cost.step_overhead).speedup  # fmt: skip

    p = config.prometheus
    r = config.retune
    client = aioredis.from_url(config.redis.url, socket_timeout=5, socket_connect_timeout=5)
    publisher = SchedulePublisher(client, config.redis.history_limit)
    if config.mode == "lossless":
        retuner = lossless_retuner(config, model, hardware)

        def speculative_speedup_of(schedule):
            alpha = retuner.mean_acceptance()  # nothing measured yet: no prediction (NaN)
            if alpha is None:
                return float("nan")
            return predict_speculative(predict_schedule(schedule), config.lossless.speculative_tokens, alpha).speedup

        def predict_schedule(schedule):
            return predict(model, schedule, hardware, cost.prompt_len, cost.gen_len, cost.samples,
                           step_overhead=retuner.overhead.value)  # fmt: skip

        source = DraftSource(p.url, p.window_s, p.timeout_s, p.max_age_s)
        return ControlLoop(config, publisher, source, initial, speculative_speedup_of, retuner=retuner)
    source = PrometheusSource(
        p.url, p.window_s, p.timeout_s, p.max_age_s, probes=config.probe.enabled, quantile=r.tail_quantile,
        alpha=r.alpha,
    )  # fmt: skip
    return ControlLoop(config, publisher, source, initial, speedup_of)


def lossless_retuner(config: ControllerConfig, model, hardware):
    """Lossless mode's retuner. Its gain is priced in the seconds the generators timed their cycles in, once they
    span enough budgets and lengths to fit (`CycleTimeModel`); until then by the cost model at each bin's middle KV
    length, with the step overhead the timed cycles imply (the configured one until then: without it a CPU's
    drafts look several times cheaper than they are)."""
    from services.controller.lossless import CycleTimeModel, LosslessRetuner, StepOverheadEstimate
    from sparrow.cost import (
        bin_middle,
        binned_step_overhead,
        decode_step_cost,
        dense_layer_count,
        speculative_step_speedup,
        step_attention_cost,
    )

    k = config.lossless.speculative_tokens

    def solve(schedule, timed):
        return binned_step_overhead(model, hardware, schedule, k, timed)

    def attention(schedule, index, budget):
        return step_attention_cost(model, hardware, bin_middle(schedule, index), budget, schedule.page_size,
                                   dense_layer_count(model, schedule))  # fmt: skip

    overhead = StepOverheadEstimate(config.cost.step_overhead, solve, config.cost.measure_step_overhead)
    timing = CycleTimeModel(attention, k, config.retune.curve_memory_s, config.lossless.price_from_cycle_times)

    def gain(schedule, index, budget, alpha):
        if alpha is None:
            return float("nan")
        kv = bin_middle(schedule, index)
        if budget >= kv:  # the draft reads the whole KV: it is the dense policy
            alpha = 1.0
        measured = timing.gain(schedule, index, budget, alpha)
        if measured is not None:
            return measured
        return speculative_step_speedup(model, hardware, kv, budget, k, alpha, schedule.page_size,
                                        dense_layer_count(model, schedule), overhead.value)  # fmt: skip

    def weight(schedule, index):  # a dense step in the bin, as the cost model prices it
        return decode_step_cost(model, hardware, bin_middle(schedule, index), 0,
                                step_overhead=overhead.value).total  # fmt: skip

    return LosslessRetuner(config.retune, config.lossless, config.prometheus.window_s, gain, overhead, timing, weight)


def serve(config: ControllerConfig) -> None:
    """Run the admin API and the control loop until SIGTERM or SIGINT, then shut down cleanly."""
    import uvicorn

    from services.controller.api import create_app

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per PromQL query drowns the decisions
    log.info("config %s", config.dump())
    loop = build_loop(config)

    async def close() -> None:
        await loop.source.aclose()
        await loop.publisher.client.aclose()
        log.info("controller stopped (schedule v%s)", loop.schedule.version if loop.schedule else None)

    app = create_app(loop, on_shutdown=close)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.api.host, port=config.api.port, log_level="warning", lifespan="on")
    )
    # uvicorn re-raises the signal it stopped on; for SIGTERM a no-op handler turns that into a clean exit 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        log.info("admin API on http://%s:%d (docs at /docs)", config.api.host, config.api.port)
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
