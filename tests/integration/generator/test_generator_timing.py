"""Where a generator's time goes, and its tokens counted as they are generated: the generator service, real
Redis, a stand-in trainer, and the launcher's own throughput reading (services/launcher/history.py).

Two engines: a paced stand-in (tests/fixtures/paced_engine.py: a fixed wall time per step, so the workload is
steady whatever the machine's load) and vLLM on CPU. Every sample runs to max_new_tokens, so a group's samples
all finish in the same step: the workload at which counting tokens at the finish made the per-step
throughput swing.
"""

from __future__ import annotations

import statistics
import time

import pytest

from services.launcher.history import History, HistorySources
from services.launcher.scrape import scrape_generator
from sparrow import metrics_contract as mc
from tests.fixtures.paced_engine import PacedEngine
from tests.integration.generator.harness import SMALL, TINY, group


def _history(tmp_path, url: str) -> History:
    sources = HistorySources(
        steps_file=tmp_path / "steps.jsonl",
        generator_metrics={"gen": url},
        redis_client=None,
        prometheus_url=None,
        promql_window_s=30.0,
        tau=0.86,
        initial_schedule=None,
        follow_redis=False,
        speedup_of=lambda _schedule: None,
    )
    return History(tmp_path, sources)


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def _phases(h) -> dict[str, float]:
    return {p: h.metric(mc.GENERATOR_PHASE_SECONDS + "_total", phase=p) for p in (*mc.GENERATOR_PHASES, "other")}


def _url(h) -> str:
    return f"http://127.0.0.1:{h.generator.metrics_port}/metrics"


def test_a_steady_workload_reads_steady_in_the_launchers_per_step_throughput(start, trainer, tmp_path):
    # 4 groups of 4 in flight, 16 sequences a step of 10 ms: 1,600 tokens per engine second, every group
    # finishing whole 0.4 s after it starts. Windows of 0.7 s: counted at the finish, a window saw 0 or
    # several groups' tokens; counted as generated, each sees its own.
    h = start(engine=PacedEngine(step_s=0.01, max_seqs=16), max_in_flight_groups=4)
    for i in range(60):
        h.enqueue(group(f"p{i}", n=4, max_new_tokens=40, seed=i))
    trainer.wait_for(lambda: len(trainer.trajectories) >= 16, 60, "the workload running")
    history = _history(tmp_path, _url(h))
    history._throughput()
    rates, finished_rates = [], []
    finished_before = sum(len(t.token_ids) for t in trainer.trajectories.values())
    for _ in range(6):
        time.sleep(0.7)
        rates.append(history._throughput()["rollout_tokens_per_s"])
        finished = sum(len(t.token_ids) for t in trainer.trajectories.values())
        finished_rates.append(finished - finished_before)
        finished_before = finished
    assert len(trainer.trajectories) < 60 * 4, "the workload ran out during the windows"
    print(f"paced: rollout tokens/s per window {[round(r) for r in rates]} (spread {_spread(rates):.1%}); "
          f"tokens of samples finished per window {finished_rates}")  # fmt: skip
    assert _spread(rates) < 0.25, rates
    assert all(1000 < r < 1700 for r in rates), rates  # 16 tokens per 10 ms step at most


@pytest.mark.slow
def test_vllm_counts_tokens_as_generated_and_splits_its_time_by_phase(start, trainer, tmp_path):
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(
        VllmEngineConfig(model=str(TINY), max_model_len=1024, max_num_seqs=16, gpu_memory_utilization=0.05,
                         ignore_eos=True)
    )  # fmt: skip
    overrides = {"engine.kind": "vllm", "engine.model_dir": str(TINY), "engine.max_model_len": 1024}
    h = start(engine=engine, max_in_flight_groups=4, **overrides)
    started = time.monotonic()  # the loop starts about now (the engine was built before)
    url = _url(h)
    tokens = lambda: scrape_generator(url).tokens  # noqa: E731
    time.sleep(1.0)  # nothing to do yet: idle

    # One long group: its tokens are in the counter while neither of its samples has reached the trainer.
    h.enqueue(group("long", n=2, max_new_tokens=900, pairs=4))
    seen: list[float] = []

    def partly_counted() -> bool:
        count = tokens()
        if count > 0 and not trainer.of_group("long"):
            seen.append(count)
        return len(seen) >= 2

    trainer.wait_for(partly_counted, 120, "the long group's tokens counted before it finished")
    assert 0 < seen[0] < seen[1] < 2 * 900
    h.wait_settled({"long": 2}, timeout=120)
    assert tokens() == 2 * 900  # every token once: none counted again at the finish

    # A steady workload of 16 sequences. Tokens per second of engine time follow the machine's load here
    # (a bare engine loop on a loaded 2-core machine reads +-20% between windows), tokens per engine step
    # do not: counted as generated, every window reads about 16 (a step that prefills adds none).
    for i in range(120):
        h.enqueue(group(f"s{i}", n=4, max_new_tokens=192, pairs=4, seed=i))
    trainer.wait_for(lambda: len(trainer.trajectories) >= 2 + 16, 120, "the workload running")
    history = _history(tmp_path, url)
    history._throughput()
    last = scrape_generator(url)
    per_step, rates, windows = [], [], []
    for _ in range(5):
        time.sleep(2.0)
        rates.append(history._throughput()["rollout_tokens_per_s"])
        now = scrape_generator(url)
        steps, generated = now.steps - last.steps, now.tokens - last.tokens
        per_step.append(generated / steps)
        windows.append((steps, generated))
        last = now
    assert len(trainer.trajectories) < 2 + 120 * 4, "the workload ran out during the windows"
    print(f"vllm: tokens per engine step per window {[round(r, 2) for r in per_step]}; "
          f"rollout tokens/s per window {[round(r) for r in rates]} (spread {_spread(rates):.1%})")  # fmt: skip
    assert _spread(per_step) < 0.25 and all(r >= 12 for r in per_step), per_step
    # A scrape is not atomic: one that falls between a step's time and its tokens moves one step's tokens
    # (16 at most) into the next window, so a window holds at most 16 tokens for each of its steps plus one.
    assert all(generated <= 16 * (steps + 1) for steps, generated in windows), windows

    # A new policy loads in place: weight sync.
    trainer.publish("policy", 1, SMALL)
    trainer.wait_for(lambda: h.service.serving.policy_version == 1, 60, "policy v1 loaded")
    time.sleep(0.6)  # past the next flush of the split to the counters
    split = _phases(h)
    wall = time.monotonic() - started
    print(f"vllm: generator split over {wall:.1f} s: {split}")
    assert split["prefill"] > 0 and split["decode"] > 0 and split["idle"] > 0.5 and split["weight_sync"] > 0
    assert split["sampling"] == 0.0  # inside vLLM's step: not told apart on this engine
    assert split["decode"] > split["prefill"]
    # Every second of the loop is charged once: the counters hold the loop's time up to the last flush.
    assert wall - 3.0 < sum(split.values()) <= wall + 0.5
