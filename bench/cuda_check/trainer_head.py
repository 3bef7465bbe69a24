"""In the `trainer_memory` phase of bench/cuda_check: one FSDP2 bf16 step at 16K tokens, chunked vs full LM head.

The same model as the phase's other cases (Qwen3-0.6B's shape, 8 of its 28 layers, Qwen3's 151,936-entry
vocabulary, each decoder layer checkpointed, bf16 compute over fp32 master weights, one NCCL rank)
takes one step on one 16K-token rollout, two ways:

    chunked  the trainer's own `trainer.rl_update.learn`: dense scoring (top-20) and the GRPO + TIS update,
             the LM head 1,024 positions at a time, never a [tokens, vocab] tensor
    full     the path it replaced: the model's whole [tokens, vocab] logits, log-softmax in float32, the
             sampled tokens' logprobs and top-20 for scoring, then the same loss on full logits

Figures: peak GPU memory (torch.cuda.max_memory_allocated over the step) and tokens/s of each; the
chunked step's peak over the full one's. Checks: the two losses agree (bf16) and the chunked step's peak
is below the full one's. The dry run (CPU, gloo, a tiny shape) runs the same code for the loss check only.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

# The rollout's logprobs sit near a random model's (log 1/vocab), so the TIS weights are about 1 and the
# loss is of order 1: its relative agreement then measures the heads, not a ratio of tiny numbers.
LOSS_TOL = {"float32": 1e-5, "bfloat16": 3e-2}
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 5e-2}  # the sampled tokens' logprobs, absolute
CHUNK = 1024


def _rollout(vocab: int, prompt: int, response: int):
    import math

    import torch

    from trainer.batch import Rollout

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (prompt + response,), generator=g).tolist()
    alt = torch.randint(3, vocab, (response,), generator=g).tolist()
    lp = -math.log(vocab)
    tops = tuple((t, a) for t, a in zip(ids[prompt:], alt, strict=True))
    return Rollout("g0", 0, tuple(ids[:prompt]), tuple(ids[prompt:]), (lp,) * response, tops, ((lp, lp),) * response)


def run(rec, folder: Path, device: str, dtype_name: str, vocab: int, tokens: int, prompt: int) -> None:
    """Both ways on the model saved in `folder`, into `rec` (a common.Record) under "head_16k"."""
    import torch

    dtype = getattr(torch, dtype_name)
    rollout = _rollout(vocab, prompt, tokens - prompt)
    figures = {}
    for head in ("chunked", "full"):
        figures[head] = _step(folder, device, dtype, head, rollout)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    out = {"tokens": tokens, "chunk": CHUNK, **figures}
    if device == "cuda":
        out["chunked_peak_over_full"] = figures["chunked"]["peak_gib"] / figures["full"]["peak_gib"]
        out["chunked_time_over_full"] = figures["chunked"]["seconds"] / figures["full"]["seconds"]
    rec["head_16k"] = out
    a, b = figures["chunked"].pop("old"), figures["full"].pop("old")
    rec.check("head_16k_logprobs_chunked_vs_full_max_abs", float((a - b).abs().max()), LOGPROB_TOL[dtype_name])
    a, b = figures["chunked"]["loss"], figures["full"]["loss"]
    rec.check("head_16k_loss_chunked_vs_full", abs(a - b) / max(abs(b), 1e-6), LOSS_TOL[dtype_name])
    if device == "cuda":
        rec.check("head_16k_chunked_peak_below_full", out["chunked_peak_over_full"], 0.9)


def _step(folder: Path, device: str, dtype, head: str, rollout) -> dict:
    import torch

    from trainer import distributed
    from trainer.activation_checkpoint import checkpoint_layers
    from trainer.model_io import load_model
    from trainer.rl_update import UpdateConfig, learn
    from trainer.scoring import Scorer

    model = load_model(folder, device)
    checkpoint_layers(model)
    distributed.shard(model, None if dtype == torch.float32 else dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    advantages = torch.tensor([1.0])
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if head == "chunked":
        config = UpdateConfig(temperature=1.0, micro_batch_size=1, lm_head_chunk=CHUNK, dtype=dtype)
        dense, _, stats = learn(
            model, optimizer, Scorer(model, chunk=CHUNK, dtype=dtype), [rollout], advantages, config
        )
        loss, old = float(stats["loss"]), dense[0].logprobs.float().cpu()
    else:
        loss, old = _full_step(model, optimizer, rollout, advantages, dtype)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "old": old,
        "loss": loss,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(len(rollout.sequence) / seconds, 1),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def _full_step(model, optimizer, rollout, advantages, dtype):
    """Scoring and the update as before the chunked head: whole [tokens, vocab] logits, both times.

    Returns the loss and the scored logprobs of the sampled tokens (the update's old policy)."""
    import torch

    from trainer.batch import collate
    from trainer.grpo import GRPOConfig, global_token_count, grpo_tis_loss, sampled_logprobs
    from trainer.scoring import compute_dtype, scaled_logprobs

    mb = collate([rollout], advantages, [0]).to(distributed_device(model))
    plen = rollout.prompt_len
    with torch.no_grad(), compute_dtype(mb.input_ids.device, dtype):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        lp = scaled_logprobs(logits[0, plen - 1 : -1], 1.0)
        old = lp.gather(1, mb.input_ids[0, plen:, None]).squeeze(1)
        torch.topk(lp, 20, dim=-1)
        del logits, lp
    optimizer.zero_grad(set_to_none=True)
    with compute_dtype(mb.input_ids.device, dtype):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]
    lps = sampled_logprobs(logits, mb.targets, 1.0)
    loss, _ = grpo_tis_loss(
        lps, mb.place([old]), mb.rollout_logprobs, mb.advantages, mb.mask, GRPOConfig(), global_token_count(mb.mask)
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), old.float().cpu()


def distributed_device(model):
    """Where the sharded model's forward runs."""
    from trainer.distributed import compute_device

    return compute_device(model)
