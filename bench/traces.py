"""Controller traces of several `sparrow up` runs side by side: p5 per bin against tau, budgets, accuracy.

    python -m bench.traces RUN_DIR [RUN_DIR ...] [--out traces.png] [--bins 1,2,3] [--last 20]

One column per run, read from its `metrics.jsonl` (one row per training step, as `sparrow up`
writes it): the exact p5 of alpha of each populated bin with tau and the [tau, tau + 0.05] band
the controller aims for, the budget the schedule gave each bin, and the step's accuracy. A
`sparrow report RUN_DIR` shows one run; this puts the runs of an experiment on one figure.

It also prints, as JSON, how each run ended: per bin, the last `--last` steps' readings (their
mean, the share at or above tau and the share inside the band), the final budgets, the schedule
versions published and the attended-KV fraction over those steps. The trainer's own record of
each step (RUN_DIR/trainer/steps.jsonl) adds, where the run has them, p1 per bin, the exact
series of a run with `[trainer] alpha = "exact"` (its p5 readings summarised as the bound's are,
`exact_*`), the accuracy, the predicted speedup and the step's time with and without the exact pass.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

TRAINER_STEPS = Path("trainer") / "steps.jsonl"  # the trainer's record of each step, in the run folder


def load_rows(run_dir: Path) -> list[dict]:
    """The per-step rows of a run; ValueError naming the file when there are none."""
    from report.history import HISTORY_FILE, read_history

    if not (Path(run_dir) / HISTORY_FILE).is_file():
        raise ValueError(f"{run_dir}: no {HISTORY_FILE} (not a `sparrow up` run folder)")
    rows = [r for r in read_history(Path(run_dir)) if "step" in r]
    if not rows:
        raise ValueError(f"{run_dir / HISTORY_FILE}: no steps recorded")
    trainer = _trainer_steps(Path(run_dir) / TRAINER_STEPS)
    for row in rows:
        step = trainer.get(row["step"])
        if step is None:
            continue
        bins = step.get("alpha_bins") or []
        row["p1"] = {str(b["bin"]): b["p1"] for b in bins if _finite(b.get("p1"))}
        exact = {str(b["bin"]): b["exact_p5"] for b in bins if _finite(b.get("exact_p5"))}
        if exact:
            row["p5_exact"] = exact
            row["p1_exact"] = {str(b["bin"]): b["exact_p1"] for b in bins if _finite(b.get("exact_p1"))}
        row["exact_seconds"] = step.get("exact_seconds")
    return rows


def _trainer_steps(path: Path) -> dict[int, dict]:
    """The trainer's step records by step (none when the file is missing; unreadable lines are skipped)."""
    out: dict[int, dict] = {}
    if not path.is_file():
        return out
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out[record["step"]] = record
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _mean(values: list) -> float | None:
    values = [v for v in values if _finite(v)]
    return round(sum(values) / len(values), 4) if values else None


def _readings(tail: list[dict], key: str, b: int, tau: float, band: float) -> dict:
    """The tail's readings of series `key` in bin `b`: count, mean, min, share >= tau, share in the band."""
    readings = [v for r in tail if _finite(v := (r.get(key) or {}).get(str(b)))]
    if not readings:
        return {}
    return {
        "readings": len(readings),
        "mean_p5": round(sum(readings) / len(readings), 4),
        "min_p5": round(min(readings), 4),
        "share_at_or_above_tau": round(sum(v >= tau for v in readings) / len(readings), 3),
        "share_in_band": round(sum(tau <= v <= tau + band for v in readings) / len(readings), 3),
    }


def populated_bins(rows: list[dict]) -> list[int]:
    """Bins with a p5 reading in any step, in order."""
    return sorted({int(b) for r in rows for b in (r.get("p5") or {})})


def budget_of(row: dict, b: int) -> int | None:
    """The budget the row's schedule gave bin `b` (None when the row has no schedule)."""
    budgets = row.get("schedule_budgets")
    return budgets[b] if budgets else None


def summarize(rows: list[dict], last: int = 20, band: float = 0.05, bins: list[int] | None = None) -> dict:
    """How a run ended: the last `last` steps' p5 readings per bin against tau and [tau, tau + band]."""
    tail = rows[-last:]
    tau = rows[-1].get("tau") or 0.86
    out: dict = {"steps": len(rows), "last_steps": len(tail), "tau": tau, "bins": {}}
    for b in bins or populated_bins(rows):
        bound = _readings(tail, "p5", b, tau, band)
        if not bound:
            continue
        entry = bound | {"final_budget": budget_of(rows[-1], b)}
        if (p1 := _mean([(r.get("p1") or {}).get(str(b)) for r in tail])) is not None:
            entry["mean_p1"] = p1
        # The exact series (a run with [trainer] alpha = "exact"), summarised as the bound's is.
        entry |= {f"exact_{k}": v for k, v in _readings(tail, "p5_exact", b, tau, band).items()}
        if (p1 := _mean([(r.get("p1_exact") or {}).get(str(b)) for r in tail])) is not None:
            entry["exact_mean_p1"] = p1
        out["bins"][str(b)] = entry
    out["final_budgets"] = rows[-1].get("schedule_budgets")
    out["schedule_version"] = rows[-1].get("schedule_version")
    out["predicted_speedup"] = rows[-1].get("predicted_speedup")
    out["attended_kv_fraction"] = _mean([r.get("attended_kv_fraction") for r in tail])
    out["accuracy_mean"] = _mean([r.get("accuracy") for r in rows])  # every step's fresh prompts
    out["accuracy_last"] = _mean([r.get("accuracy") for r in tail])
    # The step's time with and without the exact pass, over every step (the pass's own time is timed apart).
    timed = [(r["step_seconds"], r.get("exact_seconds") or 0.0) for r in rows if _finite(r.get("step_seconds"))]
    if timed:
        step_s, exact_s = sum(t for t, _ in timed), sum(e for _, e in timed)
        out["step_seconds_mean"] = round(step_s / len(timed), 3)
        out["exact_seconds_mean"] = round(exact_s / len(timed), 3)
        out["step_over_step_without_exact"] = round(step_s / (step_s - exact_s), 3) if step_s > exact_s else None
    return out


def plot(runs: dict[str, list[dict]], out: str | Path, bins: list[int] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(runs), figsize=(4.2 * len(runs), 8), sharex="col", squeeze=False)
    for col, (name, rows) in enumerate(runs.items()):
        tau = rows[-1].get("tau") or 0.86
        shown = bins or populated_bins(rows)
        steps = [r["step"] for r in rows]
        ax = axes[0][col]
        ax.axhspan(tau, tau + 0.05, color="green", alpha=0.12, label="[tau, tau + 0.05]")
        ax.axhline(tau, color="red", linestyle="--", linewidth=1)
        for b in shown:
            line = ax.plot(steps, [(r.get("p5") or {}).get(str(b)) for r in rows], marker=".", label=f"bin {b}")
            if any("p5_exact" in r for r in rows):  # the exact series of the same bin, dashed
                exact = [(r.get("p5_exact") or {}).get(str(b)) for r in rows]
                ax.plot(steps, exact, linestyle="--", color=line[0].get_color(), label=f"bin {b} exact")
        ax.set_title(name)
        ax.set_ylim(-0.03, 1.03)
        if col == 0:
            ax.set_ylabel("p5 of alpha (top-k bound; exact dashed)")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        for b in shown:
            ax.step(
                steps,
                [budget_of(r, b) for r in rows],
                where="post",
                label=f"bin {b}",
            )
        if col == 0:
            ax.set_ylabel("KV budget (tokens)")
        ax.legend(fontsize=7)
        ax = axes[2][col]
        ax.plot(steps, [r.get("accuracy") for r in rows], marker=".", color="black")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("step")
        if col == 0:
            ax.set_ylabel("accuracy (step's prompts)")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.traces", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="the figure (PNG); without it only the JSON summary")
    p.add_argument("--bins", default=None, help="comma-separated bins to show (default: every populated one)")
    p.add_argument("--last", type=int, default=20, help="steps at the end of each run that the summary covers")
    args = p.parse_args(argv)
    try:
        bins = [int(b) for b in args.bins.split(",")] if args.bins else None
        runs = {Path(d).name: load_rows(Path(d)) for d in args.run_dirs}
    except ValueError as exc:
        print(f"bench.traces: error: {exc}", file=sys.stderr)
        return 2
    if args.last < 1:
        print(f"bench.traces: error: --last must be at least 1, got {args.last}", file=sys.stderr)
        return 2
    print(json.dumps({name: summarize(rows, args.last, bins=bins) for name, rows in runs.items()}, indent=1))
    if args.out:
        plot(runs, args.out, bins)
    return 0


if __name__ == "__main__":
    sys.exit(main())
