"""Lossless self-speculative decoding in vLLM 0.32: the target model drafts for itself through block-sparse
attention over its own KV cache, and vLLM's dense verify and rejection sampler keep every token exact.

The engine asks for vLLM's `draft_model` method with the target's own folder as the draft and probabilistic
draft sampling (`VllmEngine`, `decode = "speculative"`), which gives what the self-draft needs from vLLM
unchanged: k lookahead KV slots reserved per request, `propose()` called with the verify's attention
metadata, the draft's full distributions handed to the rejection sampler, and the emitted tokens' logprobs
taken from the verify's (dense) logits. Two named patches of `DraftModelProposer` make the draft the target
itself (only when the engine's `additional_config` carries `SELF_DRAFT`; a real draft model is untouched):

- `load_model`: the draft *is* the target module (no second model, no second KV cache; a policy reload
  updates both), and its attention layers are all the target's. vLLM's own would load a second copy and
  take as draft layers "all layers minus the target's", which is none here.
- `propose`: k one-token decode steps from each row's next token. vLLM's draft-model path first re-runs
  every token the target just ran (the draft model keeps a KV cache of its own); the target's KV for them
  is already in the cache, and re-running them sparsely would overwrite it. Each step advances positions,
  slots and sequence lengths with vLLM's own step kernel (`_update_positions_dependent_metadata`), builds
  the attention metadata through the layers' builder for drafting (which marks it, so the plugin decodes
  it under the schedule) and samples with vLLM's draft sampler (temperature applied, full probabilities).

A draft step writes the KV of its position into the slot the next verify pass writes again, so the draft
never leaves a trace in the cache the target reads; the target's forwards decode every row densely
(`SparrowAttentionImpl.forward_dense` in a self-drafting engine), rows without drafts too.
"""

from __future__ import annotations

import functools
from collections import deque

SELF_DRAFT = "sparrow_self_draft"  # the key in vLLM's additional_config that turns the patches on
DRAFTING = "sparrow_drafting"  # the attribute the metadata builder sets on a draft step's attention metadata


def _self_drafting(proposer) -> bool:
    return bool((proposer.vllm_config.additional_config or {}).get(SELF_DRAFT))


def _attention_layers(vllm_config) -> dict:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]


def self_draft_proposer() -> None:
    """Patch `DraftModelProposer.load_model` and `propose` (see the module doc); idempotent."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    if getattr(DraftModelProposer.propose, "_sparrow_patched", False):
        return
    load_model, propose = DraftModelProposer.load_model, DraftModelProposer.propose

    @functools.wraps(load_model)
    def load_target_as_draft(self, target_model) -> None:
        if not _self_drafting(self):
            return load_model(self, target_model)
        self.model = target_model
        layers = _attention_layers(self.vllm_config)
        self._draft_attn_layer_names = {
            name for name, layer in layers.items() if layer.get_kv_cache_spec(self.vllm_config) is not None
        }

    @functools.wraps(propose)
    def propose_from_target(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                            next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                            *args, **kwargs):  # fmt: skip
        if not _self_drafting(self):
            return propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                           next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                           *args, **kwargs)  # fmt: skip
        return _draft(self, num_speculative_tokens, target_positions, next_token_ids, token_indices_to_sample,
                      common_attn_metadata, sampling_metadata)  # fmt: skip

    load_target_as_draft._sparrow_patched = True
    propose_from_target._sparrow_patched = True
    DraftModelProposer.load_model = load_target_as_draft
    DraftModelProposer.propose = propose_from_target


def _draft(self, k, target_positions, next_token_ids, token_indices_to_sample, cad, sampling_metadata):
    """k draft tokens per row, [rows, k], from each row's next token on (its draft probabilities kept)."""
    import torch
    from vllm.forward_context import set_forward_context

    timed = _clock(next_token_ids.device) if getattr(self, "_sparrow_time_next", False) else None
    self.num_speculative_tokens = k
    self._last_draft_probs = None
    rows = cad.batch_size()
    if token_indices_to_sample is None:  # one query token per row: each row's last token is its own
        token_indices_to_sample = cad.query_start_loc[1 : rows + 1] - 1
    # The last token the target accepted in each row; its next token goes at the position after it.
    last = target_positions[token_indices_to_sample].to(torch.int64)
    self.positions[:rows] = last
    positions = self.positions[:rows]
    cad.seq_lens = (last + 1).to(cad.seq_lens.dtype)  # a new tensor: the step kernel writes it in place
    cad.seq_lens_cpu_upper_bound = None
    cad.max_seq_len = int(cad.seq_lens.max()) if rows else 0
    cad.num_actual_tokens = rows
    cad.max_query_len = 1
    cad.query_start_loc = self.arange[: rows + 1]
    cad.query_start_loc_cpu = torch.from_numpy(self.token_arange_np[: rows + 1]).clone()
    tokens, probs = [next_token_ids], []
    for step in range(k):
        positions = self._update_positions_dependent_metadata(positions, cad, rows, rows, self.block_size)
        _, per_layer = self.build_per_group_and_layer_attn_metadata(cad, draft_index=step + 1)
        self.input_ids[:rows] = tokens[-1].int()
        with set_forward_context(per_layer, self.vllm_config, num_tokens=rows,
                                 slot_mapping=self._get_slot_mapping(rows)):  # fmt: skip
            hidden = self.model(input_ids=self.input_ids[:rows], positions=self._get_positions(rows))
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        drafted, p = self._sample_draft_tokens(hidden[:rows], sampling_metadata)
        tokens.append(drafted)
        if p is not None:
            probs.append(p)
    if probs:
        self._last_draft_probs = torch.stack(probs, dim=1).contiguous()
    drafts = torch.stack(tokens[1:], dim=1)
    if timed is not None:  # rows, the first draft step's mean KV length, seconds of the k steps
        kv = int(last.float().mean()) + 2 if rows else 0
        self._sparrow_draft_time = (rows, kv, _clock(drafts.device) - timed)
    return drafts


# On a GPU a timed interval ends in a device synchronisation, which stalls vLLM's overlap of CPU and device
# work: only one cycle in this many is timed there. On a CPU every cycle is, at no cost.
DEVICE_TIMING_EVERY = 16
KEPT_CYCLE_TIMES = 4096  # the newest, when nobody takes them (an engine that does not read them)


def _clock(device) -> float:
    """Seconds on the wall clock once the device's queued work is done."""
    import time

    import torch

    if device.type != "cpu":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_cycles() -> None:
    """Patch the model runner's `execute_model` and `sample_tokens` (one engine step: the verify forward, then
    rejection sampling and the next drafts) to time each step of decodes alone in which every row verifies k
    drafts and the drafts for the next cycle are made: the k draft steps apart from the rest (`_draft` times
    its own part). The worker extension hands the times out (`sparrow_take_cycle_times`). Only when
    self-drafting (`SELF_DRAFT`); a step that prefills any row is not timed (its prefill is not the verify's)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    execute, sample = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
    if getattr(execute, "_sparrow_patched", False):
        return

    @functools.wraps(execute)
    def execute_timed(self, scheduler_output, *args, **kwargs):
        self._sparrow_step_start = None
        if _self_drafting(self):
            self.drafter._sparrow_draft_time = None
            self.drafter._sparrow_time_next = False
            if _decodes_alone(self, scheduler_output):
                self._sparrow_timed_steps = getattr(self, "_sparrow_timed_steps", 0) + 1
                if self.device.type == "cpu" or self._sparrow_timed_steps % DEVICE_TIMING_EVERY == 0:
                    self.drafter._sparrow_time_next = True
                    self._sparrow_step_start = _clock(self.device)
        return execute(self, scheduler_output, *args, **kwargs)

    @functools.wraps(sample)
    def sample_timed(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        start = getattr(self, "_sparrow_step_start", None)
        draft = getattr(self.drafter, "_sparrow_draft_time", None) if start is not None else None
        if draft is not None:
            total = _clock(self.device) - start
            rows, kv, seconds = draft
            times = self.__dict__.setdefault("_sparrow_cycle_times", deque(maxlen=KEPT_CYCLE_TIMES))
            times.append((rows, kv, seconds, total - seconds))
        self._sparrow_step_start = None
        return out

    execute_timed._sparrow_patched = True
    sample_timed._sparrow_patched = True
    GPUModelRunner.execute_model = execute_timed
    GPUModelRunner.sample_tokens = sample_timed


def _decodes_alone(runner, scheduler_output) -> bool:
    """Every scheduled row verifies k drafts: k + 1 tokens each, no prefill beside them."""
    counts = scheduler_output.num_scheduled_tokens
    k = runner.vllm_config.speculative_config.num_speculative_tokens
    return bool(counts) and all(c == k + 1 for c in counts.values())


def note_drafts() -> None:
    """Patch the model runner's `_sample` to note, per request, every verified draft of a full cycle: alpha
    (sum_x min(p, q) of the verify's and the draft's distributions), whether it was accepted, and the KV
    length of the draft step that made it. The worker extension hands the notes out
    (`sparrow_take_drafts`), so a sample reports its drafts as the reference engine's do. Only when
    self-drafting (`SELF_DRAFT`); a short cycle (fewer than k drafts, at a sample's end) is not noted."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = GPUModelRunner._sample
    if getattr(sample, "_sparrow_patched", False):
        return

    @functools.wraps(sample)
    def sample_and_note(self, logits, spec_decode_metadata):
        out = sample(self, logits, spec_decode_metadata)
        if spec_decode_metadata is not None and logits is not None and _self_drafting(self):
            _note(self, logits, spec_decode_metadata, out.sampled_token_ids)
        return out

    sample_and_note._sparrow_patched = True
    GPUModelRunner._sample = sample_and_note


def _note(runner, logits, meta, sampled) -> None:
    import torch

    counts = [int(c) for c in meta.num_draft_tokens]
    n = sum(counts)
    if n == 0 or len(counts) > len(runner.input_batch.req_ids):  # nothing drafted, or a warm-up batch
        return
    k = runner.vllm_config.speculative_config.num_speculative_tokens
    batch = runner.input_batch
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    drafts = meta.draft_token_ids[:n].long()
    target = logits[meta.target_logits_indices].double()
    temperature = batch.sampling_metadata.temperature
    greedy = torch.ones(n, dtype=torch.bool) if temperature is None else (temperature[rows].double() < 1e-5)
    # Greedy rows: one-hot p and q, so alpha is 1 where the draft is the verify's argmax, else 0.
    alphas = (target.argmax(-1) == drafts).double()
    q = runner._get_spec_decode_draft_probs(meta)
    if q is not None and bool((~greedy).any()):
        p = torch.softmax(target / temperature[rows].double().clamp(min=1e-5)[:, None], dim=-1)
        alphas = torch.where(greedy, alphas, torch.minimum(p, q[:n].double()).sum(-1))
    # Emitted tokens per row (placeholders are -1): the accepted drafts, then one more.
    accepted = ((sampled >= 0).sum(1) - 1).tolist()
    notes = runner.__dict__.setdefault("_sparrow_drafts", {})
    start = 0
    for r, count in enumerate(counts):
        if count == k:
            first = int(batch.num_computed_tokens_cpu[r])  # the row's next token: draft j (from 1) sits at first + j
            row = notes.setdefault(batch.req_ids[r], [])
            row.extend((float(alphas[start + j]), j < accepted[r], first + j + 1) for j in range(count))
        start += count
