"""Methods vLLM adds to its worker class (`worker_extension_cls`), called by name via `collective_rpc`.

They run inside every worker process, between engine steps, so a change applies from the next step
on, for all sequences in the batch, without restarting the engine.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from services.generator.plugin.decode_context import DecodeContext
from services.generator.plugin.scheduled_decode import ScheduledDecode
from sparrow.schedule import Schedule


class SparrowWorkerExtension:
    """Mixed into vLLM's worker: schedule and probe swaps and in-place weight reloads."""

    def _sparrow_impls(self) -> list[ScheduledDecode]:
        # The CPU and the CUDA impls alike, each holding this worker's decode context.
        model = self.model_runner.get_model()
        impls = [m.impl for m in model.modules() if isinstance(getattr(m, "impl", None), ScheduledDecode)]
        context = self._sparrow_context()
        for impl in impls:
            impl.context = context
        return impls

    def _sparrow_context(self) -> DecodeContext:
        """What this worker's attention layers share (one per worker, made on first use)."""
        context = getattr(self, "_sparrow_decode_context", None)
        if context is None:
            context = self._sparrow_decode_context = DecodeContext()
        return context

    def sparrow_set_schedule(self, schedule_json: str | None) -> int:
        """Decode under this schedule (JSON of `Schedule.to_json`; None: dense) from the next step on.

        Returns how many attention layers took it (0 means the plugin is not active in this worker).
        """
        schedule = None if schedule_json is None else Schedule.from_json(schedule_json)
        impls = self._sparrow_impls()
        for impl in impls:
            impl.set_schedule(schedule)
        return len(impls)

    def sparrow_take_drafts(self, request_ids: list[str]) -> dict[str, list[tuple[float, bool, int]]]:
        """Hand out and forget the drafts noted for these requests (`self_draft.note_drafts`): per request, in
        order, (alpha, accepted, KV length of the draft step). vLLM's own ids carry a suffix after `-`."""
        notes = getattr(self.model_runner, "_sparrow_drafts", None) or {}
        out: dict[str, list] = {}
        for key in list(notes):
            rid = next((r for r in request_ids if key == r or key.startswith(r + "-")), None)
            if rid is not None:
                out[rid] = notes.pop(key)
        return out

    def sparrow_take_cycle_times(self) -> list[tuple[int, int, float, float]]:
        """Hand out and forget the cycles timed since the last call (`self_draft.time_cycles`): per cycle, the
        batch's rows, their first draft step's mean KV length, seconds of the k draft steps and of the rest."""
        runner = self.model_runner
        times = runner.__dict__.pop("_sparrow_cycle_times", ())
        return [tuple(t) for t in times]

    def sparrow_set_probe(self, pages: list[int] | None) -> int:
        """Rows of probe requests (`scheduled_decode.PROBE_PREFIX`) decode at `pages[bin]` pages from the
        next step on (None: they follow the schedule like every row). Returns the layers that took it."""
        if pages is not None and (not pages or any(not isinstance(p, int) or p <= 0 for p in pages)):
            raise ValueError(f"probe pages must be positive integers per bin, got {pages!r}")
        runner = self.model_runner
        if pages is not None and not hasattr(getattr(runner, "input_batch", None), "req_ids"):
            raise RuntimeError(
                f"probes need the model runner's persistent batch (input_batch.req_ids), which "
                f"{type(runner).__name__} does not have"
            )

        def row_ids():
            # The batch's request ids in row order: the order of the attention metadata's rows (vLLM
            # builds both from the persistent batch, decode rows reordered first where a backend asks).
            return runner.input_batch.req_ids

        impls = self._sparrow_impls()
        for impl in impls:
            impl.set_probe(pages, row_ids if pages is not None else None)
        return len(impls)

    def sparrow_track_rows(self) -> int:
        """Rows of dense requests (`scheduled_decode.DENSE_PREFIX`) decode densely from the next step on,
        beside the others. Returns the layers that will; 0 where the runner has no persistent batch."""
        runner = self.model_runner
        if not hasattr(getattr(runner, "input_batch", None), "req_ids"):
            return 0
        impls = self._sparrow_impls()
        # The batch's request ids in row order, as for probes (see sparrow_set_probe).
        self._sparrow_context().dense_row_ids = lambda: runner.input_batch.req_ids
        return len(impls)

    def sparrow_attention_layers(self) -> int:
        """How many layers run the project's attention here."""
        return len(self._sparrow_impls())

    def sparrow_load_weights(self, folder: str) -> int:
        """Loads every safetensors file of an HF checkpoint folder into the running model, in place.

        Returns the number of tensors read. The model's own `load_weights` maps checkpoint names to
        the fused layers (qkv, gate_up) as at start-up. On CPU every linear layer computes with a
        packed copy of its weight, so each is re-packed afterwards (the plain weights are kept for
        this by `patches.keep_cpu_linear_weights`); elsewhere vLLM's in-place reload does both.
        """
        from safetensors import safe_open

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {folder}")
        count = 0

        def tensors():
            nonlocal count
            for f in files:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        count += 1
                        yield name, st.get_tensor(name)

        self._sparrow_load(tensors())
        return count

    def sparrow_load_tensors(
        self, tensors: list[tuple[str, torch.Tensor]], first: bool = True, last: bool = True
    ) -> int:
        """Loads (name, host tensor) pairs of a checkpoint into the running model, in place, as
        `sparrow_load_weights` does from files (a streamed policy version, staged and checked by the
        generator, sent in buckets; `first`, `last`: the version's first and final bucket, after
        which CPU weights are re-packed). Each tensor is whole: under tensor parallelism the model's weight loaders keep
        this worker's shard. Returns the number of tensors. With the in-process executor the tensors
        are the generator's own (no copy); a multiprocess executor sends them to every worker."""
        if first:  # whatever a refused version left waiting is dropped
            self._sparrow_pending = []
        self._sparrow_load(iter(tensors), repack=last)
        return len(tensors)

    def _sparrow_load(self, tensors, repack: bool = True) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            # vLLM's layerwise in-place reload processes a layer once all of it arrived, within one call:
            # buckets wait here until the version's last one.
            pending, self._sparrow_pending = getattr(self, "_sparrow_pending", []), []
            if not repack:
                self._sparrow_pending = pending + list(tensors)
            elif pending:
                self.reload_weights(weights_iterator=itertools.chain(pending, tensors))
            else:  # one bucket, or the files' iterator (sparrow_load_weights): read as it goes
                self.reload_weights(weights_iterator=tensors)
            return
        model = self.model_runner.get_model()
        with torch.no_grad():
            model.load_weights(tensors)
            if not repack:  # more of the version follows before the next step
                return
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if hasattr(module, "cpu_linear") and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)

    def sparrow_config_echo(self, payload: str) -> str:
        """Round-trips a JSON payload (a liveness check of the extension through collective_rpc)."""
        return json.dumps(json.loads(payload))
