"""Held-out evaluation of a model on a dataset with its own tokenizer: k samples per prompt by plain
transformers generation, stopping at every stop id, scored by a reward function the caller gives.

Prompts arrive already rendered (sparrow/prompts.py); `score(prompt, text) -> float` is the caller's
(the CLI runs the dataset's rewards in the reward pool, with timeouts). Figures per source as in
sparrow/evaluation.py: avg@k and unbiased pass@k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sparrow.evaluation import summarize
from sparrow.prompts import Prompt


def sample_responses(
    model, tokenizer, prompt: Prompt, k: int, max_new_tokens: int, stop_ids: Sequence[int], seed: int
) -> list[str]:
    """`k` sampled completions (temperature 1.0) of one prompt, decoded without special tokens."""
    import torch

    ids = torch.tensor([list(prompt.token_ids)] * k, dtype=torch.long, device=model.device)
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=list(stop_ids),
        pad_token_id=pad,
    )
    return [tokenizer.decode(row[ids.shape[1] :].tolist(), skip_special_tokens=True) for row in out]


def evaluate_prompts(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    k: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    score: Callable[[Prompt, list[str]], list[float]],
    seed: int = 0,
) -> dict[str, dict]:
    """{data_source: {prompts, samples, avg@k, pass@...}} over `prompts`."""
    by_source: dict[str, list[list[float]]] = {}
    for i, prompt in enumerate(prompts):
        texts = sample_responses(model, tokenizer, prompt, k, max_new_tokens, stop_ids, seed + i)
        by_source.setdefault(prompt.sample.data_source, []).append(score(prompt, texts))
    return {src: summarize(groups) for src, groups in sorted(by_source.items())}
