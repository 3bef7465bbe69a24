"""Held-out evaluation figures: avg@k and the unbiased pass@k estimator (Chen et al., 2021) per source.

For a prompt with n samples of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k): the chance
that at least one of k samples drawn without replacement from the n is correct, averaged over
prompts. avg@k is the mean reward over all n samples of every prompt (verl's mean@N).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `n` samples, `c` of them correct (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_reported(n: int) -> list[int]:
    """The k of pass@k reported for n samples per prompt: 1, the powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def summarize(groups: Iterable[Sequence[float]], correct_at: float = 1.0) -> dict:
    """{prompts, samples, avg@n, pass@k for k in ks_reported(n)} over groups of n rewards each."""
    groups = [list(g) for g in groups]
    if not groups:
        return {"prompts": 0, "samples": 0}
    n = min(len(g) for g in groups)
    out: dict = {"prompts": len(groups), "samples": sum(len(g) for g in groups)}
    out[f"avg@{n}"] = sum(sum(g) for g in groups) / out["samples"]
    for k in ks_reported(n):
        out[f"pass@{k}"] = sum(pass_at_k(len(g), sum(r >= correct_at for r in g), k) for g in groups) / len(groups)
    return out
