"""Where each step's time went, in the report: a stacked bar per step of the trainer's phases, and a table.

The figures are the history rows' `timing/<phase>` seconds (the trainer's split of each step's wall time,
services/trainer/service.py), in the order of `sparrow.metrics_contract.TRAINER_PHASES` with `other`
last; the generators' split over the same windows (`generator_timing`) is tabled beside the trainer's.
Under `--compare` the dense and the sparse runs' bars stand side by side on one scale.
"""

from __future__ import annotations

import math
from pathlib import Path

from sparrow import metrics_contract as mc
from sparrow.timing import OTHER

PHASES = (*mc.TRAINER_PHASES, OTHER)
GENERATOR_PHASES = (*mc.GENERATOR_PHASES, OTHER)
PLOT = "time_split"
TITLE = "Where each step's time went (trainer)"


def step_split(row: dict) -> dict[str, float] | None:
    """The row's trainer phases in seconds (PHASES order, absent ones 0), or None for a row without a split."""
    split = {p: row.get(mc.TIMING_PREFIX + p) for p in PHASES}
    if all(v is None for v in split.values()):
        return None  # a history from before the split, or a trainer that wrote none
    return {p: float(v) if _finite(v) else 0.0 for p, v in split.items()}


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def split_figures(rows: list[dict]) -> dict[str, list[list]]:
    """{phase: [[step, seconds], ...]} over the rows that have a split."""
    out: dict[str, list[list]] = {p: [] for p in PHASES}
    for r in rows:
        split = step_split(r)
        if split is not None:
            for p in PHASES:
                out[p].append([r["step"], split[p]])
    return out


def draw(ax, rows: list[dict], title: str) -> None:
    """A stacked bar per step on `ax` (an empty note when no row has a split)."""
    import matplotlib

    figs = split_figures(rows)
    steps = [s for s, _ in figs[PHASES[0]]]
    bottom = [0.0] * len(steps)
    colours = matplotlib.colormaps["tab10"]
    for i, phase in enumerate(PHASES):
        values = [v for _, v in figs[phase]]
        if steps and any(values):
            ax.bar(steps, values, bottom=bottom, label=phase, color=colours(i % 10), width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if not steps:
        ax.text(0.5, 0.5, "no time split in this history", ha="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    if steps:
        ax.legend(fontsize=7, ncol=3)


def plot(rows: list[dict], out: Path) -> None:
    """The run's stacked bars as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    draw(ax, rows, TITLE)
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)


def plot_side_by_side(runs: dict[str, list[dict]], out: Path) -> None:
    """Each run's stacked bars (e.g. dense and sparse) side by side, on one seconds scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], runs.items(), strict=True):
        draw(ax, rows, f"{name}: time per step")
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)


def mean_split(rows: list[dict]) -> dict[str, float] | None:
    """Mean seconds per phase over the rows with a split (None: none has one)."""
    splits = [s for r in rows if (s := step_split(r)) is not None]
    if not splits:
        return None
    return {p: sum(s[p] for s in splits) / len(splits) for p in PHASES}


def section(rows: list[dict]) -> list[str]:
    """The report's Markdown: the plot and a table of each step's seconds per phase (and the generators')."""
    md = ["", f"## {TITLE}", "", f"![{TITLE}]({PLOT}.png)", ""]
    if mean_split(rows) is None:
        return [*md, "No step of this history has a time split.", ""]
    md += [
        "Seconds per phase; a step's phases sum to its wall time, from the end of the step before "
        "(docs/trainer.md says what each phase holds).",
        "",
        "| step | wall s | " + " | ".join(PHASES) + " |",
        "|---|---|" + "---|" * len(PHASES),
    ]
    for r in rows:
        split = step_split(r)
        if split is not None:
            wall = r.get("step_wall_seconds")
            wall = wall if _finite(wall) else sum(split.values())
            md.append(f"| {r['step']} | {wall:.3f} | " + " | ".join(f"{split[p]:.3f}" for p in PHASES) + " |")
    gen = [r for r in rows if isinstance(r.get("generator_timing"), dict) and r["generator_timing"]]
    if gen:
        md += [
            "",
            "The generators' loop over the same windows (seconds, summed over generators):",
            "",
            "| step | " + " | ".join(GENERATOR_PHASES) + " |",
            "|---|" + "---|" * len(GENERATOR_PHASES),
        ]
        for r in gen:
            t = r["generator_timing"]
            cells = [f"{t[p]:.3f}" if _finite(t.get(p)) else "-" for p in GENERATOR_PHASES]
            md.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return [*md, ""]


def compare_table(runs: dict[str, list[dict]]) -> list[str]:
    """Mean seconds per phase of each run, a column per run (dense, sparse), for the comparison's report."""
    means = {name: mean_split(rows) for name, rows in runs.items()}
    if all(m is None for m in means.values()):
        return []
    names = list(runs)
    md = [
        "| mean seconds per step | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for p in (*PHASES, "wall"):
        cells = []
        for name in names:
            m = means[name]
            cells.append("-" if m is None else f"{(sum(m.values()) if p == 'wall' else m[p]):.3f}")
        md.append(f"| {p} | " + " | ".join(cells) + " |")
    return md
