"""The whole cluster from `sparrow up`: Redis, Prometheus, two generators, the trainer and the controller.

One generator is killed with SIGKILL while it holds prompt groups: the run goes on, every group the
trainer enqueued is trained exactly once or counted (dropped stale, still waiting in the trainer's
ledger), none is lost.

While it runs, the real Prometheus the launcher started answers the controller's PromQL p5 per bin
consistently with the trainer's exact p5 gauge. The gauge covers the last step's tokens only, so the
rate window is chosen to hold exactly one step: two consecutive scrapes between which the histogram
grew by exactly the tokens the gauge reports. A bin holds tens of tokens here, so its 5% tail is one
or two tokens, and the two definitions of p5 need not land in neighbouring buckets: the exact one
interpolates between the order statistics at q(n-1) (numpy's rule), PromQL's interpolates inside the
bucket that holds the one at rank qn. Both are checked against the buckets that the step's own
histogram counts (the counters at the two scrapes) put those order statistics in.
"""

import json
import math
import os
import signal
import time
import urllib.parse
import urllib.request

import pytest
import redis

from services.launcher.scrape import parse_generator_metrics
from sparrow import metrics_contract as mc
from sparrow.work import GENERATOR_GROUP, PROMPTS_STREAM, PromptGroup
from tests.integration.launcher.helpers import (
    UpProcess,
    alive,
    processes,
    tiny_config,
    trained_and_dropped,
    wait_for_processes,
)

pytestmark = pytest.mark.slow

STEPS = 6
# 16-token bins over prompts of 59 tokens (18 pairs) plus up to 16 new ones: a response's first 5 tokens
# fall in bin 3 and the rest in bin 4 (a short correct answer is 8 tokens), so both bins fill every step;
# and a 48-token budget (sink + 2 local pages) makes every decode step of layers 1-3 sparse.
SCHEDULE = {"name": "test", "version": 1, "bin_width": 16, "budgets": [48] * 6, "dense_layers": [0]}
# One step's worth of groups ahead of training: a group the killed generator holds must be generated
# again before the next step can be complete, so the run goes on only if it is.
# and one group in hand per generator, so that both have work.
TRAINER = {"outstanding_steps": 1.0}
EXTRA = """
[generator]
max_in_flight_groups = 1
[generator.queue]
claim_idle_s = 2.0
"""
PROMQL = "histogram_quantile(0.05, sum by (le, bin) (rate(" + mc.ALPHA_HISTOGRAM + "_bucket[{window}ms])))"


def _held_groups(client: redis.Redis, consumer: str) -> set[str]:
    """Group ids of the stream entries `consumer` has claimed and not acked."""
    pending = client.xpending_range(PROMPTS_STREAM, GENERATOR_GROUP, "-", "+", 100, consumername=consumer)
    groups = set()
    for p in pending:
        for _, fields in client.xrange(PROMPTS_STREAM, p["message_id"], p["message_id"]):
            groups.add(PromptGroup.from_fields({k.decode(): v.decode() for k, v in fields.items()}).group_id)
    return groups


def _in_flight(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return parse_generator_metrics(resp.read().decode()).in_flight
    except OSError:
        return 0


def _query(prometheus: str, promql: str, at: float | None = None) -> list[dict]:
    params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?{urllib.parse.urlencode(params)}", timeout=5) as r:
        return json.load(r)["data"]["result"]


def _by_bin(result: list[dict]) -> dict[str, float]:
    values = {r["metric"].get("bin", ""): float(r["value"][1]) for r in result}
    return {b: v for b, v in values.items() if math.isfinite(v)}


def _bucket_counts(prometheus: str, t0: float, t1: float) -> dict[str, list[tuple[float, float]]]:
    """Cumulative bucket counts by bin of the tokens the histogram took between the scrapes at t0 and t1:
    [(upper edge, tokens <= it)], edges ascending, +Inf last."""
    before = {
        (r["metric"].get("bin", ""), r["metric"]["le"]): float(r["value"][1])
        for r in _query(prometheus, f"{mc.ALPHA_HISTOGRAM}_bucket", t0)
    }
    counts: dict[str, list[tuple[float, float]]] = {}
    for r in _query(prometheus, f"{mc.ALPHA_HISTOGRAM}_bucket", t1):
        key = (r["metric"].get("bin", ""), r["metric"]["le"])
        counts.setdefault(key[0], []).append((float(key[1]), float(r["value"][1]) - before.get(key, 0.0)))
    return {b: sorted(c) for b, c in counts.items()}


def _one_step_windows(prometheus: str, seen: set[float]) -> list[tuple[dict, dict, dict]]:
    """(PromQL p5, exact p5, cumulative bucket counts) by bin at every scrape, not seen before, whose
    window since the previous scrape holds exactly one step's tokens."""
    totals: dict[float, float] = {}  # scrape time -> tokens in the histogram, all bins
    for series in _query(prometheus, f"{mc.ALPHA_HISTOGRAM}_count[5m]"):
        for t, v in series["values"]:
            totals[float(t)] = totals.get(float(t), 0.0) + float(v)
    times = sorted(totals)
    out = []
    for t0, t1 in zip(times, times[1:], strict=False):
        grown = totals[t1] - totals[t0]
        if grown <= 0 or t1 in seen:
            continue
        seen.add(t1)
        step_tokens = _by_bin(_query(prometheus, f"{mc.ALPHA_TOKENS_GAUGE}", t1))
        if grown != sum(step_tokens.values()):
            continue  # two steps (or part of one) between these scrapes
        # The window reaches back just past the scrape at t0 (and not to the one before): rate() then barely
        # extrapolates, which it would do unevenly, less for a bucket whose counter was still 0 at t0.
        window = round((t1 - t0) * 1000) + 1
        estimated = _by_bin(_query(prometheus, PROMQL.format(window=window), t1))
        exact = _by_bin(_query(prometheus, mc.ALPHA_P5_GAUGE, t1))
        # A bin whose first tokens came in this step has no histogram series before t1, and rate() needs two
        # samples: PromQL has no estimate for it yet (it has from the next step on), so it is left out here.
        existed = _by_bin(_query(prometheus, f"{mc.ALPHA_HISTOGRAM}_count", t0))
        exact = {b: v for b, v in exact.items() if b in existed or b in estimated}
        counts = _bucket_counts(prometheus, t0, t1)
        for b, tokens in step_tokens.items():
            grew = counts.get(b, [(math.inf, 0.0)])[-1]
            assert grew == (math.inf, tokens), f"bin {b}: histogram grew by {grew}, gauge {tokens}"
        out.append((estimated, exact, counts))
    return out


def _bucket_of(cumulative: list[tuple[float, float]], i: int) -> tuple[float, float]:
    """(lower, upper) edges of the bucket that holds the i-th smallest token (0-based) of the window."""
    lower = 0.0
    for upper, count in cumulative:
        if count > i:
            return lower, upper
        lower = upper
    raise AssertionError(f"no bucket holds token {i} of {cumulative[-1][1]:.0f}")


def _check_p5(estimate: float, exact: float, cumulative: list[tuple[float, float]], q: float = 0.05) -> str | None:
    """What is wrong with the two p5 of one bin and one step, given the step's cumulative bucket counts."""
    n = round(cumulative[-1][1])
    lo = math.floor(q * (n - 1))  # the exact p5 lies between the order statistics lo and lo + 1
    low, high = _bucket_of(cumulative, lo)[0], _bucket_of(cumulative, min(lo + 1, n - 1))[1]
    if not low <= exact <= high:
        return f"exact {exact:.4f} outside ({low}, {high}], where the histogram puts tokens {lo}-{lo + 1} of {n}"
    rank = q * n  # PromQL interpolates inside the bucket holding the token at this rank (1-based)
    # A rank within 1% of a whole number may fall either side of it after rate()'s extrapolation.
    first = max(0, math.ceil(rank * 0.99) - 1)
    last = math.ceil(rank * 1.01) - 1
    low, high = _bucket_of(cumulative, first)[0], _bucket_of(cumulative, min(last, n - 1))[1]
    if not low <= estimate <= high:
        return f"PromQL {estimate:.4f} outside ({low}, {high}], the bucket of rank {rank:.2f} of {n}"
    return None


def test_two_generators_one_killed_nothing_lost_and_promql_matches_the_exact_p5(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(
        tmp_path / "up.toml", schedule=SCHEDULE, pairs=18, top={"scrape_interval_s": 0.25}, trainer=TRAINER, extra=EXTRA
    )
    up = UpProcess(
        "--config", str(config), "--model-size", "tiny", "--steps", str(STEPS), "--generators", "2",
        "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    windows = []  # (PromQL p5 by bin, exact p5 by bin) over one step's tokens, read while the run goes
    try:
        everything = {"redis", "prometheus", "trainer", "gen-0", "gen-1", "controller"}
        procs = wait_for_processes(up, run_dir, everything, 240)
        client = redis.Redis(port=procs["redis"]["ports"]["port"])
        prometheus = f"http://127.0.0.1:{procs['prometheus']['ports']['port']}"
        first = up.next_object(240)
        assert first["type"] == "step", first

        # SIGKILL gen-1 while it holds work: its claimed groups must be reclaimed by gen-0.
        victim = procs["gen-1"]
        deadline = time.monotonic() + 60
        while _in_flight(victim["ports"]["metrics"]) == 0:
            assert time.monotonic() < deadline and up.proc.poll() is None, "gen-1 never held a sequence"
            time.sleep(0.05)
        held = _held_groups(client, "gen-1")
        os.kill(victim["pid"], signal.SIGKILL)
        assert held, "gen-1 held no stream entry when it was killed"

        seen: set[float] = set()
        while up.proc.poll() is None:
            try:
                windows += _one_step_windows(prometheus, seen)
            except OSError:
                pass  # Prometheus stopped: the run is ending
            time.sleep(0.5)
        code = up.wait(60)
    finally:
        up.kill()
    assert code == 0, up.proc.stderr.read()[-3000:]

    summary = up.lines[-1]
    assert summary["type"] == "summary" and summary["outcome"] == "completed"
    assert summary["steps_done"] == STEPS
    assert {"name": "gen-1", "exit": "signal SIGKILL"} in summary["exits"]

    # Every group: trained exactly once, or dropped as stale, or still waiting in the trainer's ledger.
    history, dropped, ledger = trained_and_dropped(run_dir)
    trained = [g for step in history for g in step]
    assert len(trained) == len(set(trained)) == 2 * STEPS
    assert not set(trained) & set(dropped)
    work = summary["work"]
    assert work["lost"] == [] and work["trained_twice"] == [] and work["trained_and_dropped"] == []
    assert work["groups_trained"] == 2 * STEPS and work["groups_dropped_stale"] == len(dropped)
    assert work["groups_enqueued"] == work["groups_trained"] + work["groups_dropped_stale"] + work["groups_waiting"]
    # What the dead generator held was generated again by the other one and went into a step (or was dropped).
    assert held <= set(trained) | set(dropped), f"held by gen-1: {held}, trained: {trained}"

    # PromQL's p5 per bin and the exact gauge agree with the step's histogram, for every populated bin.
    assert windows, "no scrape window held exactly one step"
    # Several length bins were checked (a window may hold one bin only: a fast step's few tokens).
    checked = set().union(*(exact for _, exact, _ in windows))
    assert len(checked) >= 2, f"bins checked in one-step windows: {[sorted(e) for _, e, _ in windows]}"
    for estimated, exact, counts in windows:
        assert set(estimated) == set(exact), (estimated, exact)
        for b, p5 in exact.items():
            wrong = _check_p5(estimated[b], p5, counts[b])
            assert wrong is None, f"bin {b}: {wrong}"

    # Tokens really were generated under the sparse schedule, and the launcher recorded PromQL's view too.
    rows = [o for o in up.lines if o["type"] == "step"]
    assert any((r["sparse_token_fraction"] or 0) > 0 for r in rows)
    assert any(r["p5_promql"] for r in rows)
    assert all(r["schedule_budgets"] for r in rows)

    children = processes(run_dir)
    assert not [c["name"] for c in children.values() if alive(c["pid"])]
