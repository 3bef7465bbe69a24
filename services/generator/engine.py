"""The rollout engine as the generator service sees it: prompt groups in, finished samples out.

`services/generator/service.py` drives an engine without knowing which one it is:

    engine.submit(group)            # n samples of one prompt group join the running batch
    for sample in engine.step():    # one engine step (continuous batching); samples that finished
        ...
    engine.take_generated()         # the tokens generated since the last call, finished or not
    engine.take_cycle_times()       # speculative cycles timed since the last call (drafts vs verify)
    engine.time_phases(timer)       # charge engine time to prefill / sampling (sparrow.timing)
    engine.set_schedule(schedule)   # applies from the next step on
    engine.set_probe(probe)         # a share of new sequences at the probe's budgets (None: off)
    engine.load_policy(folder, 7)   # in place, no restart
    engine.load_policy_tensors(tensors, 8)  # the same from host memory (streamed loads; vLLM only)
    engine.load_adapter(folder, 3)  # runtime LoRA, new lora_int_id per version

Implementations: `vllm_engine.VllmEngine` (production: vLLM with the block-sparse attention
plugin) and `reference_engine.ReferenceEngine` (the project's own paged torch decode loop of
`trainer.reference_generate`, slow, no vLLM needed; used to test the service's plumbing quickly and
on machines without vLLM). Both are real generators; neither is a mock.
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from sparrow.probe import Probe, ProbePlan
from sparrow.schedule import Schedule
from sparrow.timing import PhaseTimer
from sparrow.work import PromptGroup

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORTED = "aborted"


@dataclass(frozen=True)
class EngineVersions:
    """What produced a sample: policy, adapter (0 = none) and schedule versions."""

    policy_version: int = 0
    adapter_version: int = 0
    schedule_version: int = 0


@dataclass
class FinishedSample:
    """One finished response of a group, with everything the trainer needs."""

    group_id: str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # sampled token's raw logprob at the group's temperature, per position
    top_token_ids: list[list[int]]  # top-k ids per position, most likely first
    top_logprobs: list[list[float]]
    kv_budgets: list[int]  # KV budget in tokens used for each position (0 = dense)
    versions: EngineVersions
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORTED
    queue_seconds: float = 0.0
    generate_seconds: float = 0.0
    probe: bool = False  # started as a probe sequence: its budgets were the probe's while one applied
    # Speculative decoding (0 and empty otherwise): drafts per cycle (k), drafts made while the sample ran and
    # those the dense verify accepted, and per drafted position (cycle by cycle, k each, drafts past the
    # sample's end included) sum_x min(p, q) of its dense and draft distributions, whether it was accepted,
    # and the KV length of the draft step that made it.
    speculative_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_alphas: list[float] = field(default_factory=list)
    draft_accepted: list[bool] = field(default_factory=list)
    draft_kv_lens: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Generated:
    """Tokens one sequence generated since the last `take_generated`: its `first`, `first + 1`, ... response
    tokens, with the KV budget of each (the sequence may be unfinished, or later aborted)."""

    group_id: str
    sample_index: int
    prompt_len: int
    first: int
    kv_budgets: list[int]


@dataclass(frozen=True)
class CycleTime:
    """One speculative cycle of a whole batch, timed by the engine: its `rows` sequences, the mean KV length of
    their first draft step, the seconds of the k draft steps, and of the rest of the cycle (the dense verify,
    rejection sampling and the engine's own work). The lossless controller prices drafts with them."""

    rows: int
    kv_len: int
    draft_seconds: float
    verify_seconds: float


class EngineError(RuntimeError):
    """An engine operation that failed without harming the engine (e.g. a refused adapter)."""


class RolloutEngine(abc.ABC):
    """A continuous-batching sampler with hot-swappable schedule, policy weights and LoRA adapter."""

    @abc.abstractmethod
    def submit(self, group: PromptGroup) -> None:
        """Adds the group's `n` samples to the batch (they start on the next `step`)."""

    @abc.abstractmethod
    def step(self) -> list[FinishedSample]:
        """Runs one engine step; returns the samples that finished in it."""

    @abc.abstractmethod
    def take_generated(self) -> list[Generated]:
        """The tokens generated since the last call, per sequence, whether or not the sequence has finished."""

    def take_cycle_times(self, flush: bool = False) -> list[CycleTime]:
        """The speculative cycles timed since the last call (none when not speculative). Only cycles of decodes
        alone, each row drafting k, are timed: a batch that also prefills would charge the prefill to the verify.
        An engine may collect them from its workers now and then; `flush` collects them now."""
        return []

    _phases: PhaseTimer | None = None

    def time_phases(self, phases: PhaseTimer | None) -> None:
        """Charge the engine's prefill and sampling time to `phases` (its `prefill` and `sampling` phases, inside
        the caller's `decode`; None: no timer); the timer's thread must be the one that calls `step`."""
        self._phases = phases

    def _phase(self, name: str) -> AbstractContextManager:
        return self._phases.phase(name) if self._phases is not None else nullcontext()

    @abc.abstractmethod
    def abort(self, group_id: str) -> None:
        """Drops the group's unfinished samples (drain, shutdown)."""

    @abc.abstractmethod
    def set_schedule(self, schedule: Schedule | None) -> None:
        """Uses `schedule` (None: dense) for every sequence from the next step on."""

    @abc.abstractmethod
    def set_probe(self, probe: Probe | None) -> None:
        """Runs `probe.share` of new sequences at the probe's budgets (None: none) while it applies to the
        schedule in force and has not expired; a probe sequence decodes at the probe's budgets while a
        probe applies, at the schedule's otherwise. Raises EngineError for a probe the schedule cannot run."""

    @property
    @abc.abstractmethod
    def probe_plan(self) -> ProbePlan | None:
        """The probe new sequences run under now (None: none applies)."""

    @abc.abstractmethod
    def load_policy(self, folder: Path, version: int) -> None:
        """Loads HF-format weights from `folder` in place; new samples carry `version`."""

    def policy_layout(self) -> dict[str, tuple[int, ...]] | None:
        """Name -> shape of the checkpoint this engine serves, when it can load a policy from host tensors
        (`load_policy_tensors`: streamed loads); None: it loads policies from folders only."""
        return None

    def load_policy_tensors(self, tensors: dict, version: int) -> None:
        """Loads a policy from host tensors (name -> tensor, the layout of `policy_layout`, every tensor finite:
        checked on arrival by weight_stream) in place; new samples carry `version`. Raises EngineError."""
        raise EngineError(f"policy v{version}: this engine loads policies from folders only")

    @abc.abstractmethod
    def load_adapter(self, folder: Path, version: int) -> None:
        """Loads a peft LoRA adapter; new sequences use it. Raises EngineError when refused."""

    def adapter_folders_in_use(self) -> set[Path]:
        """Adapter folders the engine may still read from disk: an engine that loads an adapter when a
        batch first needs it (vLLM) reads the folder of every unfinished sequence's adapter. None here:
        an engine that reads an adapter whole in `load_adapter` needs no folder afterwards."""
        return set()

    @property
    @abc.abstractmethod
    def versions(self) -> EngineVersions:
        """The versions new sequences are generated with."""

    @property
    @abc.abstractmethod
    def in_flight(self) -> int:
        """Unfinished sequences in the batch."""

    def has_work(self) -> bool:
        return self.in_flight > 0

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the engine (subprocesses, memory)."""
