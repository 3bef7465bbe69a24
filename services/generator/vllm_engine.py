"""The production rollout engine: vLLM (in-process engine core) with the block-sparse attention plugin.

The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni",
synchronous scheduling), so one `step()` is exactly one model step: a schedule set between two
steps applies to every token of the next one, and the budget each token was produced under is known
here without asking the workers. Schedules and weights reach the worker through the plugin's worker
extension (`collective_rpc` by method name), which also works with multi-process executors.

A group marked `dense` (evaluation) decodes densely in every layer whatever the schedule, beside
the others in the same batch: its request ids carry `DENSE_PREFIX`, which the attention layers
tell apart (`sparrow_track_rows`); its samples report budget 0 throughout.

Outputs stream as deltas (one new token per sequence per step), with flat logprobs: the sampled
token's raw logprob first, then the top-k in rank order.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from services.generator.engine import (
    FINISH_ABORTED,
    FINISH_LENGTH,
    FINISH_STOP,
    CycleTime,
    EngineError,
    EngineVersions,
    FinishedSample,
    Generated,
    RolloutEngine,
)
from services.generator.plugin import CUDA_BACKEND_NAME, STATIC_DECODE, WORKER_EXTENSION, engine_attention_backend
from services.generator.plugin import enabled as plugin_enabled
from services.generator.plugin.scheduled_decode import DENSE_PREFIX, PROBE_PREFIX
from services.generator.plugin.self_draft import SELF_DRAFT
from services.generator.weight_checks import check_adapter, check_policy, check_policy_names, checkpoint_layout
from sparrow.budget import page_mismatch, step_budget
from sparrow.probe import Probe, ProbeError, ProbePlan, ShareCounter
from sparrow.schedule import Schedule
from sparrow.speculative import MAX_DRAFTS, MIN_DRAFTS
from sparrow.work import PromptGroup

_SEQUENCE_PREFIX = "seq:"  # request ids of sequences that follow the schedule


@dataclass
class _Sequence:
    group: PromptGroup
    index: int
    versions: EngineVersions
    submitted: float
    probe: bool = False
    adapter_folder: str | None = None  # the LoRA this sequence runs with (vLLM may load it from disk again)
    started: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class VllmEngineConfig:
    """How the engine is built (see GeneratorConfig for the documented fields)."""

    model: str
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_lora_rank: int = 16
    seed: int = 0
    top_logprobs: int = 20
    kv_cache_gib: int = 1  # CPU only: memory for the KV cache (vLLM would otherwise take a share of RAM)
    ignore_eos: bool = False  # benchmarks: every sequence runs to max_new_tokens
    attention_backend: str | None = None  # None: the plugin's (TRITON_ATTN on CUDA), else vLLM's choice
    static_decode: bool = False  # CUDA, graphs on: steps of pure decodes as full CUDA graphs (plugin.cuda_backend)
    tensor_parallel_size: int = 1  # past 1: vLLM's multiprocess executor, one worker per device
    speculative_tokens: int = 0  # past 0: lossless self-speculative decoding, k drafts a cycle (plugin.self_draft)


class VllmEngine(RolloutEngine):
    """vLLM with block-sparse decode, hot-swappable schedule, policy weights and LoRA adapter."""

    def __init__(self, config: VllmEngineConfig, schedule: Schedule | None = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
        # vLLM's own log config writes to stdout, which belongs to the caller (e.g. `--json` output).
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        check_tensor_parallel(config.model, config.tensor_parallel_size)  # the model's limit, before the machine's
        if config.tensor_parallel_size > 1:
            _bind_cpu_workers(config.tensor_parallel_size)
        overrides = {}
        if config.max_model_len > _max_positions(config.model):
            # RoPE has no length limit, but vLLM sizes its cos/sin table by max_position_embeddings and
            # goes wrong past it; the trainer's transformers scoring computes any position.
            overrides["max_position_embeddings"] = config.max_model_len
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        extra = {}
        if config.static_decode:
            _check_static_decode(config)
            extra[STATIC_DECODE] = True
        speculative = None
        if config.speculative_tokens:
            _check_speculative(config)
            extra[SELF_DRAFT] = True
            # vLLM's draft-model method with the target's own folder: k lookahead slots, draft probabilities to
            # the rejection sampler; the plugin's patches make the draft the target itself (plugin.self_draft).
            speculative = {
                "method": "draft_model",
                "model": config.model,
                "num_speculative_tokens": config.speculative_tokens,
                "draft_sample_method": "probabilistic",
            }
        self.config = config
        args = EngineArgs(
            model=config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_lora=config.enable_lora,
            max_lora_rank=config.max_lora_rank if config.enable_lora else None,
            max_loras=2 if config.enable_lora else 1,
            max_logprobs=max(config.top_logprobs, 1),
            # After temperature scaling, as the trainer scores them (log_softmax(logits / T)): raw ones are taken
            # before it and describe another distribution at any T != 1. (After top-p too, which RL leaves at 1.)
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            # One worker in this process; past one, vLLM's multiprocess executor (a process per device).
            distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else "mp",
            tensor_parallel_size=config.tensor_parallel_size,
            async_scheduling=False,
            worker_extension_cls=WORKER_EXTENSION,
            attention_backend=config.attention_backend or engine_attention_backend(),
            seed=config.seed,
            hf_overrides=overrides,
            additional_config=extra,
            speculative_config=speculative,
        )
        self._engine = LLMEngine.from_engine_args(args)
        # vLLM checks prompt ids against its tokenizer, which is not loaded here (skip_tokenizer_init).
        self.vocab_size = self._engine.model_config.get_vocab_size()
        # What a new policy must look like: the checkpoint the engine started from, name by name.
        self._layout = checkpoint_layout(Path(config.model)) if Path(config.model).is_dir() else {}
        layers = set(self._engine.collective_rpc("sparrow_attention_layers"))
        if len(layers) != 1:  # a worker without the plugin would decode densely while the others do not
            raise EngineError(f"the workers run the project's attention in differing numbers of layers: {layers}")
        self.sparse_layers = int(layers.pop())
        # Whether the layers tell rows of dense groups apart (without the plugin every row is dense anyway).
        self._dense_rows = not self.sparse_layers or int(self._rpc("sparrow_track_rows")) > 0
        self._sequences: dict[str, _Sequence] = {}
        self._by_group: dict[str, list[str]] = {}
        self._versions = EngineVersions()
        self._schedule: Schedule | None = None
        self._lora = None
        self._lora_loads = 0
        self._probe: Probe | None = None
        self._plan: ProbePlan | None = None  # the probe as the workers run it now
        self._probe_share = ShareCounter()
        self._generated: list[Generated] = []
        self._cycles_taken = float("-inf")  # when take_cycle_times last asked the workers
        self.set_schedule(schedule)

    # -- hot swaps ---------------------------------------------------------------------------------

    def set_schedule(self, schedule: Schedule | None) -> None:
        if schedule is not None and not self.sparse_layers:
            raise EngineError("the sparrow attention plugin is not active in this engine (SPARROW_ATTENTION=stock?)")
        if schedule is not None and self.config.speculative_tokens and not _sparse_layers(schedule, self.config.model):
            raise EngineError(
                f"decode speculative needs a schedule with a sparse layer; schedule v{schedule.version} keeps all "
                "layers dense, so there is nothing to draft with"
            )
        if schedule is not None and (mismatch := page_mismatch(schedule.page_size)):
            raise EngineError(mismatch)
        if self.sparse_layers:
            self._rpc("sparrow_set_schedule", None if schedule is None else schedule.to_json())
        self._schedule = schedule
        version = schedule.version if schedule is not None else self._versions.schedule_version
        self._versions = EngineVersions(self._versions.policy_version, self._versions.adapter_version, version)
        try:
            self._apply_probe()
        except (ProbeError, EngineError):  # the probe was for the old layout; it cannot apply to this schedule
            self._probe = None
            self._apply_probe()

    @property
    def speculative(self) -> bool:
        """Whether this engine decodes losslessly by self-speculation (every request; vLLM's choice is engine-wide)."""
        return self.config.speculative_tokens > 0

    def speculative_counts(self) -> dict[str, int]:
        """vLLM's running totals of a speculative engine: `cycles` (steps that drafted), `drafted` and `accepted`
        draft tokens (all 0 for a sparse engine)."""
        names = {"vllm:spec_decode_num_drafts": "cycles", "vllm:spec_decode_num_draft_tokens": "drafted",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}  # fmt: skip
        out = dict.fromkeys(names.values(), 0)
        if self.speculative:
            for metric in self._engine.get_metrics():
                if metric.name in names:
                    out[names[metric.name]] += int(getattr(metric, "value", 0))
        return out

    def set_probe(self, probe: Probe | None) -> None:
        if probe is not None and not self.sparse_layers:
            raise EngineError("the sparrow attention plugin is not active in this engine (SPARROW_ATTENTION=stock?)")
        if probe is not None and self.speculative:
            raise EngineError("probe refused: a speculative engine emits the dense policy's tokens only, so a lossy "
                              "budget has no tail to show in them")  # fmt: skip
        old = self._probe
        self._probe = probe
        try:
            self._apply_probe()
        except (ProbeError, EngineError) as exc:
            self._probe = old
            raise EngineError(f"probe refused: {exc}") from None

    @property
    def probe_plan(self) -> ProbePlan | None:
        """The probe the workers run now (None: every sequence follows the schedule)."""
        return self._plan

    def _apply_probe(self) -> None:
        # The plan in force: the probe resolved against the schedule, while it has not expired.
        probe = self._probe
        plan = probe.plan(self._schedule) if probe is not None and not probe.expired() else None
        pages = None if plan is None else plan.pages()
        if pages != (None if self._plan is None else self._plan.pages()) and self.sparse_layers:
            try:
                self._rpc("sparrow_set_probe", pages)
            except Exception as exc:  # raised in the worker: it keeps the plan it had
                raise EngineError(f"the attention layers refused the probe: {exc}") from exc
        self._plan = plan

    def load_policy(self, folder: Path, version: int) -> None:
        check_policy(Path(folder), self._layout, version)
        try:
            self._rpc("sparrow_load_weights", str(folder))
        except Exception as exc:  # the worker raised: the old weights may be partly overwritten
            raise EngineError(f"loading policy version {version} from {folder} failed: {exc}") from exc
        # Cached prefixes were computed with the old weights.
        self._engine.reset_prefix_cache(reset_running_requests=False)
        self._versions = EngineVersions(version, self._versions.adapter_version, self._versions.schedule_version)

    def policy_layout(self) -> dict[str, tuple[int, ...]] | None:
        return dict(self._layout) or None  # unknown (a model not in a folder): policies come through disk

    def load_policy_tensors(self, tensors: dict, version: int) -> None:
        check_policy_names(tensors, self._layout, version)
        buckets = load_buckets(tensors, LOAD_BUCKET_BYTES)
        try:
            # Bucket by bucket, all in this call: no engine step runs between two of the version's tensors.
            # Every worker gets each whole tensor (out of band, through vLLM's shared-memory queue) and its
            # model's weight loaders keep its own shard; a bucket bounds what a worker holds at once.
            for i, bucket in enumerate(buckets):
                self._rpc("sparrow_load_tensors", bucket, i == 0, i == len(buckets) - 1)
        except Exception as exc:  # the worker raised: the old weights may be partly overwritten
            raise EngineError(f"loading policy version {version} from memory failed: {exc}") from exc
        self._engine.reset_prefix_cache(reset_running_requests=False)
        self._versions = EngineVersions(version, self._versions.adapter_version, self._versions.schedule_version)

    def load_adapter(self, folder: Path, version: int) -> None:
        if self.speculative:
            raise EngineError(f"adapter v{version}: decode speculative does not take DistillSparse adapters yet (they "
                              "belong to the drafts, and vLLM would apply them to the dense verify too)")  # fmt: skip
        if not self.config.enable_lora:
            raise EngineError("this engine was started without LoRA support (enable_lora = false)")
        from vllm.lora.request import LoRARequest

        check_adapter(Path(folder), self.config.max_lora_rank, self._layout)
        # A fresh LoRA id per load, not the version: vLLM skips an add_lora whose id it already holds,
        # so a version number reused (a new trainer run) would keep serving the old weights.
        self._lora_loads += 1
        request = LoRARequest(f"sparrow-adapter-{version}-{self._lora_loads}", self._lora_loads, str(folder))
        try:
            self._engine.add_lora(request)
        except Exception as exc:
            raise EngineError(f"adapter version {version} refused by the engine: {exc}") from exc
        self._lora = request
        self._versions = EngineVersions(self._versions.policy_version, version, self._versions.schedule_version)

    def adapter_folders_in_use(self) -> set[Path]:
        # vLLM reads a LoRA from its folder when a batch needs it and its cache does not hold it (the
        # cache keeps `max_loras`): the folder of every unfinished sequence's adapter must stay.
        folders = {Path(seq.adapter_folder) for seq in self._sequences.values() if seq.adapter_folder}
        if self._lora is not None:
            folders.add(Path(self._lora.lora_path))
        return folders

    # -- generation --------------------------------------------------------------------------------

    def submit(self, group: PromptGroup) -> None:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        s = group.sampling
        if group.n < 1:  # a group of no samples would never finish
            raise EngineError(f"group {group.group_id}: n must be at least 1, got {group.n}")
        if group.dense and not self._dense_rows:
            raise EngineError(f"group {group.group_id}: this engine's attention layers cannot decode a group densely")
        if group.decode == "speculative" and not group.dense and not self.speculative:
            raise EngineError(
                f"group {group.group_id}: this vLLM engine decodes sparsely; speculative groups need an engine "
                "started with engine.decode = speculative (vLLM speculates for every request or none)"
            )
        if group.decode == "sparse" and not group.dense and self.speculative:
            raise EngineError(
                f"group {group.group_id}: this vLLM engine decodes speculatively (lossless, for every request); "
                "a lossy sparse group needs an engine started with engine.decode = sparse"
            )
        if self.speculative and s.top_p < 1.0:
            raise EngineError(
                f"group {group.group_id}: speculative decoding on vLLM samples its drafts at the temperature only; "
                f"top_p {s.top_p} would make the drafts' distribution differ from the one verified (use top_p 1)"
            )
        if len(group.prompt_token_ids) + s.max_new_tokens > self.config.max_model_len:
            raise EngineError(
                f"group {group.group_id}: prompt ({len(group.prompt_token_ids)}) + max_new_tokens ({s.max_new_tokens}) "
                f"exceeds the engine's max_model_len {self.config.max_model_len}"
            )
        # Unchecked, one id outside the embedding fails the step of every sequence in the batch.
        bad = next((t for t in group.prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise EngineError(
                f"group {group.group_id}: prompt token id {bad} is outside the model's vocabulary of {self.vocab_size}"
            )
        try:
            params = SamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_new_tokens,
                logprobs=s.top_logprobs,
                detokenize=False,
                ignore_eos=self.config.ignore_eos,
                # Every eos id of the model (Qwen3 lists two) and the trainer's own; vLLM alone stops at one.
                stop_token_ids=[] if self.config.ignore_eos else list(s.stop_token_ids),
                flat_logprobs=True,
                output_kind=RequestOutputKind.DELTA,
            )
        except (VLLMValidationError, ValueError) as exc:  # vLLM's own refusals are no ValueError
            raise EngineError(f"group {group.group_id}: vLLM refused its sampling settings: {exc}") from None
        now = time.time()
        keys = [f"{group.group_id}#{group.attempt}#{i}" for i in range(group.n)]
        prefixes = (PROBE_PREFIX, DENSE_PREFIX, _SEQUENCE_PREFIX)
        if any(prefix + key in self._sequences for key in keys for prefix in prefixes):
            raise EngineError(f"group {group.group_id} attempt {group.attempt} is already being generated")
        self._expire_probe()
        ids = []
        for i, key in enumerate(keys):
            # External ids (vLLM adds its own suffix internally; outputs and aborts use these). The
            # attention layers tell probe and dense rows by the prefix; every other id starts otherwise.
            probe = (
                not (group.dense or group.evaluation)
                and self._plan is not None
                and self._probe_share.take(self._plan.share)
            )
            rid = (DENSE_PREFIX if group.dense else PROBE_PREFIX if probe else _SEQUENCE_PREFIX) + key
            try:
                self._engine.add_request(
                    rid, {"prompt_token_ids": list(group.prompt_token_ids)}, params, lora_request=self._lora
                )
            except (VLLMValidationError, ValueError) as exc:
                if ids:  # none of the group's samples stays behind
                    self._engine.abort_request(ids)
                    for added in ids:
                        self._sequences.pop(added, None)
                raise EngineError(f"group {group.group_id}: vLLM refused it: {exc}") from None
            folder = self._lora.lora_path if self._lora is not None else None
            self._sequences[rid] = _Sequence(
                group, i, self._versions, submitted=now, probe=probe, adapter_folder=folder
            )
            ids.append(rid)
        self._by_group.setdefault(group.group_id, []).extend(ids)

    def step(self) -> list[FinishedSample]:
        if not self._sequences:
            return []
        self._expire_probe()
        schedule, plan = self._schedule, self._plan
        started = time.time()
        finished: list[FinishedSample] = []
        # vLLM runs prefills and decodes in one batch, and its step does not say how long each took: a step
        # while any sequence still waits for its first token counts as prefill whole, the others as decode.
        prefill = any(not seq.token_ids for seq in self._sequences.values())
        with self._phase("prefill") if prefill else nullcontext():
            outputs = self._engine.step()
        done = [o.request_id for o in outputs if o.finished and o.request_id in self._sequences]
        drafts = self._rpc("sparrow_take_drafts", done) if self.speculative and done else {}
        for out in outputs:
            seq = self._sequences.get(out.request_id)
            if seq is None:
                continue
            if not seq.started:
                seq.started = started
            completion = out.outputs[0]
            # A speculative engine emits only tokens of the dense policy: each is recorded with the dense budget.
            follows = not (seq.group.dense or self.speculative)
            self._append(seq, completion, schedule if follows else None, plan if seq.probe else None)
            if out.finished:
                reason = FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH
                if completion.finish_reason == "abort":
                    reason = FINISH_ABORTED
                finished.append(self._finish(out.request_id, reason, drafts.get(out.request_id, ())))
        return finished

    def _expire_probe(self) -> None:
        if self._plan is not None and self._probe is not None and self._probe.expired():
            self._apply_probe()

    def _append(self, seq: _Sequence, completion, schedule: Schedule | None, plan: ProbePlan | None) -> None:
        plen = len(seq.group.prompt_token_ids)
        flat = completion.logprobs
        first = len(seq.token_ids)
        for j, token in enumerate(completion.token_ids):
            t = len(seq.token_ids)  # generated tokens before this one
            seq.token_ids.append(int(token))
            if flat is not None and len(flat.start_indices) > j:
                a, b = flat.start_indices[j], flat.end_indices[j]
                ids, lps, ranks = flat.token_ids[a:b], flat.logprobs[a:b], flat.ranks[a:b]
                # The sampled token comes first; the top-k follow in rank order (it may appear twice).
                seq.logprobs.append(float(lps[0]))
                top = sorted(zip(ranks[1:], ids[1:], lps[1:], strict=True))
                seq.top_ids.append([int(i) for _, i, _ in top])
                seq.top_logprobs.append([float(lp) for _, _, lp in top])
            # Token 0 comes from the dense prefill; token t >= 1 from a decode step at KV length plen + t.
            source = None if t == 0 or schedule is None else plan or schedule
            seq.budgets.append(step_budget(source, plen + t))
        if len(seq.token_ids) > first:
            self._generated.append(Generated(seq.group.group_id, seq.index, plen, first, seq.budgets[first:]))

    def take_generated(self) -> list[Generated]:
        out, self._generated = self._generated, []
        return out

    def take_cycle_times(self, flush: bool = False) -> list[CycleTime]:
        # One call to the workers a second at most (the times wait in the worker meanwhile); the first worker's:
        # under tensor parallelism every worker runs the same cycles, each timed by its own clock.
        now = time.monotonic()
        if not self.speculative or (now - self._cycles_taken < CYCLE_TIMES_EVERY_S and not flush):
            return []
        self._cycles_taken = now
        times = self._engine.collective_rpc("sparrow_take_cycle_times")[0]
        return [CycleTime(int(r), int(kv), float(d), float(v)) for r, kv, d, v in times]

    def _finish(self, request_id: str, reason: str, drafts=()) -> FinishedSample:
        seq = self._sequences.pop(request_id)
        group_ids = self._by_group.get(seq.group.group_id, [])
        if request_id in group_ids:
            group_ids.remove(request_id)
        if not group_ids:
            self._by_group.pop(seq.group.group_id, None)
        now = time.time()
        return FinishedSample(
            group_id=seq.group.group_id,
            sample_index=seq.index,
            prompt_token_ids=list(seq.group.prompt_token_ids),
            token_ids=seq.token_ids,
            logprobs=seq.logprobs,
            top_token_ids=seq.top_ids,
            top_logprobs=seq.top_logprobs,
            kv_budgets=seq.budgets,
            versions=seq.versions,
            finish_reason=reason,
            queue_seconds=max(0.0, (seq.started or now) - seq.submitted),
            generate_seconds=max(0.0, now - (seq.started or now)),
            probe=seq.probe,
            # A speculative engine's full cycles, k drafts each: (alpha, accepted, KV length of the draft step).
            speculative_tokens=self.config.speculative_tokens if drafts else 0,
            drafted_tokens=len(drafts),
            accepted_tokens=sum(1 for _, ok, _ in drafts if ok),
            draft_alphas=[float(a) for a, _, _ in drafts],
            draft_accepted=[bool(ok) for _, ok, _ in drafts],
            draft_kv_lens=[int(kv) for _, _, kv in drafts],
        )

    def abort(self, group_id: str) -> None:
        ids = self._by_group.pop(group_id, [])
        if ids:
            self._engine.abort_request(ids)
            if self.speculative and self._engine is not None:
                self._rpc("sparrow_take_drafts", ids)  # their drafts' notes go with them
        for rid in ids:
            self._sequences.pop(rid, None)

    @property
    def versions(self) -> EngineVersions:
        return self._versions

    @property
    def in_flight(self) -> int:
        return len(self._sequences)

    def close(self) -> None:
        for gid in list(self._by_group):
            self.abort(gid)
        engine, self._engine = self._engine, None
        if engine is not None:
            shutdown = getattr(engine.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def _rpc(self, method: str, *args):
        """Calls the worker extension's `method` on every worker; their answers must agree (one worker that
        took a schedule, a probe or a load differently from the others would decode another model)."""
        results = self._engine.collective_rpc(method, args=args)
        if any(r != results[0] for r in results[1:]):
            raise EngineError(f"the workers answered {method} differently: {results}")
        return results[0]


CYCLE_TIMES_EVERY_S = 1.0  # how often the engine collects the workers' timed speculative cycles
LOAD_BUCKET_BYTES = 512 << 20  # what one call to the workers carries of a streamed version


def load_buckets(tensors: dict, limit: int) -> list[list[tuple[str, object]]]:
    """Splits (name, tensor) pairs into consecutive buckets of at most `limit` bytes (a larger tensor alone)."""
    buckets: list[list[tuple[str, object]]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def _bind_cpu_workers(size: int) -> None:
    """On a CPU engine, gives each of the `size` workers its own share of this process's CPUs, unless
    VLLM_CPU_OMP_THREADS_BIND says otherwise. vLLM's default ("auto") binds one NUMA node per worker and
    refuses to start a multiprocess engine on a machine with fewer nodes than workers (most machines)."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size:
        raise EngineError(f"engine.tensor_parallel_size {size} needs a CPU per worker; this process has {len(cpus)}")
    share = len(cpus) // size
    groups = [cpus[i * share : (i + 1) * share] for i in range(size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(str(c) for c in g) for g in groups)


def check_tensor_parallel(model_dir: str, size: int) -> None:
    """Refuses (EngineError, one line) a tensor-parallel size that does not divide the model's attention heads
    and KV heads: each worker holds whole heads (vLLM would otherwise fail deep in its start-up, or replicate
    KV heads, which the per-head page selection does not expect)."""
    if size < 1:
        raise EngineError(f"engine.tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"engine.tensor_parallel_size {size}: cannot read {model_dir}/config.json: {exc}") from None
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads", 0))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    for count, what in ((heads, "attention heads"), (kv_heads, "KV heads")):
        if count <= 0 or count % size:
            raise EngineError(f"engine.tensor_parallel_size {size} does not divide the model's {count} {what}")


def _max_positions(model_dir: str) -> int:
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 1 << 30))
    except (OSError, ValueError):
        return 1 << 30


def _check_speculative(config: VllmEngineConfig) -> None:
    """Raise EngineError unless this engine can draft for itself: k in range, the plugin's CPU attention (whose
    metadata builder marks draft steps), and none of the options the self-draft does not combine with yet."""
    from vllm.platforms import current_platform

    k = config.speculative_tokens
    if not MIN_DRAFTS <= k <= MAX_DRAFTS:
        raise EngineError(f"speculative_tokens must be in [{MIN_DRAFTS}, {MAX_DRAFTS}], got {k}")
    if current_platform.is_cuda() or config.attention_backend not in (None, "CPU_ATTN") or not plugin_enabled():
        raise EngineError("decode speculative on vLLM runs on the plugin's CPU attention only so far (its CUDA "
                          "backend does not tell draft steps apart)")  # fmt: skip
    refused = {
        "static_decode": config.static_decode,
        "enable_lora (a DistillSparse adapter belongs to the drafts, which vLLM would give the verify too)": (
            config.enable_lora
        ),
        "tensor_parallel_size > 1": config.tensor_parallel_size > 1,
    }
    for option, on in refused.items():
        if on:
            raise EngineError(f"decode speculative on vLLM does not combine with {option}")


def _sparse_layers(schedule: Schedule, model: str) -> int:
    """How many of the model's layers `schedule` decodes sparsely."""
    layers = int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])
    return layers - len({i for i in schedule.dense_layers if 0 <= i < layers})


def _check_static_decode(config: VllmEngineConfig) -> None:
    """Raise EngineError unless static decode can run: a CUDA engine with the plugin and CUDA graphs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise EngineError("static decode (full CUDA graphs of decode steps) needs a CUDA engine")
    if config.enforce_eager:
        raise EngineError("static decode captures CUDA graphs: it needs enforce_eager off")
    if (config.attention_backend or engine_attention_backend()) != CUDA_BACKEND_NAME:
        raise EngineError(
            f"static decode needs the plugin's attention ({CUDA_BACKEND_NAME}, SPARROW_ATTENTION not stock)"
        )
