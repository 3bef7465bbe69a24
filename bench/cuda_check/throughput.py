"""Phase `throughput` (vLLM): the engine's decode tokens/s, dense vs sparse, batch 8 at 32K, Qwen3-1.7B's shape."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.cuda_check.common import Record
from bench.cuda_check.engines import random_qwen3, skip_engine_phase


def phase_throughput(rec: Record) -> None:
    if skip_engine_phase(rec):
        return
    import random

    import torch

    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    from sparrow.presets import get_preset
    from sparrow.schedule import Schedule
    from sparrow.work import PromptGroup, Sampling

    batch, prompt_len, gen_len = 8, 32000, 96
    model = random_qwen3(Path(tempfile.mkdtemp(prefix="sparrow-1p7b-")), 28, 2048, 16, 8, 6144, 151936, torch.bfloat16)
    rec["model"] = "random Qwen3-1.7B shape (28 layers, 16/8 heads, head_dim 128), bf16"
    engine = VllmEngine(
        VllmEngineConfig(
            model=str(model),
            dtype="bfloat16",
            max_model_len=prompt_len + gen_len + 16,
            max_num_seqs=batch,
            gpu_memory_utilization=0.6,
            enforce_eager=False,
            enable_prefix_caching=True,
            ignore_eos=True,
        )  # fmt: skip
    )
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 151_000) for _ in range(prompt_len)) for _ in range(batch)]
    schedules = {  # 4096 and 2048 tokens at 32K
        "dense": None,
        "qwen3-1.7b-0.86": get_preset("qwen3-1.7b-0.86"),
        "flat-2048": Schedule(budgets=(2048,), bin_width=2000, name="flat-2048"),
    }
    for label, schedule in schedules.items():  # the first run also fills the prefix cache for the others
        engine.set_schedule(schedule)
        for i, p in enumerate(prompts):
            engine.submit(PromptGroup(f"{label}-{i}", p, 1, 0, Sampling(max_new_tokens=gen_len)))
        decode_s, decode_tokens = 0.0, 0
        while engine.in_flight:
            # Bench-only peek at the engine's private table: a step where every sequence already has a
            # token is a pure decode step; only those are timed.
            pure = all(s.token_ids for s in engine._sequences.values())
            running = engine.in_flight
            start = time.perf_counter()
            engine.step()
            if pure:
                decode_s, decode_tokens = decode_s + time.perf_counter() - start, decode_tokens + running
        rec[label] = {"decode_tokens_per_s": round(decode_tokens / max(decode_s, 1e-9), 1), "tokens": decode_tokens}
    dense = rec.data["dense"]["decode_tokens_per_s"]
    rec["speedups"] = {k: round(v["decode_tokens_per_s"] / dense, 3) for k, v in rec.data.items() if k in schedules}
    engine.close()
