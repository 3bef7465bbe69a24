"""The controller's config: every knob of the loop, one typed model with defaults (sparrow.config)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from services.common.sections import RedisConfig, SecurityConfig
from services.controller.grid import BudgetGrid
from sparrow import metrics_contract as mc
from sparrow.config import ConfigSection, SparrowConfig
from sparrow.schedule import PAGE_SIZE


class RetuneConfig(ConfigSection):
    """How budgets move: the target, its margin and hysteresis, bounds and step sizes."""

    tau: float = Field(
        0.86, gt=0, lt=1, description="Stability threshold on each bin's tail statistic (tail_quantile of alpha)."
    )
    margin: float = Field(0.02, ge=0, lt=0.5, description="Safety margin: a bin is raised when its p5 < tau + margin.")
    hysteresis: float = Field(
        0.02,
        ge=0,
        lt=0.5,
        description="Lowering without a bracketing observation needs p5 > tau + margin + hysteresis.",
    )
    refine_margin: float = Field(
        0.002,
        ge=0,
        lt=0.5,
        description="A budget whose fitted p5 is below target + this is never lowered onto (stops hopping).",
    )
    lower_hold_s: float = Field(
        120.0, ge=0, description="Seconds a bin's p5 must stay at or above target before its budget is lowered."
    )
    lower_min_readings: int = Field(
        2, ge=1, description="Distinct fresh readings a bin needs over the hold before it is lowered."
    )
    raise_min_readings: int = Field(
        2,
        ge=1,
        description="Readings at a budget, each >= tau, with a mean under target before a raise (under tau: at once).",
    )
    average_readings: int = Field(
        4, ge=1, description="Readings at one budget are averaged; the newest keeps at least 1/this of the weight."
    )
    min_tokens: int = Field(2000, ge=1, description="Tokens a bin's reading needs before it is acted on.")
    min_budget: int = Field(512, gt=0, description="Lowest budget (kept KV tokens) the controller sets.")
    max_budget: int = Field(32768, gt=0, description="Highest budget (kept KV tokens) the controller sets.")
    budget_quantum: int = Field(
        256, gt=0, description="Finest step of the budgets the controller sets (tokens; a multiple of the page)."
    )
    steps_per_doubling: int = Field(
        8, ge=1, description="Grid steps per octave above quantum x this: 256 up to 4096, then 512, 1024, ..."
    )
    max_step_ratio: float = Field(
        2.0, gt=1, description="One change multiplies a budget by at most this, or divides it by at most this."
    )
    prior_slope: float = Field(
        0.06, gt=0, description="Assumed p5 gain per doubling of budget until a bin's own curve shows its slope."
    )
    min_slope: float = Field(
        0.01, gt=0, description="Smallest slope (p5 per doubling) used to extrapolate a bin's fitted curve."
    )
    curve_memory_s: float = Field(3600.0, gt=0, description="Observations older than this leave a bin's curve.")
    curve_reset_delta: float = Field(
        0.03,
        gt=0,
        description="A fresh reading this far from the bin's fitted curve means the curve moved: older points go.",
    )
    tail_quantile: float = Field(
        mc.TAIL_QUANTILE,
        gt=0,
        lt=0.5,
        description="The tail statistic each bin must hold >= tau: this quantile of alpha (0.05: the paper's p5; "
        "0.01: p1, for tasks that hinge on rare tokens). The gauge path needs a trainer gauge (0.05 or 0.01).",
    )
    alpha: Literal["topk", "exact"] = Field(
        "topk",
        description="Which alpha the statistic is read from: the top-k bound, or the exact value (needs the trainer's "
        'alpha = "exact").',
    )
    p5_source: Literal["exact", "histogram", "min"] = Field(
        "exact",
        description="Which p5 decides: the exact gauge (histogram when it lacks tokens), the histogram, or the lower.",
    )

    @property
    def grid(self) -> BudgetGrid:
        """The budgets the controller may set."""
        return BudgetGrid(self.budget_quantum, self.steps_per_doubling)

    @property
    def target(self) -> float:
        """The p5 every bin must hold: tau + margin."""
        return self.tau + self.margin

    @model_validator(mode="after")
    def _check(self) -> RetuneConfig:
        q = self.budget_quantum
        if q % PAGE_SIZE or q & (q - 1):  # a power of two, so the coarser octave steps stay multiples of it
            raise ValueError(f"budget_quantum {q} must be a power of two and a multiple of the page size {PAGE_SIZE}")
        for name in ("min_budget", "max_budget"):
            value = getattr(self, name)
            if not self.grid.contains(value):
                raise ValueError(
                    f"{name} {value} is not on the budget grid (the next grid value is {self.grid.up(value)})"
                )
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget {self.min_budget} is above max_budget {self.max_budget}")
        if self.target >= 1:
            raise ValueError(f"tau + margin must be below 1, got {self.target}")
        if self.p5_source != "histogram" and mc.alpha_series(self.alpha).gauge(self.tail_quantile) is None:
            raise ValueError(
                f"tail_quantile {self.tail_quantile:g} has no per-bin gauge (the trainer exports "
                f"{', '.join(f'{q:g}' for q in mc.GAUGE_QUANTILES)}); use one of those or p5_source = 'histogram'"
            )
        return self


class LosslessConfig(ConfigSection):
    """`mode = "lossless"`: per bin, the draft budget of speculative decoding that maximises tokens per unit cost.

    The budgets move on `retune`'s grid and bounds (`min_budget`, `max_budget`, `budget_quantum`,
    `steps_per_doubling`, `max_step_ratio`) and its memory (`average_readings`, `curve_memory_s`); tau,
    margin and the probes do not apply.
    """

    speculative_tokens: int = Field(
        6, ge=1, le=16, description="Drafts per cycle (k) the generators run (their engine.speculative_tokens)."
    )
    min_drafts: int = Field(2000, ge=1, description="Drafted positions a bin's reading needs before it is acted on.")
    hold_s: float = Field(120.0, ge=0, description="Seconds of fresh readings at a budget before the bin may move.")
    min_readings: int = Field(2, ge=1, description="Readings at a budget before the bin may move.")
    min_gain: float = Field(
        0.02,
        ge=0,
        lt=1,
        description="A move needs a predicted tokens per cost at least this much (relative) above the current "
        "budget's.",
    )
    rejection_ratio_per_doubling: float = Field(
        0.6,
        gt=0,
        lt=1,
        description="Assumed factor by which the share of rejected drafts (1 - acceptance) shrinks per doubling of "
        "the draft budget, until a bin's own readings show it.",
    )
    min_rejection_ratio_per_doubling: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="The weakest shrink per doubling used to extrapolate a bin's fitted curve.",
    )
    price_from_cycle_times: bool = Field(
        True,
        description="Price a bin's cycles in the seconds the generators timed them in: the verify's as measured in "
        "the bin, a draft step's fitted over every bin and budget read (a fixed part plus a slope in the step's "
        "attention cost), once those span enough to fit. False, or until then: the cost model, with the step "
        "overhead of [cost].",
    )
    curve_reset_delta: float = Field(
        0.5,
        gt=0,
        description="A fresh reading this far from the bin's fitted curve, in -ln(1 - acceptance), means the curve "
        "moved: older points go (0.5: the share of rejections off by a factor 1.65).",
    )

    @model_validator(mode="after")
    def _check(self) -> LosslessConfig:
        if self.min_rejection_ratio_per_doubling < self.rejection_ratio_per_doubling:
            raise ValueError("min_rejection_ratio_per_doubling must be at least rejection_ratio_per_doubling")
        return self


class PrometheusConfig(ConfigSection):
    """Where and how the tail statistic is read."""

    url: str = Field("http://127.0.0.1:9090", description="Base URL of the Prometheus HTTP API.")
    window_s: float = Field(300.0, gt=0, description="Range W of rate(...[W]) in the histogram quantile, seconds.")
    timeout_s: float = Field(5.0, gt=0, description="Timeout of one query, seconds.")
    max_age_s: float = Field(120.0, gt=0, description="A bin's latest sample older than this is stale.")


class ScheduleStoreConfig(RedisConfig):
    """The schedule store: the shared Redis, and how much history it keeps."""

    history_limit: int = Field(1000, ge=1, description="Schedule versions kept in the history list.")


class ApiConfig(ConfigSection):
    """The admin API."""

    host: str = Field("127.0.0.1", description="Address the admin API listens on.")
    port: int = Field(8470, ge=0, le=65535, description="Port of the admin API and /metrics.")
    decisions_kept: int = Field(50, ge=1, description="Recent decisions shown in the status.")


class CostConfig(ConfigSection):
    """What the cost model prices when it reports a schedule's predicted speedup."""

    model: str = Field("qwen3-1.7b", description="Model preset name or a HF config.json path.")
    hardware: str = Field("h200", description="Hardware preset (h200, h100, cpu).")
    prompt_len: int = Field(512, ge=0, description="Prompt tokens.")
    gen_len: int = Field(32768, ge=1, description="Generated tokens per sample.")
    samples: int = Field(8, ge=1, description="Samples per prompt.")
    step_overhead: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="What a decode forward costs per sequence beyond the paper's terms (weight reads, sampling, the "
        "engine's own work), in multiples of the weights' FLOPs 2P; 0 prices as the paper does. Measure it: "
        "`sparrow bench rollout` reports `cost.implied_step_overhead` for the engine, batch and length it ran. "
        "In lossless mode it is priced until the generators' timed cycles give a measured one.",
    )
    measure_step_overhead: bool = Field(
        True,
        description="Lossless mode: price with the step overhead the generators' own timing of drafts and verifies "
        "implies (sparrow_generator_draft_seconds / verify_seconds), once they have timed a cycle; false keeps "
        "the configured step_overhead.",
    )


class ProbeConfig(ConfigSection):
    """Optional probe requests: a share of sequences run below the current budget to learn the curve there."""

    enabled: bool = Field(False, description="Write probe requests for generators (needs trainer probe metrics).")
    share: float = Field(0.05, gt=0, le=0.5, description="Share of new sequences that run at the probe budget.")
    ratio: float = Field(0.75, gt=0, lt=1, description="Probe budget as a fraction of the current budget.")
    ttl_s: float = Field(600.0, gt=0, description="A probe request expires after this many seconds.")


class ControllerConfig(SparrowConfig):
    """The controller service's whole config (TOML file, SPARROW_* environment, flags)."""

    renamed: ClassVar[dict[str, str]] = {"api.token": "security.token"}

    mode: Literal["tail", "lossless"] = Field(
        "tail",
        description='What the controller serves: "tail" holds every bin\'s p5 of alpha above tau for lossy sparse '
        'rollouts (the trainer\'s metrics); "lossless" picks the draft budgets that maximise throughput for '
        "speculative rollouts (the generators' acceptance; see [lossless]).",
    )
    initial_schedule: str = Field(
        "qwen3-1.7b-0.86", description="Preset name or schedule JSON file published when Redis holds none."
    )
    interval_s: float = Field(30.0, gt=0, description="Seconds between two control ticks.")
    retune: RetuneConfig = Field(default_factory=RetuneConfig, description="Retuning rules.")
    prometheus: PrometheusConfig = Field(default_factory=PrometheusConfig, description="Prometheus source.")
    redis: ScheduleStoreConfig = Field(default_factory=ScheduleStoreConfig, description="Schedule store.")
    api: ApiConfig = Field(default_factory=ApiConfig, description="Admin API.")
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="Bearer token of the admin API's POST endpoints (override, pause, resume); unset disables them.",
    )
    cost: CostConfig = Field(default_factory=CostConfig, description="Cost model inputs for predicted speedup.")
    probe: ProbeConfig = Field(default_factory=ProbeConfig, description="Optional probe requests.")
    lossless: LosslessConfig = Field(default_factory=LosslessConfig, description='`mode = "lossless"`: its rules.')

    @model_validator(mode="after")
    def _check_probe(self) -> ControllerConfig:
        # The trainer's probe gauges hold p5: a curve fitted to them does not describe another quantile.
        if self.probe.enabled and abs(self.retune.tail_quantile - mc.TAIL_QUANTILE) > 1e-12:
            raise ValueError(f"probes read p5; they need retune.tail_quantile = {mc.TAIL_QUANTILE:g}")
        if self.probe.enabled and self.mode == "lossless":
            raise ValueError("probes measure a lossy budget's tail; mode = 'lossless' has none: drop probe.enabled")
        return self
