"""The monotone fit behind each bin's p5-vs-budget curve."""

import math
import random

import pytest

from services.controller.curve import Curve, Point, isotonic_fit


def test_isotonic_fit_keeps_ordered_points():
    pts = [(512, 0.80, 1), (1024, 0.85, 1), (2048, 0.90, 1)]
    assert isotonic_fit(pts) == [(512, 0.80), (1024, 0.85), (2048, 0.90)]


def test_isotonic_fit_pools_violators_by_weight():
    assert isotonic_fit([(1, 0.5, 1), (2, 0.4, 1)]) == [(1, pytest.approx(0.45)), (2, pytest.approx(0.45))]
    fitted = isotonic_fit([(1, 0.5, 3), (2, 0.4, 1), (4, 0.6, 1)])
    assert [y for _, y in fitted] == [pytest.approx(0.475), pytest.approx(0.475), pytest.approx(0.6)]


def test_isotonic_fit_merges_equal_budgets_and_drops_unusable_points():
    fitted = isotonic_fit([(1, 0.8, 1), (1, 0.9, 3), (2, float("nan"), 1), (3, 0.1, 0)])
    assert fitted == [(1, pytest.approx(0.875))]


def test_isotonic_fit_is_monotone_and_preserves_the_weighted_mean():
    rng = random.Random(1)
    for _ in range(50):
        pts = [(x, rng.random(), rng.uniform(0.1, 3)) for x in rng.sample(range(1, 40), 12)]
        fitted = dict(isotonic_fit(pts))
        ys = [fitted[x] for x in sorted(fitted)]
        assert all(a <= b + 1e-12 for a, b in zip(ys, ys[1:], strict=False))
        total = sum(w for _, _, w in pts)
        assert sum(fitted[x] * w for x, _, w in pts) / total == pytest.approx(sum(y * w for _, y, w in pts) / total)


def _curve(pairs, prior=0.06):
    return Curve.from_points([Point(b, y, 1.0, 0.0) for b, y in pairs], prior_slope=prior, min_slope=0.01)


def test_predict_is_linear_in_log_budget_between_points():
    c = _curve([(1024, 0.84), (4096, 0.90)])
    assert c.predict(2048) == pytest.approx(0.87)
    assert c.predict(8192) == pytest.approx(0.93)  # above: the secant slope, 0.03 per doubling
    assert c.predict(512) == pytest.approx(0.84 - 0.06)  # below: the prior slope


def test_cheapest_interpolates_when_bracketed_and_extrapolates_otherwise():
    c = _curve([(1024, 0.84), (4096, 0.90)])
    budget, bracketed = c.cheapest(0.87)
    assert bracketed and budget == pytest.approx(2048)
    budget, bracketed = c.cheapest(0.93)
    assert not bracketed and budget == pytest.approx(8192)
    budget, bracketed = c.cheapest(0.78)
    assert not bracketed and budget == pytest.approx(512)
    one = _curve([(2048, 0.82)])
    assert one.cheapest(0.88)[0] == pytest.approx(2048 * 2 ** (0.06 / 0.06))


def test_flat_data_extrapolates_with_the_prior_and_never_divides_by_zero():
    c = _curve([(1024, 0.8), (2048, 0.8)])
    budget, _ = c.cheapest(0.86)
    assert math.isfinite(budget) and budget > 2048


def test_lowest_holding_and_failing_below():
    c = _curve([(1024, 0.85), (2048, 0.881), (4096, 0.90)])
    assert c.lowest_holding(0.88) == 2048
    assert c.lowest_holding(0.885) == 4096
    assert c.failing_below(4096, 0.885) == [(2048, 0.881), (1024, 0.85)]
    assert c.failing_below(1024, 0.885) == []
    assert c.has_point_below(4096, 0.86) and not c.has_point_below(1024, 0.86)
