"""Two whole generators (reference engine, real Redis) with relay.enabled, against the trainer's real weight
path (bench/weight_fleet.py's PublishingTrainer: WeightStore, digests, deltas, its WeightService): the second
gets each version from the first, deltas after the first, every version checked by digest and served."""

import threading
import time

import torch
from safetensors import safe_open

from bench.weight_fleet import PublishingTrainer
from services.generator.reference_engine import ReferenceEngine
from tests.integration.generator.harness import TINY

SIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _tiny_state():
    with safe_open(str(TINY / "model.safetensors"), framework="pt") as st:
        return {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118


def _wait(pred, what, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(what)


def test_generators_relay_versions_to_each_other_and_serve_deltas(start, tmp_path, monkeypatch):
    # Two generators share this process: transformers' from_pretrained is not safe to run in two threads at
    # once (each generator is a process of its own in a deployment), so their engine loads take turns here.
    lock = threading.Lock()
    real_load = ReferenceEngine.load_policy

    def load_in_turn(self, folder, version):
        with lock:
            return real_load(self, folder, version)

    monkeypatch.setattr(ReferenceEngine, "load_policy", load_in_turn)
    side = {name: (TINY / name).read_text() for name in SIDE if (TINY / name).is_file()}
    trainer = PublishingTrainer(tmp_path / "run", trainer_fanout=1, peer_fanout=2)
    try:
        state = _tiny_state()
        trainer.publish(1, state, "float32", side)
        relay = {"trainer.weights_address": trainer.address, "relay.enabled": True, "relay.host": "127.0.0.1"}
        first = start(**relay)
        _wait(lambda: first.service.serving.policy_version == 1, "first generator at v1")
        second = start(**relay)
        _wait(lambda: second.service.serving.policy_version == 1, "second generator at v1")
        sources = trainer.planner.sources_of(1)
        assert sources[first.config.generator_id] == ""
        assert sources[second.config.generator_id] == f"127.0.0.1:{first.generator.relay.port}"
        state = dict(state)
        name = next(k for k in state if k.endswith("q_proj.weight"))
        state[name] = state[name] + 1e-3 * torch.ones_like(state[name])  # one tensor moves: a small delta
        trainer.publish(2, state, "float32", side)
        for h in (first, second):
            _wait(lambda h=h: h.service.serving.policy_version == 2, "v2 everywhere")
        assert trainer.sent["delta"] == trainer.sync.record(2).delta_bytes  # one delta off the trainer
        # Whichever generator's watch saw v2 first asked first and got the trainer; the other got it as its peer.
        root, child = (first, second) if trainer.planner.sources_of(2)[first.config.generator_id] == "" else (
            second, first)  # fmt: skip
        assert trainer.planner.sources_of(2)[child.config.generator_id] == f"127.0.0.1:{root.generator.relay.port}"
        assert child.metric("sparrow_generator_policy_fetch_bytes_total", kind="delta", source="peer") > 0
        assert root.metric("sparrow_generator_policy_fetch_bytes_total", kind="delta", source="trainer") > 0
        assert second.metric("sparrow_generator_swaps_total", kind="policy", outcome="ok") == 2
    finally:
        trainer.close()
