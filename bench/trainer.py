"""The trainer's LM head at Qwen3's vocabulary: peak memory and tokens/s of scoring and of one update step.

A random Qwen3-shaped model (151,936-entry vocabulary, tied head, GQA, a small hidden size so that
it runs on this machine) scores and trains on one sequence of 2K, 8K and 16K tokens, three ways:
- `chunked`: the trainer's own path (`trainer.rl_update.dense_scores` and `grpo_update`, the LM head
  a chunk of positions at a time, `trainer.lm_head`);
- `full`: the path it replaced, full [seq, vocab] float32 logits, log-softmax, gather (and top-20);
- `none`: the decoder alone (hidden states, and for the update a loss on them), the baseline that
  the head's extra memory is measured against.
Each case runs in a fresh process (peak RSS is a process's high-water mark on CPU;
torch.cuda.max_memory_allocated on CUDA), forked from a server that has imported torch and the trainer
once (no interpreter start-up per case), after a warm-up on a short sequence, so the optimizer's
state exists before the measured run. The full head is skipped where its own estimate (three
[seq, vocab] float32 tensors) exceeds `full_limit_gib`: the memory wall it is measured for.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import asdict, dataclass

from bench import rss

VOCAB = 151_936
PROMPT = 128  # prompt tokens of every measured sequence; the rest is the response
WARMUP_TOKENS = 256
# What every case imports, once, in the fork server its processes are forked from (nothing else runs there).
PRELOAD = ["torch", "transformers.models.qwen3.modeling_qwen3", "trainer.rl_update", "trainer.scoring", "bench.trainer"]


@dataclass(frozen=True)
class Shape:
    """The benchmarked model: Qwen3's architecture and vocabulary, small elsewhere."""

    hidden: int = 128
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    intermediate: int = 384


@dataclass(frozen=True)
class Case:
    op: str  # "score" or "update"
    head: str  # "chunked", "full" or "none"
    tokens: int
    chunk: int
    shape: Shape
    threads: int
    device: str


def _model(shape: Shape, device: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer import sparse_attention

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=32768, tie_word_embeddings=True,
    )  # fmt: skip
    return sparse_attention.install(Qwen3ForCausalLM(config)).float().to(device)


def _rollout(tokens: int, seed: int):
    import torch

    from trainer.batch import Rollout

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g).tolist()
    n = tokens - PROMPT
    lps = (-torch.rand(n, generator=g) * 12).tolist()
    return Rollout("g", 0, tuple(ids[:PROMPT]), tuple(ids[PROMPT:]), tuple(lps), (), ())


def _run(case: Case, model, optimizer, rollout) -> None:
    import torch

    from trainer import lm_head
    from trainer.batch import collate
    from trainer.grpo import GRPOConfig, global_token_count, grpo_tis_loss, sampled_logprobs
    from trainer.rl_update import UpdateConfig, dense_scores, grpo_update
    from trainer.scoring import Scorer, response_hidden, scaled_logprobs

    device = torch.device(case.device)
    adv = torch.tensor([1.0])
    old = [torch.tensor(rollout.logprobs) + 0.01]
    if case.op == "score":
        with torch.no_grad():
            if case.head == "chunked":
                dense_scores(Scorer(model, chunk=case.chunk), [rollout], 1.0, 1)
            else:
                mb = collate([rollout], adv, [0]).to(device)
                if case.head == "full":
                    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
                    lp = scaled_logprobs(logits[0, PROMPT - 1 : -1], 1.0)
                    lp.gather(1, mb.input_ids[0, PROMPT:, None])
                    torch.topk(lp, 20, dim=-1)
                else:
                    lm_head.hidden_states(model, mb.input_ids, mb.attention_mask)
        return
    if case.head == "chunked":
        config = UpdateConfig(micro_batch_size=1, lm_head_chunk=case.chunk, max_grad_norm=1.0)
        grpo_update(model, optimizer, [rollout], old, adv, config)
        return
    mb = collate([rollout], adv, [0]).to(device)
    optimizer.zero_grad(set_to_none=True)
    if case.head == "full":  # the replaced path: full logits, log-softmax over the vocabulary, gather
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]
        lp = sampled_logprobs(logits, mb.targets, 1.0)
        loss, _ = grpo_tis_loss(
            lp, mb.place(old), mb.rollout_logprobs, mb.advantages, mb.mask, GRPOConfig(), global_token_count(mb.mask)
        )
    else:  # the decoder alone: the same backward through every layer, no head
        loss = response_hidden(model, mb).float().square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return rss.peak_bytes()


def _child(case: Case, out) -> None:
    rss.reset_peak()  # the case's own peak, not the parent's
    import torch

    torch.set_num_threads(case.threads)
    model = _model(case.shape, case.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    _run(case, model, optimizer, _rollout(WARMUP_TOKENS, 1))  # optimizer state and allocator warmed up
    if case.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rollout = _rollout(case.tokens, 2)
    start = time.perf_counter()
    _run(case, model, optimizer, rollout)
    if case.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out.send({"seconds": seconds, "peak_bytes": _peak_bytes(case.device)})


def _measure(case: Case) -> dict:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(case, send))
    proc.start()
    send.close()
    try:
        result = recv.recv()
    except EOFError:
        result = None
    proc.join()
    if result is None:
        raise RuntimeError(f"the {case.op}/{case.head} case at {case.tokens} tokens died (exit code {proc.exitcode})")
    return result


def run_trainer_bench(
    lengths: tuple[int, ...] = (2048, 8192, 16384),
    chunk: int = 1024,
    shape: Shape = Shape(),
    threads: int = 1,
    device: str = "cpu",
    full_limit_gib: float = 6.0,
    log=print,
) -> dict:
    """Every (op, head, length) case in its own process; figures and the goals' ratios as one dict."""
    gib = 2**30
    three_chunks = 3 * chunk * VOCAB * 4
    rows = []
    for tokens in lengths:
        for op in ("score", "update"):
            figures = {}
            for head in ("none", "chunked", "full"):
                full_estimate = 3 * tokens * VOCAB * 4
                if head == "full" and full_estimate > full_limit_gib * gib:
                    log(f"{op} {tokens}: full head skipped (needs about {full_estimate / gib:.1f} GiB for its logits)")
                    continue
                case = Case(op, head, tokens, chunk, shape, threads, device)
                r = _measure(case)
                figures[head] = r
                log(f"{op} {tokens} {head}: {r['seconds']:.2f} s, peak {r['peak_bytes'] / gib:.2f} GiB")
            base = figures["none"]["peak_bytes"]
            row = {"op": op, "tokens": tokens}
            for head, r in figures.items():
                row[head] = {
                    "seconds": r["seconds"],
                    "tokens_per_s": tokens / r["seconds"],
                    "peak_gib": r["peak_bytes"] / gib,
                    "head_extra_gib": (r["peak_bytes"] - base) / gib,
                }
            row["chunked_extra_over_three_chunk_tensors"] = (figures["chunked"]["peak_bytes"] - base) / three_chunks
            if "full" in figures:
                row["chunked_time_over_full"] = figures["chunked"]["seconds"] / figures["full"]["seconds"]
                row["full_extra_over_chunked_extra"] = (figures["full"]["peak_bytes"] - base) / max(
                    figures["chunked"]["peak_bytes"] - base, 1
                )
            else:
                row["full_logits_estimate_gib"] = 3 * tokens * VOCAB * 4 / gib
            rows.append(row)
    at_2k = [r for r in rows if r["tokens"] == min(lengths) and "chunked_time_over_full" in r]
    return {
        "vocab": VOCAB,
        "shape": asdict(shape),
        "chunk": chunk,
        "device": device,
        "threads": threads,
        "three_chunk_tensors_gib": three_chunks / gib,
        "rows": rows,
        "goals": {
            "chunked_extra_within_three_chunk_tensors": all(
                r["chunked_extra_over_three_chunk_tensors"] <= 1.0 for r in rows
            ),
            "chunked_time_within_1.15x_of_full_at_shortest": bool(at_2k)
            and all(r["chunked_time_over_full"] <= 1.15 for r in at_2k),
        },
    }
