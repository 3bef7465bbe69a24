"""Offline calibration of a sparsity schedule, the paper's way (its Figure 3, first row).

For each fixed budget: generate with block-sparse decode on a prompt set, score every generated token
densely (teacher-forced, same tokens, same temperature), and compute alpha per token, exactly from
the two full distributions and as the top-20 lower bound. Per KV-length bin, the p5 and mean of
exact alpha decide: each bin takes the smallest budget whose p5 >= tau, and a running maximum makes
the schedule non-decreasing (the cheapest one, if p5 rises with the budget). Bins with fewer than
`min_bin_tokens` tokens are reported but do not constrain the fit. The fitted schedule is then
validated by generating with it on held-out prompts.

Per budget it also reports whole sequences: the mean over sequences of prod_t alpha_t (how likely a
dense verifier is to accept a sparse sample token after token to its end) and the same per 1,000
tokens. p5 per token cannot see a failure confined to fewer than 5% of the tokens, however often
it derails a sequence (a structural copy every few dozen tokens, say); the sequence figure can.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparrow.acceptance import alpha_exact, alpha_topk, binned_stats
from sparrow.schedule import Schedule
from trainer.reference_generate import generate
from trainer.scoring import Scorer

# The "done when" band of issue 3: the fitted schedule should hold p5 within [tau - 0.03, tau + 0.05].
BAND_BELOW, BAND_ABOVE = 0.03, 0.05


@dataclass(frozen=True)
class Settings:
    """What a calibration run measures and how."""

    budgets: tuple[int, ...]  # fixed KV budgets to measure, in tokens (sink and local included)
    bin_width: int
    tau: float = 0.86
    max_new_tokens: int = 512
    temperature: float = 1.0
    seed: int = 0
    min_bin_tokens: int = 100  # fewer tokens than this and a bin's p5 is reported but not trusted
    batch_size: int = 8
    backend: str = "auto"
    quantile: float = 0.05
    template: Schedule = field(default_factory=lambda: Schedule(budgets=(64,)))  # sink, local, dense layers

    def fixed(self, budget: int) -> Schedule:
        """The one-bin schedule of a fixed budget, with this run's block rule."""
        return dataclasses.replace(self.template, budgets=(budget,), bin_width=self.bin_width, name=f"fixed-{budget}")


@dataclass
class Measurement:
    """Alpha of every generated token of one run, with the KV length it was produced at."""

    kv_lens: torch.Tensor
    alpha: torch.Tensor  # exact
    alpha_topk: torch.Tensor  # top-20 lower bound
    seconds: float
    lengths: list[int] = field(default_factory=list)  # tokens of each sequence, in order (alpha is their concatenation)

    def sequences(self) -> dict[str, Any]:
        """Whole-sequence acceptance: the mean over sequences of prod_t alpha_t, and exp(1000 x mean log alpha)."""
        if not self.lengths:
            return {"sequences": 0, "mean_tokens": None, "acceptance_mean": None, "acceptance_per_1k": None}
        logs = torch.log(self.alpha.double().clamp_min(1e-300))
        per_seq = [float(part.sum().exp()) for part in torch.split(logs, self.lengths)]
        return {
            "sequences": len(self.lengths),
            "mean_tokens": sum(self.lengths) / len(self.lengths),
            "acceptance_mean": sum(per_seq) / len(per_seq),
            "acceptance_per_1k": float((1000 * logs.mean()).exp()) if logs.numel() else None,
        }

    def bins(self, settings: Settings) -> list[dict[str, Any]]:
        """Per populated bin: token count, whether trusted, and of exact and top-20 alpha side by side: p5, p1, mean,
        and the share of tokens under 0.5 (the top-k one suffixed `_topk`)."""
        exact = binned_stats(self.alpha, self.kv_lens, settings.bin_width, settings.quantile)
        topk = binned_stats(self.alpha_topk, self.kv_lens, settings.bin_width, settings.quantile)
        return [
            {
                "index": e.index,
                "kv_start": e.kv_start,
                "kv_end": e.kv_end,
                "tokens": e.count,
                "trusted": e.count >= settings.min_bin_tokens,
                "p5": e.quantile,
                "mean": e.mean,
                "p1": e.p1,
                "under_half": e.under_half,
                "p5_topk": t.quantile,
                "mean_topk": t.mean,
                "p1_topk": t.p1,
                "under_half_topk": t.under_half,
            }
            for e, t in zip(exact, topk, strict=True)
        ]


def measure(
    scorer: Scorer,
    prompts: Sequence[Sequence[int]],
    schedule: Schedule,
    settings: Settings,
    eos_id: int | None,
) -> Measurement:
    """Generate under `schedule` and compare every generated token's distribution with the dense one."""
    t0 = time.monotonic()
    kv, exact, lower, lengths = [], [], [], []
    for start in range(0, len(prompts), settings.batch_size):
        chunk = [list(p) for p in prompts[start : start + settings.batch_size]]
        gens = generate(
            scorer.model,
            chunk,
            schedule,
            settings.max_new_tokens,
            temperature=settings.temperature,
            seed=settings.seed + start,
            eos_id=eos_id,
            backend=settings.backend,
            full=True,
        )
        dense = scorer.score(
            [p + g.tokens for p, g in zip(chunk, gens, strict=True)],
            [len(p) for p in chunk],
            temperature=settings.temperature,
            full=True,
        )
        for g, d in zip(gens, dense, strict=True):
            kv.append(g.scores.kv_lens.cpu())
            exact.append(alpha_exact(g.scores.full_logprobs, d.full_logprobs).cpu())
            lower.append(alpha_topk(g.scores.top_ids, g.scores.top_logprobs, d.top_ids, d.top_logprobs).cpu())
            lengths.append(int(exact[-1].numel()))
    return Measurement(torch.cat(kv), torch.cat(exact), torch.cat(lower), time.monotonic() - t0, lengths)


def fit(tables: dict[int, list[dict[str, Any]]], settings: Settings) -> tuple[Schedule, list[dict[str, Any]]]:
    """The cheapest non-decreasing schedule with p5 >= tau in every trusted bin, and the reason for each bin."""
    budgets = sorted(tables)
    num_bins = 1 + max(row["index"] for rows in tables.values() for row in rows)
    by_bin = {b: {row["index"]: row for row in rows} for b, rows in tables.items()}
    chosen, notes = [], []
    for i in range(num_bins):
        rows = {b: by_bin[b].get(i) for b in budgets}
        trusted = [b for b in budgets if rows[b] is not None and rows[b]["trusted"]]
        if not trusted:
            choice, why = budgets[0], "too few tokens to constrain the fit"
        else:
            passing = [b for b in trusted if rows[b]["p5"] >= settings.tau]
            if passing:
                choice, why = passing[0], "smallest budget with p5 >= tau"
            else:
                choice, why = budgets[-1], "no measured budget reaches tau: the largest one"
        floor = chosen[-1] if chosen else budgets[0]
        if choice < floor:
            choice, why = floor, f"{why}; raised to {floor} to stay non-decreasing"
        chosen.append(choice)
        row = rows[choice]
        measured = row["p5"] if row is not None and row["trusted"] else None
        notes.append({"index": i, "budget": choice, "reason": why, "measured_p5": measured})
    name = f"calibrated-tau{settings.tau:g}"
    schedule = dataclasses.replace(settings.template, budgets=tuple(chosen), bin_width=settings.bin_width, name=name)
    return schedule, notes


def calibrate(
    scorer: Scorer,
    prompts: Sequence[Sequence[int]],
    heldout: Sequence[Sequence[int]],
    settings: Settings,
    eos_id: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every fixed budget, fit the schedule, validate it on `heldout`; the whole report as a dict.

    The report's "schedule" is a `Schedule` (the rest is JSON-ready).
    """
    if not prompts or not heldout:
        raise ValueError("calibration needs at least one calibration prompt and one held-out prompt")
    runs = []
    tables: dict[int, list[dict[str, Any]]] = {}
    for budget in sorted(settings.budgets):
        m = measure(scorer, prompts, settings.fixed(budget), settings, eos_id)
        tables[budget] = m.bins(settings)
        runs.append({"budget": budget, "tokens": int(m.alpha.numel()), "seconds": round(m.seconds, 2)})
        runs[-1]["bins"] = tables[budget]
        runs[-1]["sequences"] = m.sequences()
        log(
            f"budget {budget}: {m.alpha.numel()} tokens in {m.seconds:.1f}s; p5 per bin "
            + _p5_text(tables[budget])
            + f"; {_sequence_text(runs[-1]['sequences'])}"
        )
    schedule, notes = fit(tables, settings)
    log(f"fitted schedule (bin width {settings.bin_width}): {schedule.compact()}")
    m = measure(scorer, heldout, schedule, settings, eos_id)
    rows = m.bins(settings)
    for row in rows:
        row["budget"] = schedule.budgets[min(row["index"], schedule.num_bins - 1)]
        row["in_band"] = settings.tau - BAND_BELOW <= row["p5"] <= settings.tau + BAND_ABOVE
    log(
        f"held-out with the fitted schedule: {m.alpha.numel()} tokens; p5 per bin "
        + _p5_text(rows)
        + f"; {_sequence_text(m.sequences())}"
    )
    settings_dict = {k: v for k, v in asdict(settings).items() if k != "template"}
    settings_dict["budgets"] = sorted(settings.budgets)
    return {
        "settings": settings_dict,
        "block_rule": {k: v for k, v in settings.template.to_dict().items() if k not in ("budgets", "version", "name")},
        "prompts": {"calibration": len(prompts), "heldout": len(heldout)},
        "fixed_budgets": runs,
        "fit": notes,
        "schedule": schedule,
        "validation": {
            "tokens": int(m.alpha.numel()),
            "seconds": round(m.seconds, 2),
            "bins": rows,
            "sequences": m.sequences(),
        },
    }


def _sequence_text(seq: dict[str, Any]) -> str:
    if not seq["sequences"]:
        return "no sequences"
    return (
        f"whole sequences ({seq['sequences']}, mean {seq['mean_tokens']:.0f} tokens): acceptance "
        f"{seq['acceptance_mean']:.3f}, per 1K tokens {seq['acceptance_per_1k']:.3f}"
    )


def _p5_text(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['kv_start']}+: {r['p5']:.3f}{'' if r['trusted'] else '?'}" for r in rows)


def task_prompts(
    tokenizer, pairs: int, max_hops: int, count: int, heldout: int, seed: int, min_hops: int = 1, filler: int = 0
) -> tuple[list, list, str]:
    """Token ids of `count` training-split and `heldout` held-out-split chain-task prompts, and a label."""
    from sparrow.tasks import ChainTask, ExampleStream

    task = ChainTask(pairs=pairs, max_hops=max_hops, min_hops=min_hops, filler=filler)
    calib = ExampleStream(task, seed=seed, split="train").take(count)
    held = ExampleStream(task, seed=seed, split="heldout").take(heldout)
    encode = _encoder(tokenizer)
    return [encode(e.prompt) for e in calib], [encode(e.prompt) for e in held], f"chain task {task.name}"


def split_prompts(tokenizer, prompts: Sequence[str], count: int, heldout: int, seed: int) -> tuple[list, list]:
    """Shuffle user prompts (by `seed`) into disjoint calibration and held-out sets of up to `count` / `heldout`.

    A file too small for both gets split in proportion; it needs at least two prompts.
    """
    if len(prompts) < 2:
        raise ValueError(f"calibration needs at least 2 prompts (one to calibrate, one held out), got {len(prompts)}")
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    if len(prompts) < count + heldout:
        count = min(len(prompts) - 1, max(1, round(len(prompts) * count / (count + heldout))))
        heldout = len(prompts) - count
    encode = _encoder(tokenizer)
    picked = [encode(prompts[i]) for i in order[: count + heldout]]
    return picked[:count], picked[count:]


def _encoder(tokenizer) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        ids = tokenizer(text)["input_ids"]
        if not ids:
            raise ValueError(f"the tokenizer turned prompt {text[:40]!r} into no tokens")
        return list(ids)

    return encode


def plot(report: dict[str, Any], path: str | Path) -> None:
    """PNG: p5 (left) and mean (right) of exact alpha vs KV length, per fixed budget and for the fitted schedule.

    Untrusted bins (too few tokens) are drawn as hollow markers; tau is the dashed line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = report["settings"]["bin_width"]
    tau = report["settings"]["tau"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [(f"budget {r['budget']}", r["bins"], {}) for r in report["fixed_budgets"]]
    fitted = report["schedule"]
    series.append(
        (f"fitted ({fitted.compact()}), held-out", report["validation"]["bins"], {"color": "black", "lw": 2.5})
    )
    for ax, stat in zip(axes, ("p5", "mean"), strict=True):
        for label, rows, style in series:
            x = [r["kv_start"] + width / 2 for r in rows]
            (line,) = ax.plot(x, [r[stat] for r in rows], marker="o", label=label, **style)
            weak = [(xi, r[stat]) for xi, r in zip(x, rows, strict=True) if not r["trusted"]]
            if weak:
                ax.plot([w[0] for w in weak], [w[1] for w in weak], "o", mfc="white", mec=line.get_color(), ls="none")
        if stat == "p5":
            ax.axhline(tau, color="red", ls="--", lw=1.2, label=f"tau = {tau:g}")
        ax.set_xlabel("KV length (tokens)")
        ax.set_ylabel(f"{'5th percentile' if stat == 'p5' else 'mean'} of alpha")
        ax.grid(alpha=0.3)
    axes[0].set_title("tail acceptance (p5) per length bin")
    axes[1].set_title("mean acceptance per length bin")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_json(report: dict[str, Any]) -> dict[str, Any]:
    """The report with its schedule in JSON form."""
    return {**report, "schedule": report["schedule"].to_dict()}
