"""The exact-alpha pass ([trainer] alpha = "exact") against the dense scoring it rides on, at Qwen3's vocabulary.

    python -m bench.exact_alpha [--tokens 2048 8192] [--chunk 1024] [--budget 1024] [--device cpu]

A random Qwen3-shaped model (bench/trainer.py's: 151,936-entry tied head, small hidden size) and one
rollout of each length whose response tokens were "decoded" under a fixed KV budget, every layer
sparse. Per length, in a fresh process each (peak memory is a process's high-water mark on CPU,
torch.cuda.max_memory_allocated on CUDA), after a warm-up on a short sequence:
  - `dense`: the step's dense scoring alone (`trainer.rl_update.dense_scores`);
  - `exact`: the same scoring with the exact pass (`scores_and_exact`): the teacher-forced sparse
    forward, the sparse LM head and the alpha of every chunk pair (`trainer.exact_alpha.chunk_alpha`).
Reported: the exact pass's own time (exact - dense) over the dense scoring's (goal <= 1.5), the peak
memory the pass adds over dense scoring, in units of one [chunk, vocab] float32 tensor and against
what one [tokens, vocab] float32 tensor would take (a pass that held it would grow with the length;
this one must not), and one whole learning step (`trainer.rl_update.learn`: scores, alpha, update)
with and without the pass.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

from bench.trainer import PROMPT, VOCAB, Shape, _model, _peak_bytes


def _rollout(tokens: int, budget: int, seed: int):
    import torch

    from trainer.batch import Rollout

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g).tolist()
    n = tokens - PROMPT
    lps = (-torch.rand(n, generator=g) * 12).tolist()
    # The generators' convention: 0 for the prefill's token and wherever the budget covered the context.
    budgets = tuple(0 if t == 0 or budget >= PROMPT + t else budget for t in range(n))
    top_ids = tuple(tuple(torch.randperm(VOCAB, generator=g)[:20].tolist()) for _ in range(n))
    top_lps = tuple(tuple(sorted((-torch.rand(20, generator=g) * 12).tolist(), reverse=True)) for _ in range(n))
    return Rollout("g", 0, tuple(ids[:PROMPT]), tuple(ids[PROMPT:]), tuple(lps), top_ids, top_lps, kv_budgets=budgets)


def _child(mode: str, tokens: int, chunk: int, budget: int, device: str, threads: int, out) -> None:
    import torch

    from trainer.distill import BlockRule
    from trainer.exact_alpha import ExactAlpha
    from trainer.rl_update import UpdateConfig, dense_scores, learn, scores_and_exact
    from trainer.scoring import Scorer

    torch.set_num_threads(threads)
    model = _model(Shape(), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scorer = Scorer(model, chunk=chunk)
    exact = ExactAlpha(model, lambda: BlockRule(1, 2, frozenset()), 1.0, chunk) if mode == "exact" else None

    def score(rollouts):
        with torch.no_grad():
            if exact is None:
                return dense_scores(scorer, rollouts, 1.0, 1), None
            exact.begin_step()
            return scores_and_exact(scorer, rollouts, 1.0, 1, exact=exact)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    score([_rollout(256, budget, 1)])  # warm-up: allocator and kernels
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rollout = _rollout(tokens, budget, 0)
    start = time.perf_counter()
    _, alpha = score([rollout])
    sync()
    seconds = time.perf_counter() - start
    peak = _peak_bytes(device)
    config = UpdateConfig(micro_batch_size=1, lm_head_chunk=chunk)
    start = time.perf_counter()
    learn(model, optimizer, scorer, [rollout], torch.tensor([1.0]), config, exact)
    sync()
    step = time.perf_counter() - start
    row = {"mode": mode, "tokens": tokens, "score_s": seconds, "step_s": step, "peak_bytes": peak}
    if alpha is not None:
        a = alpha[0]
        sparse = sum(b > 0 for b in rollout.kv_budgets)
        row.update(alpha_min=float(a.min()), alpha_mean=float(a.mean()), sparse_tokens=sparse)
    out.put(row)


def _measure(mode: str, tokens: int, args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(mode, tokens, args.chunk, args.budget, args.device, args.threads, out))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"bench.exact_alpha: the {mode} run at {tokens} tokens failed (exit {proc.exitcode})")
    return out.get(timeout=10)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one JSON object."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192], help="sequence lengths (prompt included)")
    p.add_argument("--chunk", type=int, default=1024, help="LM-head chunk (positions)")
    p.add_argument("--budget", type=int, default=1024, help="KV budget (tokens) the response was decoded with")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    chunk_bytes = args.chunk * VOCAB * 4
    rows = []
    for tokens in args.tokens:
        dense, exact = _measure("dense", tokens, args), _measure("exact", tokens, args)
        extra = exact["peak_bytes"] - dense["peak_bytes"]
        rows.append({
            "tokens": tokens,
            "dense_score_s": round(dense["score_s"], 3),
            "exact_pass_s": round(exact["score_s"] - dense["score_s"], 3),
            "exact_over_dense": round((exact["score_s"] - dense["score_s"]) / dense["score_s"], 3),
            "extra_peak_gib": round(extra / 2**30, 3),
            "extra_peak_in_chunk_vocab_fp32": round(extra / chunk_bytes, 2),
            "seq_vocab_fp32_gib": round((tokens - PROMPT) * VOCAB * 4 / 2**30, 3),
            "step_s_without": round(dense["step_s"], 3),
            "step_s_with": round(exact["step_s"], 3),
            "step_ratio": round(exact["step_s"] / dense["step_s"], 3),
            "alpha_min": round(exact["alpha_min"], 4),
            "alpha_mean": round(exact["alpha_mean"], 4),
            "sparse_tokens": exact["sparse_tokens"],
        })  # fmt: skip
    report = {
        "bench": "exact_alpha",
        "device": args.device,
        "vocab": VOCAB,
        "chunk": args.chunk,
        "budget": args.budget,
        "chunk_vocab_fp32_gib": round(chunk_bytes / 2**30, 3),
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
