"""Rollout throughput of the generator's vLLM engine, dense then block-sparse, in one run.

One engine, one set of prompts: the batch is generated with dense decode attention, then again
under the schedule (set at runtime, as the controller does), every sequence running to the full
generation length (EOS ignored), so both sides produce the same number of tokens at the same
lengths. Reported: generated tokens per second of each side, their ratio, the mean attended-KV
fraction of the sparse run (over every layer, dense layers counted whole), and, with
`check_alpha`, the p5 of alpha per length bin of the sparse run's tokens against dense scoring
(the trainer's scoring of the same tokens), so the speedup is quoted next to the tail it costs.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from services.generator.engine import FinishedSample
from sparrow.schedule import Schedule
from sparrow.work import PromptGroup, Sampling


@dataclass
class RolloutBenchResult:
    model: str
    schedule: str
    prompt_len: int
    gen_len: int
    batch: int
    prompts: str  # "random" token ids, or the model's chain task (its label)
    dense_tokens_per_s: float
    sparse_tokens_per_s: float
    speedup: float
    dense_seconds: float
    sparse_seconds: float
    attended_kv_fraction: float
    layers: int
    dense_layers: list[int]
    alpha_p5_per_bin: dict[str, float] = field(default_factory=dict)
    alpha_tokens_per_bin: dict[str, int] = field(default_factory=dict)
    # With speculative_tokens > 0: a second engine decodes the same prompts losslessly (plugin.self_draft).
    speculative: dict = field(default_factory=dict)
    # The cost model against the measurement: its predicted speedup, and the step overhead that explains the gap.
    cost: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, vocab) for _ in range(prompt_len)) for _ in range(batch)]


def _generate(engine, prompts, gen_len: int, tag: str, log: Callable[[str], None] | None = None, temperature=1.0,
              cycles: list | None = None):  # fmt: skip
    """(the finished samples, seconds); `log` gets a line at every tenth of the generation length; `cycles`
    collects the engine's timed speculative cycles."""
    for i, p in enumerate(prompts):
        engine.submit(PromptGroup(f"{tag}{i}", p, 1, 0, Sampling(max_new_tokens=gen_len, temperature=temperature)))
    out: list[FinishedSample] = []
    start = time.perf_counter()
    steps, every = 0, max(1, gen_len // 10)
    while engine.in_flight:
        out.extend(engine.step())
        if cycles is not None:
            cycles.extend(engine.take_cycle_times())
        steps += 1  # a decode step generates one token of every running sequence (EOS is ignored)
        if log is not None and (steps % every == 0 or not engine.in_flight):
            t = time.perf_counter() - start
            log(f"bench rollout: {tag} step {steps} ({gen_len} tokens per sequence), {t:.0f} s")
    seconds = time.perf_counter() - start
    if cycles is not None:
        cycles.extend(engine.take_cycle_times(flush=True))
    return out, seconds


def attended_fraction(samples: list[FinishedSample], layers: int, dense_layers: int) -> float:
    """Mean over generated tokens of attended KV / context KV, averaged over every layer."""
    attended = context = 0.0
    for s in samples:
        plen = len(s.prompt_token_ids)
        for t, b in enumerate(s.kv_budgets):
            ctx = plen + t
            sparse_part = min(b, ctx) if b else ctx
            attended += dense_layers * ctx + (layers - dense_layers) * sparse_part
            context += layers * ctx
    return attended / context if context else 1.0


def run_rollout_bench(
    model: str,
    schedule: Schedule,
    prompt_len: int,
    gen_len: int,
    batch: int,
    check_alpha: bool = False,
    seed: int = 0,
    enforce_eager: bool = True,
    static_decode: bool = False,
    log: Callable[[str], None] | None = None,
    speculative_tokens: int = 0,
    greedy_check: int = 256,
    task_prompts: list[tuple[int, ...]] | None = None,
    task_label: str = "",
) -> RolloutBenchResult:
    """Generate the same batch dense, then sparse, with one engine; see the module docstring. Progress goes
    to `log` (default: stderr, so that stdout holds the figures alone)."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    import json
    from pathlib import Path

    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    cfg = json.loads((Path(model) / "config.json").read_text())
    layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    if task_prompts is not None:  # the model's own task: each response runs to its EOS (at most gen_len tokens)
        prompt_len = max(len(p) for p in task_prompts)
    max_len = prompt_len + gen_len + 16 + speculative_tokens

    def make(k: int) -> VllmEngine:
        return VllmEngine(
            VllmEngineConfig(
                model=model,
                max_model_len=max_len,
                max_num_seqs=batch,
                ignore_eos=task_prompts is None,
                seed=seed,
                enforce_eager=enforce_eager,
                static_decode=static_decode,
                enable_prefix_caching=False,
                kv_cache_gib=max(1, -(-batch * max_len * _kv_bytes_per_token(cfg) // (1 << 30)) + 1),
                speculative_tokens=k,
            )
        )

    prompts = _prompts(batch, prompt_len, vocab, seed) if task_prompts is None else [tuple(p) for p in task_prompts]
    greedy = min(greedy_check, gen_len)
    engine = make(0)
    try:
        _generate(engine, prompts[:1], 8, "warmup")  # first-step allocations off the clock
        say(f"bench rollout: engine ready; {batch} sequences of {prompt_len} + {gen_len} tokens, dense then sparse")
        engine.set_schedule(None)
        dense, dense_s = _generate(engine, prompts, gen_len, "dense", say)
        if speculative_tokens:
            dense_greedy, _ = _generate(engine, prompts, greedy, "dense-greedy", None, temperature=0.0)
        engine.set_schedule(schedule)
        sparse, sparse_s = _generate(engine, prompts, gen_len, "sparse", say)
    finally:
        engine.close()
    speculative = {}
    if speculative_tokens:
        speculative = _speculative(make(speculative_tokens), schedule, prompts, gen_len, greedy, dense_greedy,
                                   sum(len(s.token_ids) for s in dense) / dense_s, say)  # fmt: skip
    tokens = sum(len(s.token_ids) for s in dense)
    sparse_tokens = sum(len(s.token_ids) for s in sparse)
    dense_layers = len([i for i in schedule.dense_layers if i < layers])
    result = RolloutBenchResult(
        model=model,
        schedule=schedule.name or schedule.compact(),
        prompt_len=prompt_len,
        gen_len=gen_len,
        batch=batch,
        prompts="random" if task_prompts is None else task_label,
        dense_tokens_per_s=tokens / dense_s,
        sparse_tokens_per_s=sparse_tokens / sparse_s,
        speedup=(sparse_tokens / sparse_s) / (tokens / dense_s),
        dense_seconds=dense_s,
        sparse_seconds=sparse_s,
        attended_kv_fraction=attended_fraction(sparse, layers, dense_layers),
        layers=layers,
        dense_layers=sorted(schedule.dense_layers),
        speculative=speculative,
    )
    result.cost = cost_against_measured(model, schedule, prompt_len, dense, result.speedup, speculative)
    if check_alpha:
        say("bench rollout: scoring the sparse tokens densely (--check-alpha)")
        result.alpha_p5_per_bin, result.alpha_tokens_per_bin = _alpha_tail(model, sparse, schedule)
    return result


def cost_against_measured(
    model: str, schedule: Schedule, prompt_len: int, dense: list[FinishedSample], measured: float, speculative: dict
) -> dict:
    """The cost model at the bench's shape (this machine's hardware, the schedule's dense layers priced dense)
    beside the measured sparse speedup: the paper's terms alone, the step overhead (multiples of 2P) that
    makes them predict the measurement (`sparrow.cost.implied_step_overhead`; the controller's
    `cost.step_overhead`), and with it the speculative speedup at the measured acceptance; beside them the
    overhead the speculative engine's own timed cycles imply (what the lossless controller prices, with no
    dense run) and the speculative speedup it predicts.

    The generation length priced is the mean of the dense run's; {"error": ...} where the cost model has no
    figures for this machine or model."""
    from sparrow.cost import binned_step_overhead, implied_step_overhead, predict, predict_speculative
    from sparrow.hardware import HardwareError, get_hardware
    from sparrow.models import ModelSpecError, resolve_model

    samples = max(1, len(dense))
    gen_len = max(1, round(sum(len(s.token_ids) for s in dense) / samples))
    try:
        spec, hardware = resolve_model(model), get_hardware("auto")
    except (ModelSpecError, HardwareError) as exc:
        return {"error": str(exc)}
    paper = predict(spec, schedule, hardware, prompt_len, gen_len, samples, price_dense_layers=True)
    overhead = implied_step_overhead(spec, paper, measured)
    out = {
        "hardware": hardware.name,
        "gen_len_priced": gen_len,
        "paper_speedup": paper.speedup,
        "measured_speedup": measured,
        "implied_step_overhead": overhead,
    }
    acceptance, k = speculative.get("acceptance"), speculative.get("speculative_tokens")
    if acceptance is None:
        return out
    out["speculative_measured"] = speculative["ratio_to_dense"]
    if overhead is not None:
        priced = predict(spec, schedule, hardware, prompt_len, gen_len, samples, True, overhead)
        out["speculative_predicted"] = predict_speculative(priced, k, acceptance).speedup
    # What the lossless controller prices without a dense run: the overhead the speculative engine's own timed
    # cycles imply (per bin, weighted by cycles), and the speculative speedup predicted with it.
    timed = {int(i): (t["cycles"], t["draft_seconds"], t["verify_seconds"])
             for i, t in (speculative.get("timed_cycles") or {}).items()}  # fmt: skip
    cycle_overhead, _ = binned_step_overhead(spec, hardware, schedule, k, timed)
    if cycle_overhead is not None:
        priced = predict(spec, schedule, hardware, prompt_len, gen_len, samples, True, cycle_overhead)
        out["cycle_step_overhead"] = cycle_overhead
        out["speculative_predicted_from_cycles"] = predict_speculative(priced, k, acceptance).speedup
    return out


def _speculative(engine, schedule, prompts, gen_len, greedy, dense_greedy, dense_rate, say) -> dict:
    """The same prompts decoded losslessly at T = 1 (tokens/s, acceptance), then greedily against dense greedy."""
    try:
        engine.set_schedule(schedule)
        _generate(engine, prompts[:1], 8, "warmup")
        say(f"bench rollout: speculative engine ready, k = {engine.config.speculative_tokens}")
        start = engine.speculative_counts()
        cycles: list = []
        samples, seconds = _generate(engine, prompts, gen_len, "speculative", say, cycles=cycles)
        counts = {k: v - start[k] for k, v in engine.speculative_counts().items()}
        spec_greedy, _ = _generate(engine, prompts, greedy, "speculative-greedy", None, temperature=0.0)
    finally:
        engine.close()
    by_id = {s.group_id.removeprefix("dense-greedy"): s.token_ids for s in dense_greedy}
    first_difference = []
    for s in spec_greedy:
        ref = by_id[s.group_id.removeprefix("speculative-greedy")]
        pairs = enumerate(zip(ref, s.token_ids, strict=False))
        first = next((i for i, (a, b) in pairs if a != b), None)
        if first is None and len(ref) != len(s.token_ids):  # one ended (EOS) where the other went on
            first = min(len(ref), len(s.token_ids))
        first_difference.append(first)
    rate = sum(len(s.token_ids) for s in samples) / seconds
    return {
        "speculative_tokens": engine.config.speculative_tokens,
        "tokens_per_s": rate,
        "seconds": seconds,
        "ratio_to_dense": rate / dense_rate,
        "acceptance": counts["accepted"] / counts["drafted"] if counts["drafted"] else None,
        "tokens_per_cycle": (counts["accepted"] + counts["cycles"]) / counts["cycles"] if counts["cycles"] else None,
        "cycles": counts["cycles"],
        "greedy_tokens_compared": greedy,
        "speculative_identical_to_dense": all(d is None for d in first_difference),
        "greedy_first_difference": first_difference,
        "timed_cycles": _timed_cycles(cycles, schedule),
    }


def _timed_cycles(cycles: list, schedule: Schedule) -> dict:
    """The engine's timed cycles (decodes alone) summed per bin of the schedule: cycles, seconds of the k draft
    steps, seconds of the rest (the verify)."""
    bins: dict[str, list] = {}
    for c in cycles:
        entry = bins.setdefault(str(schedule.bin_of(c.kv_len)), [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += c.draft_seconds
        entry[2] += c.verify_seconds
    return {i: {"cycles": n, "draft_seconds": d, "verify_seconds": v} for i, (n, d, v) in sorted(bins.items())}


def _kv_bytes_per_token(cfg: dict) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


def _alpha_tail(model: str, samples: list[FinishedSample], schedule: Schedule) -> tuple[dict, dict]:
    """p5 of alpha (top-20 lower bound) per length bin: the engine's sparse top-20 vs dense scoring."""
    import torch

    from sparrow.acceptance import alpha_topk, binned_stats
    from trainer.model_io import load_model
    from trainer.scoring import Scorer

    scorer = Scorer(load_model(model), backend="cpu")
    alphas, lens = [], []
    for s in samples:
        [dense] = scorer.score([s.prompt_token_ids + s.token_ids], [len(s.prompt_token_ids)])
        ids = torch.tensor(s.top_token_ids)
        lps = torch.tensor(s.top_logprobs)
        alphas.append(alpha_topk(ids, lps, dense.top_ids, dense.top_logprobs))
        lens.append(dense.kv_lens)
    stats = binned_stats(torch.cat(alphas), torch.cat(lens), schedule.bin_width)
    return {str(b.index): b.quantile for b in stats}, {str(b.index): b.count for b in stats}
