"""Phase `parity` (vLLM): stock vLLM vs the plugin, float32, greedy, on a random Qwen3."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.cuda_check.common import PARITY_TOL, Record, seconds_left
from bench.cuda_check.engines import engine_child, random_qwen3, skip_engine_phase


def phase_parity(rec: Record) -> None:
    if skip_engine_phase(rec):
        return
    import torch

    from sparrow.schedule import Schedule

    work = Path(tempfile.mkdtemp(prefix="sparrow-parity-"))
    model = random_qwen3(work / "model", 4, 512, 8, 4, 1024, 2048, torch.float32)
    full = Schedule(budgets=(4096,), bin_width=4096, dense_layers=(), name="full-every-layer")
    small = Schedule(budgets=(64, 128, 256), bin_width=256, name="small")
    for name, s in (("full", full), ("small", small)):
        s.save(work / f"{name}.json")
    stock = engine_child(["--phase", "engine_rollout", "--model", str(model), "--stock"], seconds_left() / 2)
    schedules = f"none,{work}/full.json,{work}/small.json"
    ours = engine_child(["--phase", "engine_rollout", "--model", str(model), "--schedules", schedules], seconds_left())
    rec["stock_status"], rec["plugin_status"] = stock.get("status"), ours.get("status")
    if "runs" not in stock or "runs" not in ours:
        raise RuntimeError(
            f"engine runs failed: stock {stock.get('error', '')[-800:]} plugin {ours.get('error', '')[-800:]}"
        )
    base = stock["runs"]["stock"]
    for path, run in ours["runs"].items():
        label = Path(path).stem
        diffs, common, total = [], 0, 0
        for s, o in zip(base, run, strict=True):
            n = next(
                (i for i, (a, b) in enumerate(zip(s["tokens"], o["tokens"], strict=True)) if a != b), len(s["tokens"])
            )
            diffs += [abs(a - b) for a, b in zip(s["logprobs"][:n], o["logprobs"][:n], strict=True)]
            common, total = common + n, total + len(s["tokens"])
        stats = {"max_abs": max(diffs, default=0.0), "mean_abs": sum(diffs) / max(len(diffs), 1)}
        rec[label] = {**stats, "common_prefix_fraction": common / total}
        if label == "none":
            rec.check("no_schedule_max_abs", stats["max_abs"], 0.0)
        elif label == "full":
            rec.check("full_budget_max_abs", stats["max_abs"], PARITY_TOL)
