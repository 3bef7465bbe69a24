"""Rollouts dense, lossy sparse and lossless speculative on the same prompts, in one run (reference engine).

`sparrow bench rollout --decode speculative`. The vLLM plugin has no speculative path yet, so the
three modes run on the generator's reference engine (`services/generator/reference_engine.py`), the
one that serves `engine.decode = "speculative"` today; one engine, the schedule set once, each
prompt group submitted once per mode (`PromptGroup.decode`, `dense`). Prompts are the chain task the
model was trained on, so acceptance is measured where the model's answers mean something.

Sampled at T = 1 (the RL setting): tokens per second of each mode, the ratios to dense, and for the
speculative run per bin of the draft step's KV length the mean acceptance of one draft
(sum_x min(p, q)), accepted over drafted and tokens per cycle. Then greedy (top_p 1e-6) dense and
speculative on every prompt: whether the speculative output equals dense token for token
(`speculative_identical_to_dense`), and where it first differs when not.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

from sparrow.schedule import Schedule
from sparrow.work import PromptGroup, Sampling

GREEDY_TOP_P = 1e-6  # keeps one token on every path of the engine: greedy


@dataclass
class SpeculativeBenchResult:
    model: str
    schedule: str
    task: str
    prompts: int
    samples: int
    speculative_tokens: int
    tokens_per_s: dict[str, float]  # dense, sparse, speculative
    seconds: dict[str, float]
    tokens: dict[str, int]
    mean_response_tokens: dict[str, float]
    ratio_to_dense: dict[str, float]
    acceptance_per_bin: dict[str, dict[str, float]] = field(default_factory=dict)
    acceptance: float = math.nan  # mean alpha of a draft over every drafted position
    tokens_per_cycle: float = math.nan
    speculative_identical_to_dense: bool = False
    greedy_differing_prompts: int = 0
    greedy_first_difference: list[int | None] = field(default_factory=list)  # per prompt: position, or None
    engine: str = "reference"

    def to_dict(self) -> dict:
        return asdict(self)


def _run(engine, prompts, samples, sampling, mode, tag) -> tuple[list, float]:
    out, start = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        group = PromptGroup(
            f"{tag}-{mode}-{i}", tuple(prompt), samples, 0, sampling,
            dense=mode == "dense", decode="" if mode == "dense" else mode,
        )  # fmt: skip
        engine.submit(group)
        while engine.in_flight:
            out.extend(engine.step())
    return out, time.perf_counter() - start


def acceptance_by_bin(samples, bin_width: int) -> tuple[dict[str, dict[str, float]], float, float]:
    """Per bin of the draft step's KV length: drafts, mean alpha, accepted over drafted, tokens per cycle."""
    per: dict[int, list[float]] = {}
    for s in samples:
        k = s.speculative_tokens
        for j, (a, ok, kv) in enumerate(zip(s.draft_alphas, s.draft_accepted, s.draft_kv_lens, strict=True)):
            acc = per.setdefault(kv // bin_width, [0, 0.0, 0, 0])
            acc[0] += 1
            acc[1] += a
            acc[2] += int(ok)
            acc[3] += int(j % k == 0)
    out = {
        str(b): {
            "drafts": n,
            "alpha_mean": total / n,
            "accepted_share": accepted / n,
            "tokens_per_cycle": 1 + accepted / cycles,
        }
        for b, (n, total, accepted, cycles) in sorted(per.items())
    }
    n = sum(v[0] for v in per.values())
    cycles = sum(v[3] for v in per.values())
    alpha = sum(v[1] for v in per.values()) / n if n else math.nan
    per_cycle = 1 + sum(v[2] for v in per.values()) / cycles if cycles else math.nan
    return out, alpha, per_cycle


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_speculative_bench(
    model: str,
    schedule: Schedule,
    prompts: list[list[int]],
    max_new_tokens: int,
    samples: int,
    k: int,
    task: str,
    seed: int = 0,
    backend: str = "auto",
    log=None,
) -> SpeculativeBenchResult:
    """Dense, sparse and speculative rollouts of `prompts` (`samples` each, T = 1), then greedy dense vs speculative."""
    from services.generator.reference_engine import ReferenceEngine

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    longest = max(len(p) for p in prompts) + max_new_tokens + k + 2
    engine = ReferenceEngine(
        model, kernel_backend=backend, seed=seed, max_model_len=longest, decode="sparse", speculative_tokens=k
    )
    try:
        engine.set_schedule(schedule)
        sampling = Sampling(max_new_tokens=max_new_tokens)
        _run(engine, [prompts[0][:8]], 1, Sampling(max_new_tokens=4), "dense", "warmup")
        runs = {}
        for mode in ("dense", "sparse", "speculative"):
            say(f"bench rollout: {mode}, {len(prompts)} prompt(s) x {samples} sample(s) at T = 1 ...")
            runs[mode] = _run(engine, prompts, samples, sampling, mode, "t1")
            out, secs = runs[mode]
            say(f"  {sum(len(s.token_ids) for s in out)} tokens in {secs:.1f} s")
        greedy = Sampling(max_new_tokens=max_new_tokens, top_p=GREEDY_TOP_P)
        say(f"bench rollout: greedy, dense and speculative on {len(prompts)} prompt(s) ...")
        dense_g = {s.group_id.split("-")[-1]: s.token_ids for s in _run(engine, prompts, 1, greedy, "dense", "g")[0]}
        spec_g = {
            s.group_id.split("-")[-1]: s.token_ids for s in _run(engine, prompts, 1, greedy, "speculative", "g")[0]
        }
    finally:
        engine.close()
    tokens = {m: sum(len(s.token_ids) for s in out) for m, (out, _) in runs.items()}
    seconds = {m: secs for m, (_, secs) in runs.items()}
    rate = {m: tokens[m] / seconds[m] for m in runs}
    per_bin, alpha, per_cycle = acceptance_by_bin(runs["speculative"][0], schedule.bin_width)
    firsts = [_first_difference(dense_g[str(i)], spec_g[str(i)]) for i in range(len(prompts))]
    return SpeculativeBenchResult(
        model=model,
        schedule=schedule.name or schedule.compact(),
        task=task,
        prompts=len(prompts),
        samples=samples,
        speculative_tokens=k,
        tokens_per_s=rate,
        seconds=seconds,
        tokens=tokens,
        mean_response_tokens={m: tokens[m] / (len(prompts) * samples) for m in runs},
        ratio_to_dense={m: rate[m] / rate["dense"] for m in ("sparse", "speculative")},
        acceptance_per_bin=per_bin,
        acceptance=alpha,
        tokens_per_cycle=per_cycle,
        speculative_identical_to_dense=all(f is None for f in firsts),
        greedy_differing_prompts=sum(f is not None for f in firsts),
        greedy_first_difference=firsts,
    )
