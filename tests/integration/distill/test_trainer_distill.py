"""The trainer service with DistillSparse on (real Redis, real gRPC, a sampling generator on the Redis Stream):
every step trains and publishes an adapter that a generator fetches sha256-checked, its metrics are served,
the probe runs on schedule, the adapter and its optimizer are checkpointed and a restart resumes them without
publishing again; the block rule comes from the schedule in Redis."""

import json
import threading
import urllib.request
from pathlib import Path

import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.common.grpc_server import GrpcSecurity
from services.generator.weight_fetch import WeightFetcher
from services.trainer.config import TrainerServiceConfig
from services.trainer.distill_step import SIDECAR, read_block_rule
from services.trainer.service import STEPS_FILE, TrainerService
from services.trainer.weights import ADAPTER
from sparrow import metrics_contract as mc
from sparrow.config import load_config
from sparrow.schedule import Schedule
from tests.integration.trainer_service.helpers import TINY, SamplingGenerator
from tests.servers import redis_server, wait_until
from trainer.distill import BlockRule

pytestmark = pytest.mark.slow


def _config(run_dir: Path, redis_url: str, steps: int) -> TrainerServiceConfig:
    return load_config(
        TrainerServiceConfig,
        overrides={
            "run_dir": str(run_dir),
            "model_dir": str(TINY),
            "redis.url": redis_url,
            "steps": steps,
            "groups_per_step": 2,
            "outstanding_steps": 1.0,
            "poll_s": 0.1,
            "task.pairs": 8,
            "task.min_hops": 4,
            "task.max_hops": 8,
            "sampling.n": 4,
            "sampling.max_new_tokens": 40,
            "grpc.address": "127.0.0.1:0",
            "grpc.grace_s": 0.5,
            "metrics.port": 0,
            "metrics.bin_width": 16,
            "metrics.num_bins": 8,
            "distill.enabled": True,
            "distill.rank": 4,
            "distill.lr": 1e-3,
            "distill.kl_coef": 1.0,
            "distill.backend": "torch",
            "distill.probe_every": 2,
            "distill.probe_samples": 2,
        },
    )


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        s.name + (f"{{bin={s.labels['bin']}}}" if "bin" in s.labels else ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_step_trains_publishes_and_checkpoints_the_adapter_and_a_restart_resumes_it(tmp_path):
    run_dir = tmp_path / "run"
    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        rule = Schedule(budgets=(64,), bin_width=128, sink_blocks=1, local_blocks=2, dense_layers=(1,), version=4)
        client.set(mc.SCHEDULE_KEY, rule.to_json())
        config = _config(run_dir, server.url, steps=3)
        service = TrainerService(config)
        assert service.distill.rule_source() == BlockRule(1, 2, frozenset({1}))  # the generators' schedule
        stop = threading.Event()
        thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
        thread.start()
        wait_until(lambda: service.grpc_port > 0, 30, "trainer serving")
        address = f"127.0.0.1:{service.grpc_port}"
        generator = SamplingGenerator(server.url, address, follow_policy=True, work_dir=tmp_path / "gen").start()
        try:
            wait_until(lambda: service.weights.latest(ADAPTER) >= 2, 180, "two adapters published")
            metrics = _metrics(service.metrics_port)
            fetcher = WeightFetcher(address, GrpcSecurity(), tmp_path / "fetched", chunk_bytes=4096)
            fetched = fetcher.fetch("adapter", 2)  # the generator's own verified download
            thread.join(180)  # three steps, then the service stops by itself
        finally:
            generator.close()
            stop.set()
            thread.join(60)
        assert not thread.is_alive()
        steps = [json.loads(line) for line in (run_dir / STEPS_FILE).read_text().splitlines()]
        trained = {n: t.clone() for n, t in service.distill.distill.adapter_tensors().items()}

        # Restart on the same run: the adapter and its version come back from the checkpoint, nothing republished.
        again = TrainerService(_config(run_dir, server.url, steps=3))
        try:
            resumed = again.distill.distill.adapter_tensors()
            assert again.state.step == 3 and again.distill.adapter_version == 3 == again.weights.latest(ADAPTER)
            assert all(torch.equal(resumed[n], trained[n]) for n in trained)
            assert again.distill.distill.optimizer.state  # the adapter's AdamW moments were restored too
        finally:
            again.shutdown()
        assert read_block_rule(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2), BlockRule()) == (
            BlockRule()
        )  # Redis unreachable: the configured rule, no crash
        client.close()

    assert [s["step"] for s in steps] == [1, 2, 3]
    assert "probe" in steps[0]["distill"] and "probe" not in steps[1]["distill"] and "probe" in steps[2]["distill"]
    assert all(s["distill"]["tokens"] > 0 and s["distill"]["kl"] >= 0 for s in steps)
    assert steps[0]["distill"]["tokens"] < sum(1 for _ in range(0)) + steps[1]["distill"]["tokens"] * 2
    assert json.loads((fetched.folder / SIDECAR).read_text()) == {"adapter_version": 2, "policy_version": 3, "step": 2}
    assert fetched.manifest.lora_rank == 4 and (fetched.folder / "adapter_model.safetensors").is_file()
    assert metrics["sparrow_trainer_adapter_version"] >= 2
    assert "sparrow_trainer_distill_loss" in metrics and "sparrow_trainer_distill_kl" in metrics
    assert any(k.startswith("sparrow_trainer_alpha_probe_with_adapter_p5{") for k in metrics)
    assert any(k.startswith("sparrow_trainer_alpha_probe_without_adapter_p5{") for k in metrics)
