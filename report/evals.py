"""The run's evaluation rounds (trainer/evals.jsonl) in the summary and the report: a table and a plot.

evals.jsonl holds one line per round and mode (`dense`, `schedule`); a line from a trainer from before
eval.modes has `dense` only and reads as its mode.
"""

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


def mode_of(rnd: dict) -> str:
    """The round line's mode: `dense` or `schedule`."""
    return rnd.get("mode") or ("dense" if rnd.get("dense", True) else "schedule")


def eval_section(rounds: list[dict], out: Path) -> list[str]:
    """Markdown lines of the report's evaluation section; writes eval.png beside it."""
    if not rounds:
        return []
    md = ["", "## Held-out evaluation", ""]
    md.append("| round | step | policy | mode | source | prompts | avg@k | pass@1 | pass@k | dense - scheduled avg@k |")
    md.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rounds:
        head = f"| {r['round']} | {r['step']} | v{r['policy_version']} | {mode_of(r)}"
        for src, fig in r.get("sources", {}).items():
            avg, top = _figure(fig, "avg@"), _figure(fig, "pass@")
            gap = _figure(r.get("dense_gap", {}).get(src, {}), "avg@")
            md.append(
                f"{head} | {src} | {fig.get('prompts', 0)} | {avg[1]:.3f} ({avg[0]}) | "
                f"{fig.get('pass@1', float('nan')):.3f} | {top[1]:.3f} ({top[0]}) | "
                f"{f'{gap[1]:+.3f}' if gap else '-'} |"
                if avg and top
                else f"{head} | {src} | 0 | - | - | - | - |"
            )
    _plot(rounds, out / "eval.png")
    return [*md, "", "![Held-out evaluation](eval.png)"]


def _plot(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    sources = sorted({s for r in rounds for s in r.get("sources", {})})
    modes = [m for m in ("dense", "schedule") if any(mode_of(r) == m for r in rounds)]
    for src in sources:
        for mode in modes:
            # Filled markers dense, hollow under the schedule; solid avg@k, dashed pass@k.
            face = {} if mode == "dense" else {"markerfacecolor": "none"}
            for prefix, style in (("avg@", "-o"), ("pass@", "--s")):
                points = [
                    (r["step"], _figure(r["sources"][src], prefix))
                    for r in rounds
                    if src in r.get("sources", {}) and mode_of(r) == mode
                ]
                points = [(step, f) for step, f in points if f is not None]
                if points:
                    label = f"{src} {points[-1][1][0]}" + (f" {mode}" if len(modes) > 1 else "")
                    ax.plot([p[0] for p in points], [p[1][1] for p in points], style, label=label, **face)
    ax.set_xlabel("training steps before the round")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Held-out evaluation" + (" (dense and under the schedule)" if len(modes) > 1 else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
