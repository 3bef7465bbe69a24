"""The paper's eFLOPs cost model of rollouts, dense vs block-sparse under a schedule (DESIGN.md section 1).

Symbols: N samples per prompt, P parameters, L_in prompt and L_out generated tokens, D the K (equally
V) dimension summed over layers, r the GQA ratio, B the KV budget in tokens, I the hardware's FLOPs
per byte. Compute terms are FLOPs; memory terms count KV-cache elements read.

Units. I is FLOPs per byte while the memory terms count elements, so an element count is turned into
bytes (times `bytes_per_element`, 2 for a bf16 KV cache) before it is weighted by I. Then
`eFLOPs / peak_flops = compute time + memory time` at peak rates, which is what makes the sum
meaningful; leaving the factor out would price a bf16 element like one byte and halve every memory
term relative to compute.

What it leaves out (as the paper does): weight reads, sampling, scheduling and launch overheads. It
therefore predicts more than measured: at tau 0.86, prompt 512, 32768 generated, 8 samples on an
H200 it gives 4.35x / 3.81x / 3.73x / 2.62x for Qwen3 1.7B / 4B / 8B / 14B, where the paper measured
2.21x / 2.41x / 2.06x / 1.49x end to end; the ordering by size is what it gets right.

Those left-out costs can be priced back as one measured figure, the step overhead: what a decode
forward costs per sequence beyond the paper's terms, in multiples of the weights' FLOPs 2P, paid once
per forward (a draft step, a dense step and a verify over k + 1 positions alike). 0, the default, is
the paper's model. `implied_step_overhead` solves it from a measured sparse/dense decode rate
(`sparrow bench rollout` reports it), `cycle_step_overhead` from a speculative engine's own timing of
its drafts and verifies (the lossless controller prices with it as the generators measure it). Where
attention is not most of a step, as on a CPU with a small model, the paper's terms alone make sparse
drafts look several times cheaper than they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparrow.hardware import Hardware
from sparrow.models import ModelSpec
from sparrow.schedule import PAGE_SIZE, Schedule
from sparrow.speculative import expected_tokens


@dataclass(frozen=True)
class CostTerms:
    """One side's cost: compute FLOPs and memory eFLOPs (bytes moved times I)."""

    compute: float
    memory: float

    @property
    def total(self) -> float:
        """Effective FLOPs, compute + I * memory bytes."""
        return self.compute + self.memory


def dense_cost(
    params: float, samples: int, prompt_len: int, gen_len: int, kv_dim: int, gqa_ratio: float, mem_weight: float
) -> CostTerms:
    """Dense rollouts: C_comp = 2PNL_out + r(2L_in + L_out)L_out N D; C_mem = 2 L_in L_out D + N L_out^2 D.

    `mem_weight` is I * bytes_per_element (eFLOPs per element read).
    """
    n, li, lo, d, r = samples, prompt_len, gen_len, kv_dim, gqa_ratio
    compute = 2 * params * n * lo + r * (2 * li + lo) * lo * n * d
    memory = 2 * li * lo * d + n * lo**2 * d
    return CostTerms(compute, mem_weight * memory)


def sparse_cost(
    params: float,
    samples: int,
    prompt_len: int,
    gen_len: int,
    kv_dim: int,
    gqa_ratio: float,
    mem_weight: float,
    budget: float,
    page_size: int = PAGE_SIZE,
) -> CostTerms:
    """Sparse rollouts at one constant budget B, the paper's formula term by term.

    compute: 2NPL_out + 2rNDBL_out + 2N L_in D L_out + rND L_out^2 / (2 page);
    memory:  2NDBL_out + 2 L_in D L_out + N D L_out^2 / (2 page) (elements; times `mem_weight`).
    The prompt scoring terms carry no 1/page and the prompt compute term no r; kept as published.
    """
    n, li, lo, d, r, b = samples, prompt_len, gen_len, kv_dim, gqa_ratio, budget
    compute = 2 * n * params * lo + 2 * r * n * d * b * lo + 2 * n * li * d * lo + r * n * d * lo**2 / (2 * page_size)
    memory = 2 * n * d * b * lo + 2 * li * d * lo + n * d * lo**2 / (2 * page_size)
    return CostTerms(compute, mem_weight * memory)


def scheduled_sparse_cost(
    params: float,
    samples: int,
    prompt_len: int,
    gen_len: int,
    kv_dim: int,
    gqa_ratio: float,
    mem_weight: float,
    schedule: Schedule,
    dense_kv_dim: int = 0,
) -> CostTerms:
    """Sparse rollouts when the budget follows `schedule`: the paper's terms summed over generated positions.

    The paper's formulas integrate per-step costs over the generated positions t = 0 .. L_out - 1.
    Here each position pays its own per-step cost at KV length L_in + t:
    - while the sequence fits its budget (L_in + t <= schedule budget) attention is dense, so the
      position pays the dense formula's per-step terms (compute 2rND(L_in + t), memory
      2 L_in D + 2ND t), with no scoring;
    - otherwise it pays the sparse formula's per-step terms at B = the scheduled budget there
      (compute 2rNDB + 2N L_in D + rND t / page, memory 2NDB + 2 L_in D + ND t / page).
    The growing part t enters at the step's midpoint t + 1/2, which turns the sum of t into exactly
    the paper's L_out^2 / 2. So a constant budget below L_in reproduces `sparse_cost`, and a budget
    that covers every length reproduces `dense_cost` (speedup 1.0). The sum is taken in closed form
    over runs of positions that share a budget and a dense/sparse mode (at most two per bin), so it
    is exact and costs O(bins) whatever L_out.

    `dense_kv_dim` is the part of D in layers that decode densely whatever the schedule (the paper
    leaves it at 0, pricing every layer as sparse); that part always pays the dense terms.
    """
    if not 0 <= dense_kv_dim <= kv_dim:
        raise ValueError(f"dense_kv_dim must be in [0, {kv_dim}], got {dense_kv_dim}")
    n, li, r, page = samples, prompt_len, gqa_ratio, schedule.page_size
    # Per unit of D (every term is linear in D): the sparse layers' cost, and what all-dense costs.
    comp = mem = dense_comp = dense_mem = 0.0
    for t0, t1, budget, sparse in _runs(schedule, li, gen_len):
        count, grown = t1 - t0, (t1 * t1 - t0 * t0) / 2  # grown = sum of (t + 1/2) over the run
        d_comp = 2 * r * n * (li * count + grown)
        d_mem = 2 * li * count + 2 * n * grown
        dense_comp, dense_mem = dense_comp + d_comp, dense_mem + d_mem
        if sparse:
            comp += 2 * r * n * budget * count + 2 * n * li * count + r * n * grown / page
            mem += 2 * n * budget * count + 2 * li * count + n * grown / page
        else:
            comp, mem = comp + d_comp, mem + d_mem
    d_sparse = kv_dim - dense_kv_dim
    compute = 2 * n * params * gen_len + d_sparse * comp + dense_kv_dim * dense_comp
    memory = d_sparse * mem + dense_kv_dim * dense_mem
    return CostTerms(compute, mem_weight * memory)


def _runs(schedule: Schedule, prompt_len: int, gen_len: int):
    """Runs [t0, t1) of generated positions with one scheduled budget, split where attention turns sparse."""
    t = 0
    while t < gen_len:
        kv = prompt_len + t
        budget = schedule.budget_for(kv)
        _, bin_end = schedule.bin_range(schedule.bin_of(kv))
        end = gen_len if bin_end is None else min(gen_len, bin_end - prompt_len)
        if kv <= budget:  # dense until the KV length passes the budget
            end = min(end, budget - prompt_len + 1)
            yield t, end, budget, False
        else:
            yield t, end, budget, True
        t = end


def mean_kept_tokens(schedule: Schedule, prompt_len: int, gen_len: int) -> float:
    """KV tokens attended per generated position under `schedule`, averaged over the positions."""
    total = 0
    for t0, t1, budget, sparse in _runs(schedule, prompt_len, gen_len):
        # Dense positions attend to their whole KV, prompt_len + t.
        total += budget * (t1 - t0) if sparse else prompt_len * (t1 - t0) + (t1 * (t1 - 1) - t0 * (t0 - 1)) // 2
    return total / gen_len


@dataclass(frozen=True)
class CostPrediction:
    """Predicted dense and sparse rollout cost of one prompt group, in effective FLOPs."""

    model: str
    schedule: str
    hardware: str
    prompt_len: int
    gen_len: int
    samples: int
    flops_per_byte: float
    bytes_per_element: int
    dense: CostTerms
    sparse: CostTerms
    mean_kept_tokens: float  # KV tokens attended per generated position, averaged, under the schedule
    dense_layers_priced: int  # layers priced as dense in the sparse run (0: the paper's model)
    step_overhead: float = 0.0  # per sequence and forward, in multiples of 2P (0: the paper's model)
    overhead: float = 0.0  # eFLOPs of the step overhead over the rollout (in both runs' compute)

    @property
    def speedup(self) -> float:
        """Predicted rollout speedup, dense eFLOPs over sparse eFLOPs."""
        return self.dense.total / self.sparse.total


def predict(
    model: ModelSpec,
    schedule: Schedule,
    hardware: Hardware,
    prompt_len: int,
    gen_len: int,
    samples: int,
    price_dense_layers: bool = False,
    step_overhead: float = 0.0,
) -> CostPrediction:
    """Dense and scheduled-sparse eFLOPs for `samples` rollouts of `gen_len` tokens after a `prompt_len` prompt.

    P is the model's total parameter count. By default, like the paper, every layer is priced as
    sparse; `price_dense_layers` prices the schedule's dense layers with the dense terms instead.
    Weight reads are ignored, as in the paper (a large decode batch amortises them), unless
    `step_overhead` prices them and the engine's other per-forward work (see the module doc): every
    generated token of both runs then pays step_overhead * 2P more compute.
    """
    for key, value, least in (("prompt_len", prompt_len, 0), ("gen_len", gen_len, 1), ("samples", samples, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{key} must be an integer >= {least}, got {value!r}")
    _check_overhead(step_overhead)
    mem_weight = hardware.flops_per_byte * hardware.bytes_per_element
    args = (model.params, samples, prompt_len, gen_len, model.kv_dim, model.gqa_ratio, mem_weight)
    dense_layers = dense_layer_count(model, schedule) if price_dense_layers else 0
    dense_kv_dim = dense_layers * model.num_kv_heads * model.head_dim
    overhead = step_overhead * 2 * model.params * samples * gen_len
    dense = dense_cost(*args)
    sparse = scheduled_sparse_cost(*args, schedule=schedule, dense_kv_dim=dense_kv_dim)
    return CostPrediction(
        model=model.name,
        schedule=schedule.name or "(unnamed)",
        hardware=hardware.name,
        prompt_len=prompt_len,
        gen_len=gen_len,
        samples=samples,
        flops_per_byte=hardware.flops_per_byte,
        bytes_per_element=hardware.bytes_per_element,
        dense=CostTerms(dense.compute + overhead, dense.memory),
        sparse=CostTerms(sparse.compute + overhead, sparse.memory),
        dense_layers_priced=dense_layers,
        mean_kept_tokens=mean_kept_tokens(schedule, prompt_len, gen_len),
        step_overhead=step_overhead,
        overhead=overhead,
    )


def _check_overhead(step_overhead: float) -> None:
    if not (isinstance(step_overhead, (int, float)) and 0 <= step_overhead < float("inf")):
        raise ValueError(f"step_overhead must be a finite number >= 0, got {step_overhead!r}")


def implied_step_overhead(model: ModelSpec, prediction: CostPrediction, measured_speedup: float) -> float | None:
    """The step overhead (multiples of 2P) at which `prediction` gives the `measured_speedup` of sparse over
    dense decoding: the overhead O solving (D + O) / (S + O) = measured, D and S its paper terms.

    0 when the paper's terms alone predict no more than measured; None when the measured speedup is not
    above 1 (no per-forward cost explains a sparse run that is not faster, nor prices one).
    """
    if not measured_speedup > 1:
        return None
    dense = prediction.dense.total - prediction.overhead
    sparse = prediction.sparse.total - prediction.overhead
    per_token = 2 * model.params * prediction.samples * prediction.gen_len
    return max(0.0, (dense - measured_speedup * sparse) / (measured_speedup - 1) / per_token)


def cycle_step_overhead(
    model: ModelSpec,
    hardware: Hardware,
    kv_len: int,
    budget: int,
    k: int,
    draft_step_seconds: float,
    verify_seconds: float,
    page_size: int = PAGE_SIZE,
    dense_layers: int = 0,
) -> float | None:
    """The step overhead (multiples of 2P) a speculative engine's own cycle times imply, with no dense run.

    A cycle at KV length `kv_len` is k draft steps at `budget` and one dense verify over k + 1 positions;
    the engine times both (`draft_step_seconds` one draft step, `verify_seconds` the rest of the cycle:
    the verify forward, rejection sampling, the engine's bookkeeping). With D and V their paper terms
    (`decode_step_cost`) and W = 2P, the overhead O solving (D + O W) / (V + O W) = draft / verify is
    O = (r V - D) / (W (1 - r)), r the measured ratio. 0 when the paper's terms alone make a draft step
    at least that dear; None when a draft step took as long as the verify or longer (no overhead
    explains it), or for times that are not positive and finite.
    """
    times = (draft_step_seconds, verify_seconds)
    if not all(isinstance(t, (int, float)) and 0 < t < float("inf") for t in times):
        return None
    r = draft_step_seconds / verify_seconds
    if r >= 1:
        return None
    draft = decode_step_cost(model, hardware, kv_len, budget, page_size, dense_layers).total
    verify = decode_step_cost(model, hardware, kv_len, 0, queries=k + 1).total
    return max(0.0, (r * verify - draft) / (2 * model.params * (1 - r)))


def bin_middle(schedule: Schedule, index: int) -> int:
    """The KV length a bin is priced at: the middle of its range (the last bin, open-ended, as one bin wide)."""
    start, end = schedule.bin_range(index)
    return max((start + (end if end is not None else start + schedule.bin_width)) // 2, 1)


def dense_layer_count(model: ModelSpec, schedule: Schedule) -> int:
    """How many of the model's layers the schedule keeps dense."""
    return sum(1 for layer in schedule.dense_layers if layer < model.num_layers)


def binned_step_overhead(
    model: ModelSpec, hardware: Hardware, schedule: Schedule, k: int, timed: dict[int, tuple[float, float, float]]
) -> tuple[float | None, dict[int, float]]:
    """The step overhead timed cycles imply, pooled over the schedule's bins: `timed` maps a bin to its cycles,
    the seconds of their k draft steps and of the rest. Each bin's is `cycle_step_overhead` at the bin's
    middle and budget; the pooled figure is their mean weighted by cycles (None where no bin gives one).
    Returns (pooled, per bin)."""
    per_bin, total, weight = {}, 0.0, 0.0
    for index, (cycles, draft_seconds, verify_seconds) in timed.items():
        if not 0 <= index < schedule.num_bins or not cycles > 0:
            continue
        overhead = cycle_step_overhead(model, hardware, bin_middle(schedule, index), schedule.budgets[index], k,
                                       draft_seconds / (k * cycles), verify_seconds / cycles, schedule.page_size,
                                       dense_layer_count(model, schedule))  # fmt: skip
        if overhead is None or not math.isfinite(overhead):
            continue
        per_bin[index] = overhead
        total, weight = total + overhead * cycles, weight + cycles
    return (total / weight if weight > 0 else None), per_bin


def step_attention_cost(
    model: ModelSpec,
    hardware: Hardware,
    kv_len: int,
    budget: int,
    page_size: int = PAGE_SIZE,
    dense_layers: int = 0,
    queries: int = 1,
) -> float:
    """The eFLOPs of a decode step (`decode_step_cost`) that depend on the KV: its total less the weights' 2P
    per query. What a draft step's time grows with as its budget or the sequence grows."""
    total = decode_step_cost(model, hardware, kv_len, budget, page_size, dense_layers, queries).total
    return total - queries * 2 * model.params


@dataclass(frozen=True)
class StepTimeFit:
    """A decode step's measured seconds as `fixed` + `per_eflop` x its attention eFLOPs (`step_attention_cost`)."""

    fixed: float  # seconds a step costs whatever its KV: the weights, sampling, the engine's own work
    per_eflop: float  # seconds per eFLOP of attention
    points: int  # the (attention eFLOPs, seconds) observations behind it
    spread: float  # the largest observed attention cost over the smallest

    def seconds(self, attention: float) -> float:
        """The step's predicted seconds at this attention cost."""
        return self.fixed + self.per_eflop * attention


def fit_step_times(points: list[tuple[float, float, float]], min_spread: float = 1.25) -> StepTimeFit | None:
    """Least squares of a step's seconds on its attention eFLOPs, both parts kept non-negative.

    `points` are (attention eFLOPs, seconds per step, weight), the weight the steps behind the figure. None
    when the attention costs observed span less than `min_spread` (their largest over their smallest): then
    the fixed part and the slope are not told apart by the data, and the caller prices another way.
    """
    pts = [(a, t, w) for a, t, w in points if a > 0 and t > 0 and w > 0 and math.isfinite(a * t * w)]
    if len(pts) < 2:
        return None
    low, high = min(a for a, _, _ in pts), max(a for a, _, _ in pts)
    if high < low * min_spread:
        return None
    sw = sum(w for _, _, w in pts)
    ma = sum(w * a for a, _, w in pts) / sw
    mt = sum(w * t for _, t, w in pts) / sw
    saa = sum(w * (a - ma) ** 2 for a, _, w in pts)
    sat = sum(w * (a - ma) * (t - mt) for a, t, w in pts)
    slope = sat / saa
    fixed = mt - slope * ma
    if slope < 0:  # more attention never makes a step cheaper: the times are one fixed figure plus noise
        slope, fixed = 0.0, mt
    elif fixed < 0:  # no step costs less than nothing: through the origin
        slope, fixed = sum(w * a * t for a, t, w in pts) / sum(w * a * a for a, _, w in pts), 0.0
    return StepTimeFit(fixed, slope, len(pts), high / low)


@dataclass(frozen=True)
class SpeculativePrediction:
    """Predicted cost of lossless (self-speculative) rollouts: k sparse drafts and one dense verify per cycle."""

    speculative_tokens: int  # k
    alpha: float  # acceptance of one draft, assumed i.i.d.
    tokens_per_cycle: float  # (1 - a^(k+1)) / (1 - a)
    verify: CostTerms  # a dense step over k + 1 query positions, summed over the generated positions
    cost: CostTerms  # of the whole rollout
    speedup: float  # dense eFLOPs over these


def predict_speculative(prediction: CostPrediction, k: int, alpha: float) -> SpeculativePrediction:
    """Speculative decoding priced with the same model: per emitted token, (k sparse steps + one verify) / E.

    E = (1 - alpha^(k+1)) / (1 - alpha) tokens per cycle. A sparse step costs what the schedule's
    sparse decode costs at that position; the verify is a dense step over k + 1 query positions: its
    compute (weights and attention FLOPs) k + 1 times a dense step's, its KV read and its step overhead
    once. Both summed over the generated positions, like the costs they come from; drafts past a
    rejection are priced as paid.
    """
    e = expected_tokens(alpha, k)
    d, s = prediction.dense, prediction.sparse
    verify = CostTerms((k + 1) * (d.compute - prediction.overhead) + prediction.overhead, d.memory)
    cost = CostTerms((k * s.compute + verify.compute) / e, (k * s.memory + verify.memory) / e)
    return SpeculativePrediction(k, alpha, e, verify, cost, d.total / cost.total)


def decode_step_cost(
    model: ModelSpec,
    hardware: Hardware,
    kv_len: int,
    budget: int,
    page_size: int = PAGE_SIZE,
    dense_layers: int = 0,
    queries: int = 1,
    step_overhead: float = 0.0,
) -> CostTerms:
    """One sequence's decode step at KV length `kv_len`, in eFLOPs: `queries` positions over one KV read.

    The paper's per-position terms for generated tokens, without the prompt's (a step reads one KV
    cache, whoever wrote it): dense, compute 2P + 2rD L and memory 2D L per query; at a budget B < L,
    the sparse layers' part D_s pays 2rD_s B + rD_s L / page of compute (the pages' centroid scores
    included) and 2D_s B + D_s L / page of memory, while the `dense_layers` part D_d pays the dense
    terms. `queries` > 1 is a verify pass: its compute `queries` times one step's, its KV read once.
    A budget of 0, or one at least `kv_len`, is dense. `step_overhead` (multiples of 2P) is paid once
    per forward, whatever the queries (see the module doc).
    """
    if kv_len < 1 or budget < 0 or queries < 1:
        raise ValueError(f"kv_len and queries must be >= 1 and budget >= 0, got {kv_len}, {queries}, {budget}")
    _check_overhead(step_overhead)
    r, d = model.gqa_ratio, model.kv_dim
    d_dense = min(dense_layers, model.num_layers) * model.num_kv_heads * model.head_dim
    if budget == 0 or budget >= kv_len:
        d_dense = d
    d_sparse = d - d_dense
    compute = 2 * model.params + 2 * r * d_dense * kv_len + d_sparse * (2 * r * budget + r * kv_len / page_size)
    memory = 2 * d_dense * kv_len + d_sparse * (2 * budget + kv_len / page_size)
    overhead = step_overhead * 2 * model.params
    return CostTerms(queries * compute + overhead, hardware.flops_per_byte * hardware.bytes_per_element * memory)


def speculative_step_speedup(
    model: ModelSpec,
    hardware: Hardware,
    kv_len: int,
    budget: int,
    k: int,
    alpha: float,
    page_size: int = PAGE_SIZE,
    dense_layers: int = 0,
    step_overhead: float = 0.0,
) -> float:
    """Tokens per eFLOP of self-speculative decoding at KV length `kv_len` over dense decoding's, at one point.

    A cycle is k draft steps at `budget` and one dense verify over k + 1 positions, and emits
    (1 - alpha^(k+1)) / (1 - alpha) tokens on average; dense decoding emits one token a step. Above
    1 the draft budget pays at this length; the lossless controller picks, per bin, the budget that
    maximises it (its acceptance as measured there). `step_overhead`: each forward's cost beyond the
    paper's terms, in multiples of 2P (module doc).
    """
    o = step_overhead
    dense = decode_step_cost(model, hardware, kv_len, 0, step_overhead=o).total
    draft = decode_step_cost(model, hardware, kv_len, budget, page_size, dense_layers, step_overhead=o).total
    verify = decode_step_cost(model, hardware, kv_len, 0, queries=k + 1, step_overhead=o).total
    return expected_tokens(alpha, k) * dense / (k * draft + verify)
