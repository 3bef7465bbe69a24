"""Whole training steps in one trainer (in-process) with a real Redis, real gRPC and a sampling generator that
follows the published policy: rewards are right, metrics are exported over HTTP, the policy version advances
and every version is fetchable with correct checksums; stale groups are dropped, counted and never trained."""

import json
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.common.grpc_server import GrpcSecurity, open_channel
from services.trainer.config import TrainerServiceConfig
from services.trainer.service import STEPS_FILE, TrainerService
from sparrow import metrics_contract as mc
from sparrow.config import load_config
from sparrow.rewards import chain_reward
from sparrow.tasks.vocab import BOS, EOS, VOCAB
from tests.integration.trainer_service.helpers import TINY, RolloutSession, SamplingGenerator, fetch_policy
from tests.servers import redis_server, wait_until
from trainer.model_io import load_model


def _config(run_dir: Path, redis_url: str, **extra) -> TrainerServiceConfig:
    overrides = {
        "run_dir": str(run_dir),
        "model_dir": str(TINY),
        "redis.url": redis_url,
        "groups_per_step": 2,
        "outstanding_steps": 1.0,
        "poll_s": 0.1,
        "task.pairs": 8,  # the tiny model gets some of these right and some wrong: rewards vary in a group
        "task.min_hops": 4,
        "task.max_hops": 8,
        "sampling.n": 4,
        "sampling.max_new_tokens": 40,
        "optim.lr": 1e-3,
        "grpc.address": "127.0.0.1:0",
        "grpc.grace_s": 0.5,
        "metrics.port": 0,
        "metrics.bin_width": 16,  # prompts of 29 tokens and answers of up to 40: bins 1 to 4
        "metrics.num_bins": 8,
        **extra,
    }
    return load_config(TrainerServiceConfig, overrides=overrides)


@contextmanager
def _running(config: TrainerServiceConfig, follow_policy: bool, work_dir: Path, probe_budget: int = 0):
    service = TrainerService(config)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    wait_until(lambda: service.grpc_port > 0, 30, "trainer serving")
    address = f"127.0.0.1:{service.grpc_port}"
    generator = SamplingGenerator(
        config.redis.url, address, follow_policy=follow_policy, work_dir=work_dir, probe_budget=probe_budget
    ).start()
    try:
        yield service, generator, address
    finally:
        generator.close()
        stop.set()
        thread.join(60)
        assert not thread.is_alive()


def _answer(prompt: str) -> str:
    """The chain's end, worked out from the prompt text alone (`A B ;` pairs, then `? start hops :`)."""
    words = prompt.split()
    q = words.index("?")
    pairs = dict(zip(words[0:q:3], words[1:q:3], strict=True))
    name, hops = words[q + 1], int(words[q + 2])
    for _ in range(hops):
        name = pairs[name]
    return name


def _scrape(port: int) -> dict[str, float]:
    """The trainer's /metrics over HTTP, as Prometheus reads it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return _parse(resp.read().decode())


def _metrics(service: TrainerService) -> dict[str, float]:
    """The trainer's metrics read in the test's process: a trainer that has run its last step stops, and its
    /metrics with it, as soon as it has checkpointed, which a test reading after that step could race."""
    from prometheus_client import generate_latest

    return _parse(generate_latest(service.metrics.registry).decode())


def _parse(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / STEPS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_steps_reward_export_publish_and_advance_the_policy(tmp_path):
    with redis_server() as redis, _running(_config(tmp_path / "run", redis.url), True, tmp_path / "gen") as running:
        service, generator, address = running
        state = lambda: f"{service.waiting_for()}\n{generator.describe()}"  # noqa: E731
        wait_until(lambda: len(_steps(tmp_path / "run")) >= 2, 240, "two training steps", explain=state)
        wait_until(lambda: generator.version >= 3, 60, "the generator on the policy after step 2", explain=state)
        metrics = _scrape(service.metrics_port)  # mid-run: the endpoint itself
        channel = open_channel(address, GrpcSecurity())
        version, _ = fetch_policy(channel, tmp_path / "fetched", version=3, chunk_bytes=8192)
        fetched = load_model(tmp_path / "fetched")
        hello = RolloutSession(channel, "late-joiner").hello
        history = list(service.state.history)
        samples = {gid: generator.trajectories[gid] for gid in history[0]}  # what the generator had accepted
    # What a waiting step would log (and a timeout above would have said).
    assert service.waiting_for().startswith(f"step {service.state.step + 1} waits: ") and "reward workers" in state()
    # Stopped: what is published last is exactly the model the trainer holds.
    latest = service.weights.folder("policy", service.state.policy_version)
    assert _same(load_model(latest), service.model)
    steps = _steps(tmp_path / "run")
    first = steps[0]
    assert [s["step"] for s in steps[:2]] == [1, 2] and [s["published_version"] for s in steps[:2]] == [2, 3]
    assert first["groups"] == history[0] and first["samples"] == 8
    rewards = [
        chain_reward(_text(t.token_ids), _answer(_text(t.prompt_token_ids))) for gid in history[0] for t in samples[gid]
    ]
    assert first["reward_mean"] == sum(rewards) / len(rewards)
    assert first["accuracy"] == sum(r == 1 for r in rewards) / len(rewards)
    assert {b["bin"] for b in first["alpha_bins"]} <= {1, 2, 3, 4} and all(
        0 <= b["p5"] <= 1 for b in first["alpha_bins"]
    )
    assert first["alpha_mean"] > 0.5 and first["kl_rollout_dense"] < 0.1  # dense rollouts of the same policy
    assert version == 3 and hello.latest.policy_version >= 3
    # Version 3 is the weights after step 2: not the starting model.
    base = load_model(TINY)
    assert any(
        not torch.equal(a, b) for a, b in zip(fetched.state_dict().values(), base.state_dict().values(), strict=True)
    )
    assert metrics["sparrow_trainer_steps_total"] >= 2 and metrics["sparrow_trainer_policy_version"] >= 3
    for name in (
        "sparrow_trainer_reward_mean",
        "sparrow_trainer_accuracy_ratio",
        "sparrow_trainer_response_length_tokens",
        "sparrow_trainer_tis_clip_ratio",
        "sparrow_trainer_kl_rollout_dense",
        "sparrow_trainer_staleness_versions",
        "sparrow_trainer_dropped_stale_total",
        "sparrow_trainer_groups_dead_total",
        "sparrow_trainer_last_step_timestamp_seconds",
        "sparrow_trainer_queue_outstanding_groups",
        "sparrow_trainer_step_seconds_count",
        "sparrow_trainer_schedule_version",
        "sparrow_trainer_trajectories_total{status=accepted}",
        "sparrow_trainer_alpha_p5{bin=1}",
        "sparrow_trainer_alpha_mean{bin=1}",
        "sparrow_trainer_alpha_bucket{bin=1,le=+Inf}",
    ):
        assert name in metrics, name
    assert metrics["sparrow_trainer_trajectories_total{status=accepted}"] >= 16
    assert 0 <= metrics["sparrow_trainer_accuracy_ratio"] <= 1 and metrics["sparrow_trainer_response_length_tokens"] > 0
    for step in steps[:2]:
        split = _timing(step)
        assert split["exact_alpha"] == 0.0 and split["distill"] == 0.0  # neither runs in this config
    # Step 1 waited for the generator's first groups; every step scored, updated and published.
    assert _timing(first)["wait_groups"] > 0
    phase_total = sum(v for k, v in metrics.items() if k.startswith("sparrow_trainer_phase_seconds_total{"))
    assert {k for k in metrics if k.startswith("sparrow_trainer_phase_seconds_total{")} == {
        f"sparrow_trainer_phase_seconds_total{{phase={p}}}" for p in (*mc.TRAINER_PHASES, "other")
    }
    # The counters hold the steps done when they were read: at least the first two steps' wall time.
    assert phase_total >= sum(s["wall_seconds"] for s in steps[:2]) - 1e-6


def _timing(step: dict) -> dict[str, float]:
    """The step's time split, checked: every phase present, none negative, summing to the step's wall time."""
    split = {k.removeprefix(mc.TIMING_PREFIX): v for k, v in step.items() if k.startswith(mc.TIMING_PREFIX)}
    assert set(split) == {*mc.TRAINER_PHASES, "other"}, sorted(split)
    assert all(v >= 0 for v in split.values()), split
    assert abs(sum(split.values()) - step["wall_seconds"]) < 1e-6
    # The wall time runs from the end of the step before: it holds the step's own training time.
    assert step["wall_seconds"] >= step["seconds"] - 1e-3
    for phase in ("score", "update", "publish"):
        assert split[phase] > 0, phase
    return split


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _text(ids) -> str:
    return " ".join(VOCAB[i] for i in ids if VOCAB[i] not in (BOS, EOS))


def test_stale_groups_are_dropped_counted_and_never_trained(tmp_path):
    with redis_server() as redis:
        config = _config(tmp_path / "run", redis.url, max_staleness=0)
        # This generator never loads a new policy: after step 1 every sample it makes lags by a version.
        with _running(config, False, tmp_path / "gen") as (service, generator, _):
            wait_until(lambda: service.metrics.dropped_stale._value.get() >= 2, 120, "stale groups dropped")
            dropped = list(service.state.dropped)
            history = list(service.state.history)
    assert len(history) == 1 and service.state.policy_version == 2
    assert set(dropped).isdisjoint(history[0]) and len(set(dropped)) == len(dropped) >= 2
    assert all(service.ledger.state(gid) == "dropped" for gid in dropped)
    step_lines = _steps(tmp_path / "run")
    assert len(step_lines) == 1 and step_lines[0]["staleness"] == 0


def test_probe_samples_are_trained_on_but_kept_out_of_the_schedules_tail_statistic(tmp_path):
    with redis_server() as redis:
        config = _config(tmp_path / "run", redis.url)
        with _running(config, False, tmp_path / "gen", probe_budget=48) as (service, generator, _):
            wait_until(lambda: len(_steps(tmp_path / "run")) >= 1, 120, "a training step")
            done = len(_steps(tmp_path / "run"))
            metrics = _metrics(service)  # the gauges of step `done` or of one just after it
            wait_until(lambda: len(_steps(tmp_path / "run")) >= done + 1, 120, "the next step's line")
            steps = _steps(tmp_path / "run")[done - 1 : done + 1]
            trajectories = dict(generator.trajectories)

    def figures(step):
        samples = [t for gid in step["groups"] for t in trajectories[gid]]
        probes = [t for t in samples if t.probe]
        return sum(len(t.token_ids) for t in samples), sum(len(t.token_ids) for t in probes), len(probes)

    for step in steps:
        tokens, probe_tokens, probes = figures(step)
        assert step["samples"] == 8 and step["probe_samples"] == probes == 2  # trained on, like the rest
        assert sum(b["tokens"] for b in step["alpha_probe_bins"]) == probe_tokens
        assert sum(b["tokens"] for b in step["alpha_bins"]) == tokens - probe_tokens
    exported = sum(v for k, v in metrics.items() if k.startswith("sparrow_trainer_alpha_tokens{"))
    probe_exported = sum(v for k, v in metrics.items() if k.startswith("sparrow_trainer_alpha_probe_tokens{"))
    # The schedule's gauges leave the probe tokens out; the probe gauges hold every probe token but the
    # first of each sample (the dense prefill).
    assert any(
        (exported, probe_exported) == (tokens - probe_tokens, probe_tokens - probes)
        for tokens, probe_tokens, probes in map(figures, steps)
    )
    probe_budgets = {k: v for k, v in metrics.items() if k.startswith("sparrow_trainer_alpha_probe_budget_tokens{")}
    assert set(probe_budgets.values()) <= {48.0, 0.0} and 48.0 in probe_budgets.values()


def test_exact_alpha_steps_export_both_series_and_exact_never_below_the_bound(tmp_path):
    with redis_server() as redis:
        config = _config(tmp_path / "run", redis.url, alpha="exact", **{"distill.dense_layers": []})
        # Probe samples carry a 48-token budget (3 pages of 16): the exact pass runs them block-sparse.
        with _running(config, True, tmp_path / "gen", probe_budget=48) as (service, generator, _):
            wait_until(lambda: len(_steps(tmp_path / "run")) >= 2, 180, "two training steps")
            metrics = _metrics(service)
    step = _steps(tmp_path / "run")[1]
    assert 0 < step["exact_seconds"] < step["seconds"]  # the pass's own time, part of the step's
    # The split charges the pass to `exact_alpha`, out of the dense scoring it runs inside.
    split = _timing(step)
    assert 0 < split["exact_alpha"] <= step["exact_seconds"] + 1e-3 and split["exact_alpha"] < step["seconds"]
    for b in step["alpha_bins"]:
        # Dense rollouts of the policy being trained (one version stale at most): exact alpha is 1 up to the
        # version lag, and never below the top-k bound of the same tokens.
        assert b["exact_tokens"] == b["tokens"]
        assert b["exact_p5"] >= b["p5"] - 1e-4 and b["exact_p1"] >= b["p1"] - 1e-4 and b["exact_mean"] >= b["mean"]
        assert b["exact_under_half"] <= b["under_half"]
    for name in ("sparrow_trainer_alpha_exact_p5", "sparrow_trainer_alpha_exact_p1", "sparrow_trainer_alpha_p1",
                 "sparrow_trainer_alpha_exact_under_half", "sparrow_trainer_alpha_under_half",
                 "sparrow_trainer_alpha_exact_tokens", "sparrow_trainer_alpha_exact_bucket"):  # fmt: skip
        assert any(k.startswith(name + "{") for k in metrics), name
    # The probe samples' exact alpha (48-token budgets over ~60-token contexts) is below 1: the sparse forward ran.
    assert any(b["mean"] < 0.9999 for b in step["alpha_probe_bins"])
