"""The decision rules, driven by synthetic readings and a fake clock: no servers."""

import random

import pytest

from services.controller.config import RetuneConfig
from services.controller.retune import BinReading, Retuner, Snapshot
from sparrow.schedule import Schedule


def power(bstar, target=0.88):
    """A p5 curve that reaches `target` at budget `bstar`."""
    return lambda b: max(0.3, 1 - (1 - target) * (bstar / b) ** 0.5)


def optimal(curves, config):
    """The cheapest non-decreasing schedule on the controller's grid holding the target in every bin."""
    out = []
    for curve in curves:
        b = config.min_budget
        while curve(b) < config.target and b < config.max_budget:
            b = config.grid.next_above(b)
        out.append(max(b, out[-1]) if out else b)
    return out


def steps_off(budgets, want, config):
    """Grid steps between each budget and its optimum."""
    return [config.grid.index(b) - config.grid.index(w) for b, w in zip(budgets, want, strict=True)]


def reading(p5, tokens=5000, **kw):
    return BinReading(p5_exact=p5, tokens_exact=tokens, **kw)


class Loop:
    """Retuner + a trainer that reports curves[i](budget) for fresh data + a clock, one tick per second."""

    def __init__(self, config, budgets, probes=False):
        self.r = Retuner(config, window_s=5)
        self.schedule = Schedule(budgets=tuple(budgets))
        self.probes, self.probe_budgets, self.now, self.publishes = probes, {}, 0.0, 0
        self.tick_no = 0

    def tick(self, curves):
        self.now += 1
        self.tick_no += 1
        bins = {}
        for i, b in enumerate(self.schedule.budgets):
            extra = {}
            if i in self.probe_budgets:
                pb = self.probe_budgets[i]
                extra = {"probe_budget": pb, "probe_p5": curves[i](pb), "probe_tokens": 3000 + self.tick_no}
            bins[i] = reading(curves[i](b), 5000 + self.tick_no, **extra)
        proposal = self.r.step(self.schedule, Snapshot(self.schedule.version, bins), self.now)
        if proposal.changed:
            self.schedule = self.schedule.with_budgets(proposal.budgets)
            self.publishes += 1
        self.probe_budgets = self.r.probe_budgets(self.schedule, 0.75) if self.probes else {}
        return proposal

    def run(self, curves, ticks):
        for _ in range(ticks):
            self.tick(curves)
        return list(self.schedule.budgets)


BSTARS = [300 + 250 * i + (600 if i == 3 else 0) for i in range(12)]
PRESET_LIKE = [512, 1024, 1536, 1536, 2048, 2560, 3072, 3584, 3584, 4096, 4096, 4096]


@pytest.mark.parametrize(
    ("probes", "hysteresis"), [(True, 0.02), (False, 0.004)], ids=["probes", "no-probes-small-hysteresis"]
)
@pytest.mark.parametrize("start", ["preset", "too-aggressive", "too-lenient"])
def test_converges_within_one_step_of_the_cheapest_schedule(probes, hysteresis, start):
    config = RetuneConfig(lower_hold_s=1, hysteresis=hysteresis)
    curves = [power(b) for b in BSTARS]
    budgets = {"preset": PRESET_LIKE, "too-aggressive": [512] * 12, "too-lenient": [8192] * 12}[start]
    loop = Loop(config, budgets, probes=probes)
    final = loop.run(curves, 40)
    want = optimal(curves, config)
    assert all(abs(d) <= 1 for d in steps_off(final, want, config)), (final, want)
    assert loop.publishes <= 12, f"{loop.publishes} publishes: creeping rather than jumping"
    # After the drift, the same again from where it stands.
    moved = [power(b * (1.6 if i % 2 else 0.7)) for i, b in enumerate(BSTARS)]
    final = loop.run(moved, 40)
    want = optimal(moved, config)
    assert all(abs(d) <= 1 for d in steps_off(final, want, config)), (final, want)


def test_a_bin_far_too_low_reaches_target_in_few_raises():
    config = RetuneConfig(lower_hold_s=1)
    loop = Loop(config, [512])
    curve = power(6000)
    ticks = 0
    while curve(loop.schedule.budgets[0]) < config.target and ticks < 30:
        loop.tick([curve])
        ticks += 1
    # From 512 to ~6000 tokens: creeping by one quantum would take ~22 raises; doubling-capped jumps take 4-5.
    assert loop.publishes <= 6 and curve(loop.schedule.budgets[0]) >= config.target


def test_raise_is_bounded_by_max_step_ratio_and_max_budget():
    config = RetuneConfig(max_budget=4096, max_step_ratio=2.0)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(1024, 3072))
    proposal = r.step(schedule, Snapshot(1, {0: reading(0.5), 1: reading(0.5)}), now=1)
    assert proposal.budgets == (2048, 4096)
    at_max = Schedule(budgets=(1024, 4096), version=2)
    proposal = r.step(at_max, Snapshot(2, {1: reading(0.5, tokens=6000)}), now=2)
    assert proposal.budgets == (1024, 4096) and proposal.bins[1].state == "at_max"


def test_lowering_respects_min_budget_and_quantum():
    config = RetuneConfig(lower_hold_s=0, lower_min_readings=1, min_budget=768)
    r = Retuner(config, window_s=5)
    proposal = r.step(Schedule(budgets=(1024, 1024)), Snapshot(1, {0: reading(0.99), 1: reading(0.99)}), now=1)
    assert proposal.budgets == (768, 768)
    assert all(d.reason == "lower" for d in proposal.decisions)


def test_non_decreasing_repair_raises_later_bins_and_says_so():
    config = RetuneConfig()
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(1024, 1024, 1536, 4096))
    proposal = r.step(schedule, Snapshot(1, {0: reading(0.80)}), now=1)  # only bin 0 needs more
    assert proposal.budgets[0] > 1536 and list(proposal.budgets) == sorted(proposal.budgets)
    reasons = {d.bin: d.reason for d in proposal.decisions}
    assert reasons[0] == "raise" and reasons[1] == "repair" and reasons[2] == "repair" and 3 not in reasons
    Schedule(budgets=proposal.budgets)  # valid


def test_hysteresis_holds_a_bin_in_the_band_and_lowering_waits_for_the_hold():
    config = RetuneConfig(lower_hold_s=10, hysteresis=0.02)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(2048, 4096))
    for t in range(30):  # bin 0 inside [target, target + hysteresis], no bracket: held for good
        proposal = r.step(schedule, Snapshot(1, {0: reading(0.89, 5000 + t)}), now=t)
        assert not proposal.changed
    r = Retuner(config, window_s=5)
    for t in range(10):  # bin 0 above the band: not before lower_hold_s
        proposal = r.step(schedule, Snapshot(1, {0: reading(0.93, 5000 + t)}), now=t)
        assert not proposal.changed, t
    proposal = r.step(schedule, Snapshot(1, {0: reading(0.93, 6000)}), now=10)
    assert proposal.budgets[0] < 2048 and proposal.decisions[0].reason == "lower"


def test_repeated_identical_readings_do_not_count_as_new_evidence():
    config = RetuneConfig(lower_hold_s=0, lower_min_readings=3)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(2048,))
    for t in range(5):  # a trainer that stopped stepping: the same gauge values scraped again
        assert not r.step(schedule, Snapshot(1, {0: reading(0.95, 5000)}), now=t).changed
    assert r.step(schedule, Snapshot(1, {0: reading(0.95, 5001)}), now=6).changed is False
    assert r.step(schedule, Snapshot(1, {0: reading(0.951, 5002)}), now=7).changed


def test_new_trainer_steps_with_the_same_reading_count_once_each():
    # A lenient budget reads p5 1.0 over a bin's 4,096 tokens at every step: the values never change,
    # only the trainer's step counter does. Each step is new evidence; a step read twice is not.
    config = RetuneConfig(lower_hold_s=0, lower_min_readings=3)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(2048,))
    for t in range(5):
        assert not r.step(schedule, Snapshot(1, {0: reading(1.0, 4096)}, trainer_steps=7), now=t).changed
    assert not r.step(schedule, Snapshot(1, {0: reading(1.0, 4096)}, trainer_steps=8), now=6).changed
    proposal = r.step(schedule, Snapshot(1, {0: reading(1.0, 4096)}, trainer_steps=9), now=7)
    assert proposal.changed and proposal.budgets[0] < 2048 and proposal.decisions[0].reason == "lower"


def test_a_bin_no_sequence_reaches_follows_the_next_bin_down_instead_of_pinning_it():
    # Bin 0 is shorter than every prompt: never any data. Bins 1-2 hold with room to spare, step after
    # step; bin 3 is beyond every sequence. Lowering 1-2 must not be blocked by bin 0's budget.
    config = RetuneConfig(lower_hold_s=0, lower_min_readings=2, min_budget=48, budget_quantum=16)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(512, 512, 512, 512), bin_width=128)
    proposal = None
    for t in range(1, 4):
        bins = {1: reading(1.0, 4096), 2: reading(1.0, 4096)}
        proposal = r.step(schedule, Snapshot(1, bins, trainer_steps=t), now=t)
        if proposal.changed:
            break
    assert proposal is not None and proposal.changed
    b = proposal.budgets
    assert b[1] < 512 and b[0] <= b[1] <= b[2] <= b[3] == 512
    by_bin = {d.bin: d for d in proposal.decisions}
    assert by_bin[0].reason == "repair" and "no data in this bin" in by_bin[0].detail
    assert by_bin[1].reason == "lower"


def test_data_from_an_older_budget_waits_and_blind_or_thin_data_never_acts():
    config = RetuneConfig()
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(1024, 2048), version=5)
    r.sync(Schedule(budgets=(1024, 1024), version=4))
    proposal = r.step(schedule, Snapshot(4, {0: reading(0.5), 1: reading(0.5)}), now=1)
    assert proposal.bins[1].state == "waiting" and proposal.bins[0].state == "fresh"
    assert [d.bin for d in proposal.decisions] == [0]  # bin 1's reading came from its old budget
    r = Retuner(config, window_s=5)
    assert not r.step(schedule, None, now=1).changed
    thin = r.step(schedule, Snapshot(5, {0: reading(0.5, tokens=10), 1: BinReading()}), now=2)
    assert not thin.changed and thin.bins[0].state == "few_tokens" and thin.bins[1].state == "no_data"


def test_histogram_is_a_fallback_only_once_its_window_is_fresh():
    config = RetuneConfig()
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(2048,))
    hist = BinReading(p5_histogram=0.5, tokens_window=9000)
    assert r.step(schedule, Snapshot(1, {0: hist}), now=0).bins[0].state == "few_tokens"
    proposal = r.step(schedule, Snapshot(1, {0: hist}), now=6)
    assert proposal.bins[0].source == "histogram" and proposal.changed


def test_one_reading_below_tau_raises_at_once_even_with_a_good_history():
    config = RetuneConfig()
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(2048,))
    for t in range(6):
        assert not r.step(schedule, Snapshot(1, {0: reading(0.885, 5000 + t)}), now=t).changed
    proposal = r.step(schedule, Snapshot(1, {0: reading(0.85, 7000)}), now=7)
    assert proposal.changed and proposal.decisions[0].reason == "raise"


def test_a_schedule_with_other_bins_resets_what_was_learned():
    r = Retuner(RetuneConfig(), window_s=5)
    r.step(Schedule(budgets=(1024, 2048)), Snapshot(1, {0: reading(0.9)}), now=1)
    assert r.points(0)
    r.step(Schedule(budgets=(1024, 2048, 2048), version=2), None, now=2)
    assert r.points(0) == []


def test_a_probe_reading_counts_once_per_trainer_step_even_when_it_repeats():
    r = Retuner(RetuneConfig(), window_s=5)
    schedule = Schedule(budgets=(512,))
    probe = {"probe_budget": 256, "probe_p5": 0.97, "probe_tokens": 3000}

    def weight_at_256(steps, now):
        r.step(schedule, Snapshot(schedule.version, {0: reading(0.99, **probe)}, trainer_steps=steps), now)
        return next(p.weight for p in r.points(0) if p.budget == 256)

    assert weight_at_256(1, 1.0) == 3000
    assert weight_at_256(1, 2.0) == 3000  # the same step read again adds nothing
    assert weight_at_256(2, 3.0) == 6000  # a new step with the same figures is a new reading


def steep(bstar, target=0.88, k=1.2):
    """A p5 curve reaching `target` at `bstar` and gaining ~0.1 per doubling there (the graded model's slope)."""
    return lambda b: 1 - (1 - target) * (bstar / b) ** k


def noisy_run(config, curves, start, sd, steps, seed, drift=lambda step: 0.0):
    """One trainer step per 5 s tick, each reading the true p5 (curve + drift) plus Gaussian noise; the true p5s."""
    rnd = random.Random(seed)
    r = Retuner(config, window_s=30)
    schedule = Schedule(budgets=(start,) * len(curves), bin_width=128)
    true = []
    for step in range(1, steps + 1):
        true.append([f(b) + drift(step) for f, b in zip(curves, schedule.budgets, strict=True)])
        bins = {i: reading(p + rnd.gauss(0, sd), 3000) for i, p in enumerate(true[-1])}
        proposal = r.step(schedule, Snapshot(schedule.version, bins, trainer_steps=step), now=5.0 * step)
        if proposal.changed:
            schedule = schedule.with_budgets(proposal.budgets)
    return true


def share(rows, i, low, high=1.0):
    return sum(low <= row[i] <= high for row in rows) / len(rows)


GRADED = [steep(150), steep(180), steep(230)]


@pytest.mark.parametrize(
    ("sd", "steps", "per_bin", "overall"),
    [(0.02, 60, 0.8, 0.85), (0.03, 120, 0.45, 0.6)],
    ids=["scatter-0.02-60-steps", "scatter-0.03-120-steps"],
)
@pytest.mark.parametrize("start", [48, 512], ids=["too-aggressive", "too-lenient"])
def test_noisy_readings_settle_inside_the_band_without_ratcheting_up(start, sd, steps, per_bin, overall):
    # One step's p5 scatters by ~0.02 around the bin's true p5 (as measured in the cluster on the graded
    # bench model; 0.03 with fewer tokens per step). Budgets must settle where the TRUE p5 lies in
    # [tau, tau + 0.05], not creep upwards a grid step per unlucky reading. Shares of the last 20 steps'
    # true p5 inside the band, mean over 10 seeds: the first controller (one reading decides) had
    # 0.17-0.36 per bin at 0.02; the one averaging its raise evidence 0.76-0.93 at 0.02 and 0.26-0.48 at
    # 0.03 over 120 steps, where it still ratcheted: each failing budget was a bound for good, each dip
    # under tau raised, and every revisit's correction of a budget's own mean shifted all the others.
    config = RetuneConfig(budget_quantum=16, min_budget=48, max_budget=4096, lower_hold_s=30)
    runs = [noisy_run(config, GRADED, start, sd, steps, seed)[-20:] for seed in range(10)]
    in_band = [sum(share(rows, i, config.tau, config.tau + 0.05) for rows in runs) / len(runs) for i in range(3)]
    for i in range(3):
        assert min(share(rows, i, config.tau) for rows in runs) >= 0.95, i
    assert min(in_band) >= per_bin and sum(in_band) / 3 >= overall, in_band


def test_a_curve_drifting_down_is_followed_with_few_steps_under_tau():
    # Settled near the band, every bin's curve then falls by 0.09 over 30 steps (4.5 scatters of 0.02):
    # headroom is the margin only, so the controller has to see the drift through the noise and raise.
    config = RetuneConfig(budget_quantum=16, min_budget=48, max_budget=4096, lower_hold_s=30)
    drift = lambda step: -0.003 * min(max(step - 40, 0), 30)  # noqa: E731
    runs = [noisy_run(config, GRADED, 256, 0.02, 120, seed, drift) for seed in range(10)]
    for i in range(3):
        during = [share(rows[40:80], i, config.tau) for rows in runs]
        assert sum(during) / len(during) >= 0.95 and min(during) >= 0.85, (i, during)
        assert min(share(rows[-20:], i, config.tau, config.tau + 0.05) for rows in runs) >= 0.9, i


def test_a_reading_inside_the_margin_is_confirmed_before_it_raises():
    config = RetuneConfig(raise_min_readings=2)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(2048,))
    first = r.step(schedule, Snapshot(1, {0: reading(0.87)}, trainer_steps=1), now=1)
    assert not first.changed and first.bins[0].state == "confirming" and first.bins[0].readings == 1
    lucky = r.step(schedule, Snapshot(1, {0: reading(0.90)}, trainer_steps=2), now=2)
    assert not lucky.changed  # mean 0.885: the first one was noise
    r = Retuner(config, window_s=5)
    r.step(schedule, Snapshot(1, {0: reading(0.87)}, trainer_steps=1), now=1)
    second = r.step(schedule, Snapshot(1, {0: reading(0.872)}, trainer_steps=2), now=2)
    assert second.changed and second.decisions[0].reason == "raise" and "< target" in second.decisions[0].detail


def settled_at_192(config):
    """A bin read eight times at 192 (mean 0.895, scatter ~0.02-0.03), no change proposed."""
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(192,), bin_width=128)
    for step, p5 in enumerate([0.92, 0.88, 0.91, 0.87, 0.92, 0.88, 0.91, 0.89], start=1):
        assert not r.step(schedule, Snapshot(1, {0: reading(p5)}, trainer_steps=step), now=step).changed
    return r, schedule


def test_a_dip_under_tau_that_the_scatter_explains_waits_for_a_second_one():
    config = RetuneConfig(budget_quantum=16, min_budget=48)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(192,), bin_width=128)
    for step, p5 in enumerate([0.96, 0.90] * 4, start=1):  # mean 0.93, scatter ~0.03
        assert not r.step(schedule, Snapshot(1, {0: reading(p5)}, trainer_steps=step), now=step).changed
    # 0.855: under tau, but within two scatters of a mean that still holds the target after it.
    dip = r.step(schedule, Snapshot(1, {0: reading(0.855)}, trainer_steps=9), now=9)
    assert not dip.changed and dip.bins[0].estimate >= config.target
    # A second reading under tau in a row is no longer one step's noise, though the mean still holds.
    again = r.step(schedule, Snapshot(1, {0: reading(0.855)}, trainer_steps=10), now=10)
    assert again.bins[0].estimate >= config.target
    assert again.changed and again.budgets[0] > 192 and "< tau" in again.decisions[0].detail
    # With no scatter learned yet, nothing explains a dip: it raises at once.
    r, schedule = Retuner(config, window_s=5), Schedule(budgets=(192,), bin_width=128)
    assert r.step(schedule, Snapshot(1, {0: reading(0.855)}, trainer_steps=1), now=1).changed


def test_a_deep_dip_raises_at_once_but_by_what_the_mean_says_is_missing():
    config = RetuneConfig(budget_quantum=16, min_budget=48)
    r, schedule = settled_at_192(config)
    proposal = r.step(schedule, Snapshot(1, {0: reading(0.80)}, trainer_steps=9), now=9)
    # The mean with the dip is 0.873, 0.007 under target: 192 x 2^(0.007 / 0.06) = 208.7 -> the grid's 224.
    # Sized by the dip itself (0.08 under target at 0.06 per doubling) it would be the 2x bound, 384.
    assert proposal.changed and proposal.decisions[0].reason == "raise"
    assert proposal.budgets == (224,)


def test_a_budget_that_failed_within_its_noise_is_tried_again_and_one_that_failed_clearly_is_not():
    config = RetuneConfig(budget_quantum=16, min_budget=48, lower_hold_s=10)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(192,), bin_width=128)
    now, step = 0.0, 0

    def read(p5):
        nonlocal now, step, schedule
        now, step = now + 1, step + 1
        proposal = r.step(schedule, Snapshot(schedule.version, {0: reading(p5)}, trainer_steps=step), now=now)
        if proposal.changed:
            schedule = schedule.with_budgets(proposal.budgets)
        return proposal

    # 192 read twice, mean 0.870: under the target, but by less than one standard error of two readings.
    read(0.88)
    assert read(0.86).budgets[0] > 192
    # The raised budget holds with a scatter of ~0.02 (so 192's standard error is ~0.02 / sqrt(2) = 0.014).
    retried = None
    for p5 in [0.91, 0.87, 0.92, 0.88, 0.91, 0.89, 0.92, 0.88, 0.91, 0.89, 0.92, 0.88]:
        proposal = read(p5)
        if proposal.changed:
            retried = proposal
            break
    assert retried is not None and retried.budgets == (192,), "192 was never tried again"
    assert retried.decisions[0].reason == "retry" and "retry 192" in retried.decisions[0].detail
    # This time 192 reads clearly under target, again and again: a bound for good, never tried again
    # (budgets above it may be: they have their own few readings).
    for p5 in [0.85, 0.862, 0.864, 0.866]:
        read(p5)
    assert schedule.budgets[0] > 192
    for p5 in [0.92, 0.90, 0.93, 0.91] * 5:
        read(p5)
        assert schedule.budgets[0] > 192


def test_a_raise_from_under_min_budget_lands_in_bounds():
    # A schedule from before a change of bounds: doubling 128 gave 256, outside [512, ...], which the loop
    # refused tick after tick, so a bin under tau never rose.
    config = RetuneConfig(min_budget=512)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(128, 1024))
    proposal = r.step(schedule, Snapshot(1, {0: reading(0.5), 1: reading(0.95)}, trainer_steps=1), 1.0)
    assert proposal.budgets[0] == 512 and proposal.decisions[0].reason == "raise"


def test_a_lowering_from_over_max_budget_lands_in_bounds():
    # The mirror of the case above: halving 16384 gave 8192, outside [..., 4096], which the loop refused tick
    # after tick, together with every other bin's change in the same proposal.
    config = RetuneConfig(lower_hold_s=0, lower_min_readings=1, max_budget=4096)
    r = Retuner(config, window_s=5)
    proposal = r.step(Schedule(budgets=(16384,)), Snapshot(1, {0: reading(0.99)}), now=1)
    assert proposal.budgets == (4096,) and proposal.decisions[0].reason == "lower"


def test_a_bin_over_max_budget_whose_readings_fail_at_max_budget_proposes_nothing_out_of_bounds():
    config = RetuneConfig(lower_hold_s=0, lower_min_readings=1, max_budget=4096)
    r = Retuner(config, window_s=5)
    schedule = Schedule(budgets=(4096,))
    for t in range(3):  # 4096 seen failing, beyond doubt
        r.step(schedule, Snapshot(1, {0: reading(0.5, 5000 + t)}, trainer_steps=t), now=t)
    schedule = Schedule(budgets=(16384,), version=2)
    for t in range(3, 8):
        proposal = r.step(schedule, Snapshot(2, {0: reading(0.99, 5000 + t)}, trainer_steps=t), now=t)
        assert all(b == 16384 or b <= 4096 for b in proposal.budgets), proposal.budgets
        assert all(b > 4096 for b in proposal.budgets), "lowered to a budget seen failing"
