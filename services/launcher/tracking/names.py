"""The tracked names: one history row (RUN_DIR/metrics.jsonl) as flat `prefix/name -> number` metrics.

Names are stable (dashboards are built on them) and grouped by prefix:

    train/     the trainer's step: reward, accuracy, response_length, samples, alpha_mean, staleness,
               kl_rollout_dense, tis_clip_fraction, step_seconds, elapsed_s, policy_version,
               published_version, trained_schedule_version
    tail/      the acceptance tail per length bin N: tail/bin_N/p5 (exact, the trainer's),
               tail/bin_N/p5_promql (what the controller reads), tail/bin_N/tokens, tail/bin_N/probe_p5;
               tail/probe_samples
    schedule/  the schedule in force: schedule/version, schedule/bin_N/budget, schedule/bin_width,
               schedule/tau, schedule/predicted_speedup
    rollout/   the generators: rollout/generated_tokens, rollout/tokens_per_s (wall), rollout/engine_tokens_per_s
               (per second of engine time), rollout/sparse_token_fraction, rollout/attended_kv_fraction,
               rollout/<generator>/policy_version, rollout/<generator>/adapter_version
    timing/    where the time went, in seconds: timing/<phase> the trainer's step (wait_groups, reward, score,
               exact_alpha, update, distill, publish, checkpoint, other; they sum to train/step_wall_seconds),
               timing/generator/<phase> the generators' loop over the row's window, summed over generators
               (prefill, decode, sampling, weight_sync, idle, other)
    reward/    the number fields a dict reward returns beside its score, per reward: reward/<reward>/<field>,
               <reward> being the reward's name, or for a file the file and function (`my_rewards.py:score`)
    eval/      evaluation: a row's `eval` table and every `eval_*` field, flattened (eval_avg@4 -> eval/avg@4,
               eval = {"math": {"pass@4": x}} -> eval/math/pass@4); and the history's evaluation rows
               (`tracked_eval_metrics`), at the step the round ran after: eval/<mode>/<source>/<figure> (mode
               dense or schedule; figure avg@k, pass@j, prompts, samples), eval/<mode>/seconds, and
               eval/dense_gap/<source>/<figure> (dense minus scheduled, a round with both modes)

A numeric field of the row not named here (one a newer trainer adds) is tracked as train/<field>, a table
of numbers as train/<field>/<key>; `step` is the step itself and `time` is the trackers' own timestamp.
Values that are absent, null, not numbers or not finite are left out of that step.
"""

from __future__ import annotations

import math

from sparrow import metrics_contract as mc

TRAIN = {
    "reward": "train/reward",
    "accuracy": "train/accuracy",
    "response_length": "train/response_length",
    "samples": "train/samples",
    "alpha_mean": "train/alpha_mean",
    "staleness": "train/staleness",
    "kl_rollout_dense": "train/kl_rollout_dense",
    "tis_clip_fraction": "train/tis_clip_fraction",
    "step_seconds": "train/step_seconds",
    "elapsed_s": "train/elapsed_s",
    "policy_version": "train/policy_version",
    "published_version": "train/published_version",
    "trained_schedule_version": "train/trained_schedule_version",
    "probe_samples": "tail/probe_samples",
    "schedule_version": "schedule/version",
    "bin_width": "schedule/bin_width",
    "tau": "schedule/tau",
    "predicted_speedup": "schedule/predicted_speedup",
    "generated_tokens": "rollout/generated_tokens",
    "tokens_per_s": "rollout/tokens_per_s",
    "rollout_tokens_per_s": "rollout/engine_tokens_per_s",
    "sparse_token_fraction": "rollout/sparse_token_fraction",
    "attended_kv_fraction": "rollout/attended_kv_fraction",
}
# Per-bin tables of the row: field -> the name under tail/bin_N/.
TAIL = {"p5": "p5", "p5_promql": "p5_promql", "alpha_tokens": "tokens", "probe_p5": "probe_p5"}
GENERATORS = {"generator_policy_versions": "policy_version", "generator_adapter_versions": "adapter_version"}
SKIPPED = {"step", "time"}
TIMING = mc.TIMING_PREFIX  # the row's timing/<phase> keys are the tracked names themselves


def _number(value) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _flatten(prefix: str, value, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{prefix}/{key}", sub, out)
        return
    number = _number(value)
    if number is not None:
        out[prefix] = number


def tracked_metrics(row: dict) -> dict[str, float]:
    """The row's figures under their tracked names (see the module's docstring)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in SKIPPED:
            continue
        if key in TRAIN:
            _flatten(TRAIN[key], value, out)
        elif key in TAIL and isinstance(value, dict):
            for b, v in value.items():
                _flatten(f"tail/bin_{b}/{TAIL[key]}", v, out)
        elif key in GENERATORS and isinstance(value, dict):
            for name, v in value.items():
                _flatten(f"rollout/{name}/{GENERATORS[key]}", v, out)
        elif key.startswith(TIMING):
            _flatten(key, value, out)
        elif key == "generator_timing" and isinstance(value, dict):
            _flatten(f"{TIMING}generator", value, out)
        elif key == "reward_extra" and isinstance(value, dict):
            for reward, fields in value.items():
                _flatten(f"reward/{str(reward).rsplit('/', 1)[-1]}", fields, out)
        elif key == "schedule_budgets":
            for b, v in enumerate(value or []):
                _flatten(f"schedule/bin_{b}/budget", v, out)
        elif key == "eval" or key.startswith("eval_"):
            _flatten("eval" if key == "eval" else f"eval/{key[len('eval_') :]}", value, out)
        else:
            _flatten(f"train/{key}", value, out)
    return out


def tracked_eval_metrics(row: dict) -> dict[str, float]:
    """An evaluation row of the history (services/launcher/history.py) under its tracked names (see above)."""
    mode = row.get("mode") or ("dense" if row.get("dense", True) else "schedule")  # rows from before modes
    out: dict[str, float] = {}
    for src, figures in (row.get("sources") or {}).items():
        _flatten(f"eval/{mode}/{src}", figures, out)
    for src, figures in (row.get("dense_gap") or {}).items():
        _flatten(f"eval/dense_gap/{src}", figures, out)
    _flatten(f"eval/{mode}/seconds", row.get("eval_seconds"), out)
    return out


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as `a.b.c -> text` (for trackers whose run parameters are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{name}."))
        else:
            out[name] = str(value)
    return out
