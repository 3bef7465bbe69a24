"""The run report: Markdown with PNG plots, built from the metrics history alone (`sparrow report RUN_DIR`).

    RUN_DIR/report/report.md        headline figures, the plots, one table row per step
    RUN_DIR/report/*.png            reward and accuracy, p5 per bin vs tau, schedule, tokens/s, where each
                                    step's time went (a stacked bar per step, report/time_split.py)
    RUN_DIR/report/figures.json     the exact series each plot draws

Every number in the report is read from RUN_DIR/metrics.jsonl (and RUN_DIR/summary.json for the
outcome and the work ledger), so rebuilding it gives the same report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from report.evals import eval_section, read_evals
from report.history import read_history
from report.time_split import PLOT as TIME_SPLIT
from report.time_split import plot as plot_time_split
from report.time_split import section as time_split_section
from report.time_split import split_figures

REPORT_DIR = "report"
SUMMARY_FILE = "summary.json"


class ReportError(ValueError):
    """No report can be built (no such run folder, or no steps in its history)."""


def headline(rows: list[dict]) -> dict:
    """The run's headline figures from its history rows."""
    last = rows[-1] if rows else {}
    rates = [v for r in rows if (v := measured(r, "rollout_tokens_per_s")) is not None]
    p5s = list(last.get("p5", {}).values())
    walls = [r["step_wall_seconds"] for r in rows if isinstance(r.get("step_wall_seconds"), int | float)]
    return {
        "steps_done": len(rows),
        "final_reward": last.get("reward"),
        "final_accuracy": last.get("accuracy"),
        "mean_reward": _mean([r["reward"] for r in rows if r.get("reward") is not None]),
        "mean_accuracy": _mean([r["accuracy"] for r in rows if r.get("accuracy") is not None]),
        "mean_rollout_tokens_per_s": _mean(rates),
        # an RL step's wall time, end of one step to the end of the next; the first also waits for the
        # first rollouts (nothing overlaps it), so the steady figure leaves it out
        "mean_step_seconds": _mean(walls),
        "steady_step_seconds": _mean(walls[1:]) if len(walls) > 1 else None,
        "final_min_p5": min(p5s) if p5s else None,
        "final_predicted_speedup": last.get("predicted_speedup"),
        "final_policy_version": last.get("published_version"),
        "final_schedule_version": last.get("schedule_version"),
        "tau": last.get("tau"),
        # the mismatch between rollout and dense policy the trainer saw: numerical noise when lossless
        "max_tis_clip_fraction": _max([r.get("tis_clip_fraction") for r in rows]),
        "max_abs_kl_rollout_dense": _max(
            [abs(v) if isinstance(v, int | float) else None for v in (r.get("kl_rollout_dense") for r in rows)]
        ),  # fmt: skip
    }


def _max(values: list) -> float | None:
    finite = [v for v in values if isinstance(v, int | float) and v == v]
    return max(finite) if finite else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def figures(rows: list[dict]) -> dict:
    """The series of every plot: {plot: {series: [[step, value], ...]}} (None values left out)."""
    steps = [r["step"] for r in rows]

    def series(key: str) -> list[list]:
        return [[s, v] for s, r in zip(steps, rows, strict=True) if (v := measured(r, key)) is not None]

    bins = sorted({b for r in rows for b in r.get("p5", {})}, key=int)
    budget_bins = max((len(r["schedule_budgets"]) for r in rows if r.get("schedule_budgets")), default=0)
    return {
        "reward_accuracy": {"reward": series("reward"), "accuracy": series("accuracy")},
        "p5": {f"bin {b}": [[r["step"], r["p5"][b]] for r in rows if b in r.get("p5", {})] for b in bins},
        "schedule": {
            f"bin {i}": [[r["step"], r["schedule_budgets"][i]] for r in rows if r.get("schedule_budgets")]
            for i in range(budget_bins)
        },
        "tokens_per_s": {
            "rollout (engine time)": series("rollout_tokens_per_s"),
            "wall": series("tokens_per_s"),
        },
        TIME_SPLIT: split_figures(rows),
    }


PLOTS = {
    "reward_accuracy": ("Reward and accuracy per step", "step", "mean reward / accuracy"),
    "p5": ("p5 of alpha per length bin (exact, trainer)", "step", "p5 of alpha"),
    "schedule": ("KV budget per length bin", "step", "kept KV tokens"),
    "tokens_per_s": ("Rollout throughput", "step", "generated tokens / s"),
}


def measured(row: dict, key: str) -> float | None:
    """row[key], or None where the step has no measurement of it (older histories wrote a rate of 0 then)."""
    if key in RATES and row.get("generated_tokens") == 0:
        return None
    return row.get(key)


RATES = ("tokens_per_s", "rollout_tokens_per_s")


def with_gaps(points: list[list], steps: list[int]) -> tuple[list, list]:
    """(xs, ys) over every step, NaN where `points` has none: the line breaks there instead of joining across."""
    known = dict((s, v) for s, v in points)
    return list(steps), [known.get(s, math.nan) for s in steps]


def _plot(name: str, data: dict, out: Path, tau: float | None, steps: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title, xlabel, ylabel = PLOTS[name]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, points in data.items():
        if points:
            if name == "schedule":
                xs, ys = zip(*points, strict=True)
                ax.step(xs, ys, label=label, where="post")
            else:
                ax.plot(*with_gaps(points, steps), label=label, marker="o", ms=3)
    if name == "p5" and tau is not None:
        ax.axhline(tau, color="red", linestyle="--", linewidth=1, label=f"tau {tau:g}")
    if not any(data.values()):
        ax.text(0.5, 0.5, "dense rollouts: no schedule" if name == "schedule" else "no data", ha="center",
                transform=ax.transAxes)  # fmt: skip
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(data.values()) or name == "p5":
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)


def _fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def step_table(rows: list[dict]) -> list[str]:
    """The per-step Markdown table."""
    lines = [
        "| step | reward | accuracy | response tokens | min p5 | p5 per bin | policy | schedule | rollout tok/s "
        "| wall tok/s | predicted speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p5 = r.get("p5", {})
        per_bin = " ".join(f"{b}:{p5[b]:.3f}" for b in sorted(p5, key=int)) or "-"
        schedule = f"v{r['schedule_version']}" if r.get("schedule_budgets") else "dense"
        lines.append(
            f"| {r['step']} | {_fmt(r.get('reward'))} | {_fmt(r.get('accuracy'))} "
            f"| {_fmt(r.get('response_length'), '.1f')} "
            f"| {_fmt(min(p5.values()) if p5 else None)} | {per_bin} | v{r.get('published_version')} | {schedule} "
            f"| {_fmt(measured(r, 'rollout_tokens_per_s'), '.1f')} | {_fmt(measured(r, 'tokens_per_s'), '.1f')} "
            f"| {_fmt(r.get('predicted_speedup'), '.2f')} |"
        )
    return lines


def build_report(run_dir: Path) -> Path:
    """Write RUN_DIR/report/ from the run's history; returns the Markdown file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run folder {run_dir}: no such folder")
    rows = read_history(run_dir)
    if not rows:
        raise ReportError(f"{run_dir}: the metrics history (metrics.jsonl) holds no steps")
    summary = _read_json(run_dir / SUMMARY_FILE)
    out = run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    figs = figures(rows)
    tau = rows[-1].get("tau")
    for name in PLOTS:
        _plot(name, figs[name], out / f"{name}.png", tau, [r["step"] for r in rows])
    plot_time_split(rows, out / f"{TIME_SPLIT}.png")
    (out / "figures.json").write_text(json.dumps(figs, indent=1) + "\n")
    head = headline(rows)
    run = summary.get("run", {})
    work = summary.get("work", {})
    md = [
        "# Sparrow run report",
        "",
        f"Run folder `{run_dir.name}`: {run.get('model', '?')} model, {run.get('engine', '?')} engine, "
        f"{run.get('generators', '?')} generator(s), {run.get('trainer_procs', 1)} trainer process(es), "
        f"{run.get('mode', '?')} rollouts, "
        f"controller {'on' if run.get('controller') else 'off'}; outcome: {summary.get('outcome', 'unknown')}.",
        "",
        "## Headline",
        "",
        "| figure | value |",
        "|---|---|",
        f"| steps done | {head['steps_done']} |",
        f"| final reward | {_fmt(head['final_reward'])} |",
        f"| final accuracy | {_fmt(head['final_accuracy'])} |",
        f"| mean reward | {_fmt(head['mean_reward'])} |",
        f"| mean rollout tokens/s (engine time) | {_fmt(head['mean_rollout_tokens_per_s'], '.1f')} |",
        f"| min p5 over bins, last step (tau {_fmt(head['tau'], 'g')}) | {_fmt(head['final_min_p5'])} |",
        f"| predicted rollout speedup, last schedule | {_fmt(head['final_predicted_speedup'], '.2f')} |",
        f"| policy version published last | {head['final_policy_version']} |",
    ]
    if work:
        md += [
            f"| prompt groups enqueued / trained / dropped stale / waiting | {work.get('groups_enqueued')} / "
            f"{work.get('groups_trained')} / {work.get('groups_dropped_stale')} / {work.get('groups_waiting')} |",
            f"| groups lost / trained twice | {len(work.get('lost', []))} / {len(work.get('trained_twice', []))} |",
        ]
    for name, (title, _, _) in PLOTS.items():
        md += ["", f"## {title}", "", f"![{title}]({name}.png)"]
    md += time_split_section(rows)
    md += eval_section(read_evals(run_dir / "trainer"), out)
    md += ["", "## Steps", "", *step_table(rows), ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
