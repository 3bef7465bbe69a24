"""What the CPU and the CUDA attention impls share: the schedule, and how a layer decodes under it.

A row with one query token decodes densely when there is no schedule or the layer is one of the
schedule's dense layers; otherwise under the schedule's budget at the row's current KV length
(sink + local + top-k pages by centroid score, `kernels.block_sparse_decode`), every row and KV
head in one batch. A row with no more pages than its budget attends to all of them.

Host syncs: on a GPU every read of a device value on the host stalls the CPU until the GPU has
caught up, and with attention run eagerly between CUDA-graph pieces that is paid per layer. Given
the rows' lengths as the host knows them (`seq_lens_cpu`, from vLLM's CPU copy), a decode reads
nothing from the device: the budgets and the sizes the kernels need (`kernels.DecodeBounds`) are
worked out on the host once per step for every layer, and the budgets go to the device once per
step by a non-blocking copy from pinned memory (no small kernels per layer to look them up).

Probes: while a probe plan is set, rows whose request id carries `PROBE_PREFIX` take the plan's
budget instead of the schedule's (same bins, sink and local blocks). Which request a row belongs to
is read from the model runner's batch (`row_ids`, set with the plan), in row order.

Dense rows: rows whose request id carries `DENSE_PREFIX` (evaluation samples) attend to every page
in every layer, whatever the schedule or the probe, beside sparse rows in the same batch: their
budget is their whole page count. Their ids come from the context's `dense_row_ids`, which the
worker installs once (`SparrowWorkerExtension.sparrow_track_rows`); without it no row is told apart.

What the layers of a worker share (the batch's request ids, the step's host plan) is a
`DecodeContext` the worker hands to each of them (`context`), never state of this class.

Static decode (`static_decode_rows`), for a step a CUDA graph captures once and replays at later
steps: a replay repeats the capture's kernels with the capture's sizes, scalars and addresses, and
runs no Python. So nothing may depend on the step's values but the device tensors' contents. The
sizes are those of the longest sequence the engine admits (`DecodeBounds(max_seq_len, its pages)`);
each row's budget is looked up on the device in per-layer tables indexed by KV length
(`StaticBudgets`), refilled in place when the schedule or the probe plan changes; which rows are
probes is a device mask at a fixed address (`ProbeRows`) the host writes before each step, outside
the graph. Dense layers, and every layer without a schedule, run the same kernels with budgets that
cover every page, so the schedule can come, change and go under a captured graph. The kernels make
the fixed sizes cost nothing: a row the budget covers whole is not scored, and each row attends over
its own selected pages only. The sink and local page counts are kernel arguments, fixed from the
first static step on: a schedule with others is refused there.

vLLM-free on purpose (torch, `kernels` and the schedule only): the decode path that is ours can then
be checked on a GPU machine without vLLM (`bench/cuda_check`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import torch

from kernels import DecodeBounds, Workspace, block_sparse_decode, decode_bounds, num_pages, sparse_decode_attention
from services.generator.plugin.decode_context import DecodeContext
from sparrow.budget import in_pages
from sparrow.schedule import Schedule, per_bin

# Request ids of sequences decoded under the probe plan start with this (the engine names them).
PROBE_PREFIX = "probe:"
# Request ids of sequences decoded densely in every layer whatever the schedule (see module doc).
DENSE_PREFIX = "dense:"

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
# A schedule's sink and local page counts when none is given.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Schedule)}
_DEFAULT_SINK_LOCAL = (_DEFAULTS["sink_blocks"], _DEFAULTS["local_blocks"])


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, without a host sync on CUDA (a non-blocking copy from pinned memory)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never on a machine without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class StaticBudgets:
    """One layer's budgets (in pages) by KV length on the device, for static decode (see module doc).

    `pages[n]` is the budget of a row of `n` cached tokens under the schedule, `probe[n]` that of a
    probe row under the probe plan (the schedule's while there is none), for n in [0, max_seq_len];
    a dense layer, or no schedule, gets `max_pages` everywhere: every row whole. `fill` writes them in
    place (a captured graph keeps reading the same memory).
    """

    def __init__(self, max_seq_len: int, device: torch.device, sink: int, local: int) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.max_seq_len, self.device, self.sink, self.local = max_seq_len, device, sink, local
        self.max_pages = num_pages(max_seq_len)
        self.bounds = DecodeBounds(max_seq_len, self.max_pages)
        self.pages = torch.full((max_seq_len + 1,), self.max_pages, dtype=torch.int32, device=device)
        self.probe = torch.full((max_seq_len + 1,), self.max_pages, dtype=torch.int32, device=device)
        self.filled: tuple | None = None

    def fill(self, schedule: Schedule | None, dense: bool, probe_pages: tuple[int, ...] | None) -> None:
        """Write the tables for `schedule` (`dense`: this layer decodes densely) and the probe plan."""
        if schedule is not None and (schedule.sink_blocks, schedule.local_blocks) != (self.sink, self.local):
            raise ValueError(
                f"static decode runs with {self.sink} sink and {self.local} local pages, fixed by its first "
                f"step (a captured CUDA graph holds them); schedule {schedule.name!r} asks for "
                f"{schedule.sink_blocks} and {schedule.local_blocks}"
            )
        key = (schedule, dense, probe_pages)
        if self.filled is not None and self.filled[0] is schedule and self.filled[1:] == key[1:]:
            return
        if schedule is None or dense:
            self.pages.fill_(self.max_pages)
            self.probe.fill_(self.max_pages)
        else:
            lens = torch.arange(self.max_seq_len + 1)
            table = schedule.budget_pages(lens)
            self.pages.copy_(table.to(self.device))
            if probe_pages is not None and len(probe_pages) == schedule.num_bins:
                table = per_bin(probe_pages, schedule.bin_width, lens)
            self.probe.copy_(table.to(self.device))
        self.filled = key

    def budgets(
        self, seq_lens: torch.Tensor, probe_rows: torch.Tensor, dense_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each row's budget in pages: device lookups only (`probe_rows`, `dense_rows`: the rows' masks;
        a dense row gets `max_pages`, every page it has)."""
        lens = seq_lens.long().clamp(0, self.max_seq_len)
        budgets = torch.where(probe_rows, self.probe[lens], self.pages[lens])
        if dense_rows is not None:
            budgets = torch.where(dense_rows, self.max_pages, budgets)
        return budgets


class ProbeRows:
    """Which rows of the running batch are probe requests (`mask`) and which dense ones (`dense`), as
    device masks at fixed addresses.

    The host writes them before each step (`write`, outside any graph: one non-blocking copy from
    pinned memory each); static decode reads them on the device. Rows past the batch read False.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.mask = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.dense = torch.zeros(capacity, dtype=torch.bool, device=device)

    def write(self, row_ids: Sequence[str | None]) -> None:
        """Mark the rows of probe requests in `mask`."""
        self._write(self.mask, row_ids, PROBE_PREFIX)

    def write_dense(self, row_ids: Sequence[str | None]) -> None:
        """Mark the rows of dense requests in `dense`."""
        self._write(self.dense, row_ids, DENSE_PREFIX)

    def _write(self, target: torch.Tensor, row_ids: Sequence[str | None], prefix: str) -> None:
        if len(row_ids) > self.capacity:
            raise ValueError(f"{len(row_ids)} rows but the probe-row mask holds {self.capacity}")
        host = torch.tensor(row_flags(row_ids, prefix, self.capacity), dtype=torch.bool)
        if target.device.type == "cuda":
            host = host.pin_memory()
        target.copy_(host, non_blocking=True)


def row_flags(row_ids: Sequence[str | None], prefix: str, n: int) -> list[bool]:
    """For each of `n` batch rows, whether its request id starts with `prefix` (rows past the ids: False)."""
    flags = [rid is not None and rid.startswith(prefix) for rid in row_ids[:n]]
    return flags + [False] * (n - len(flags))


def layer_index_of(layer_name: str) -> int:
    """The decoder layer number in a vLLM layer name like `model.layers.3.self_attn.attn`."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise ValueError(f"cannot tell the layer number of attention layer {layer_name!r}")
    return int(m.group(1))


def refuse_unsupported(
    alibi_slopes,
    sliding_window,
    logits_soft_cap,
    kv_cache_dtype: str,
    attn_type,
    kv_sharing_target_layer_name,
    sinks,
    **more: bool,
) -> None:
    """Raise NotImplementedError naming every requested feature the impls cannot compute.

    `more` adds an impl's own refusals, keyed by the name the message gives them.
    """
    attn_type = getattr(attn_type, "value", attn_type)
    features = {
        "ALiBi": alibi_slopes is not None,
        "sliding-window attention": sliding_window is not None,
        "logit soft-capping": bool(logits_soft_cap),
        "attention sinks": sinks is not None,
        f"KV cache dtype {kv_cache_dtype}": kv_cache_dtype != "auto",
        f"attention type {attn_type}": attn_type != "decoder",
        "KV sharing across layers": kv_sharing_target_layer_name is not None,
        **more,
    }
    refused = [name for name, present in features.items() if present]
    if refused:
        raise NotImplementedError(
            f"sparrow block-sparse attention does not support {', '.join(refused)}; "
            "run this model with SPARROW_ATTENTION=stock"
        )


class ScheduledDecode:
    """Mixin of an attention impl: the runtime-settable schedule and block-sparse decode under it.

    The impl sets `scale`, `layer_index` (from the layer name, on the first forward), `centroids`
    (current page centroids of its cache), and may set `backend` and `workspace`. `context` is what
    it shares with the other layers of its worker (its own until the worker gives it the shared one).
    """

    scale: float
    schedule: Schedule | None = None
    layer_index: int | None = None
    backend: str = "auto"
    centroids: torch.Tensor | None = None
    workspace: Workspace | None = None
    probe_pages: tuple[int, ...] | None = None  # per bin, for rows of probe requests
    row_ids: Callable[[], Sequence[str | None]] | None = None
    _budget_table: tuple[Schedule, torch.Tensor] | None = None
    _probe_table: tuple[tuple[int, ...], torch.Tensor] | None = None
    _probe_rows: tuple[tuple, torch.Tensor] | None = None
    _dense_rows: tuple[tuple, torch.Tensor] | None = None
    static: StaticBudgets | None = None  # this layer's tables, from its first static decode on
    forward_dense: bool = False  # this forward decodes every row densely (the target's, when drafting for itself)
    _context: DecodeContext | None = None

    @property
    def context(self) -> DecodeContext:
        """What this layer shares with the other layers of its worker (see `decode_context`)."""
        if self._context is None:
            self._context = DecodeContext()
        return self._context

    @context.setter
    def context(self, context: DecodeContext) -> None:
        self._context = context

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Decode under `schedule` from the next forward on (None: dense).

        Under static decode a schedule whose sink or local page counts differ from the first static
        step's is refused (ValueError), and the layer keeps its schedule."""
        if self.static is not None:
            self.static.fill(schedule, self._dense_under(schedule), self.probe_pages)
        self.schedule = schedule

    def set_probe(
        self, pages: list[int] | tuple[int, ...] | None, row_ids: Callable[[], Sequence[str | None]] | None = None
    ) -> None:
        """Rows of probe requests take `pages[bin]` (None: no probe) from the next forward on.

        `row_ids()` gives the request id of each row of the running batch, in row order.
        """
        if pages is not None and row_ids is None:
            raise ValueError("a probe plan needs the batch's request ids (row_ids)")
        self.probe_pages = None if pages is None else tuple(int(p) for p in pages)
        self.row_ids = row_ids
        self._probe_rows = None
        self.context.probe_row_ids = row_ids
        if self.static is not None:
            self.static.fill(self.schedule, self._dense_under(self.schedule), self.probe_pages)

    def decodes_densely(self) -> bool:
        """True when this layer decodes every row densely now (no schedule, a dense layer, or a forward of the
        target in a self-drafting engine: `forward_dense`)."""
        return self.forward_dense or self._dense_under(self.schedule)

    def _dense_under(self, schedule: Schedule | None) -> bool:
        return schedule is None or self.layer_index in schedule.dense_layers

    def budget_pages(self, seq_lens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`Schedule.budget_pages` of each row's KV length, from a per-schedule device table (no host sync);
        rows of probe requests get the probe plan's. `rows`: batch row of each entry (None: 0, 1, ...)."""
        s = self.schedule
        cached = self._budget_table
        if cached is None or cached[0] is not s or cached[1].device != seq_lens.device:
            cached = (s, to_device([in_pages(b, s.page_size) for b in s.budgets], torch.int64, seq_lens.device))
            self._budget_table = cached
        bins = torch.div(seq_lens.long(), s.bin_width, rounding_mode="floor").clamp(max=s.num_bins - 1)
        budgets = cached[1][bins]
        count = seq_lens.shape[0] if rows is None else None
        if self.probe_pages is not None and len(self.probe_pages) == s.num_bins:
            probing = self._probe_mask(count, rows, seq_lens.device)
            if probing is not None:
                table = self._probe_table
                if table is None or table[0] != self.probe_pages or table[1].device != seq_lens.device:
                    table = (self.probe_pages, to_device(list(self.probe_pages), torch.int64, seq_lens.device))
                    self._probe_table = table
                budgets = torch.where(probing, table[1][bins], budgets)
        dense = self._dense_mask(count, rows, seq_lens.device)
        if dense is not None:  # every page the row has
            budgets = torch.where(dense, num_pages(seq_lens.long()), budgets)
        return budgets

    def _probe_mask(self, count: int | None, rows: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """True for the rows (the first `count` batch rows, or `rows`) of probe requests; None when there are none."""
        return self._row_mask("_probe_rows", PROBE_PREFIX, self.row_ids, count, rows, device)

    def _dense_mask(self, count: int | None, rows: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """True for the rows (as in `_probe_mask`) of dense requests; None when there are none."""
        return self._row_mask("_dense_rows", DENSE_PREFIX, self.context.dense_row_ids, count, rows, device)

    def _row_mask(self, attr: str, prefix: str, source, count, rows, device) -> torch.Tensor | None:
        ids = source() if source is not None else ()
        n = count if rows is None else (int(rows.max()) + 1 if rows.numel() else 0)
        key = tuple(ids[:n])
        cached = getattr(self, attr)
        if cached is None or cached[0] != key or (cached[1] is not None and cached[1].device != device):
            flags = row_flags(key, prefix, n)
            cached = (key, to_device(flags, torch.bool, device) if any(flags) else None)
            setattr(self, attr, cached)
        mask = cached[1]
        if mask is None:
            return None
        return mask if rows is None else mask[rows]

    def host_bounds(self, seq_lens_cpu: torch.Tensor) -> DecodeBounds:
        """`DecodeBounds` of the batch's first rows from their lengths on the host (see module doc)."""
        return self.host_plan(seq_lens_cpu)[0]

    def host_plan(
        self, seq_lens_cpu: torch.Tensor, device: torch.device | None = None
    ) -> tuple[DecodeBounds, torch.Tensor | None]:
        """The bounds and the budgets (in pages, on `device`; None without a schedule or a device) of
        the batch's first rows, from their lengths on the host (see module doc).

        Pure Python past one `tolist`, and worked out once per step: the layers of a step share the
        metadata's CPU lengths (the same tensor), the schedule and the probe plan, so they share
        the answer, the budgets' one copy to the device included. Kept by the identity of
        `seq_lens_cpu`: other lengths come in another tensor (vLLM's builder makes one per step).
        """
        s = self.schedule
        probing = s is not None and self.probe_pages is not None and len(self.probe_pages) == s.num_bins
        n = seq_lens_cpu.shape[0]
        ids = tuple(self.row_ids()[:n]) if probing and self.row_ids is not None else None
        source = self.context.dense_row_ids
        dense_ids = tuple(source()[:n]) if s is not None and source is not None else None
        probe = (self.probe_pages, ids, dense_ids)
        last = self.context.last_plan
        if last is None or last[0] is not seq_lens_cpu or last[1] is not s or last[2] != probe:
            lens = seq_lens_cpu.tolist()
            if s is None:
                bounds, budgets = DecodeBounds(max(lens, default=0), 0), None
            else:
                bins = [s.bin_of(n) for n in lens]
                budgets = [in_pages(s.budgets[b], s.page_size) for b in bins]
                for r, rid in enumerate(ids or ()):
                    if rid is not None and rid.startswith(PROBE_PREFIX):
                        budgets[r] = self.probe_pages[bins[r]]
                for r, rid in enumerate(dense_ids or ()):
                    if rid is not None and rid.startswith(DENSE_PREFIX):
                        budgets[r] = num_pages(lens[r])  # every page: the row attends to its whole context
                bounds = decode_bounds(lens, budgets, s.sink_blocks, s.local_blocks)
            last = (seq_lens_cpu, s, probe, bounds, budgets, {})
            self.context.last_plan = last
        bounds, budgets, on_device = last[3:]
        if budgets is None or device is None:
            return bounds, None
        if device not in on_device:
            on_device[device] = to_device(budgets, torch.int64, device)
        return bounds, on_device[device]

    def static_decode_rows(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        probe_rows: torch.Tensor,
        dense_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`decode_rows` as a CUDA graph can capture it once and replay it at any later step (see module doc).

        `max_seq_len`: the longest sequence the engine admits (a row's length may not exceed it);
        `probe_rows`: bool [rows], True for rows of probe requests (`ProbeRows.mask`); `dense_rows` likewise
        for rows of dense requests (`ProbeRows.dense`; None: none). Rows of length
        0 (a graph's padding) attend to nothing. The Triton kernels only: no other backend is captured.
        The tables must exist before a graph captures this (`make_static_tables`). Scratch memory is
        the call's own, not the workspace's: a graph keeps what it allocated, while a workspace buffer
        regrown later would leave it writing freed memory.
        """
        st = self.static
        if st is None or st.max_seq_len != max_seq_len or st.device != seq_lens.device:
            st = self.make_static_tables(max_seq_len, seq_lens.device)
        out, _ = block_sparse_decode(
            q,
            k_cache,
            v_cache,
            self.centroids,
            block_table,
            seq_lens,
            st.budgets(seq_lens, probe_rows, dense_rows),
            st.sink,
            st.local,
            self.scale,
            None,
            backend="triton",
            bounds=st.bounds,
        )
        return out

    def make_static_tables(self, max_seq_len: int, device: torch.device) -> StaticBudgets:
        """This layer's static-decode tables for the current schedule and probe plan, made now.

        Outside any CUDA graph: made inside one, their allocation and first fill would be replayed at
        every step (RuntimeError then)."""
        if capturing():
            raise RuntimeError(
                "static decode's budget tables must be made before a CUDA graph captures the step "
                "(the builder makes them: cuda_backend.prepare_static_layers)"
            )
        s = self.schedule
        sink, local = (s.sink_blocks, s.local_blocks) if s is not None else _DEFAULT_SINK_LOCAL
        st = StaticBudgets(max_seq_len, device, sink, local)
        st.fill(s, self._dense_under(s), self.probe_pages)
        self.static = st
        return st

    def decode_rows(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Output [rows, q_heads, head_dim] of one query token per row under the schedule (see module doc).

        `rows`: the batch row of each of these rows when they are not the batch's first rows in order.
        `seq_lens_cpu`: `seq_lens` on the host (the same values), for the batch's first rows only;
        with it nothing is read from the device (see module doc)."""
        if seq_lens_cpu is not None and rows is not None:
            raise ValueError("seq_lens_cpu is for the batch's first rows in order, not for a subset (rows)")
        bounds, budgets = None, None
        if seq_lens_cpu is not None:
            bounds, budgets = self.host_plan(seq_lens_cpu, seq_lens.device)
        if self.decodes_densely():
            return sparse_decode_attention(
                q,
                k_cache,
                v_cache,
                block_table,
                seq_lens,
                None,
                self.scale,
                self.workspace,
                backend=self.backend,
                bounds=bounds,
            )
        s = self.schedule
        out, _ = block_sparse_decode(
            q,
            k_cache,
            v_cache,
            self.centroids,
            block_table,
            seq_lens,
            self.budget_pages(seq_lens, rows) if budgets is None else budgets,
            s.sink_blocks,
            s.local_blocks,
            self.scale,
            self.workspace,
            backend=self.backend,
            bounds=bounds,
        )
        return out
