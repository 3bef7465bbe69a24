"""Static decode: one CUDA-graph capture of a step of decodes that serves every later step.

A CUDA graph replays the kernels its capture launched, with the capture's sizes, scalar arguments
and memory addresses, and runs no Python. A replay of a step computes what an eager run of a later
step would when that step (1) reads nothing back to the host, (2) runs the same kernels and torch
ops with the same sizes and scalars, and (3) reads, of what it did not make itself, the same
addresses (persistent buffers whose contents change between steps, as vLLM's are).

On a CPU these tests record (2) and (3) for steps that differ in lengths, schedule, probe rows and
dense or sparse, require every record to equal the first, and check each step's output against the
references; (1) is the host-read probe of `test_cuda_backend`. The Triton kernels run in the
interpreter, whose launches are recorded (`InterpretedFunction.run`); torch ops by a dispatch mode.
On a GPU (`bench/cuda_check` runs this file) the step is captured as a real CUDA graph once and
replayed at the later steps instead.

Two drivers, as in `test_cuda_backend`: "core" (`ScheduledDecode.static_decode_rows` and
`PageCentroids`, vLLM-free) and "impl" (`SparrowTritonAttentionImpl.forward` on the metadata of the
backend's own builder, made from a real vLLM config; needs vLLM).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import Workspace, new_centroids, update_centroids_ref
from services.generator.plugin.decode_context import DecodeContext
from services.generator.plugin.page_centroids import PageCentroids
from services.generator.plugin.scheduled_decode import ProbeRows, ScheduledDecode, StaticBudgets
from sparrow.schedule import Schedule
from tests.unit.generator.test_cuda_backend import (
    DEVICE,
    GROUP,
    HEAD_DIM,
    KV_HEADS,
    PROMPTS,
    SCALE,
    SMALL,
    SPARSE_LAYER,
    TOL,
    HostReads,
    ImplDriver,
    PagedBatch,
    dense_reference,
    oracle_decode,
    stock,  # noqa: F401 (the fixture standing in for vLLM's kernel on CPU, used below)
)

MAX_SEQ_LEN = 512  # the engine's longest sequence: the static sizes
ROWS = len(PROMPTS) + 1  # the decode rows and one padding row (length 0, slot -1), as vLLM pads a graph's batch
OTHER = SMALL.with_budgets((64, 80, 96, 112), name="other")
PROBE_PAGES = (3, 4, 3, 5)
PROBE_IDS = ["probe:a", "b", "probe:c", None]


class StepRecord(TorchDispatchMode):
    """The torch ops and Triton launches of a step as a capture would hold them (see the module doc).

    A tensor argument is described by its sizes, strides, offset, dtype and origin: made by the
    n-th event of the step, or from outside at an address."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.made: dict[int, tuple] = {}
        self.launching = False

    def describe(self, x):
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            origin = self.made.get(ptr, ("outside", ptr))
            return ("tensor", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, origin)
        if isinstance(x, list | tuple):
            return tuple(self.describe(v) for v in x)
        if isinstance(x, dict):
            return tuple((k, self.describe(v)) for k, v in sorted(x.items()))
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.launching:  # the interpreter's own handling of a launch's arguments
            return func(*args, **kwargs)
        event = (str(func), self.describe(args), self.describe(kwargs))
        out = func(*args, **kwargs)
        self.events.append(event)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made[t.untyped_storage().data_ptr()] = ("made", len(self.events) - 1)
        return out

    def launch(self, name: str, grid, args, kwargs) -> None:
        self.events.append(("launch", name, tuple(grid), self.describe(args), self.describe(kwargs)))


@pytest.fixture
def recorder(monkeypatch):
    """Records the Triton launches into the active `StepRecord` (CPU: interpreted kernels)."""
    if DEVICE == "cuda":
        yield None
        return
    from triton.runtime.interpreter import InterpretedFunction

    active: list[StepRecord] = []
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not active:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        record = active[-1]
        record.launch(self.fn.__name__, grid, args, kwargs)
        record.launching = True
        try:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            record.launching = False

    monkeypatch.setattr(InterpretedFunction, "run", run)
    yield active


class Buffers:
    """A step's inputs at fixed addresses, refilled in place each step (what vLLM's runner keeps)."""

    def __init__(self, batch: PagedBatch) -> None:
        self.batch = batch
        self.q = torch.zeros(ROWS, KV_HEADS * GROUP, HEAD_DIM, device=DEVICE)
        self.kv = torch.zeros(ROWS, KV_HEADS, HEAD_DIM, device=DEVICE)
        self.seq_lens = torch.zeros(ROWS, dtype=torch.int32, device=DEVICE)
        self.slots = torch.full((ROWS,), -1, dtype=torch.int64, device=DEVICE)
        self.out = torch.zeros(ROWS, KV_HEADS * GROUP, HEAD_DIM, device=DEVICE)
        self.probe = ProbeRows(8, torch.device(DEVICE))

    def load_decode_step(self) -> None:
        """Decode one token in every real row (the padding row stays at length 0) into the buffers."""
        step = self.batch.step([1] * (ROWS - 1) + [0])
        n = ROWS - 1
        self.q[:n].copy_(step.query)
        self.seq_lens.copy_(step.seq_lens)
        self.slots[:n].copy_(step.slots[:n])
        self.last = step


class CoreStatic:
    """`PageCentroids` + `ScheduledDecode.static_decode_rows` on the buffers."""

    def __init__(self, buffers: Buffers, layer: int) -> None:
        self.decoder = ScheduledDecode()
        self.decoder.scale, self.decoder.layer_index, self.decoder.backend = SCALE, layer, "triton"
        self.decoder.workspace = Workspace()
        b = buffers.batch
        self.page_centroids = PageCentroids(b.k_cache, backend="triton")
        self.decoder.centroids = self.page_centroids.table
        self.buffers = buffers

    @property
    def centroids(self) -> torch.Tensor:
        return self.page_centroids.table

    def prefilled(self, step) -> None:
        self.page_centroids.refresh(self.buffers.batch.k_cache, step.slots)

    def prepare(self) -> None:
        """The builder's part, before the step and outside any graph: the probe rows."""
        ids = self.decoder.context.current_probe_row_ids()
        if ids is not None:
            self.buffers.probe.write(ids)

    def run(self, prepared=None) -> None:
        b, bat = self.buffers, self.buffers.batch
        self.page_centroids.refresh(bat.k_cache, b.slots, one_token_per_page=True)
        out = self.decoder.static_decode_rows(
            b.q, bat.k_cache, bat.v_cache, bat.block_table, b.seq_lens, MAX_SEQ_LEN, b.probe.mask[:ROWS]
        )
        b.out.copy_(out)


class ImplStatic:
    """`SparrowTritonAttentionImpl.forward` on the metadata of the CUDA backend's own builder, built
    from a real vLLM config of an engine with static decode on (vLLM's CPU build makes it here).

    The builder finds the layer in vLLM's static forward context (`register`), as in an engine."""

    def __init__(self, buffers: Buffers, layer: int, register: bool = True) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from services.generator.plugin import STATIC_DECODE
        from services.generator.plugin.cuda_backend import SparrowTritonMetadataBuilder
        from tests.unit.generator.tiny_models import TINY

        self.driver = ImplDriver(buffers.batch, layer, None)
        self.decoder = self.driver.impl
        self.buffers = buffers
        self.query_start_loc = torch.arange(ROWS + 1, dtype=torch.int32, device=DEVICE).clamp(max=ROWS - 1)
        self.output = torch.zeros(ROWS, KV_HEADS * GROUP, HEAD_DIM, device=DEVICE)
        engine = EngineArgs(
            model=str(TINY),
            max_model_len=MAX_SEQ_LEN,
            max_num_seqs=8,
            skip_tokenizer_init=True,
            enforce_eager=True,  # the CPU platform's; the builder reads only what static decode needs
            additional_config={STATIC_DECODE: True},
        )
        self.config = engine.create_engine_config()
        spec = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
        name = self.driver.layer.layer_name
        with set_current_vllm_config(self.config):
            self.builder = SparrowTritonMetadataBuilder(spec, [name], self.config, torch.device(DEVICE))
        if register:
            self.register()

    def register(self) -> None:
        """The layer in vLLM's static forward context, its KV cache bound."""
        context = self.config.compilation_config.static_forward_context
        context[self.driver.layer.layer_name] = SimpleNamespace(impl=self.decoder, kv_cache=self.buffers.batch.kv_cache)

    @property
    def centroids(self) -> torch.Tensor:
        return self.decoder.centroids

    def prefilled(self, step) -> None:
        self.driver.run(step)

    def prepare(self):
        """The builder's part, before the step and outside any graph: the metadata (probe rows written)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        b = self.buffers
        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc,
            query_start_loc_cpu=self.query_start_loc.cpu(),
            seq_lens=b.seq_lens,
            seq_lens_cpu_upper_bound=b.seq_lens.cpu(),
            num_reqs=ROWS,
            num_actual_tokens=ROWS - 1,
            max_query_len=1,
            max_seq_len=MAX_SEQ_LEN,
            block_table_tensor=b.batch.block_table[:ROWS],
            slot_mapping=b.slots,
        )
        return self.builder.build(0, common)

    def run(self, metadata) -> None:
        b = self.buffers
        self.decoder.forward(self.driver.layer, b.q, b.kv, b.kv, b.batch.kv_cache, metadata, self.output)
        b.out.copy_(self.output)


def real_rows_centroids(batch: PagedBatch) -> torch.Tensor:
    """Every page's centroid afresh from the cache, over the real rows (the padding row has none)."""
    fresh = new_centroids(batch.k_cache)
    lens = torch.tensor(batch.lens[: ROWS - 1], dtype=torch.int32, device=DEVICE)
    update_centroids_ref(batch.k_cache, fresh, batch.block_table[: ROWS - 1], lens)
    return fresh


def make_static(kind: str, buffers: Buffers, layer: int):
    if kind == "impl":
        pytest.importorskip("vllm")
        return ImplStatic(buffers, layer)
    return CoreStatic(buffers, layer)


def expected(buffers: Buffers, layer: int, schedule: Schedule | None, probe: bool) -> torch.Tensor:
    """Float64 reference of the real rows: dense, or the kernel oracle under the step's budgets."""
    b, n = buffers.batch, ROWS - 1
    if schedule is None or layer in schedule.dense_layers:
        return dense_reference(b, buffers.last)
    lens = buffers.seq_lens[:n].cpu()
    budgets = schedule.budget_pages(lens)
    if probe:
        for r, rid in enumerate(PROBE_IDS):
            if rid is not None and rid.startswith("probe:"):
                budgets[r] = PROBE_PAGES[schedule.bin_of(int(lens[r]))]
    return oracle_decode(buffers.q, b, lens, budgets, schedule)[0]


# What changes between the steps a capture must serve: (schedule, probe plan on).
CHANGES = [(SMALL, False), (OTHER, False), (OTHER, True), (None, False), (SMALL, True), (SMALL, False)]


def set_step(static, schedule: Schedule | None, probe: bool) -> None:
    """The worker's swaps between steps (`collective_rpc`)."""
    static.decoder.set_schedule(schedule)
    static.decoder.set_probe(PROBE_PAGES, lambda: PROBE_IDS) if probe else static.decoder.set_probe(None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["core", "impl"])
@pytest.mark.parametrize("layer", [SPARSE_LAYER, 0], ids=["sparse-layer", "dense-layer"])
@pytest.mark.usefixtures("stock")  # the impl prefills through vLLM's kernel
def test_one_capture_serves_every_later_step(kind, layer, recorder):
    batch = PagedBatch(ROWS, MAX_SEQ_LEN)
    buffers = Buffers(batch)
    static = make_static(kind, buffers, layer)
    static.prefilled(batch.step([*PROMPTS, 0]))
    static.decoder.set_schedule(SMALL)
    buffers.load_decode_step()
    static.run(static.prepare())  # warm-up: the workspace and the tables are made, as vLLM warms up
    graph = None
    records = []
    for i, (schedule, probe) in enumerate(CHANGES):
        set_step(static, schedule, probe)
        buffers.load_decode_step()
        prepared = static.prepare()
        if DEVICE == "cuda":
            graph = _replay(static, prepared, graph)
        else:
            record = StepRecord()
            recorder.append(record)
            with record, HostReads() as seen:
                static.run(prepared)
            recorder.pop()
            assert seen.reads == []
            records.append(record.events)
            assert records[i] == records[0], f"step {i} ({schedule and schedule.name}, probe={probe}) differs"
        want = expected(buffers, layer, schedule, probe)
        torch.testing.assert_close(buffers.out[: ROWS - 1].double().cpu(), want, **TOL)
        assert bool(torch.isfinite(buffers.out[ROWS - 1]).all())  # the padding row attends to nothing
        torch.testing.assert_close(static.centroids, real_rows_centroids(batch), atol=1e-6, rtol=1e-6)
    if records:
        assert any(e[0] == "launch" and e[1] == "_select_blocks_kernel" for e in records[0])


def _replay(static, prepared, graph):
    """CUDA: capture the step once (after the warm-up), replay it at every later step."""
    if graph is None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            static.run(prepared)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.run(prepared)
    graph.replay()
    torch.cuda.synchronize()
    return graph


@pytest.mark.slow
def test_the_record_sees_a_step_that_a_capture_could_not_serve(recorder):
    # The eager decode sizes its kernels from the step's lengths and budgets: a schedule with other
    # budgets makes other sizes, which the record must show (the check above can fail).
    if DEVICE == "cuda":
        pytest.skip("records the interpreter's launches (CPU)")
    batch = PagedBatch(ROWS - 1, MAX_SEQ_LEN)
    batch.step(PROMPTS)
    cents = PageCentroids(batch.k_cache, backend="triton")
    cents.refresh(batch.k_cache, torch.arange(0, 0, device=DEVICE))
    decoder = ScheduledDecode()
    decoder.scale, decoder.layer_index, decoder.backend = SCALE, SPARSE_LAYER, "triton"
    decoder.centroids, decoder.workspace = cents.table, Workspace()
    step = batch.step([1] * (ROWS - 1))
    lens_cpu = step.seq_lens.cpu()
    records = []
    for schedule in (SMALL, OTHER):
        decoder.set_schedule(schedule)
        record = StepRecord()
        recorder.append(record)
        with record:
            decoder.decode_rows(
                step.query, batch.k_cache, batch.v_cache, batch.block_table, step.seq_lens, None, lens_cpu
            )
        recorder.pop()
        records.append(record.events)
    assert records[0] != records[1]


def test_static_budgets_follow_the_schedule_the_probes_and_dense_layers():
    st = StaticBudgets(300, torch.device("cpu"), 1, 2)
    lens = torch.tensor([0, 1, 63, 64, 127, 128, 191, 192, 300], dtype=torch.int32)
    no_probe = torch.zeros(len(lens), dtype=torch.bool)
    st.fill(SMALL, False, None)
    assert torch.equal(st.budgets(lens, no_probe), SMALL.budget_pages(lens).int())
    probe = torch.tensor([i % 2 == 1 for i in range(len(lens))])
    st.fill(SMALL, False, PROBE_PAGES)
    got = st.budgets(lens, probe)
    want = [
        PROBE_PAGES[SMALL.bin_of(int(n))] if p else int(b)
        for n, p, b in zip(lens, probe, SMALL.budget_pages(lens), strict=True)
    ]
    assert got.tolist() == want
    for schedule, dense in ((SMALL, True), (None, False)):
        st.fill(schedule, dense, PROBE_PAGES)
        assert bool((st.budgets(lens, probe) == st.max_pages).all()) and st.max_pages == 19
    pages = st.pages
    st.fill(OTHER, False, None)
    assert st.pages is pages  # refilled in place: a captured graph keeps reading it
    assert torch.equal(st.budgets(lens, probe), OTHER.budget_pages(lens).int())  # no plan: probes follow the schedule


def test_a_schedule_with_other_sink_or_local_pages_is_refused_under_static_decode():
    batch = PagedBatch(2, 64)
    batch.step([20, 40])
    buffers_lens = batch.step([1, 1]).seq_lens
    decoder = ScheduledDecode()
    decoder.scale, decoder.layer_index, decoder.backend = SCALE, SPARSE_LAYER, "triton"
    decoder.centroids, decoder.workspace = PageCentroids(batch.k_cache).table, Workspace()
    decoder.set_schedule(SMALL)
    q = torch.zeros(2, KV_HEADS * GROUP, HEAD_DIM, device=DEVICE)
    mask = torch.zeros(2, dtype=torch.bool, device=DEVICE)
    decoder.static_decode_rows(q, batch.k_cache, batch.v_cache, batch.block_table, buffers_lens, 64, mask)
    wider = Schedule(budgets=(96,), bin_width=64, sink_blocks=2, local_blocks=2, name="wider")
    with pytest.raises(ValueError, match="static decode runs with 1 sink and 2 local pages"):
        decoder.set_schedule(wider)
    assert decoder.schedule is SMALL  # refused: the layer keeps its schedule
    decoder.set_schedule(None)  # no schedule is always fine
    decoder.set_schedule(OTHER)


def test_probe_rows_are_written_in_place_and_bounded():
    rows = ProbeRows(4, torch.device("cpu"))
    mask = rows.mask
    rows.write(["probe:x", None, "y"])
    assert rows.mask is mask and mask.tolist() == [True, False, False, False]
    rows.write([])
    assert mask.tolist() == [False] * 4
    with pytest.raises(ValueError, match="5 rows but the probe-row mask holds 4"):
        rows.write(["a"] * 5)


def test_static_decode_is_asked_for_by_the_engine_config():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import AttentionCGSupport

    from services.generator.plugin.cuda_backend import STATIC_DECODE, SparrowTritonMetadataBuilder

    support = SparrowTritonMetadataBuilder.get_cudagraph_support
    assert support(SimpleNamespace(additional_config={}), None) is AttentionCGSupport.NEVER
    on = SimpleNamespace(additional_config={STATIC_DECODE: True})
    assert support(on, None) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_only_steps_of_pure_decodes_are_marked_static():
    pytest.importorskip("vllm")
    from services.generator.plugin.cuda_backend import with_static_decode

    batch = PagedBatch(ROWS, 400)
    driver = ImplDriver(batch, SPARSE_LAYER, None)
    rows = ProbeRows(8, torch.device(DEVICE))
    mixed = driver.metadata(batch.step([*PROMPTS, 40]))  # a step with a prefill chunk
    context = DecodeContext()
    assert with_static_decode(mixed, 400, rows, context).static_max_seq_len is None
    decodes = driver.metadata(batch.step([1] * ROWS))
    context.probe_row_ids = lambda: ["probe:a", None, "probe:b"]
    context.dense_row_ids = lambda: ["probe:a", "dense:c", "probe:b"]
    marked = with_static_decode(decodes, 400, rows, context)
    assert marked.static_max_seq_len == 400 and marked.probe_rows is rows.mask
    assert rows.mask.tolist()[:4] == [True, False, True, False]
    assert marked.dense_rows is rows.dense and rows.dense.tolist()[:4] == [False, True, False, False]


def test_an_engine_refuses_static_decode_where_it_cannot_run(tmp_path):
    pytest.importorskip("vllm")
    from services.generator.engine import EngineError
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    with pytest.raises(EngineError, match="needs a CUDA engine"):  # this machine's vLLM runs on CPU
        VllmEngine(VllmEngineConfig(model=str(tmp_path), static_decode=True, enforce_eager=False))


def test_nothing_is_made_inside_a_capture(monkeypatch):
    # Made inside a capture, a table's allocation and first fill (the centroids' zeroing) would be
    # replayed at every step: the builder makes them first, and a capture that finds none refuses.
    pytest.importorskip("vllm")
    from services.generator.plugin import cuda_backend, scheduled_decode

    def capture(on: bool) -> None:
        for module in (scheduled_decode, cuda_backend):
            monkeypatch.setattr(module, "capturing", lambda: on)

    batch = PagedBatch(ROWS, MAX_SEQ_LEN)
    buffers = Buffers(batch)
    static = ImplStatic(buffers, SPARSE_LAYER, register=False)  # the builder cannot see the layer
    static.decoder.set_schedule(SMALL)
    batch.step([*PROMPTS, 0])  # the keys are cached; the layer has made nothing yet
    buffers.load_decode_step()
    prepared = static.prepare()
    assert static.decoder.page_centroids is None and static.decoder.static is None
    assert not static.builder.static_prepared  # it tries again at the next build
    capture(True)
    with pytest.raises(RuntimeError, match="page centroids must be made before a CUDA graph"):
        static.run(prepared)
    with pytest.raises(RuntimeError, match="budget tables must be made before a CUDA graph"):
        static.decoder.make_static_tables(MAX_SEQ_LEN, torch.device(DEVICE))

    capture(False)
    name = static.driver.layer.layer_name
    unbound = {name: SimpleNamespace(impl=static.decoder, kv_cache=torch.tensor([]))}
    assert cuda_backend.prepare_static_layers(unbound, MAX_SEQ_LEN) is False  # vLLM binds caches later
    static.register()
    prepared = static.prepare()  # the next build makes them
    assert static.builder.static_prepared and static.decoder.static.max_seq_len == MAX_SEQ_LEN
    # The prefill's pages' centroids, as its (eager) step would have refreshed them.
    static.decoder.page_centroids.table.copy_(real_rows_centroids(batch))
    capture(True)
    static.run(prepared)  # nothing left to make: the step runs as a capture would record it
    want = expected(buffers, SPARSE_LAYER, SMALL, False)
    torch.testing.assert_close(buffers.out[: ROWS - 1].double().cpu(), want, **TOL)


def test_dense_rows_take_every_page_under_static_decode():
    st = StaticBudgets(300, torch.device("cpu"), 1, 2)
    lens = torch.tensor([63, 128, 192, 300], dtype=torch.int32)
    probe = torch.tensor([False, True, False, False])
    dense = torch.tensor([False, False, True, True])
    st.fill(SMALL, False, PROBE_PAGES)
    plain = st.budgets(lens, probe)
    got = st.budgets(lens, probe, dense)
    assert got[:2].tolist() == plain[:2].tolist() and got[2:].tolist() == [st.max_pages] * 2
    rows = ProbeRows(4, torch.device("cpu"))
    dense_mask, probe_mask = rows.dense, rows.mask
    rows.write_dense(["dense:x", "probe:y", None, "dense:z"])
    rows.write(["dense:x", "probe:y", None, "dense:z"])
    assert rows.dense is dense_mask and dense_mask.tolist() == [True, False, False, True]
    assert probe_mask.tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="5 rows"):
        rows.write_dense(["a"] * 5)
