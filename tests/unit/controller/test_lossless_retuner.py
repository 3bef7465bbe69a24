"""Lossless mode's rule, driven by synthetic acceptance curves and a fake clock, priced by the real cost model."""

import math

import pytest

from services.controller.config import ControllerConfig
from services.controller.main import lossless_retuner
from services.controller.readings import DraftReading, Snapshot
from sparrow.hardware import get_hardware
from sparrow.models import resolve_model
from sparrow.schedule import Schedule

WINDOW = 5
MODEL, HARDWARE = resolve_model("qwen3-1.7b"), get_hardware("h200")


def config(**lossless):
    return ControllerConfig.model_validate(
        {"mode": "lossless", "lossless": {"hold_s": 10, **lossless}, "prometheus": {"window_s": WINDOW}}
    )


def acceptance(b0, floor=0.5):
    """Mean acceptance of one draft at budget b: 1 - 0.03 (b0 / b)^0.7, so a = 0.97 at b0; at least `floor`."""
    return lambda b: max(floor, 1.0 - 0.03 * (b0 / b) ** 0.7)


class Fleet:
    """The retuner + generators that report curves[i](budget) once the schedule is in force + a clock."""

    def __init__(self, cfg, budgets, bin_width=4096):
        self.cfg = cfg
        self.r = lossless_retuner(cfg, MODEL, HARDWARE)
        self.schedule = Schedule(budgets=tuple(budgets), bin_width=bin_width)
        self.now, self.publishes, self.running = 0.0, 0, self.schedule.version
        self.drafts = 6000

    def tick(self, curves, seconds=1.0):
        self.now += seconds
        bins = {i: DraftReading(curves[i](b), self.drafts) for i, b in enumerate(self.schedule.budgets)}
        proposal = self.r.step(self.schedule, Snapshot(self.running, bins), self.now)
        self.running = self.schedule.version  # the generators take a new schedule within a tick
        if proposal.changed:
            self.schedule = self.schedule.with_budgets(proposal.budgets)
            self.schedule = Schedule(**{**self.schedule.to_dict(), "version": self.schedule.version + 1})
            self.publishes += 1
        return proposal

    def gain(self, index, budget, curves):
        return self.r.gain(self.schedule, index, budget, curves[index](budget))


def best_budgets(fleet, curves):
    """Per bin, the grid budget in the bounds with the highest true gain (before the non-decreasing repair)."""
    c, out = fleet.cfg.retune, []
    for i in range(len(curves)):
        b, best = c.min_budget, None
        while b <= c.max_budget:
            if best is None or fleet.gain(i, b, curves) > fleet.gain(i, best, curves):
                best = b
            b = c.grid.next_above(b)
        out.append(best)
    return out


def test_each_bin_converges_near_its_best_draft_budget_and_stays():
    cfg = config()
    curves = [acceptance(b0) for b0 in (600, 1200, 2500, 4000, 6000)]
    fleet = Fleet(cfg, [4096] * 5)
    for _ in range(600):
        fleet.tick(curves)
    want = best_budgets(fleet, curves)
    got = fleet.schedule.budgets
    for i, (b, w) in enumerate(zip(got, want, strict=True)):
        # Within 2% of the best bin's gain (the fit between grid points and min_gain leave it that close).
        assert fleet.gain(i, b, curves) >= 0.98 * fleet.gain(i, w, curves), (i, got, want)
    assert all(fleet.gain(i, b, curves) > 1.2 for i, b in enumerate(got) if i >= 1)
    settled = fleet.publishes
    for _ in range(300):
        fleet.tick(curves)
    assert fleet.publishes == settled  # no hopping once there
    assert list(got) == sorted(got)


def test_a_drop_in_acceptance_moves_the_budget_up_and_the_bin_settles_again():
    cfg = config()
    fleet = Fleet(cfg, [1024, 2048], bin_width=16384)
    good = [acceptance(400), acceptance(800)]
    for _ in range(500):
        fleet.tick(good)
    before = fleet.schedule.budgets
    worse = [acceptance(3000), acceptance(30000)]  # the policy moved: drafts at the same budget agree less
    for _ in range(800):
        fleet.tick(worse)
    after = fleet.schedule.budgets
    assert after[1] > before[1]
    want = best_budgets(fleet, worse)
    assert fleet.gain(1, after[1], worse) >= 0.97 * fleet.gain(1, want[1], worse)


def test_readings_under_an_older_schedule_or_the_first_window_or_few_drafts_move_nothing():
    cfg = config()
    r = lossless_retuner(cfg, MODEL, HARDWARE)
    s = Schedule(budgets=(4096, 4096), bin_width=16384, version=3)
    bad = {0: DraftReading(0.5, 10**6), 1: DraftReading(0.5, 10**6)}
    for t in range(200):  # the generators still run v2: nothing they count is this schedule's
        p = r.step(s, Snapshot(2, bad), float(t))
        assert not p.changed and {b.state for b in p.bins} == {"waiting"}
    p = r.step(s, Snapshot(3, bad), 200.0)  # fresh, but the window still holds v2's drafts
    assert not p.changed and p.bins[0].state == "waiting"
    few = {0: DraftReading(0.99, 10), 1: DraftReading(0.99, 10)}
    for t in range(201, 400):
        p = r.step(s, Snapshot(3, few), float(t))
        assert not p.changed
    assert p.bins[0].state == "few_tokens"
    for t in range(400, 600):
        p = r.step(s, None, float(t))  # blind
        assert not p.changed


def test_the_gain_model_prices_drafts_and_the_verify():
    cfg = config(speculative_tokens=6)
    r = lossless_retuner(cfg, MODEL, HARDWARE)
    s = Schedule(budgets=(512,) * 8, bin_width=4096)
    # At a dense draft (budget over the KV) k + 1 dense-priced passes emit k + 1 tokens: a little under 1x.
    assert 0.5 < r.gain(s, 0, 4096, 0.3) < 1.0
    # Long contexts, a cheap accepted draft: several-fold fewer KV reads per token.
    assert r.gain(s, 7, 1024, 0.97) > 2.5
    # More acceptance at one budget never costs, more budget at one acceptance never pays.
    assert r.gain(s, 7, 1024, 0.9) < r.gain(s, 7, 1024, 0.97)
    assert r.gain(s, 7, 2048, 0.9) < r.gain(s, 7, 1024, 0.9)
    assert math.isnan(r.gain(s, 7, 1024, None))


def test_lossless_mode_refuses_probes():
    with pytest.raises(ValueError, match="lossless"):
        ControllerConfig.model_validate({"mode": "lossless", "probe": {"enabled": True}})


def test_a_step_overhead_prices_drafts_dearer_and_keeps_budgets_where_they_pay():
    """Where attention is a small part of a step (a CPU, a small model), the paper's terms alone make drafts look
    several times cheaper than they are; with the measured step overhead the best budget is a larger one."""
    from sparrow.hardware import Hardware

    model, cpu = resolve_model("models/long"), Hardware("cpu-like", 9e10, 1.9e10, 4, "a 2-core CPU's order")
    s = Schedule(budgets=(512,) * 8, bin_width=1024, dense_layers=(0, 1))

    def curve(b):  # rejections shrink by 0.6 per doubling: 0.987 at 512, as models/long's drafts at 8K
        return 1 - 0.013 * 0.6 ** math.log2(b / 512)

    def retuner(overhead):
        cfg = {"mode": "lossless", "lossless": {"speculative_tokens": 6}, "cost": {"step_overhead": overhead}}
        return lossless_retuner(ControllerConfig.model_validate(cfg), model, cpu)

    paper, priced = retuner(0.0), retuner(200.0)
    budgets = [64, 128, 256, 512, 1024, 2048, 4096]

    def best(r):
        return max(budgets, key=lambda b: r.gain(s, 7, b, curve(b)))

    assert best(paper) == 256 and best(priced) == 512
    for b in budgets:  # a fixed cost per forward brings every gain towards 1
        assert 1 < priced.gain(s, 7, b, curve(b)) < paper.gain(s, 7, b, curve(b))


def test_the_step_overhead_priced_is_the_one_the_generators_timed_cycles_imply():
    from sparrow.cost import decode_step_cost

    s = Schedule(budgets=(512, 1024, 2048, 4096), bin_width=4096, dense_layers=(0, 1))
    k = 6

    def timed(index, overhead, cycles):
        kv, budget = 4096 * index + 2048, s.budgets[index]
        draft = decode_step_cost(MODEL, HARDWARE, kv, budget, 16, 2, step_overhead=overhead).total
        verify = decode_step_cost(MODEL, HARDWARE, kv, 0, queries=k + 1, step_overhead=overhead).total
        scale = 1e-12 * cycles  # seconds summed over the window's cycles
        return DraftReading(0.97, 6000, 0, 0, cycles, k * draft * scale, verify * scale)

    cfg = ControllerConfig.model_validate(  # priced by the cost model (cycle times: the next test)
        {"mode": "lossless", "lossless": {"speculative_tokens": k, "price_from_cycle_times": False},
         "cost": {"step_overhead": 7.0}}
    )  # fmt: skip
    r = lossless_retuner(cfg, MODEL, HARDWARE)
    est = r.overhead
    assert est.value == 7.0 and est.measured is None  # nothing timed yet: the configured figure
    # Bins 0-1 timed as an engine paying 30 x 2P, bin 2 as one paying 90, with three times fewer cycles than each
    # of the others; bin 3 too few cycles to count.
    bins = {0: timed(0, 30, 24), 1: timed(1, 30, 24), 2: timed(2, 90, 8), 3: timed(3, 500, 2)}
    r.step(s, Snapshot(s.version, bins), 0.0)
    assert est.measured is None  # the first window may hold cycles of a budget before the current one
    later = 1.0 + cfg.prometheus.window_s
    r.step(s, Snapshot(s.version, bins), later)
    assert est.per_bin == pytest.approx({0: 30, 1: 30, 2: 90})
    assert est.value == est.measured == pytest.approx((30 * 48 + 90 * 8) / 56)
    # The gain is priced with it: the same as a retuner configured with that overhead.
    fixed = {"mode": "lossless", "lossless": {"speculative_tokens": k},
             "cost": {"step_overhead": est.value, "measure_step_overhead": False}}  # fmt: skip
    same = lossless_retuner(ControllerConfig.model_validate(fixed), MODEL, HARDWARE)
    assert r.gain(s, 1, 768, 0.98) == pytest.approx(same.gain(s, 1, 768, 0.98))
    assert same.overhead.value == est.value and same.overhead.measure is False
    # A blind tick, or one with no bin timed enough, keeps the last estimate.
    r.step(s, None, later + 1)
    r.step(s, Snapshot(s.version, {0: timed(0, 400, 3)}), later + 2)
    assert est.value == pytest.approx((30 * 48 + 90 * 8) / 56)
    # Times no overhead explains (a draft step as long as the verify) are left out.
    bad = DraftReading(0.97, 6000, 0, 0, 20, 6.0, 1.0)
    r.step(s, Snapshot(s.version, {0: bad, 1: timed(1, 60, 20)}), later + 3)
    assert est.per_bin == pytest.approx({1: 60}) and est.value == pytest.approx(60)
    # With measuring off, the configured figure stays whatever is timed.
    off = lossless_retuner(
        ControllerConfig.model_validate({**fixed, "cost": {"step_overhead": 7.0, "measure_step_overhead": False}}),
        MODEL, HARDWARE,
    )  # fmt: skip
    off.step(s, Snapshot(s.version, bins), 0.0)
    off.step(s, Snapshot(s.version, bins), 1.0 + cfg.prometheus.window_s)
    assert off.overhead.measured == pytest.approx((30 * 48 + 90 * 8) / 56)  # measured and shown, not priced
    assert off.overhead.value == 7.0 and off.overhead.status()["priced"] == 7.0


def timed_cycles(schedule, k, draft_seconds, verify_seconds, acceptance, cycles=20):
    """Each bin's reading of `cycles` timed cycles at its budget: draft_seconds(bin, budget) a draft step,
    verify_seconds(bin) the rest of a cycle."""
    out = {}
    for i, b in enumerate(schedule.budgets):
        draft, verify = k * draft_seconds(i, b) * cycles, verify_seconds(i) * cycles
        out[i] = DraftReading(acceptance(b), 6000, 0, 0, cycles, draft, verify)
    return out


def test_the_gain_is_priced_in_the_seconds_the_generators_timed_their_cycles_in():
    """An engine whose forwards pay 30 x 2P beyond the paper's terms times its cycles; the fitted draft step (a
    fixed part plus a slope in attention) and the verify as measured price each budget as the cost model with
    that overhead does, for budgets no bin has tried too; before the times span enough, the cost model prices."""
    from sparrow.cost import bin_middle, decode_step_cost

    s = Schedule(budgets=(512, 1024, 2048, 4096), bin_width=4096, dense_layers=(0, 1))
    k, o, scale = 6, 30.0, 1e-12

    def draft(i, b):
        return decode_step_cost(MODEL, HARDWARE, bin_middle(s, i), b, 16, 2, step_overhead=o).total * scale

    def verify(i):
        return decode_step_cost(MODEL, HARDWARE, bin_middle(s, i), 0, queries=k + 1, step_overhead=o).total * scale

    def retuner(**lossless):
        cost = {"step_overhead": o, "measure_step_overhead": False}
        cfg = {"mode": "lossless", "lossless": {"speculative_tokens": k, **lossless}, "cost": cost,
               "prometheus": {"window_s": WINDOW}}  # fmt: skip
        return lossless_retuner(ControllerConfig.model_validate(cfg), MODEL, HARDWARE)

    r, model_priced = retuner(), retuner(price_from_cycle_times=False)
    bins = timed_cycles(s, k, draft, verify, lambda b: 0.97)
    # One bin read: one attention cost, no fit; the cost model prices (here with the true overhead).
    r.step(s, Snapshot(s.version, bins), 0.0)  # the first window may hold another budget's cycles: waits
    r.step(s, Snapshot(s.version, {3: bins[3]}), 1.0 + WINDOW)
    assert r.timing.fit is None and not r.timing.status()["fitted"]
    assert r.gain(s, 3, 1536, 0.98) == model_priced.gain(s, 3, 1536, 0.98)
    r.step(s, Snapshot(s.version, bins), 2.0 + WINDOW)
    fit = r.timing.fit
    assert fit.fixed == pytest.approx(scale * 2 * MODEL.params * (1 + o)) and fit.per_eflop == pytest.approx(scale)
    status = r.timing.status()
    assert status["fitted"] and status["observations"] == 4 and len(status["verify_s"]) == 4
    for i, b, a in ((0, 256, 0.9), (1, 768, 0.98), (2, 3072, 0.99), (3, 1024, 0.95), (3, 16384, 0.97)):
        assert r.gain(s, i, b, a) == pytest.approx(model_priced.gain(s, i, b, a), rel=1e-9), (i, b)
    # A reading older than the memory leaves the fit; the verify of a bin never measured is not priced by it.
    later = 3.0 + WINDOW + r.timing.memory_s
    r.step(s, Snapshot(s.version, {0: bins[0]}), later)
    assert r.timing.fit is None and r.timing.status()["observations"] == 1
    off = retuner(price_from_cycle_times=False)
    off.step(s, Snapshot(s.version, bins), 0.0)
    off.step(s, Snapshot(s.version, bins), 1.0 + WINDOW)
    assert off.timing.fit is not None and off.timing.gain(s, 1, 768, 0.98) is None  # fitted and shown, not priced


def test_priced_in_measured_seconds_a_cpu_keeps_the_budget_that_pays_where_the_overhead_fit_lowers_it():
    """On this CPU a verify over k + 1 positions takes about 2 dense steps where the cost model prices 7, and a
    draft step's fixed part is most of it (8K RL run, docs/results.md). The one-overhead fit to the draft/verify
    ratio then prices drafts too cheap: it picks half the best budget and predicts 1.7x where 1.27x is true. The
    measured seconds pick the best budget and, with the dense step as the fit extrapolates it, its true gain."""
    from sparrow.cost import bin_middle, step_attention_cost
    from sparrow.hardware import Hardware
    from sparrow.speculative import expected_tokens

    model, cpu = resolve_model("models/long"), Hardware("cpu-like", 9e10, 1.9e10, 4, "a 2-core CPU's order")
    s = Schedule(budgets=(256, 384, 512, 640, 768, 896, 1024, 1024), bin_width=1024, dense_layers=(0, 1))
    k = 6

    def curve(b):  # rejections shrink by 0.6 per doubling: 0.987 at 512, as models/long's drafts at 8K
        return 1 - 0.013 * 0.6 ** math.log2(b / 512)

    def draft(i, b):  # 10 ms a step, 30 ms a dense one at 8K
        return 0.010 + 0.020 * step_attention_cost(model, cpu, bin_middle(s, i), b, 16, 2) / dense_attention(7)

    def dense_attention(i):
        return step_attention_cost(model, cpu, bin_middle(s, i), 0, 16, 2)

    def verify(i):
        return 2 * draft(i, 0)

    def true_gain(i, b):
        a = 1.0 if b >= bin_middle(s, i) else curve(b)
        return expected_tokens(a, k) * draft(i, 0) / (k * draft(i, b) + verify(i))

    def retuner(**lossless):
        lossless = {"speculative_tokens": k, **lossless}
        cfg = {"mode": "lossless", "lossless": lossless, "prometheus": {"window_s": WINDOW}}
        r = lossless_retuner(ControllerConfig.model_validate(cfg), model, cpu)
        bins = timed_cycles(s, k, draft, verify, curve)
        r.step(s, Snapshot(s.version, bins), 0.0)
        r.step(s, Snapshot(s.version, bins), 1.0 + WINDOW)
        return r

    timed, fitted = retuner(), retuner(price_from_cycle_times=False)
    assert fitted.overhead.measured is not None and timed.timing.fit is not None
    grid = [64, 128, 256, 512, 768, 1024, 1536, 2048, 4096]
    true_best = max(grid, key=lambda b: true_gain(7, b))
    assert true_best == 512
    assert max(grid, key=lambda b: timed.gain(s, 7, b, curve(b))) == true_best
    assert max(grid, key=lambda b: fitted.gain(s, 7, b, curve(b))) == 256
    for b in grid:
        assert timed.gain(s, 7, b, curve(b)) == pytest.approx(true_gain(7, b), rel=1e-6)
    assert fitted.gain(s, 7, 512, curve(512)) > 1.3 * true_gain(7, 512)


def test_a_short_bins_raise_that_would_push_the_long_bins_off_their_best_is_not_made():
    """Bin 0 (short KV: drafts barely pay) gains 2% at 1024 over 512; the later bins, where the time goes, are best
    at 512 and lose 13% at 1024. The non-decreasing repair would carry bin 0's raise into them: it is not made.
    Where the later bins are best at 1024, the same raise costs them nothing and is made."""
    from services.controller.lossless import LosslessRetuner

    cfg = config()
    short = {512: 0.94, 1024: 0.96}
    table = {0: short, 1: {512: 1.5, 1024: 1.3}, 2: {512: 1.6, 1024: 1.4}}

    def gain(schedule, index, budget, alpha):
        return table[index].get(budget, 0.5)  # off the two budgets: far worse

    def settle(budgets):
        r = LosslessRetuner(cfg.retune, cfg.lossless, WINDOW, gain, weight=lambda s, i: 1.0 + i)
        s, moves = Schedule(budgets=budgets, bin_width=1024), []
        for t in range(40):
            bins = {i: DraftReading(0.99, 6000) for i in range(3)}
            proposal = r.step(s, Snapshot(s.version, bins), float(t))
            if proposal.changed:
                moves += proposal.decisions
                s = Schedule(**{**s.with_budgets(proposal.budgets).to_dict(), "version": s.version + 1})
        return s.budgets, moves

    budgets, moves = settle((512, 512, 512))
    assert budgets == (512, 512, 512) and not moves
    table.update({1: {512: 1.3, 1024: 1.5}, 2: {512: 1.4, 1024: 1.6}})
    budgets, moves = settle((512, 1024, 1024))
    assert budgets == (1024, 1024, 1024)
    assert [(d.bin, d.old, d.new, d.reason) for d in moves] == [(0, 512, 1024, "raise")]
    # The check is what held the first: bin 0 alone (no later bin to carry) moves to 1024.
    r = LosslessRetuner(cfg.retune, cfg.lossless, WINDOW, gain)
    s = Schedule(budgets=(512,), bin_width=1024)
    for t in range(40):
        proposal = r.step(s, Snapshot(s.version, {0: DraftReading(0.99, 6000)}), float(t))
        if proposal.changed:
            break
    assert proposal.budgets == (1024,)
