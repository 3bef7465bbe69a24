"""The `trainer_memory` phase of bench/cuda_check: FSDP2's CPU offload and activation checkpointing on one GPU.

A random Qwen3-0.6B-shaped model (8 of its 28 layers, Qwen3's vocabulary) is sharded by the
trainer's own code (`trainer.distributed.shard`, bf16 compute, fp32 master weights) on a one-rank
NCCL group and trains two `trainer.rl_update.learn` steps on four 4K-token rollouts, three ways:

    resident     weights, gradients and AdamW state on the GPU, every activation kept
    checkpoint   the same with each decoder layer checkpointed (`trainer.activation_checkpoint`)
    offload      checkpointed and FSDP2's CPU offload ([trainer.memory] cpu_offload): shards,
                 gradients and optimizer state in pinned host memory, the optimizer on the CPU

Before the steps, the resident and the offloaded model are published as the trainer publishes
(trainer/hf_checkpoint.py: every tensor cast to bf16 where its shard lies, on the GPU or on the
host, then gathered and written), and each folder must equal byte for byte the one a plain model
on the CPU writes from the same weights. Checks: the gradients of each step (gathered right before
the optimizer step) agree between the three within bf16's tolerance (relative to their norm), the
losses too; the offloaded parameters and optimizer state are on the CPU; the peak GPU memory
(torch.cuda.max_memory_allocated over the steps) of `checkpoint` is below `resident`'s and
`offload`'s below `checkpoint`'s. Figures: peak GiB and tokens/s of each. The dry run (CPU, gloo,
a tiny shape) rehearses the same code without the offload (pinned memory needs a GPU) and without
the memory checks.

Then one step on one 16K-token rollout with the chunked LM head against the full one
(bench/cuda_check/trainer_head.py: peak memory, tokens/s, agreement).
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
from pathlib import Path

GRAD_TOL = {"float32": 1e-5, "bfloat16": 3e-2}
PUBLISH_SHARD_BYTES = 200 << 20  # several files, the embedding alone in one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rollouts(vocab: int, count: int, prompt: int, response: int):
    import torch

    from trainer.batch import Rollout

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        ids = torch.randint(3, vocab, (prompt + response,), generator=g).tolist()
        alt = torch.randint(3, vocab, (response,), generator=g).tolist()
        out.append(
            Rollout(
                f"g{i // 2}",
                i % 2,
                tuple(ids[:prompt]),
                tuple(ids[prompt:]),
                (-2.0,) * response,
                tuple((t, a) for t, a in zip(ids[prompt:], alt, strict=True)),
                ((-2.0, -3.0),) * response,
            )  # fmt: skip
        )
    return out


def phase_trainer_memory(rec) -> None:
    """The phase, into `rec` (a common.Record), on the GPU, or on the CPU in the dry run."""
    from bench.cuda_check.common import DEVICE, DRY

    run(rec, DEVICE, DRY)


def run(rec, device: str, dry: bool) -> None:
    """Run the phase into `rec` (a common.Record) on `device`; `dry`: the CPU rehearsal."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0")
    os.environ["WORLD_SIZE"] = "1"
    distributed.init_from_env(device, timeout_s=120)
    if dry:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip
        count, prompt, response, dtype = 4, 16, 48, "float32"
    else:
        shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936)  # fmt: skip
        count, prompt, response, dtype = 4, 128, 3968, "bfloat16"
    rec["shape"] = {**shape, "rollouts": count, "tokens_per_rollout": prompt + response, "dtype": dtype}
    rec["offload_applied"] = not dry  # pinned host memory needs a GPU: the dry run checkpoints only
    rollouts = _rollouts(shape["vocab_size"], count, prompt, response)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=40960)).save_pretrained(
            tmp
        )
        for case, checkpoint, offload in (("resident", False, False), ("checkpoint", True, False),
                                          ("offload", True, not dry)):  # fmt: skip
            # Publishing does not depend on activation checkpointing: the GPU and the offloaded host are the cases.
            published = None if case == "checkpoint" else Path(tmp) / f"published-{case}"
            results[case] = _case(Path(tmp), device, getattr(torch, dtype), checkpoint, offload, rollouts, published)
            gc.collect()  # the case's model, optimizer and their hooks, before the next case measures
            if device == "cuda":
                torch.cuda.empty_cache()
            rec[case] = {k: v for k, v in results[case].items() if k != "grads"}
        _check_published(rec, Path(tmp), ["resident", "offload"])
        # Then one step at 16K tokens, chunked vs full LM head (bench/cuda_check/trainer_head.py), on the same model.
        from bench.cuda_check.trainer_head import run as head_run

        head_run(rec, Path(tmp), device, dtype, shape["vocab_size"], 256 if dry else 16384, prompt)
    distributed.close()
    ref = results["resident"]
    for case in ("checkpoint", "offload"):
        for step, (ga, gb) in enumerate(zip(ref["grads"], results[case]["grads"], strict=True)):
            rec.check(f"{case}_grads_step{step}", _rel(ga, gb), GRAD_TOL[dtype])
        for step, (la, lb) in enumerate(zip(ref["losses"], results[case]["losses"], strict=True)):
            rec.check(f"{case}_loss_step{step}", abs(la - lb) / max(abs(la), 1e-6), GRAD_TOL[dtype])
    if dry:
        return
    off = results["offload"]
    rec.check("offload_params_on_cpu", 0.0, 0.0, ok=off["params_on"] == "cpu" and off["optimizer_state_on"] == "cpu")
    # Checkpointing keeps one layer's intermediates of 8 instead of all; offload takes ~4 GiB of fp32 state away.
    rec.check("checkpoint_peak_below_resident", results["checkpoint"]["peak_gib"] / ref["peak_gib"], 0.9)
    rec.check("offload_peak_below_checkpoint", off["peak_gib"] / results["checkpoint"]["peak_gib"], 0.9)


def _check_published(rec, folder: Path, cases: list[str]) -> None:
    """Each case's published folder against the one a plain model on the CPU writes (file names and bytes)."""
    import torch

    from trainer.hf_checkpoint import write_checkpoint
    from trainer.model_io import load_model

    reference = folder / "published-cpu"
    reference.mkdir()
    write_checkpoint(load_model(folder), reference, torch.bfloat16, PUBLISH_SHARD_BYTES)
    names = sorted(p.name for p in reference.iterdir())
    for case in cases:
        ours = folder / f"published-{case}"
        same = sorted(p.name for p in ours.iterdir()) == names
        same = same and all((ours / n).read_bytes() == (reference / n).read_bytes() for n in names)
        rec.check(f"{case}_published_equals_cpu", 0.0, 0.0, ok=same)


def _case(folder: Path, device: str, dtype, checkpoint: bool, offload: bool, rollouts, published: Path | None) -> dict:
    import torch

    from trainer import distributed
    from trainer.activation_checkpoint import checkpoint_layers
    from trainer.hf_checkpoint import write_checkpoint
    from trainer.model_io import load_model
    from trainer.rl_update import UpdateConfig, learn
    from trainer.scoring import Scorer

    model = load_model(folder, device)
    if checkpoint:
        checkpoint_layers(model)
    distributed.shard(model, None if dtype == torch.float32 else dtype, cpu_offload=offload)
    if published is not None:
        published.mkdir()
        write_checkpoint(model, published, torch.bfloat16, PUBLISH_SHARD_BYTES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cuda = device == "cuda"
    grads: list[dict[str, torch.Tensor]] = []
    peaks: list[float] = []

    def keep_grads(*_) -> None:
        # The copies to the host are the check's, not training's: the peak is taken before them and reset after.
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated())
        grads.append({n: p.grad.full_tensor().float().cpu() for n, p in model.named_parameters() if p.grad is not None})
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    optimizer.register_step_pre_hook(keep_grads)
    config = UpdateConfig(temperature=1.0, micro_batch_size=1, lm_head_chunk=1024, dtype=dtype)
    scorer = Scorer(model, chunk=1024, dtype=dtype)
    advantages = torch.linspace(-1.0, 1.0, len(rollouts))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, start = [], time.perf_counter()
    for _ in range(2):
        _, _, stats = learn(model, optimizer, scorer, rollouts, advantages, config)
        losses.append(float(stats["loss"]))
    if cuda:
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    seconds = time.perf_counter() - start
    state = next(iter(optimizer.state.values()))["exp_avg"]
    out = {
        "losses": losses,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(2 * sum(len(r.sequence) for r in rollouts) / seconds, 1),
        "peak_gib": max(peaks) / 2**30 if cuda else None,
        "params_on": next(model.parameters()).device.type,
        "optimizer_state_on": state.device.type,
        "grads": grads,
    }
    return out  # the model and its optimizer go with this frame (the caller collects them)


def _rel(a: dict, b: dict) -> float:
    """|a - b| / |a| over every gradient together (bf16 noise is relative to the whole, not to each entry)."""
    if a.keys() != b.keys() or not a:
        return float("inf")
    num = sum(float((a[n] - b[n]).double().pow(2).sum()) for n in a)
    den = sum(float(a[n].double().pow(2).sum()) for n in a)
    return (num / max(den, 1e-30)) ** 0.5
