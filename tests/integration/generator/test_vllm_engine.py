"""The vLLM engine with the block-sparse attention plugin, for real (vLLM CPU, in this process or a child).

- at a budget that covers every page, the plugin's logprobs equal stock vLLM's (separate processes:
  the attention backend is chosen once per process);
- with small budgets, its logprobs equal the trainer's teacher-forced sparse scoring of the same
  tokens under the budgets it reported, and a schedule set between two steps governs the next one;
- new policy weights and a LoRA adapter load without a restart; a corrupt adapter is refused and the
  previous one keeps serving.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparrow.schedule import Schedule
from sparrow.work import PromptGroup, Sampling

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SMALL = REPO / "models" / "small"


def _random_qwen3(folder: Path, head_dim: int = 32) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=521,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return folder


def _rollout(model: Path, out: Path, *flags: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_HOST_IP": "127.0.0.1"}
    env.pop("SPARROW_ATTENTION", None)
    cmd = [sys.executable, "-m", "tests.fixtures.vllm_rollout", "--model", str(model), "--out", str(out), *flags]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_plugin_matches_stock_vllm_at_full_budget(tmp_path):
    model = _random_qwen3(tmp_path / "model")
    full = Schedule(budgets=(1024,), bin_width=1024, name="full")
    full.save(tmp_path / "full.json")
    stock = _rollout(model, tmp_path / "stock.json", "--stock")
    ours = _rollout(model, tmp_path / "ours.json", "--schedule", str(tmp_path / "full.json"))
    assert stock["layers"] == 0 and ours["layers"] == 4  # stock really ran vLLM's kernel, ours ours
    for s, o in zip(stock["samples"], ours["samples"], strict=True):
        assert s["tokens"] == o["tokens"]
        diff = (torch.tensor(s["logprobs"]) - torch.tensor(o["logprobs"])).abs().max()
        assert float(diff) <= 1e-5, f"{s['group_id']}: max |stock - plugin| = {float(diff):.2e}"
        top = (torch.tensor(s["top_logprobs"]) - torch.tensor(o["top_logprobs"])).abs().max()
        assert float(top) <= 1e-5
        assert s["top_ids"] == o["top_ids"]
        assert all(b == 0 for b in o["budgets"])  # a budget covering the context is reported as dense


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    eng = VllmEngine(
        VllmEngineConfig(model=str(SMALL), max_model_len=1024, max_num_seqs=8, enable_lora=True, max_lora_rank=8)
    )
    yield eng
    eng.close()


def _run(engine, groups):
    for g in groups:
        engine.submit(g)
    out = []
    while engine.in_flight:
        out.extend(engine.step())
    return sorted(out, key=lambda s: (s.group_id, s.sample_index))


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(t) for t in torch.randint(3, 500, (length,), generator=g))


def _teacher_forced(model, samples, schedule: Schedule | None = None, temperature: float = 1.0, full: bool = False):
    """The trainer's scoring of the engine's tokens under the budgets the engine reported (`full`: every id's)."""
    from trainer import sparse_attention
    from trainer.scoring import scaled_logprobs

    sparse_attention.install(model).eval()
    rows = []
    for s in samples:
        seq = s.prompt_token_ids + s.token_ids
        plen = len(s.prompt_token_ids)
        extra = {}
        if schedule is not None:
            extra["sparrow_plan"] = sparse_attention.recorded_plan(
                [plen],
                [s.kv_budgets],
                len(seq),
                schedule.sink_blocks,
                schedule.local_blocks,
                frozenset(schedule.dense_layers),
                backend="cpu",
            )
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq]), use_cache=False, **extra).logits[0]
        lp = scaled_logprobs(logits[plen - 1 : len(seq) - 1], temperature)
        rows.append(lp if full else lp.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0])
    return rows


def test_sparse_logprobs_match_trainer_oracle_and_schedule_switches_next_step(engine):
    from trainer.model_io import load_model

    first = Schedule(budgets=(48, 64, 80, 96), bin_width=128, version=11, name="first")
    second = Schedule(budgets=(64, 96, 112, 128), bin_width=128, version=12, name="second")
    engine.set_schedule(first)
    groups = [PromptGroup(f"s{i}", _prompt(i, 300 + 40 * i), 2, 0, Sampling(max_new_tokens=80)) for i in range(2)]
    for g in groups:
        engine.submit(g)
    done, steps = [], 0
    while steps < 30:
        done.extend(engine.step())
        steps += 1
    engine.set_schedule(second)  # between step 30 and 31
    while engine.in_flight:
        done.extend(engine.step())
    engine.set_schedule(None)
    assert len(done) == 4
    model = load_model(SMALL)
    for s, ref in zip(done, _teacher_forced(model, done, first), strict=True):
        plen = len(s.prompt_token_ids)
        # Step 1 prefilled every prompt (token 0, dense); token t came from step t + 1.
        want = [0] + [first.budget_for(plen + t) for t in range(1, 30)]
        want += [second.budget_for(plen + t) for t in range(30, len(s.token_ids))]
        assert s.kv_budgets == want
        assert all(0 < b < plen for b in s.kv_budgets[1:])  # selection really happened
        assert s.versions.schedule_version == 11
        diff = (ref - torch.tensor(s.logprobs)).abs().max()
        assert float(diff) <= 1e-3, f"max |engine - teacher-forced| = {float(diff):.2e}"
        assert len(s.top_token_ids) == len(s.token_ids) and all(len(t) == 20 for t in s.top_token_ids)


def test_logprobs_at_a_temperature_other_than_one_are_the_trainers_scaled_ones(engine):
    # The trainer scores log_softmax(logits / T); vLLM's raw logprobs are taken before temperature scaling,
    # so at T != 1 the generator's sampled and top-20 logprobs must come after it (alpha, TIS, the tail).
    from trainer.model_io import load_model

    engine.set_schedule(None)
    t = 0.7
    groups = [
        PromptGroup(f"t{i}", _prompt(40 + i, 120), 2, 0, Sampling(temperature=t, max_new_tokens=24)) for i in range(2)
    ]
    done = _run(engine, groups)
    assert len(done) == 4
    model = load_model(SMALL)
    for s, full in zip(done, _teacher_forced(model, done, temperature=t, full=True), strict=True):
        ids = torch.tensor(s.token_ids)
        sampled = full.gather(1, ids[:, None])[:, 0]
        diff = (sampled - torch.tensor(s.logprobs)).abs().max()
        assert float(diff) <= 1e-3, f"sampled: max |engine - trainer at T={t}| = {float(diff):.2e}"
        top_ids, top_lps = torch.tensor(s.top_token_ids), torch.tensor(s.top_logprobs)
        # The engine's top-20 is the trainer's: the same ids carry the same scaled logprobs.
        diff = (full.gather(1, top_ids) - top_lps).abs().max()
        assert float(diff) <= 1e-3, f"top-20: max |engine - trainer at T={t}| = {float(diff):.2e}"
        assert float((full.topk(20, dim=-1).values - top_lps).abs().max()) <= 1e-3


def test_probe_sequences_decode_at_the_probe_budgets_in_the_same_batch(engine):
    """Half the sequences run at the probe's budgets beside the others in one batch (the worker tells
    their rows by request id), mixed prefill/decode steps included; clearing the probe returns them to
    the schedule from the next step. Every token matches the trainer's scoring under its reported budget."""
    import time

    from services.generator.engine import EngineError
    from sparrow.probe import Probe
    from trainer.model_io import load_model

    schedule = Schedule(budgets=(96, 128, 160, 192), bin_width=128, version=21, name="probed")
    engine.set_schedule(schedule)
    with pytest.raises(EngineError, match="3 bins"):
        engine.set_probe(Probe(21, 0.5, (48, None, 64), time.time() + 60))
    probe = Probe(21, 0.5, (None, 64, 96, None), time.time() + 60)
    engine.set_probe(probe)
    plan = engine.probe_plan
    assert plan is not None and plan.budgets == (96, 64, 96, 192)
    # KV 200-280 and 240-320: bins 1 and 2, where the probe runs at half the schedule's budget.
    a = PromptGroup("pa", _prompt(7, 200), 2, 0, Sampling(max_new_tokens=80))
    b = PromptGroup("pb", _prompt(8, 240), 2, 0, Sampling(max_new_tokens=80))
    engine.submit(a)
    done = []
    for _ in range(5):
        done.extend(engine.step())
    engine.submit(b)  # its prefill shares a step with a's decode rows
    steps = 5
    while steps < 40:
        done.extend(engine.step())
        steps += 1
    engine.set_probe(None)  # between step 40 and 41
    while engine.in_flight:
        done.extend(engine.step())
    engine.set_schedule(None)
    done.sort(key=lambda s: (s.group_id, s.sample_index))
    assert [s.probe for s in done] == [False, True, False, True]
    model = load_model(SMALL)
    for s, ref in zip(done, _teacher_forced(model, done, schedule), strict=True):
        plen, start = len(s.prompt_token_ids), (0 if s.group_id == "pa" else 5)
        cleared = 40 - start  # the sequence's token from step 41 on is token 40 - start
        want = [0] + [
            (plan if s.probe and t < cleared else schedule).budget_for(plen + t) for t in range(1, len(s.token_ids))
        ]
        assert s.kv_budgets == want
        diff = (ref - torch.tensor(s.logprobs)).abs().max()
        assert float(diff) <= 1e-3, f"{s.group_id}/{s.sample_index}: max |engine - teacher-forced| = {float(diff):.2e}"
    probes = [s for s in done if s.probe]
    assert all({64, 96} & set(s.kv_budgets) and {128, 160} & set(s.kv_budgets) for s in probes)  # probe, then not
    assert all(not {64, 96} & set(s.kv_budgets) for s in done if not s.probe)
    # Scored as if they had followed the schedule, the probe sequences' logprobs differ: the rows really
    # decoded at the probe's budgets.
    as_scheduled = [
        type(s)(
            **{
                **s.__dict__,
                "kv_budgets": [0]
                + [schedule.budget_for(len(s.prompt_token_ids) + t) for t in range(1, len(s.token_ids))],
            }
        )
        for s in probes
    ]
    for s, ref in zip(probes, _teacher_forced(model, as_scheduled, schedule), strict=True):
        assert float((ref - torch.tensor(s.logprobs)).abs().max()) > 1e-2


def test_an_evaluation_group_under_the_schedule_is_never_probed(engine):
    """An eval round's scheduled groups (eval.modes "schedule") measure the schedule: while a probe asks for
    every new sequence, theirs follow the schedule's budgets, and a training group beside them is probed."""
    import time

    from sparrow.probe import Probe

    schedule = Schedule(budgets=(96, 128, 160, 192), bin_width=128, version=41, name="eval-scheduled")
    engine.set_schedule(schedule)
    engine.set_probe(Probe(41, 1.0, (None, 64, None, None), time.time() + 60))
    prompt = _prompt(12, 200)
    evaluation = PromptGroup("es", prompt, 2, 0, Sampling(max_new_tokens=30), evaluation=True)
    training = PromptGroup("et", prompt, 2, 0, Sampling(max_new_tokens=30))
    done = _run(engine, [evaluation, training])
    engine.set_probe(None)
    engine.set_schedule(None)
    assert [(s.group_id, s.probe) for s in done] == [("es", False), ("es", False), ("et", True), ("et", True)]
    for s in done[:2]:
        plen = len(s.prompt_token_ids)
        assert s.kv_budgets == [0] + [schedule.budget_for(plen + t) for t in range(1, len(s.token_ids))]
        assert 128 in s.kv_budgets  # bin 1, where the probe would have run at 64
    assert all(64 in s.kv_budgets for s in done[2:])


def test_a_dense_group_decodes_densely_beside_scheduled_ones_in_the_same_batch(engine):
    """Evaluation samples (a group marked dense) attend to every page under a sparse schedule while the
    batch's other rows follow it (the worker tells their rows by request id); each token matches the
    trainer's scoring: dense for the dense group, under its reported budgets for the other."""
    from trainer.model_io import load_model

    schedule = Schedule(budgets=(48, 64, 80, 96), bin_width=128, version=31, name="eval-beside")
    engine.set_schedule(schedule)
    prompt = _prompt(11, 300)
    scheduled = PromptGroup("ds", prompt, 2, 0, Sampling(max_new_tokens=40))
    dense = PromptGroup("dd", prompt, 2, 0, Sampling(max_new_tokens=40), dense=True)
    done = _run(engine, [scheduled, dense])
    engine.set_schedule(None)
    dense_out, sched_out = done[:2], done[2:]
    assert [s.group_id for s in done] == ["dd", "dd", "ds", "ds"]
    assert all(b == 0 for s in dense_out for b in s.kv_budgets) and not any(s.probe for s in dense_out)
    assert all(0 < b < 300 for s in sched_out for b in s.kv_budgets[1:])  # selection really happened beside them
    model = load_model(SMALL)
    refs = _teacher_forced(model, dense_out) + _teacher_forced(model, sched_out, schedule)
    for s, ref in zip(done, refs, strict=True):
        diff = (ref - torch.tensor(s.logprobs)).abs().max()
        assert float(diff) <= 1e-3, f"{s.group_id}/{s.sample_index}: max |engine - teacher-forced| = {float(diff):.2e}"

    # Scored as if they had followed the schedule, the dense samples' logprobs differ: they really decoded densely.
    def scheduled_budgets(s):
        return [0] + [schedule.budget_for(300 + t) for t in range(1, len(s.token_ids))]

    as_scheduled = [type(s)(**{**s.__dict__, "kv_budgets": scheduled_budgets(s)}) for s in dense_out]
    for s, ref in zip(dense_out, _teacher_forced(model, as_scheduled, schedule), strict=True):
        assert float((ref - torch.tensor(s.logprobs)).abs().max()) > 1e-2


def test_policy_weights_and_adapter_load_without_restart(engine, tmp_path):
    from peft import LoraConfig, get_peft_model

    from trainer.model_io import load_model

    engine.set_schedule(None)
    # New policy weights: the small model, perturbed.
    policy = load_model(SMALL)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.save_pretrained(tmp_path / "policy")
    engine.load_policy(tmp_path / "policy", 2)
    assert engine.versions.policy_version == 2
    [s] = _run(engine, [PromptGroup("p", _prompt(7, 200), 1, 2, Sampling(max_new_tokens=40))])
    assert s.versions.policy_version == 2
    [new_ref] = _teacher_forced(policy, [s])
    [old_ref] = _teacher_forced(load_model(SMALL), [s])
    assert float((new_ref - torch.tensor(s.logprobs)).abs().max()) <= 1e-4
    assert float((old_ref - torch.tensor(s.logprobs)).abs().max()) > 1e-2  # the old weights are gone

    # A LoRA adapter on the new policy.
    lora = get_peft_model(
        load_model(tmp_path / "policy"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
    )
    lora.save_pretrained(tmp_path / "adapter")
    engine.load_adapter(tmp_path / "adapter", 1)
    [a] = _run(engine, [PromptGroup("a", _prompt(8, 200), 1, 2, Sampling(max_new_tokens=40))])
    assert a.versions.adapter_version == 1
    [lora_ref] = _teacher_forced(lora.merge_and_unload(), [a])
    assert float((lora_ref - torch.tensor(a.logprobs)).abs().max()) <= 1e-4

    # A corrupt adapter (NaN) is refused; the previous one keeps serving.
    from safetensors.torch import load_file, save_file

    from services.generator.engine import EngineError

    shutil.copytree(tmp_path / "adapter", tmp_path / "bad")
    f = next((tmp_path / "bad").glob("*.safetensors"))
    tensors = load_file(f)
    name = next(iter(tensors))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, f)
    with pytest.raises(EngineError, match="NaN"):
        engine.load_adapter(tmp_path / "bad", 2)
    assert engine.versions.adapter_version == 1
    [b] = _run(engine, [PromptGroup("b", _prompt(9, 200), 1, 2, Sampling(max_new_tokens=20))])
    [lora_ref_b] = _teacher_forced(lora, [b])
    assert b.versions.adapter_version == 1
    assert float((lora_ref_b - torch.tensor(b.logprobs)).abs().max()) <= 1e-4


def _greedy(engine, gid: str):
    [s] = _run(engine, [PromptGroup(gid, _prompt(5, 60), 1, 0, Sampling(temperature=0.0, max_new_tokens=12))])
    return s


def test_prompt_token_ids_outside_the_vocabulary_are_refused_at_submit(engine):
    """vLLM checks ids against its tokenizer, which the engine does not load: unchecked, one bad id fails
    the whole batch's step instead of its own group's submit."""
    from services.generator.engine import EngineError

    for gid, ids in (("oov", (5, 521, 7)), ("neg", (5, -1, 7))):
        try:
            with pytest.raises(EngineError, match="vocabulary"):
                engine.submit(PromptGroup(gid, ids, 2, 0, Sampling(max_new_tokens=4)))
        finally:
            engine.abort(gid)
    assert engine.in_flight == 0
    [s] = _run(engine, [PromptGroup("in-vocab", (5, 520, 7), 1, 0, Sampling(max_new_tokens=4))])
    assert len(s.token_ids) == 4


def test_groups_vllm_refuses_are_refused_as_engine_errors(engine):
    """vLLM's own refusals (VLLMValidationError, no ValueError) leave submit as EngineError, as the contract
    says, so that the service dead-letters the group instead of dying; nothing of the group stays behind."""
    from services.generator.engine import EngineError

    p = _prompt(3, 20)
    bad = {
        "empty": PromptGroup("empty", (), 2, 0, Sampling(max_new_tokens=4)),
        "no tokens": PromptGroup("zero", p, 2, 0, Sampling(max_new_tokens=0)),
        "top-k above max_logprobs": PromptGroup("topk", p, 2, 0, Sampling(max_new_tokens=4, top_logprobs=21)),
    }
    for what, group in bad.items():
        try:
            with pytest.raises(EngineError, match=group.group_id):
                engine.submit(group)
        finally:
            engine.abort(group.group_id)
        assert engine.in_flight == 0, what
    [s] = _run(engine, [PromptGroup("fine", p, 1, 0, Sampling(max_new_tokens=4))])
    assert len(s.token_ids) == 4


def test_a_group_of_no_samples_is_refused(engine):
    from services.generator.engine import EngineError

    try:
        with pytest.raises(EngineError, match="n must be"):
            engine.submit(PromptGroup("none", _prompt(3, 20), 0, 0, Sampling(max_new_tokens=4)))
    finally:
        engine.abort("none")


def _policy(folder: Path, change) -> Path:
    """The small model's checkpoint with `change(tensors)` applied."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for f in SMALL.glob("*.json"):
        shutil.copy(f, folder)
    tensors = load_file(SMALL / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


def _perturb_first_layer(tensors) -> None:
    # Loaded before the fault further on: a load that is not refused up front overwrites them.
    for name in tensors:
        if ".layers.0." in name:
            tensors[name] = tensors[name] + 0.5


def test_a_policy_that_does_not_fit_the_model_is_refused_and_the_old_weights_keep_serving(engine, tmp_path):
    from services.generator.engine import EngineError

    def missing(t):
        _perturb_first_layer(t)
        for name in [n for n in t if ".layers.2." in n]:
            del t[name]

    def wrong_shape(t):
        _perturb_first_layer(t)
        w = t["model.layers.3.mlp.down_proj.weight"]
        t["model.layers.3.mlp.down_proj.weight"] = torch.zeros(w.shape[0], w.shape[1] + 1)

    def unknown(t):
        _perturb_first_layer(t)
        t["model.layers.9.mlp.down_proj.weight"] = torch.zeros(3, 3)

    before, version = _greedy(engine, "before"), engine.versions.policy_version
    for change in (missing, wrong_shape, unknown):
        with pytest.raises(EngineError, match="does not fit"):
            engine.load_policy(_policy(tmp_path / change.__name__, change), version + 1)
        assert engine.versions.policy_version == version
    after = _greedy(engine, "after")
    assert after.token_ids == before.token_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def test_a_policy_with_nan_weights_is_refused(engine, tmp_path):
    from services.generator.engine import EngineError

    def nan(t):
        t["model.layers.1.self_attn.q_proj.weight"][0, 0] = float("nan")

    before, version = _greedy(engine, "before-nan"), engine.versions.policy_version
    with pytest.raises(EngineError, match="NaN"):
        engine.load_policy(_policy(tmp_path / "nan", nan), version + 1)
    assert engine.versions.policy_version == version
    after = _greedy(engine, "after-nan")
    assert after.token_ids == before.token_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def _lora(model, folder: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(folder)
    return folder


def test_a_damaged_adapter_is_refused(engine, tmp_path):
    from services.generator.engine import EngineError
    from trainer.model_io import load_model

    damaged = _lora(load_model(SMALL), tmp_path / "damaged")
    f = next(damaged.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:100])
    version = engine.versions.adapter_version
    with pytest.raises(EngineError, match="cannot read"):
        engine.load_adapter(damaged, version + 1)
    assert engine.versions.adapter_version == version


def test_an_adapter_for_another_model_is_refused(engine, tmp_path):
    """Half the small model's width: vLLM would copy its A matrices into the first half of its own and
    serve the result."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.generator.engine import EngineError

    narrow = Qwen3Config(
        vocab_size=521,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    other = _lora(Qwen3ForCausalLM(narrow), tmp_path / "other")
    version = engine.versions.adapter_version
    with pytest.raises(EngineError, match="shape"):
        engine.load_adapter(other, version + 1)
    assert engine.versions.adapter_version == version


def _streaming_sync(engine, trainer, root: Path):
    """VersionSync as the generator wires it without a relay: streamed loads into this engine."""
    from services.common.grpc_server import GrpcSecurity
    from services.generator.version_sync import VersionSync
    from services.generator.weight_fetch import WeightFetcher

    def from_disk(kind, folder, version):
        raise AssertionError(f"{kind} v{version} went through {folder}")

    def load_tensors(tensors, version):
        engine.load_policy_tensors(tensors, version)
        return engine.versions

    fetcher = WeightFetcher(trainer.address, GrpcSecurity(), root, chunk_bytes=4096)  # tensors span chunks
    return VersionSync(
        fetcher, from_disk, lambda: engine.versions, None, None, None, load_tensors, engine.policy_layout()
    )


def _noisy(t) -> None:
    g = torch.Generator().manual_seed(3)
    for name in t:
        t[name] = t[name] + 0.05 * torch.randn(t[name].shape, generator=g)


def test_a_streamed_policy_serves_as_the_same_version_loaded_from_disk(engine, tmp_path):
    from tests.fixtures.standin_rollout_server import StandinRolloutServer

    engine.set_schedule(None)
    folder = _policy(tmp_path / "policy", _noisy)
    before = _greedy(engine, "stream-before")
    with StandinRolloutServer() as trainer:
        trainer.publish("policy", 31, folder)
        _streaming_sync(engine, trainer, tmp_path / "weights").load_now(31, 0)
    assert engine.versions.policy_version == 31
    assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())  # no disk copy
    streamed = _greedy(engine, "streamed")
    assert streamed.versions.policy_version == 31
    assert streamed.logprobs != pytest.approx(before.logprobs, abs=1e-3)  # the new weights serve
    engine.load_policy(folder, 32)  # the same weights from disk
    disk = _greedy(engine, "from-disk")
    assert streamed.token_ids == disk.token_ids
    assert streamed.logprobs == pytest.approx(disk.logprobs, abs=1e-6)


def test_a_corrupted_stream_is_refused_and_the_old_version_keeps_serving(engine, tmp_path):
    from services.generator.weight_fetch import WeightFetchError
    from tests.fixtures.standin_rollout_server import StandinRolloutServer

    def nan(t):
        _perturb_first_layer(t)  # in the file before the NaN: a load as they come would have overwritten them
        t["model.layers.3.self_attn.q_proj.weight"][0, 0] = float("nan")

    def wrong_shape(t):
        _perturb_first_layer(t)
        w = t["model.layers.3.mlp.down_proj.weight"]
        t["model.layers.3.mlp.down_proj.weight"] = torch.zeros(w.shape[0], w.shape[1] + 1)

    engine.set_schedule(None)
    before, version = _greedy(engine, "corrupt-before"), engine.versions.policy_version
    cases = {
        41: (_policy(tmp_path / "tail", _perturb_first_layer), "model.safetensors", r"sha256 .* does not match"),
        42: (_policy(tmp_path / "nan", nan), "", "q_proj.weight has NaN or inf"),
        43: (_policy(tmp_path / "shape", wrong_shape), "", r"does not fit the serving model: .*down_proj"),
    }
    with StandinRolloutServer() as trainer:
        sync = _streaming_sync(engine, trainer, tmp_path / "weights")
        for v, (folder, tail, message) in cases.items():
            trainer.publish("policy", v, folder, corrupt_tail=tail)
            with pytest.raises(WeightFetchError, match=f"policy v{v} refused: .*{message}"):
                sync.load_now(v, 0)
            assert engine.versions.policy_version == version
    after = _greedy(engine, "corrupt-after")
    assert after.token_ids == before.token_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-6)
