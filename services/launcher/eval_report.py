"""The run's evaluation rounds (trainer/evals.jsonl) in the summary and the report: a table and a plot."""

from __future__ import annotations

import json
from pathlib import Path

EVALS_FILE = "evals.jsonl"  # written by the trainer in its run folder (services/trainer/evaluation.py)


def read_evals(trainer_dir: Path) -> list[dict]:
    """Every evaluation round the trainer reported, in order ([] when none ran)."""
    path = Path(trainer_dir) / EVALS_FILE
    if not path.is_file():
        return []
    rounds = []
    for line in path.read_text().splitlines():
        try:
            rounds.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a trainer killed mid-write
    return rounds


def _figure(figures: dict, prefix: str) -> tuple[str, float] | None:
    keys = [k for k in figures if k.startswith(prefix)]
    if not keys:
        return None
    key = max(keys, key=lambda k: int(k.split("@")[1]))
    return key, figures[key]


def eval_section(rounds: list[dict], out: Path) -> list[str]:
    """Markdown lines of the report's evaluation section; writes eval.png beside it."""
    if not rounds:
        return []
    md = ["", "## Held-out evaluation", "", "| round | step | policy | source | prompts | avg@k | pass@1 | pass@k |"]
    md.append("|---|---|---|---|---|---|---|---|")
    for r in rounds:
        for src, fig in r.get("sources", {}).items():
            avg, top = _figure(fig, "avg@"), _figure(fig, "pass@")
            md.append(
                f"| {r['round']} | {r['step']} | v{r['policy_version']} | {src} | {fig.get('prompts', 0)} | "
                f"{avg[1]:.3f} ({avg[0]}) | {fig.get('pass@1', float('nan')):.3f} | {top[1]:.3f} ({top[0]}) |"
                if avg and top
                else f"| {r['round']} | {r['step']} | v{r['policy_version']} | {src} | 0 | - | - | - |"
            )
    _plot(rounds, out / "eval.png")
    return [*md, "", "![Held-out evaluation](eval.png)"]


def _plot(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    sources = sorted({s for r in rounds for s in r.get("sources", {})})
    for src in sources:
        for prefix, style in (("avg@", "-o"), ("pass@", "--s")):
            points = [(r["step"], _figure(r["sources"][src], prefix)) for r in rounds if src in r.get("sources", {})]
            points = [(step, f) for step, f in points if f is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1][1] for p in points], style, label=f"{src} {points[-1][1][0]}")
    ax.set_xlabel("training steps before the round")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Held-out evaluation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
