"""Parity of the generator's sparse logprobs with the trainer's teacher-forced sparse scoring.

The vLLM engine (plugin active) samples a batch under a schedule with small budgets, so that page
selection really happens at almost every step; the trainer's side then scores the same tokens with
the teacher-forced block-sparse forward under the budgets the engine reported for each position
(`trainer.sparse_attention.recorded_plan`). Reported: max and mean absolute difference of the
sampled tokens' logprobs, and how often the top-20 ids agree.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from sparrow.schedule import Schedule
from sparrow.work import PromptGroup, Sampling

DEFAULT_SCHEDULE = Schedule(budgets=(48, 64, 80, 96, 112, 128), bin_width=128, name="parity-small-budgets")


@dataclass
class ParityBenchResult:
    model: str
    schedule: str
    tensor_parallel_size: int
    tokens: int
    sparse_tokens: int
    attended_kv_fraction: float
    max_abs_diff: float
    mean_abs_diff: float
    top_ids_equal_fraction: float

    def to_dict(self) -> dict:
        return asdict(self)


def run_parity_bench(
    model: str,
    schedule: Schedule | None,
    prompts: int,
    prompt_len: int,
    gen_len: int,
    seed: int = 0,
    tensor_parallel_size: int = 1,
) -> ParityBenchResult:
    import json
    from pathlib import Path

    import torch

    from bench.rollout import attended_fraction
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    from trainer import sparse_attention
    from trainer.model_io import load_model
    from trainer.scoring import scaled_logprobs

    schedule = schedule or DEFAULT_SCHEDULE
    cfg = json.loads((Path(model) / "config.json").read_text())
    rng = random.Random(seed)
    engine = VllmEngine(
        VllmEngineConfig(
            model=model,
            max_model_len=prompt_len + gen_len + 16,
            max_num_seqs=prompts,
            ignore_eos=True,
            tensor_parallel_size=tensor_parallel_size,
        ),
        schedule=schedule,
    )
    try:
        for i in range(prompts):
            ids = tuple(rng.randrange(3, int(cfg["vocab_size"])) for _ in range(prompt_len))
            engine.submit(PromptGroup(f"p{i}", ids, 1, 0, Sampling(max_new_tokens=gen_len)))
        samples = []
        while engine.in_flight:
            samples.extend(engine.step())
    finally:
        engine.close()

    policy = sparse_attention.install(load_model(model)).eval()
    diffs, top_equal, positions = [], 0, 0
    for s in samples:
        seq = s.prompt_token_ids + s.token_ids
        plen = len(s.prompt_token_ids)
        plan = sparse_attention.recorded_plan(
            [plen],
            [s.kv_budgets],
            len(seq),
            schedule.sink_blocks,
            schedule.local_blocks,
            frozenset(schedule.dense_layers),
            backend="cpu",
        )
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([seq]), use_cache=False, sparrow_plan=plan).logits[0]
        lp = scaled_logprobs(logits[plen - 1 : len(seq) - 1], 1.0)
        ref = lp.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        diffs.append((ref - torch.tensor(s.logprobs)).abs())
        ref_top = lp.topk(len(s.top_token_ids[0]), dim=-1).indices
        top_equal += int((ref_top == torch.tensor(s.top_token_ids)).all(dim=1).sum())
        positions += len(s.token_ids)
    d = torch.cat(diffs)
    layers = int(cfg["num_hidden_layers"])
    return ParityBenchResult(
        model=model,
        schedule=schedule.name or schedule.compact(),
        tensor_parallel_size=tensor_parallel_size,
        tokens=positions,
        sparse_tokens=sum(1 for s in samples for b in s.kv_budgets if b),
        attended_kv_fraction=attended_fraction(samples, layers, len([x for x in schedule.dense_layers if x < layers])),
        max_abs_diff=float(d.max()),
        mean_abs_diff=float(d.mean()),
        top_ids_equal_fraction=top_equal / positions,
    )
