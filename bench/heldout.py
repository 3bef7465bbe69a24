"""Held-out accuracy over a `sparrow up` run: the learning curve of the policy the trainer published.

The trainer publishes policy version v after step v - 1 (v1 is the starting model) under
`trainer/policy/`; a run keeps the newest `[trainer.weights] keep` of them, so a run meant for a
curve sets `keep` above its step count. Every `every`-th kept version, and the last, is loaded and
sampled (temperature 1.0, as the rollouts are) on the same held-out prompts of the chain task
(the task's held-out split, never trained on), with dense attention: what is measured is the
policy, whichever rollouts trained it. The same prompts and sampling seed for every version make
versions comparable with less noise than the per-step training accuracy.

A run folder of `sparrow up --compare` (with `dense/` and `sparse/` inside) gives both curves.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

VERSION_DIR = re.compile(r"^v(\d{8})$")


class HeldoutError(ValueError):
    """A run folder without published policies, or a bad setting; the message says which."""


def runs_in(path: Path) -> dict[str, Path]:
    """The runs in a folder: {"dense": ..., "sparse": ...} for a --compare folder, else {name: folder}."""
    path = Path(path)
    arms = {arm: path / arm for arm in ("dense", "sparse") if (path / arm / "trainer" / "policy").is_dir()}
    if arms:
        return arms
    if (path / "trainer" / "policy").is_dir():
        return {path.name: path}
    raise HeldoutError(f"{path}: no trainer/policy folder (not a `sparrow up` run folder)")


def policy_versions(run_dir: Path) -> dict[int, Path]:
    """Published policy folders by version, oldest first."""
    found = {}
    for child in (Path(run_dir) / "trainer" / "policy").iterdir():
        m = VERSION_DIR.match(child.name)
        if m and child.is_dir() and (child / "config.json").is_file():
            found[int(m.group(1))] = child
    if not found:
        raise HeldoutError(f"{run_dir}: no published policy versions under trainer/policy")
    return dict(sorted(found.items()))


def pick(versions: Sequence[int], every: int) -> list[int]:
    """Every `every`-th version from the first kept one, and the last."""
    if every < 1:
        raise HeldoutError(f"every must be >= 1, got {every}")
    first = versions[0]
    chosen = [v for v in versions if (v - first) % every == 0]
    if chosen[-1] != versions[-1]:
        chosen.append(versions[-1])
    return chosen


def standard_error(p: float, n: int) -> float:
    """Binomial standard error of an accuracy measured on n samples."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def heldout_curve(
    folders: Sequence[Path],
    difficulties: Sequence[tuple[int, int]],
    every: int = 5,
    samples: int = 64,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Sampled held-out accuracy per kept policy version of every run in `folders`."""
    import torch

    from offline.evaluate import evaluate
    from sparrow.tasks import ChainTask
    from trainer.model_io import load_model

    if samples < 1:
        raise HeldoutError(f"samples must be >= 1, got {samples}")
    tasks = [ChainTask(pairs, hops, min_hops=hops) for pairs, hops in difficulties]
    runs: dict[str, Path] = {}
    for folder in folders:
        for name, path in runs_in(folder).items():
            runs[name if name not in runs else f"{folder.name}/{name}"] = path
    out: dict[str, Any] = {
        "difficulties": [t.name for t in tasks],
        "samples": samples,
        "seed": seed,
        "sampling": "temperature 1.0, dense attention, held-out split",
        "runs": {},
    }
    for name, path in runs.items():
        versions = policy_versions(path)
        points = []
        for v in pick(list(versions), every):
            t0 = time.monotonic()
            model = load_model(versions[v])
            with torch.no_grad():
                rows = evaluate(model, tasks, samples=samples, seed=seed, log=lambda *_: None, modes=("sampled",))
            point = {"version": v, "after_step": v - 1, "accuracy": {}, "stderr": {}}
            for task, row in zip(tasks, rows, strict=True):
                acc = row["sampled_accuracy"]
                point["accuracy"][task.name] = acc
                point["stderr"][task.name] = round(standard_error(acc, samples), 4)
            point["seconds"] = round(time.monotonic() - t0, 1)
            log(f"{name} v{v} (after step {v - 1}): " + ", ".join(f"{k} {a:.3f}" for k, a in point["accuracy"].items()))
            points.append(point)
        first, last = points[0], points[-1]
        out["runs"][name] = {
            "path": str(path),
            "points": points,
            "change": {k: round(last["accuracy"][k] - first["accuracy"][k], 4) for k in first["accuracy"]},
        }
    return out


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Held-out accuracy per policy version, one line per run and difficulty, +-1 standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in result["runs"].items():
        for task in result["difficulties"]:
            steps = [p["after_step"] for p in run["points"]]
            acc = [p["accuracy"][task] for p in run["points"]]
            err = [p["stderr"][task] for p in run["points"]]
            label = name if len(result["difficulties"]) == 1 else f"{name} {task}"
            ax.errorbar(steps, acc, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xlabel("training step (0 = starting model)")
    ax.set_ylabel(f"held-out accuracy, sampled ({result['samples']} prompts)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
