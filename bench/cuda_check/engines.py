"""The engine phases' shared parts: a random Qwen3 checkpoint, an engine in a child process, the skip without vLLM,
and `engine_rollout`, the child `parity` starts for each engine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench.cuda_check.common import DRY, Record, has_vllm, result_file, run_child, vllm_version


def random_qwen3(folder: Path, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def engine_child(args: list[str], limit: float) -> dict:
    """One engine in a fresh process (vLLM picks the attention backend once per process).

    It stays in this phase's process group, so stopping the phase stops it too.
    """
    return run_child(args, result_file(), limit, new_session=False)


def skip_engine_phase(rec: Record) -> bool:
    if has_vllm():
        return False
    rec["status"] = "skipped"
    rec["reason"] = "dry run" if DRY else f"vLLM does not import here ({vllm_version() or 'not installed'})"
    return True


def phase_engine_rollout(rec: Record, a: argparse.Namespace) -> None:
    """Child of `parity`: greedy samples of one engine, per schedule (stock: vLLM's own attention)."""
    if a.stock:
        os.environ["SPARROW_ATTENTION"] = "stock"
    import random

    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    from sparrow.schedule import Schedule
    from sparrow.work import PromptGroup, Sampling

    cfg = VllmEngineConfig(
        model=a.model, max_model_len=2048, max_num_seqs=8, attention_backend="TRITON_ATTN", ignore_eos=True
    )
    engine = VllmEngine(cfg)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 2048) for _ in range(600 + 37 * i)) for i in range(4)]
    runs = {}
    for label in ["stock"] if a.stock else a.schedules.split(","):
        engine.set_schedule(None if label in ("stock", "none") else Schedule.load(label))
        tag = Path(label).stem
        for i, p in enumerate(prompts):
            engine.submit(PromptGroup(f"{tag}-{i}", p, 1, 0, Sampling(temperature=0.0, max_new_tokens=64)))
        samples = []
        while engine.in_flight:
            samples.extend(engine.step())
        samples.sort(key=lambda s: int(s.group_id.rsplit("-", 1)[1]))
        runs[label] = [{"tokens": s.token_ids, "logprobs": s.logprobs} for s in samples]
        rec["runs"] = runs
    rec["sparse_layers"] = engine.sparse_layers
    engine.close()
