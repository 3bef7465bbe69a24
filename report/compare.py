"""The report of a `sparrow up --compare` folder: both runs' figures side by side, the plots, compare.json.

    RUN_DIR/dense/    a whole run folder (dense rollouts, no controller)
    RUN_DIR/sparse/   a whole run folder (the schedule, the controller when on): sparse rollouts, or
                      speculative ones when the config says so (the report names it: `second_mode`)
    RUN_DIR/report.md, RUN_DIR/compare_*.png, RUN_DIR/compare.json
                      (compare_time_split.png: each run's trainer time per step, stacked by phase, side by side)

Rollout throughput is tokens per second of engine step time (the launcher's history), measured in each run
on the same machine with the same engine, prompts (same task seed) and sampling, so their ratio is
the measured rollout speedup of sparse over dense. Accuracy is the training accuracy per step,
on prompts drawn fresh from the task at every step (never seen before by the policy).
"""

from __future__ import annotations

import json
from pathlib import Path

from report.evals import read_evals
from report.history import HISTORY_FILE, read_history
from report.run_report import SUMMARY_FILE, ReportError, build_report, headline, measured, with_gaps
from report.time_split import compare_table, plot_side_by_side

COMPARE_FILE = "compare.json"
MODES = ("dense", "sparse")


def compare_figures(root: Path) -> dict:
    """Headline figures of both runs and the measured speedup."""
    heads = {}
    for mode in MODES:
        rows = read_history(root / mode)
        if not rows:
            raise ReportError(f"{root / mode}: the metrics history holds no steps")
        heads[mode] = headline(rows)
        heads[mode]["heldout"] = [_heldout(r) for r in read_evals(root / mode / "trainer")]
    dense, sparse = heads["dense"]["mean_rollout_tokens_per_s"], heads["sparse"]["mean_rollout_tokens_per_s"]
    steady = heads["dense"]["steady_step_seconds"] and heads["sparse"]["steady_step_seconds"]
    key = "steady_step_seconds" if steady else "mean_step_seconds"
    dense_step, sparse_step = heads["dense"][key], heads["sparse"][key]
    return {
        "dense": heads["dense"],
        "sparse": heads["sparse"],
        "second_mode": second_mode(root),
        "measured_rollout_speedup": sparse / dense if dense and sparse else None,
        # dense step time over sparse step time: > 1 when sparse rollouts make the RL step faster
        "measured_step_speedup": dense_step / sparse_step if dense_step and sparse_step else None,
        "step_speedup_of": "steps after the first" if steady else "all steps",
        "accuracy_difference": _diff(heads["sparse"]["mean_accuracy"], heads["dense"]["mean_accuracy"]),
    }


def second_mode(root: Path) -> str:
    """How the second run (RUN_DIR/sparse/) decoded: sparse, or speculative (its summary, else "sparse")."""
    try:
        return str(json.loads((root / "sparse" / SUMMARY_FILE).read_text())["run"]["mode"])
    except (OSError, ValueError, KeyError, TypeError):
        return "sparse"


def _heldout(round_: dict) -> dict:
    """One evaluation round in brief: when, how decoded, and each source's figures (avg@k, pass@k, ...)."""
    keep = ("round", "step", "mode", "k", "prompts", "complete", "sources")
    return {k: round_.get(k) for k in keep}


def _diff(a, b):
    return a - b if a is not None and b is not None else None


def build_compare_report(root: Path) -> tuple[Path, dict]:
    """Rebuild both runs' reports and the comparison; (the comparison's Markdown file, its figures)."""
    for mode in MODES:
        build_report(root / mode)
    figs = compare_figures(root)
    (root / COMPARE_FILE).write_text(json.dumps(figs, indent=1) + "\n")
    _plot(root, "rollout_tokens_per_s", "Rollout tokens/s (engine time)", root / "compare_tokens_per_s.png")
    _plot(root, "accuracy", "Accuracy per step", root / "compare_accuracy.png")
    runs = {mode: read_history(root / mode) for mode in MODES}
    plot_side_by_side(runs, root / "compare_time_split.png")
    d, s = figs["dense"], figs["sparse"]

    def f(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    speedup, other = figs["measured_rollout_speedup"], figs["second_mode"]
    md = [
        f"# Sparrow: dense vs {other} rollouts",
        "",
        f"Measured rollout speedup of {other} over dense: **{f(speedup, '.2f')}x** "
        f"(predicted by the cost model: {f(s['final_predicted_speedup'], '.2f')}x); "
        f"RL step time, dense over {other}: **{f(figs['measured_step_speedup'], '.2f')}x** "
        f"({figs['step_speedup_of']}).",
        "",
        f"| figure | dense | {other} |",
        "|---|---|---|",
        f"| mean rollout tokens/s (engine time) | {f(d['mean_rollout_tokens_per_s'], '.1f')} "
        f"| {f(s['mean_rollout_tokens_per_s'], '.1f')} |",
        f"| mean RL step seconds (all steps) | {f(d['mean_step_seconds'], '.1f')} "
        f"| {f(s['mean_step_seconds'], '.1f')} |",
        f"| mean RL step seconds (after the first) | {f(d['steady_step_seconds'], '.1f')} "
        f"| {f(s['steady_step_seconds'], '.1f')} |",
        f"| mean accuracy | {f(d['mean_accuracy'])} | {f(s['mean_accuracy'])} |",
        f"| final accuracy | {f(d['final_accuracy'])} | {f(s['final_accuracy'])} |",
        f"| mean reward | {f(d['mean_reward'])} | {f(s['mean_reward'])} |",
        f"| min p5 over bins, last step | {f(d['final_min_p5'])} | {f(s['final_min_p5'])} |",
        f"| max TIS clip fraction of a step | {f(d['max_tis_clip_fraction'], '.4f')} "
        f"| {f(s['max_tis_clip_fraction'], '.4f')} |",
        f"| max abs kl_rollout_dense of a step | {f(d['max_abs_kl_rollout_dense'], '.2e')} "
        f"| {f(s['max_abs_kl_rollout_dense'], '.2e')} |",
        f"| steps | {d['steps_done']} | {s['steps_done']} |",
        "",
        *_heldout_table(d["heldout"], s["heldout"], other),
        "![rollout tokens/s](compare_tokens_per_s.png)",
        "",
        "![accuracy](compare_accuracy.png)",
        "",
        "## Where each step's time went (trainer)",
        "",
        "![time per step, dense and sparse](compare_time_split.png)",
        "",
        *compare_table(runs),
        "",
        f"Each run's own report: [dense](dense/report/report.md), [{other}](sparse/report/report.md).",
        "",
    ]
    path = root / "report.md"
    path.write_text("\n".join(md))
    return path, figs


def _heldout_table(dense: list[dict], sparse: list[dict], other: str) -> list[str]:
    """Held-out rounds side by side, by round number: each source's first avg@ figure (none: no lines).

    `other`: how the second run decoded (sparse or speculative), its column's name."""
    if not dense and not sparse:
        return []

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        parts = []
        for src, figures in (r.get("sources") or {}).items():
            avg = next(((k, v) for k, v in figures.items() if k.startswith("avg@")), None)
            if avg is not None:
                parts.append(f"{src} {avg[0]} {avg[1]:.3f}")
        return ", ".join(parts) or "-"

    by = {m: {(r["round"], r["mode"]): r for r in rs} for m, rs in (("dense", dense), ("sparse", sparse))}
    lines = [f"| held-out round (at step, decoded) | dense run | {other} run |", "|---|---|---|"]
    for key in sorted(set(by["dense"]) | set(by["sparse"]), key=lambda k: (k[0], str(k[1]))):
        step = (by["dense"].get(key) or by["sparse"].get(key))["step"]
        lines.append(f"| {key[0]} ({step}, {key[1]}) | {cell(by['dense'].get(key))} | {cell(by['sparse'].get(key))} |")
    return [*lines, ""]


def build_any_report(run_dir: Path) -> tuple[Path, dict]:
    """Rebuild a run's report, or a comparison's (a folder holding dense/ and sparse/ runs); (path, figures)."""
    run_dir = Path(run_dir)
    if (run_dir / "dense" / HISTORY_FILE).exists() and (run_dir / "sparse" / HISTORY_FILE).exists():
        return build_compare_report(run_dir)
    path = build_report(run_dir)
    return path, headline(read_history(run_dir))


def _plot(root: Path, key: str, title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for mode in MODES:
        rows = read_history(root / mode)
        points = [(r["step"], v) for r in rows if (v := measured(r, key)) is not None]
        if points:
            ax.plot(*with_gaps(points, [r["step"] for r in rows]), marker="o", ms=3, label=mode)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata={"Software": None})
    plt.close(fig)
