"""The generator's metrics: exact names, sparse/dense token split, attended KV per bin, schedule gauges."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.generator.metrics import GeneratorMetrics
from sparrow.schedule import Schedule

NAMES = {
    "sparrow_generator_tokens_total",
    "sparrow_generator_attended_kv_tokens_total",
    "sparrow_generator_context_kv_tokens_total",
    "sparrow_generator_kv_budget_tokens",
    "sparrow_generator_queue_lag_entries",
    "sparrow_generator_queue_wait_seconds_count",
    "sparrow_generator_in_flight_sequences",
    "sparrow_generator_policy_version",
    "sparrow_generator_adapter_version",
    "sparrow_generator_schedule_version",
    "sparrow_generator_swaps_total",
    "sparrow_generator_trajectories_total",
    "sparrow_generator_groups_total",
    "sparrow_generator_step_seconds_count",
    "sparrow_generator_policy_fetch_bytes_total",
    "sparrow_generator_policy_fetch_failures_total",
    "sparrow_generator_policy_sync_seconds",
    "sparrow_generator_phase_seconds_total",
}


def _samples(metrics: GeneratorMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_contract_name_is_exported_with_low_cardinality_labels():
    m = GeneratorMetrics()
    m.show_schedule(Schedule(budgets=(48, 64), bin_width=100))
    m.record_tokens(10, [0, 48])
    samples = _samples(m)
    assert NAMES <= {name for name, _ in samples}
    labels = {k for _, lbl in samples for k, _ in lbl}
    assert labels <= {"mode", "bin", "kind", "outcome", "status", "le", "source", "reason", "phase"}
    assert samples[("sparrow_generator_swaps_total", (("kind", "adapter"), ("outcome", "refused")))] == 0


def test_tokens_split_by_mode_and_attended_kv_per_bin():
    m = GeneratorMetrics()
    m.show_schedule(Schedule(budgets=(48, 64), bin_width=60))
    # prompt 50: token i has 50 + i in context. Budgets as an engine reports them: the first token from the
    # dense prefill (0), then the schedule's (48 below KV 60, 64 from there).
    budgets = [0] + [48] * 9 + [64] * 10  # contexts 50..69
    m.record_tokens(50, budgets)
    s = _samples(m)
    # sparse: budget > 0 and < context: contexts 51..59 under 48 (9 tokens), 65..69 under 64 (5 tokens)
    assert s[("sparrow_generator_tokens_total", (("mode", "sparse"),))] == 14
    assert s[("sparrow_generator_tokens_total", (("mode", "dense"),))] == 6
    bin0 = 50 + sum(range(51, 60))  # bin 0: contexts 50..59; the first dense (50), then 48 each
    assert s[("sparrow_generator_context_kv_tokens_total", (("bin", "0"),))] == bin0
    assert s[("sparrow_generator_attended_kv_tokens_total", (("bin", "0"),))] == 50 + 48 * 9
    # bin 1: contexts 60..69 under 64: 60..64 attend all of it, 65..69 attend 64
    assert s[("sparrow_generator_context_kv_tokens_total", (("bin", "1"),))] == sum(range(60, 70))
    assert s[("sparrow_generator_attended_kv_tokens_total", (("bin", "1"),))] == sum(range(60, 65)) + 64 * 5


def test_lengths_past_the_last_bin_count_in_it_and_dense_schedule_clears_budgets():
    m = GeneratorMetrics()
    m.show_schedule(Schedule(budgets=(48,), bin_width=10, version=7))
    m.record_tokens(100, [48, 48])
    s = _samples(m)
    assert s[("sparrow_generator_context_kv_tokens_total", (("bin", "0"),))] == 201
    assert s[("sparrow_generator_kv_budget_tokens", (("bin", "0"),))] == 48
    assert s[("sparrow_generator_schedule_version", ())] == 7
    m.show_schedule(None)
    s = _samples(m)
    assert not any(name == "sparrow_generator_kv_budget_tokens" for name, _ in s)
    assert s[("sparrow_generator_schedule_version", ())] == 0


def test_speculation_counts_drafts_accepted_drafts_cycles_and_alpha_per_bin():
    from services.generator.engine import EngineVersions, FinishedSample

    m = GeneratorMetrics()
    m.show_schedule(Schedule(budgets=(48, 64), bin_width=60))
    # k = 3: cycle 1 drafts at KV 57..59 (bin 0), keeps 2; cycle 2 at 60..62 (bin 1), keeps all 3.
    sample = FinishedSample(
        "g", 0, [1] * 56, [5] * 7, [0.0] * 7, [[5]] * 7, [[0.0]] * 7, [0] * 7, EngineVersions(), "length",
        speculative_tokens=3, drafted_tokens=6, accepted_tokens=5,
        draft_alphas=[0.999, 0.97, 0.4, 1.0, 0.995, 0.9], draft_accepted=[True, True, False, True, True, True],
        draft_kv_lens=[57, 58, 59, 60, 61, 62],
    )  # fmt: skip
    m.record_speculation(sample)
    m.record_speculation(FinishedSample("h", 0, [1], [5], [0.0], [[5]], [[0.0]], [0], EngineVersions(), "length"))
    s = _samples(m)
    for name, bin0, bin1 in (
        ("sparrow_generator_draft_tokens_total", 3, 3),
        ("sparrow_generator_accepted_draft_tokens_total", 2, 3),
        ("sparrow_generator_speculative_cycles_total", 1, 1),
        ("sparrow_generator_draft_alpha_count", 3, 3),
    ):
        assert (s[(name, (("bin", "0"),))], s[(name, (("bin", "1"),))]) == (bin0, bin1), name
    assert s[("sparrow_generator_draft_alpha_sum", (("bin", "0"),))] == pytest.approx(0.999 + 0.97 + 0.4)
    assert s[("sparrow_generator_draft_alpha_bucket", (("bin", "0"), ("le", "0.5")))] == 1


def test_timed_cycles_add_their_draft_and_verify_seconds_to_the_bin_of_their_kv_length():
    from services.generator.engine import CycleTime

    m = GeneratorMetrics()
    m.show_schedule(Schedule(budgets=(48, 64), bin_width=60))
    m.record_cycle(CycleTime(rows=8, kv_len=30, draft_seconds=0.012, verify_seconds=0.010))
    m.record_cycle(CycleTime(rows=4, kv_len=59, draft_seconds=0.008, verify_seconds=0.006))
    m.record_cycle(CycleTime(rows=8, kv_len=500, draft_seconds=0.02, verify_seconds=0.01))  # past the last bin
    m.record_cycle(CycleTime(rows=8, kv_len=70, draft_seconds=0.0, verify_seconds=0.01))  # not a timing: dropped
    s = _samples(m)
    for name, bin0, bin1 in (
        ("sparrow_generator_timed_cycles_total", 2, 1),
        ("sparrow_generator_draft_seconds_total", 0.020, 0.02),
        ("sparrow_generator_verify_seconds_total", 0.016, 0.01),
    ):
        assert s[(name, (("bin", "0"),))] == pytest.approx(bin0), name
        assert s[(name, (("bin", "1"),))] == pytest.approx(bin1), name


def test_a_response_counted_in_pieces_as_generated_counts_as_it_would_whole():
    budgets = [0] + [48] * 9 + [64] * 10  # prompt 50: contexts 50..69
    whole, pieces = GeneratorMetrics(), GeneratorMetrics()
    for m in (whole, pieces):
        m.show_schedule(Schedule(budgets=(48, 64), bin_width=60))
    whole.record_tokens(50, budgets)
    for first in range(0, len(budgets), 3):  # three tokens per engine step, the last step one
        pieces.record_tokens(50, budgets[first : first + 3], first)
    counted = lambda m: {k: v for k, v in _samples(m).items() if not k[0].endswith("_created")}  # noqa: E731
    assert counted(pieces) == counted(whole)
    assert counted(whole)[("sparrow_generator_tokens_total", (("mode", "sparse"),))] == 14


def test_phase_seconds_add_up_by_phase():
    m = GeneratorMetrics()
    m.record_phases({"decode": 1.5, "idle": 0.25, "other": 0.0})
    m.record_phases({"decode": 0.5, "prefill": 0.125})
    s = _samples(m)
    phase = lambda p: s[("sparrow_generator_phase_seconds_total", (("phase", p),))]  # noqa: E731
    assert (phase("decode"), phase("idle"), phase("prefill"), phase("sampling")) == (2.0, 0.25, 0.125, 0.0)
