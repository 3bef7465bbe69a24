"""The controller's own Prometheus metrics, on a registry of its own (served on /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from sparrow import metrics_contract as mc

DECISION_REASONS = ("raise", "lower", "refine", "retry", "repair", "override", "initial", "restore")
TICK_OUTCOMES = ("ok", "blind", "paused", "store_error", "rejected", "conflict")


class ControllerMetrics:
    """Budgets, what was read, decisions and the loop's health."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.budget = Gauge(
            "sparrow_controller_budget_tokens", "Scheduled KV budget per length bin.", [mc.BIN_LABEL], registry=r
        )
        self.alpha_p5 = Gauge(
            "sparrow_controller_alpha_p5",
            "p5 of alpha per bin that the controller last acted on (its running estimate).",
            [mc.BIN_LABEL],
            registry=r,
        )
        self.draft_alpha = Gauge(
            "sparrow_controller_draft_alpha",
            "Lossless mode: mean acceptance of one draft per bin at its budget (the running estimate).",
            [mc.BIN_LABEL],
            registry=r,
        )
        self.bin_gain = Gauge(
            "sparrow_controller_bin_predicted_gain",
            "Lossless mode: predicted tokens per cost of speculative decoding over dense, per bin at its budget.",
            [mc.BIN_LABEL],
            registry=r,
        )
        self.target = Gauge("sparrow_controller_alpha_target", "The p5 every bin must hold: tau + margin.", registry=r)
        self.speedup = Gauge(
            "sparrow_controller_predicted_speedup", "Cost model's rollout speedup of the current schedule.", registry=r
        )
        self.step_overhead = Gauge(
            "sparrow_controller_step_overhead",
            "Lossless mode: the step overhead the gain is priced with (multiples of 2P; measured from the generators' "
            "timed cycles, or the configured one).",
            registry=r,
        )
        self.draft_fixed = Gauge(
            "sparrow_controller_draft_fixed_seconds",
            "Lossless mode: the fixed part of a draft step in the fit of the generators' timed cycles (seconds a "
            "step costs whatever its budget); 0 until the cycles span enough to fit.",
            registry=r,
        )
        self.version = Gauge("sparrow_controller_schedule_version", "Version of the current schedule.", registry=r)
        self.blind = Gauge(
            "sparrow_controller_blind", "1 while no fresh trainer metrics are readable (schedule held).", registry=r
        )
        self.paused = Gauge("sparrow_controller_paused", "1 while retuning is paused.", registry=r)
        self.decisions = Counter(
            "sparrow_controller_decisions", "Budget changes per bin, by reason.", ["reason"], registry=r
        )
        self.ticks = Counter("sparrow_controller_ticks", "Control ticks by outcome.", ["outcome"], registry=r)
        self.steps_unseen = Counter(
            "sparrow_controller_trainer_steps_unseen",
            "Trainer steps that ended between two ticks: their p5 readings were never read.",
            registry=r,
        )
        for reason in DECISION_REASONS:
            self.decisions.labels(reason=reason)
        for outcome in TICK_OUTCOMES:
            self.ticks.labels(outcome=outcome)

    def show_schedule(self, budgets: tuple[int, ...], version: int, speedup: float | None) -> None:
        """Publish the current schedule's budgets, version and predicted speedup."""
        for i, b in enumerate(budgets):
            self.budget.labels(**{mc.BIN_LABEL: mc.bin_label(i)}).set(b)
        self.version.set(version)
        if speedup is not None:
            self.speedup.set(speedup)

    def show_estimates(self, estimates: dict[int, float]) -> None:
        """The per-bin p5 estimates of the last tick (bins without one keep their last value)."""
        for i, value in estimates.items():
            self.alpha_p5.labels(**{mc.BIN_LABEL: mc.bin_label(i)}).set(value)

    def show_draft_estimates(self, bins: list) -> None:
        """Lossless mode: each bin's acceptance estimate and predicted gain (bins without one keep their last)."""
        for status in bins:
            label = {mc.BIN_LABEL: mc.bin_label(status.bin)}
            if status.estimate is not None:
                self.draft_alpha.labels(**label).set(status.estimate)
            if status.predicted_gain is not None:
                self.bin_gain.labels(**label).set(status.predicted_gain)

    def exposition(self) -> bytes:
        """The text exposition format of every metric here."""
        return generate_latest(self.registry)
