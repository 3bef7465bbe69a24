"""A rollout engine on the project's own paged torch decode loop: no vLLM, slow, exact.

It reuses `trainer.reference_generate.PagedDecodeCache` (dense prefill, block-sparse decode under
the schedule's budget at each step's KV length) and the transformers model of `trainer.model_io`.
No continuous batching: each `step()` generates one whole submitted group, its `n` samples as
one batch, so a schedule set between steps applies from the next group on. It honours the
group's temperature, top_p, max_new_tokens and top logprobs, stops rows at EOS, reports the
budget of every position (0 where attention was dense: the first token, which comes from the
dense prefill, and any step whose budget covered its whole context), loads new
policy weights in place and peft LoRA adapters (injected by peft, one adapter name per version;
a refused adapter leaves the previous one serving).

`decode` (`DECODE_MODES`, per engine; a group may ask for its own, `PromptGroup.decode`): sparse is the
above; dense ignores the schedule; speculative drafts through the block-sparse path and verifies
densely (`speculative_decode`), so every token is the dense policy's and reports budget 0. A
speculative group with no schedule in force decodes densely (there is nothing to draft with), and
none of its samples is a probe (a probe measures a lossy budget's tail, which a lossless sample lacks).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from pathlib import Path

import torch

from services.generator.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    CycleTime,
    EngineError,
    EngineVersions,
    FinishedSample,
    Generated,
    RolloutEngine,
)
from services.generator.speculative_decode import DecodedRow, SpeculativeDecoder
from sparrow.budget import in_pages, page_mismatch, step_budget
from sparrow.probe import Probe, ProbeError, ProbePlan, ShareCounter
from sparrow.prompts import stop_token_ids
from sparrow.schedule import Schedule
from sparrow.speculative import MAX_DRAFTS, MIN_DRAFTS
from sparrow.work import PromptGroup
from trainer import sparse_attention
from trainer.reference_generate import PagedDecodeCache
from trainer.scoring import scaled_logprobs

# How decode attends: sparse (lossy, the schedule's budgets), speculative (sparse drafts verified
# densely: lossless), dense (every page, the schedule ignored).
DECODE_MODES = ("sparse", "speculative", "dense")

_PEFT_PREFIX = "base_model.model."


class ReferenceEngine(RolloutEngine):
    """One group per step, sampled with the reference block-sparse decode loop."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        kernel_backend: str = "auto",
        seed: int = 0,
        max_model_len: int = 4096,
        max_lora_rank: int = 64,
        policy_version: int = 0,
        decode: str = "sparse",
        speculative_tokens: int = 6,
    ) -> None:
        from trainer.model_io import ModelLoadError, load_model

        if decode not in DECODE_MODES:
            raise EngineError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
        if not MIN_DRAFTS <= speculative_tokens <= MAX_DRAFTS:
            raise EngineError(f"speculative_tokens must be in [{MIN_DRAFTS}, {MAX_DRAFTS}], got {speculative_tokens}")

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.model = sparse_attention.install(load_model(model_dir, device))
        except ModelLoadError as exc:
            raise EngineError(str(exc)) from None
        self.device = torch.device(device)
        self.backend = kernel_backend
        self.max_model_len = max_model_len
        self.max_lora_rank = max_lora_rank
        self.decode = decode
        self.speculative_tokens = speculative_tokens
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        # config.json's eos and generation_config.json's (Qwen3 lists two there, one in config.json)
        self.eos_ids = list(stop_token_ids(None, model_dir))
        self._queue: deque[tuple[PromptGroup, float]] = deque()
        self._schedule: Schedule | None = None
        self._probe: Probe | None = None
        self._probe_share = ShareCounter()
        self._versions = EngineVersions(policy_version=policy_version)
        self._adapter: str | None = None
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        self._generated: list[Generated] = []
        self._cycle_times: list[CycleTime] = []

    # ---- the batch ----------------------------------------------------------------------------------

    def submit(self, group: PromptGroup) -> None:
        plen = len(group.prompt_token_ids)
        if plen >= self.max_model_len:
            raise EngineError(f"a prompt of {plen} tokens leaves no room under max_model_len {self.max_model_len}")
        top = max(group.prompt_token_ids)
        if top >= self.vocab_size:
            raise EngineError(f"prompt token id {top} is outside the model's vocabulary of {self.vocab_size}")
        if any(g.group_id == group.group_id for g, _ in self._queue):
            raise EngineError(f"group {group.group_id} is already in the batch")
        if self._mode(group) == "speculative" and self._adapter is not None:
            raise EngineError(
                f"group {group.group_id} asks for speculative decoding, which does not take the DistillSparse "
                f"adapter this engine serves (adapter v{self._versions.adapter_version})"
            )
        self._queue.append((group, time.monotonic()))

    def _mode(self, group: PromptGroup) -> str:
        """How `group` decodes: dense groups densely, otherwise the mode it asks for or the engine's."""
        return "dense" if group.dense else group.decode or self.decode

    def step(self) -> list[FinishedSample]:
        if not self._queue:
            return []
        group, submitted = self._queue.popleft()
        return self._generate(group, submitted)

    def take_generated(self) -> list[Generated]:
        # A step generates its group whole: its tokens are all generated in the step that returns them.
        out, self._generated = self._generated, []
        return out

    def take_cycle_times(self, flush: bool = False) -> list[CycleTime]:
        out, self._cycle_times = self._cycle_times, []
        return out

    def abort(self, group_id: str) -> None:
        self._queue = deque((g, t) for g, t in self._queue if g.group_id != group_id)

    @property
    def in_flight(self) -> int:
        return sum(g.n for g, _ in self._queue)

    @torch.no_grad()
    def _generate(self, group: PromptGroup, submitted: float) -> list[FinishedSample]:
        start = time.monotonic()
        s, n = group.sampling, group.n
        prompt = list(group.prompt_token_ids)
        plen = len(prompt)
        max_new = min(s.max_new_tokens, self.max_model_len - plen)
        schedule, versions = self._schedule, self._versions
        plan = self.probe_plan
        mode = self._mode(group)
        if mode == "dense":  # dense attention whatever the schedule, and never a probe
            schedule, plan = None, None
        if group.evaluation:  # evaluation under the schedule: that schedule's samples, never a probe's
            plan = None
        if mode == "speculative":  # a probe measures a lossy budget's tail; a lossless sample has none to show
            plan = None
        # Which of the group's samples are probes: decoded at the plan's budgets (fixed for the group:
        # this engine takes a new probe or schedule between groups).
        probing = torch.tensor(
            [plan is not None and self._probe_share.take(plan.share) for _ in range(n)], device=self.device
        )
        speculate = mode == "speculative" and schedule is not None
        lens = torch.full((n,), plen, dtype=torch.long, device=self.device)
        # Speculation drafts up to k slots past the last token it may emit.
        capacity = plen + max_new + (self.speculative_tokens + 1 if speculate else 0)
        cache = PagedDecodeCache(self.model, lens, capacity, schedule, self.backend)
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)[None].expand(n, plen)
        positions = torch.arange(plen, device=self.device)[None].expand(n, plen)
        with self._phase("prefill"):
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False, sparrow_cache=cache)
            logits = out.logits[:, -1]
        stops = list(dict.fromkeys([*self.eos_ids, *s.stop_token_ids]))
        eos = torch.tensor(stops, dtype=torch.long, device=self.device)
        if speculate:
            decoder = SpeculativeDecoder(self.model, cache, s, self.speculative_tokens, max_new, eos, self._rng)
            rows = decoder.run(logits, lens)
            self._cycle_times += decoder.cycle_times
            return self._finished(group, rows, stops, versions, probing, submitted, start)
        rows = [DecodedRow() for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        budgets = torch.zeros(n, dtype=torch.long, device=self.device)  # the first token: dense prefill
        for step in range(max_new):
            with self._phase("sampling"):
                logprobs = scaled_logprobs(logits, s.temperature)
                nxt = self._sample(logprobs, s.top_p)
                sampled = logprobs.gather(-1, nxt[:, None])[:, 0]
                top = torch.topk(logprobs, min(s.top_logprobs, logprobs.shape[-1]), dim=-1)
                for i in (~done).nonzero()[:, 0].tolist():
                    rows[i].add(
                        int(nxt[i]), float(sampled[i]), top.indices[i].tolist(), top.values[i].tolist(), int(budgets[i])
                    )
                done |= torch.isin(nxt, eos)
            if bool(done.all()) or step == max_new - 1:
                break
            lens = lens + 1
            cache.start_step(lens)
            if plan is not None:
                cache.budgets = torch.where(probing, in_pages(plan.budget_tokens(lens)), cache.budgets)
            # What each row reports, as in vLLM (0 where its budget covered the whole context).
            budgets = torch.where(probing, step_budget(plan, lens), step_budget(schedule, lens))
            out = self.model(
                input_ids=nxt[:, None], position_ids=(lens - 1)[:, None], use_cache=False, sparrow_cache=cache
            )
            logits = out.logits[:, 0]
        return self._finished(group, rows, stops, versions, probing, submitted, start)

    def _finished(self, group, rows, stops, versions, probing, submitted: float, start: float) -> list[FinishedSample]:
        elapsed = time.monotonic() - start
        prompt = list(group.prompt_token_ids)
        self._generated += [Generated(group.group_id, i, len(prompt), 0, list(r.budgets)) for i, r in enumerate(rows)]
        return [
            FinishedSample(
                group_id=group.group_id,
                sample_index=i,
                prompt_token_ids=prompt,
                token_ids=r.tokens,
                logprobs=r.logprobs,
                top_token_ids=r.top_ids,
                top_logprobs=r.top_logprobs,
                kv_budgets=r.budgets,
                versions=versions,
                finish_reason=FINISH_STOP if r.tokens[-1] in stops else FINISH_LENGTH,
                queue_seconds=start - submitted,
                generate_seconds=elapsed,
                probe=bool(probing[i]),
                speculative_tokens=self.speculative_tokens if r.drafted else 0,
                drafted_tokens=r.drafted,
                accepted_tokens=r.accepted,
                draft_alphas=r.alphas,
                draft_accepted=r.draft_accepted,
                draft_kv_lens=r.alpha_kv_lens,
            )
            for i, r in enumerate(rows)
        ]

    def _sample(self, logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
        probs = logprobs.exp()
        if top_p >= 1.0:
            return torch.multinomial(probs, 1, generator=self._rng)[:, 0]
        # Nucleus: the most likely tokens until their mass reaches top_p (always at least one).
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        choice = torch.multinomial(sorted_p * keep, 1, generator=self._rng)
        return order.gather(-1, choice)[:, 0]

    # ---- swaps --------------------------------------------------------------------------------------

    def set_schedule(self, schedule: Schedule | None) -> None:
        if schedule is not None and (mismatch := page_mismatch(schedule.page_size)):
            raise EngineError(mismatch)
        if schedule is not None and self.decode == "speculative" and not self._sparse_layers(schedule):
            raise EngineError(
                f"decode speculative needs a schedule with a sparse layer; schedule v{schedule.version} keeps all "
                f"{self.num_layers} layers dense, so its drafts would be the dense pass itself"
            )
        self._schedule = schedule
        self._versions = EngineVersions(
            self._versions.policy_version, self._versions.adapter_version, schedule.version if schedule else 0
        )

    def _sparse_layers(self, schedule: Schedule) -> list[int]:
        return [layer for layer in range(self.num_layers) if layer not in schedule.dense_layers]

    def set_probe(self, probe: Probe | None) -> None:
        if probe is not None:
            try:
                probe.plan(self._schedule)
            except ProbeError as exc:
                raise EngineError(f"probe refused: {exc}") from None
        self._probe = probe

    @property
    def probe_plan(self) -> ProbePlan | None:
        """The probe new groups run under (None: none applies to the schedule now, or it expired)."""
        probe = self._probe
        if probe is None or probe.expired():
            return None
        try:
            return probe.plan(self._schedule)
        except ProbeError:  # set for another layout, then the schedule changed
            return None

    def load_policy(self, folder: Path, version: int) -> None:
        from trainer.model_io import ModelLoadError, load_model

        try:
            new = dict(load_model(folder).named_parameters())
        except ModelLoadError as exc:
            raise EngineError(f"policy v{version}: {exc}") from None
        mine = {n.replace(".base_layer", ""): p for n, p in self.model.named_parameters() if "lora_" not in n}
        if set(new) != set(mine):
            odd = sorted(set(new) ^ set(mine))[0]
            raise EngineError(f"policy v{version} does not fit the serving model (tensor {odd})")
        for name, p in new.items():
            if p.shape != mine[name].shape:
                raise EngineError(f"policy v{version}: {name} is {list(p.shape)}, serving {list(mine[name].shape)}")
            if not bool(torch.isfinite(p).all()):
                raise EngineError(f"policy v{version}: {name} holds NaN or infinite values")
        with torch.no_grad():  # in place: the paged cache and any adapter keep pointing at these tensors
            for name, p in new.items():
                mine[name].copy_(p)
        self._versions = EngineVersions(version, self._versions.adapter_version, self._versions.schedule_version)

    def load_adapter(self, folder: Path, version: int) -> None:
        from peft import LoraConfig, inject_adapter_in_model, load_peft_weights, set_peft_model_state_dict

        if self.decode == "speculative":
            # The adapter belongs to the sparse actor; the verify would apply it to the dense pass too.
            raise EngineError(
                f"adapter v{version}: decode speculative does not take DistillSparse adapters yet (they would "
                "change the dense verify too)"
            )
        try:
            config = LoraConfig.from_pretrained(str(folder))
            weights = load_peft_weights(str(folder), device=str(self.device))
        except Exception as exc:  # missing files, bad JSON, unreadable safetensors: many types
            raise EngineError(f"adapter v{version}: cannot read {folder}: {' '.join(str(exc).split())[:200]}") from None
        weights = {k.removeprefix(_PEFT_PREFIX): v for k, v in weights.items()}
        self._check_adapter(config, weights, version)
        name = f"v{version}"
        if self._adapter == name:
            raise EngineError(f"adapter v{version} is already loaded")
        try:
            with warnings.catch_warnings():  # peft warns that a second adapter joins the first: intended
                warnings.simplefilter("ignore")
                inject_adapter_in_model(config, self.model, adapter_name=name)
            result = set_peft_model_state_dict(self.model, weights, adapter_name=name)
            missing = [k for k in result.missing_keys if f".{name}." in k]
            if missing or result.unexpected_keys:
                raise EngineError(
                    f"adapter v{version}: tensors missing or left over, e.g. {(missing or result.unexpected_keys)[0]}"
                )
        except Exception as exc:
            self._drop_adapter(name)
            raise exc if isinstance(exc, EngineError) else EngineError(f"adapter v{version}: {exc}") from None
        self._activate(name)
        self._versions = EngineVersions(self._versions.policy_version, version, self._versions.schedule_version)

    def _check_adapter(self, config, weights: dict[str, torch.Tensor], version: int) -> None:
        what = f"adapter v{version}"
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
            raise EngineError(f"{what} is not a LoRA adapter ({config.peft_type})")
        if config.r > self.max_lora_rank:
            raise EngineError(f"{what} has rank {config.r}, above max_lora_rank {self.max_lora_rank}")
        if not weights:
            raise EngineError(f"{what} holds no tensors")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            for part in ("lora_A", "lora_B"):
                if key.endswith(f".{part}.weight"):
                    pairs.setdefault(key[: -len(f".{part}.weight")], {})[part] = tensor
                    break
            else:
                raise EngineError(f"{what}: unsupported tensor {key} (plain LoRA A/B weights only)")
            if not bool(torch.isfinite(tensor).all()):
                raise EngineError(f"{what}: {key} holds NaN or infinite values")
        for path, ab in pairs.items():
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                raise EngineError(f"{what} targets {path}, which the model does not have") from None
            base = getattr(module, "base_layer", module)
            if not isinstance(base, torch.nn.Linear) or set(ab) != {"lora_A", "lora_B"}:
                raise EngineError(f"{what}: {path} needs a Linear layer and both lora_A and lora_B")
            a, b = ab["lora_A"], ab["lora_B"]
            rank = config.r if not config.rank_pattern else a.shape[0]
            if a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank):
                raise EngineError(
                    f"{what}: {path} has A {list(a.shape)} and B {list(b.shape)}, but rank {rank} on this layer "
                    f"needs A [{rank}, {base.in_features}] and B [{base.out_features}, {rank}]"
                )
            if rank > self.max_lora_rank:
                raise EngineError(f"{what}: {path} has rank {rank}, above max_lora_rank {self.max_lora_rank}")

    def _lora_layers(self):
        from peft.tuners.lora import LoraLayer

        return [m for m in self.model.modules() if isinstance(m, LoraLayer)]

    def _activate(self, name: str) -> None:
        old, self._adapter = self._adapter, name
        for layer in self._lora_layers():
            if name in layer.lora_A:
                layer.set_adapter(name)
        if old is not None:
            self._drop_adapter(old)

    def _drop_adapter(self, name: str) -> None:
        for layer in self._lora_layers():
            if name in layer.lora_A:
                layer.delete_adapter(name)
        getattr(self.model, "peft_config", {}).pop(name, None)

    @property
    def versions(self) -> EngineVersions:
        return self._versions

    def close(self) -> None:
        self._queue.clear()
        self.model = None
