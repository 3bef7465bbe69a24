import dataclasses

import pytest

from sparrow.cost import dense_cost, mean_kept_tokens, predict, scheduled_sparse_cost, sparse_cost
from sparrow.hardware import get_hardware
from sparrow.models import get_model
from sparrow.presets import get_preset
from sparrow.schedule import Schedule

# P=10, N=2, L_in=4, L_out=6, D=3, r=2, I*bytes=5, B=2, page=2.
SMALL = dict(params=10, samples=2, prompt_len=4, gen_len=6, kv_dim=3, gqa_ratio=2, mem_weight=5)


def test_dense_cost_by_hand():
    c = dense_cost(**SMALL)
    assert c.compute == 2 * 10 * 2 * 6 + 2 * (2 * 4 + 6) * 6 * 2 * 3  # 240 + 1008
    assert c.memory == 5 * (2 * 4 * 6 * 3 + 2 * 6**2 * 3)  # 5 * (144 + 216)
    assert c.total == 1248 + 1800


def test_sparse_cost_by_hand():
    c = sparse_cost(**SMALL, budget=2, page_size=2)
    assert c.compute == 240 + 288 + 288 + 108
    assert c.memory == 5 * (144 + 144 + 54)


def test_constant_schedule_below_the_prompt_is_the_paper_formula():
    args = dict(params=1e9, samples=8, prompt_len=4096, gen_len=3000, kv_dim=4096, gqa_ratio=4, mem_weight=400)
    scheduled = scheduled_sparse_cost(**args, schedule=Schedule(budgets=(1024, 1024, 1024)))
    closed = sparse_cost(**args, budget=1024, page_size=16)
    assert scheduled.compute == pytest.approx(closed.compute, rel=1e-12)
    assert scheduled.memory == pytest.approx(closed.memory, rel=1e-12)


def test_budget_covering_every_length_is_dense():
    args = dict(params=1e9, samples=8, prompt_len=500, gen_len=3000, kv_dim=4096, gqa_ratio=4, mem_weight=400)
    scheduled = scheduled_sparse_cost(**args, schedule=Schedule(budgets=(3504,)))
    dense = dense_cost(**args)
    assert scheduled.total == pytest.approx(dense.total, rel=1e-12)
    m, hw = get_model("qwen3-4b"), get_hardware("h200")
    assert predict(m, Schedule(budgets=(40_000,)), hw, 512, 32768, 8).speedup == pytest.approx(1.0, rel=1e-12)


def test_scheduled_cost_sums_positions():
    s = Schedule(budgets=(64, 128), bin_width=100, page_size=16)
    n, li, lo, d, r, w = 3, 40, 200, 5, 2, 7
    compute, memory, kept = 2 * n * 11 * lo, 0.0, 0
    for t in range(lo):
        kv, b, g = li + t, s.budget_for(li + t), t + 0.5
        kept += min(kv, b)
        if kv <= b:  # dense while the sequence fits its budget
            compute += 2 * r * n * d * (li + g)
            memory += 2 * li * d + 2 * n * d * g
        else:
            compute += 2 * r * n * d * b + 2 * n * li * d + r * n * d * g / 16
            memory += 2 * n * d * b + 2 * li * d + n * d * g / 16
    c = scheduled_sparse_cost(11, n, li, lo, d, r, w, s)
    assert c.compute == pytest.approx(compute, rel=1e-12)
    assert c.memory == pytest.approx(w * memory, rel=1e-12)
    assert mean_kept_tokens(s, li, lo) == pytest.approx(kept / lo)


def _speedup(size, **kw):
    return predict(
        get_model(f"qwen3-{size}"), get_preset(f"qwen3-{size}-0.86"), get_hardware("h200"), 512, 32768, 8, **kw
    )


def test_speedup_falls_with_model_size_at_0_86():
    for kw in ({}, {"price_dense_layers": True}):
        s = {size: _speedup(size, **kw).speedup for size in ("1.7b", "4b", "8b", "14b")}
        assert s["1.7b"] > s["8b"] > s["14b"] > 1.5
        assert s["1.7b"] < 5


def test_pricing_dense_layers_lowers_the_speedup():
    plain, priced = _speedup("1.7b"), _speedup("1.7b", price_dense_layers=True)
    assert priced.dense_layers_priced == 2 and plain.dense_layers_priced == 0
    assert priced.speedup < plain.speedup
    assert priced.dense == plain.dense


def test_bytes_per_element_weights_memory():
    m, s = get_model("qwen3-4b"), get_preset("qwen3-4b-0.86")
    h1 = dataclasses.replace(get_hardware("h200"), bytes_per_element=1)
    one, two = predict(m, s, h1, 512, 4096, 8), predict(m, s, get_hardware("h200"), 512, 4096, 8)
    assert two.dense.memory == pytest.approx(2 * one.dense.memory)
    assert two.dense.compute == one.dense.compute


def test_predict_rejects_bad_lengths():
    m, s, hw = get_model("qwen3-4b"), get_preset("qwen3-4b-0.86"), get_hardware("h200")
    with pytest.raises(ValueError, match="gen_len"):
        predict(m, s, hw, 512, 0, 8)
    with pytest.raises(ValueError, match="samples"):
        predict(m, s, hw, 512, 10, 0)


def test_speculative_cost_is_k_sparse_steps_and_one_wide_dense_verify_per_expected_cycle():
    from sparrow.cost import predict_speculative

    base = predict(get_model("qwen3-1.7b"), get_preset("qwen3-1.7b-0.86"), get_hardware("h200"), 512, 32768, 8)
    spec = predict_speculative(base, 6, 0.97)
    e = (1 - 0.97**7) / 0.03
    assert spec.tokens_per_cycle == pytest.approx(e)
    d, s = base.dense, base.sparse
    assert spec.verify.compute == pytest.approx(7 * d.compute) and spec.verify.memory == pytest.approx(d.memory)
    assert spec.cost.total == pytest.approx((6 * s.total + 7 * d.compute + d.memory) / e)
    assert spec.speedup == pytest.approx(d.total / spec.cost.total)
    assert 1.0 < spec.speedup < base.speedup  # lossless costs some of the lossy speedup
    # Every draft accepted: k + 1 tokens per cycle; none: one token per k sparse steps and a verify, a slowdown.
    assert predict_speculative(base, 6, 1.0).tokens_per_cycle == 7
    assert predict_speculative(base, 6, 0.0).speedup < 1.0
    assert predict_speculative(base, 2, 0.99).speedup < predict_speculative(base, 8, 0.99).speedup


def test_a_step_overhead_is_paid_once_per_forward_in_every_run():
    from sparrow.cost import decode_step_cost, predict_speculative

    m, s, hw = get_model("qwen3-1.7b"), get_preset("qwen3-1.7b-0.86"), get_hardware("h200")
    base = predict(m, s, hw, 512, 32768, 8)
    priced = predict(m, s, hw, 512, 32768, 8, step_overhead=3.0)
    per_run = 3.0 * 2 * m.params * 8 * 32768  # every generated token of every sample, one forward each
    assert priced.overhead == pytest.approx(per_run)
    assert priced.dense.compute == pytest.approx(base.dense.compute + per_run)
    assert priced.sparse.compute == pytest.approx(base.sparse.compute + per_run)
    assert (priced.dense.memory, priced.sparse.memory) == (base.dense.memory, base.sparse.memory)
    assert 1.0 < priced.speedup < base.speedup  # a fixed cost per token dilutes what sparse attention saves
    # The verify runs k + 1 positions through one forward: their FLOPs k + 1 times, the overhead once.
    spec = predict_speculative(priced, 6, 0.97)
    assert spec.verify.compute == pytest.approx(7 * base.dense.compute + per_run)
    one = decode_step_cost(m, hw, 8192, 0, step_overhead=3.0)
    wide = decode_step_cost(m, hw, 8192, 0, queries=7, step_overhead=3.0)
    assert wide.compute - 7 * (one.compute - 6 * m.params) == pytest.approx(6 * m.params)
    with pytest.raises(ValueError, match="step_overhead"):
        predict(m, s, hw, 512, 32768, 8, step_overhead=-1.0)
    with pytest.raises(ValueError, match="step_overhead"):
        decode_step_cost(m, hw, 8192, 0, step_overhead=float("nan"))


def test_the_implied_step_overhead_reproduces_a_measured_speedup():
    from sparrow.cost import implied_step_overhead

    m, s, hw = get_model("qwen3-1.7b"), get_preset("qwen3-1.7b-0.86"), get_hardware("h200")
    paper = predict(m, s, hw, 512, 32768, 8)
    measured = 1.3  # well below the paper terms' prediction, as on a machine where attention is a small part
    overhead = implied_step_overhead(m, paper, measured)
    assert overhead > 0
    assert predict(m, s, hw, 512, 32768, 8, step_overhead=overhead).speedup == pytest.approx(measured)
    # Priced with an overhead already, the same measurement gives the same answer (the paper terms are solved).
    again = predict(m, s, hw, 512, 32768, 8, step_overhead=overhead / 2)
    assert implied_step_overhead(m, again, measured) == pytest.approx(overhead)
    # At or above the paper's own prediction no overhead is implied; a sparse run no faster has no answer.
    assert implied_step_overhead(m, paper, paper.speedup * 1.1) == 0.0
    assert implied_step_overhead(m, paper, 1.0) is None and implied_step_overhead(m, paper, 0.8) is None


def test_the_cycle_step_overhead_reproduces_an_engines_draft_to_verify_time_ratio():
    from sparrow.cost import cycle_step_overhead, decode_step_cost

    m, hw = get_model("qwen3-1.7b"), get_hardware("h200")
    kv, budget, k, dense = 12288, 768, 6, 2
    # What an engine whose every forward pays 40 x 2P more would time, in any unit.
    draft = decode_step_cost(m, hw, kv, budget, 16, dense, step_overhead=40.0).total
    verify = decode_step_cost(m, hw, kv, 0, queries=k + 1, step_overhead=40.0).total
    assert cycle_step_overhead(m, hw, kv, budget, k, draft * 1e-13, verify * 1e-13, 16, dense) == pytest.approx(40.0)
    # A draft step as cheap as the paper's terms say (or cheaper) implies none; as dear as the verify, no figure.
    paper_draft = decode_step_cost(m, hw, kv, budget, 16, dense).total
    paper_verify = decode_step_cost(m, hw, kv, 0, queries=k + 1).total
    assert cycle_step_overhead(m, hw, kv, budget, k, 0.5 * paper_draft, paper_verify, 16, dense) == 0.0
    assert cycle_step_overhead(m, hw, kv, budget, k, 2.0, 2.0, 16, dense) is None
    for bad in ((0.0, 1.0), (1.0, 0.0), (float("nan"), 1.0), (1.0, float("inf")), (-1.0, 1.0)):
        assert cycle_step_overhead(m, hw, kv, budget, k, *bad, 16, dense) is None, bad


def test_a_steps_attention_cost_is_its_total_less_the_weights():
    from sparrow.cost import decode_step_cost, step_attention_cost

    m, hw = get_model("qwen3-1.7b"), get_hardware("h200")
    for kv, budget, queries in ((12288, 768, 1), (12288, 0, 1), (4096, 0, 7), (500, 2048, 1)):
        total = decode_step_cost(m, hw, kv, budget, 16, 2, queries).total
        assert step_attention_cost(m, hw, kv, budget, 16, 2, queries) == pytest.approx(total - queries * 2 * m.params)
    # A budget at or over the KV is the dense step; a smaller one attends less.
    assert step_attention_cost(m, hw, 500, 2048, 16, 2) == step_attention_cost(m, hw, 500, 0, 16, 2)
    assert 0 < step_attention_cost(m, hw, 12288, 768, 16, 2) < step_attention_cost(m, hw, 12288, 0, 16, 2)


def test_step_times_are_fitted_as_a_fixed_part_plus_a_slope_in_attention():
    from sparrow.cost import fit_step_times

    # Exact line: 9 ms a step plus 2 ms per unit of attention, whatever the weights.
    pts = [(a, 0.009 + 0.002 * a, w) for a, w in ((1.0, 10), (2.5, 1), (4.0, 30))]
    fit = fit_step_times(pts)
    assert fit.fixed == pytest.approx(0.009) and fit.per_eflop == pytest.approx(0.002)
    assert fit.points == 3 and fit.spread == pytest.approx(4.0) and fit.seconds(3.0) == pytest.approx(0.015)
    # Weighted: the heavier observations pull the line.
    noisy = fit_step_times([(1.0, 0.010, 100), (2.0, 0.013, 1), (3.0, 0.014, 100)])
    assert noisy.per_eflop == pytest.approx(0.002, rel=0.01)
    # Times falling with attention (noise around one figure): a fixed cost, no slope.
    flat = fit_step_times([(1.0, 0.012, 1), (2.0, 0.010, 1)])
    assert flat.per_eflop == 0 and flat.fixed == pytest.approx(0.011)
    # A line through negative fixed seconds: through the origin instead.
    steep = fit_step_times([(1.0, 0.001, 1), (2.0, 0.010, 1)])
    assert steep.fixed == 0 and steep.per_eflop == pytest.approx((0.001 + 0.020) / 5)
    # Too narrow a span of attention costs to tell the two apart, one point, or only bad points: no fit.
    assert fit_step_times([(1.0, 0.01, 1), (1.2, 0.011, 1)]) is None
    assert fit_step_times([(1.0, 0.01, 1)]) is None
    bad = [(0.0, 0.01, 1), (2.0, -1.0, 1), (3.0, float("nan"), 1), (4.0, 0.01, 0)]
    assert fit_step_times(bad) is None
    assert fit_step_times([*bad, (1.0, 0.011, 1), (2.0, 0.013, 1)]).per_eflop == pytest.approx(0.002)
