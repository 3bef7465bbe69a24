"""Held-out accuracy per difficulty, greedy and sampled (temperature 1.0), with plain transformers generation."""

from __future__ import annotations

import time

from sparrow.rewards import chain_reward
from sparrow.tasks import ChainTask, ExampleStream, encode_words
from sparrow.tasks.vocab import BOS, EOS, TOKEN_TO_ID, VOCAB


def _generate(model, prompts, max_new: int, sample: bool, seed: int):
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    torch.manual_seed(seed)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        eos_token_id=TOKEN_TO_ID[EOS],
        pad_token_id=TOKEN_TO_ID[EOS],
        **kwargs,
    )
    return out[:, ids.shape[1] :].tolist()


def evaluate(
    model,
    tasks: list[ChainTask],
    samples: int = 64,
    seed: int = 0,
    batch: int = 32,
    log=print,
    modes: tuple[str, ...] = ("greedy", "sampled"),
) -> list:
    """Per task: greedy and/or sampled accuracy on `samples` held-out examples, and the KV lengths reached."""
    if not modes or set(modes) - {"greedy", "sampled"}:
        raise ValueError(f"modes must be a non-empty subset of greedy, sampled; got {modes}")
    eos = TOKEN_TO_ID[EOS]
    results = []
    for task in tasks:
        t0 = time.monotonic()
        examples = ExampleStream(task, seed=seed, split="heldout").take(samples)
        max_new = task.sequence_tokens() - task.prompt_tokens() + 8
        row = {"task": task.name, "pairs": task.pairs, "hops": task.max_hops, "samples": samples}
        for mode in modes:
            correct, kv = 0, []
            for i in range(0, samples, batch):
                chunk = examples[i : i + batch]
                prompts = [[TOKEN_TO_ID[BOS]] + encode_words(ex.prompt) for ex in chunk]
                outs = _generate(model, prompts, max_new, mode == "sampled", seed + i)
                for ex, prompt, gen in zip(chunk, prompts, outs, strict=True):
                    n = gen.index(eos) + 1 if eos in gen else len(gen)
                    text = " ".join(VOCAB[t] for t in gen[:n] if t != eos)
                    correct += chain_reward(text, ex.answer) > 0
                    kv.append(len(prompt) + n)
            row[f"{mode}_accuracy"] = correct / samples
            row[f"{mode}_kv_mean"] = round(sum(kv) / len(kv), 1)
            row[f"{mode}_kv_max"] = max(kv)
        row["seconds"] = round(time.monotonic() - t0, 1)
        last = modes[-1]
        accuracies = " ".join(f"{m} {row[m + '_accuracy']:.2f}" for m in modes)
        log(
            f"{task.name}: {accuracies} "
            f"kv mean {row[last + '_kv_mean']:.0f} max {row[last + '_kv_max']} ({row['seconds']}s)"
        )
        results.append(row)
    return results
