"""The CUDA path of the vLLM plugin (`cuda_backend`), run as far as this machine allows.

vLLM's CUDA KV layout is built by hand: per layer a cache tensor [num_blocks, kv_heads, 16, 2 * head_dim]
in NHD physical order (vLLM's default layout, so the key and value halves are strided views), written
at slot_mapping as vLLM's `do_kv_cache_update` writes it (with -1 padding slots after the real ones),
a shuffled block table, and batches whose decode rows come first (vLLM reorders them so for this
backend). Rows: four decode rows of different lengths and length bins (one shorter than its budget)
and one prefill row whose chunks start mid-page; several steps, crossing page boundaries.

Two drivers run the same checks:
  - "core": the vLLM-free part that is ours (`PageCentroids` + `ScheduledDecode.decode_rows`); this is
    what `bench/cuda_check` runs on a GPU machine without vLLM;
  - "impl": `SparrowTritonAttentionImpl.forward` with vLLM's metadata types (needs vLLM).
Without a GPU our Triton kernels run in the interpreter in float32. vLLM's own Triton kernel cannot
run here (vLLM's CPU build swaps Triton for placeholders), so on CPU `triton_attn.unified_attention`,
the stock kernel the impl calls for prefill rows and for dense layers, is replaced by a float64
torch equivalent that also records which rows it got; on a CUDA machine the real kernel runs.
Nothing else is mocked. References are float64: a dense causal attention over the cache, and the
naive oracle of the kernel tests (`kernel_oracle.sparse_decode`: scores, selection, attention).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kernels import PAGE_SIZE, Workspace, new_centroids, update_centroids_ref
from services.generator.plugin import scheduled_decode
from services.generator.plugin.page_centroids import PageCentroids, page_ends
from services.generator.plugin.scheduled_decode import ScheduledDecode
from sparrow.schedule import Schedule
from tests.unit.kernels import kernel_oracle as oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 2, 32, 16
SCALE = HEAD_DIM**-0.5
TOL = {"atol": 1e-5, "rtol": 1e-5}
# The stock kernel may multiply float32 in TF32 on a GPU; here its stand-in is exact.
STOCK_TOL = {"atol": 5e-3, "rtol": 5e-3} if DEVICE == "cuda" else TOL
PROMPTS = [150, 62, 300, 20]  # decode rows A, B (crosses a bin edge), C, E (fits its budget: dense)
CHUNKS = [40, 45]  # prefill row D: two chunks, the second starting mid-page, then decodes
FULL = Schedule(budgets=(4096,), bin_width=4096, name="full")  # dense layers 0 and 1, the default
SMALL = Schedule(budgets=(48, 64, 80, 96), bin_width=64, name="small")  # 3..6 pages
SPARSE_LAYER = 2


@dataclass
class Step:
    q_lens: list[int]
    query: torch.Tensor  # [tokens, q_heads, d]
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor  # [tokens + 3], -1 padded as vLLM pads it
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    rows: torch.Tensor  # row of each token
    positions: torch.Tensor  # position of each token in its row

    @property
    def num_decodes(self) -> int:
        return next((i for i, n in enumerate(self.q_lens) if n > 1), len(self.q_lens))

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)


class PagedBatch:
    """Rows of one attention layer in vLLM's CUDA KV layout, grown a step at a time."""

    def __init__(self, rows: int, max_len: int, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        per_row = -(-max_len // BLOCK)
        blocks = rows * per_row + 3
        nhd = torch.zeros(blocks, BLOCK, KV_HEADS, 2 * HEAD_DIM)
        self.kv_cache = nhd.transpose(1, 2).to(DEVICE)  # logical [blocks, kv_heads, 16, 2d], NHD in memory
        table = torch.randperm(blocks, generator=self.gen)[: rows * per_row].view(rows, per_row)
        self.block_table = table.to(torch.int32).to(DEVICE)
        self.lens = [0] * rows

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv_cache[..., :HEAD_DIM]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv_cache[..., HEAD_DIM:]

    def step(self, q_lens: list[int]) -> Step:
        tokens = sum(q_lens)

        def randn(*shape):
            return torch.randn(*shape, generator=self.gen).to(DEVICE)

        query = randn(tokens, KV_HEADS * GROUP, HEAD_DIM)
        key, value = randn(tokens, KV_HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM)
        rows = torch.cat([torch.full((n,), r) for r, n in enumerate(q_lens)])
        positions = torch.cat([torch.arange(self.lens[r], self.lens[r] + n) for r, n in enumerate(q_lens)])
        table = self.block_table.cpu().long()
        slots = table[rows, positions // BLOCK] * BLOCK + positions % BLOCK
        blocks, offsets = (slots // BLOCK).to(DEVICE), (slots % BLOCK).to(DEVICE)
        self.kv_cache[blocks, :, offsets, :HEAD_DIM] = key  # what do_kv_cache_update does
        self.kv_cache[blocks, :, offsets, HEAD_DIM:] = value
        self.lens = [n + q for n, q in zip(self.lens, q_lens, strict=True)]
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return Step(
            q_lens,
            query,
            key,
            value,
            torch.cat([slots, torch.full((3,), -1)]).to(DEVICE),
            torch.tensor(self.lens, dtype=torch.int32, device=DEVICE),
            starts.to(DEVICE),
            rows,
            positions,
        )


def steps() -> list[list[int]]:
    """q_lens per step: prefills, a mixed step (decodes + a mid-page chunk), then pure decode steps."""
    decoding = [1] * len(PROMPTS)
    return [[*PROMPTS, CHUNKS[0]], [*decoding, CHUNKS[1]], [*decoding, 1], [*decoding, 1], [*decoding, 1]]


def dense_reference(batch: PagedBatch, step: Step) -> torch.Tensor:
    """Float64 causal attention of every token of the step over its row's cached prefix."""
    k, v = batch.k_cache.double().cpu(), batch.v_cache.double().cpu()
    table = batch.block_table.cpu().long()
    out = torch.zeros(step.tokens, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.float64)
    for r in range(len(step.q_lens)):
        n = batch.lens[r]
        blocks = table[r, : -(-n // BLOCK)]
        keys = k[blocks].transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(GROUP, dim=1)
        values = v[blocks].transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(GROUP, dim=1)
        mine = (step.rows == r).nonzero().squeeze(1)
        q = step.query.cpu().double()[mine]  # [t, hq, d]
        logits = torch.einsum("thd,lhd->thl", q, keys) * SCALE
        visible = torch.arange(n)[None, :] <= step.positions[mine][:, None]
        probs = logits.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        out[mine] = torch.einsum("thl,lhd->thd", probs, values)
    return out


def oracle_decode(query: torch.Tensor, batch: PagedBatch, lens: torch.Tensor, budgets: torch.Tensor, schedule):
    """The kernel oracle's step (float64 output, selected pages) for the batch's first len(lens) rows."""
    n = len(lens)
    cpu = (query[:n], batch.k_cache, batch.v_cache, batch.block_table[:n])
    return oracle.sparse_decode(
        *(t.cpu() for t in cpu), lens, budgets, schedule.sink_blocks, schedule.local_blocks, SCALE
    )


def scratch_centroids(batch: PagedBatch) -> torch.Tensor:
    """Every page's centroid computed afresh from the cache (the kernels' reference)."""
    fresh = new_centroids(batch.k_cache)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=DEVICE)
    update_centroids_ref(batch.k_cache, fresh, batch.block_table, lens)
    return fresh


class CoreDriver:
    """The vLLM-free decode path: centroid upkeep from the slots, then `decode_rows` of the decode rows."""

    def __init__(self, batch: PagedBatch, layer: int, schedule: Schedule | None) -> None:
        self.decoder = ScheduledDecode()
        self.decoder.scale, self.decoder.layer_index, self.decoder.backend = SCALE, layer, "triton"
        self.decoder.workspace = Workspace()
        self.decoder.set_schedule(schedule)
        self.page_centroids = PageCentroids(batch.k_cache, backend="triton")  # as on a GPU
        self.decoder.centroids = self.page_centroids.table
        self.batch = batch

    @property
    def centroids(self) -> torch.Tensor:
        return self.page_centroids.table

    def prepare(self, step: Step) -> torch.Tensor:
        """The decode rows' lengths on the host, as the impl takes them from vLLM's metadata."""
        return step.seq_lens[: step.num_decodes].cpu()

    def run(self, step: Step, lens_cpu: torch.Tensor | None = None) -> torch.Tensor | None:
        b, nd = self.batch, step.num_decodes
        lens_cpu = self.prepare(step) if lens_cpu is None else lens_cpu
        # Padding slots included: they must land in the scratch block.
        self.page_centroids.refresh(b.k_cache, step.slots, one_token_per_page=nd == len(step.q_lens))
        if not nd:
            return None
        q, table, lens = step.query[:nd], b.block_table[:nd], step.seq_lens[:nd]
        return self.decoder.decode_rows(q, b.k_cache, b.v_cache, table, lens, seq_lens_cpu=lens_cpu)


class ImplDriver:
    """`SparrowTritonAttentionImpl.forward` with vLLM's metadata types."""

    def __init__(self, batch: PagedBatch, layer: int, schedule: Schedule | None) -> None:
        from services.generator.plugin.cuda_backend import SparrowTritonAttentionImpl

        self.impl = SparrowTritonAttentionImpl(KV_HEADS * GROUP, HEAD_DIM, SCALE, KV_HEADS, None, None, "auto")
        self.impl.set_schedule(schedule)
        one = torch.ones((), device=DEVICE)
        self.layer = SimpleNamespace(
            layer_name=f"model.layers.{layer}.self_attn.attn", _k_scale=one, _v_scale=one, _q_scale=one
        )
        self.batch = batch

    @property
    def centroids(self) -> torch.Tensor:
        return self.impl.centroids

    def prepare(self, step: Step):
        return self.metadata(step)

    def metadata(self, step: Step):
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

        from services.generator.plugin.cuda_backend import with_decode_split

        rows, hq = len(step.q_lens), KV_HEADS * GROUP
        common = CommonAttentionMetadata(
            query_start_loc=step.query_start_loc,
            query_start_loc_cpu=step.query_start_loc.cpu(),
            seq_lens=step.seq_lens,
            seq_lens_cpu_upper_bound=step.seq_lens.cpu(),  # exact: no speculative decoding
            num_reqs=rows,
            num_actual_tokens=step.tokens,
            max_query_len=max(step.q_lens),
            max_seq_len=max(self.batch.lens),
            block_table_tensor=self.batch.block_table[:rows],
            slot_mapping=step.slots,
        )
        segments = (16, hq, 16)
        stock = TritonAttentionMetadata(
            num_actual_tokens=step.tokens,
            max_query_len=max(step.q_lens),
            query_start_loc=step.query_start_loc,
            max_seq_len=max(self.batch.lens),
            seq_lens=step.seq_lens,
            block_table=self.batch.block_table[:rows],
            slot_mapping=step.slots,
            seq_threshold_3D=16,
            num_par_softmax_segments=16,
            softmax_segm_output=torch.empty(*segments, HEAD_DIM, device=DEVICE),
            softmax_segm_max=torch.empty(*segments, device=DEVICE),
            softmax_segm_expsum=torch.empty(*segments, device=DEVICE),
            causal=True,
        )
        return with_decode_split(stock, common)

    def run(self, step: Step, metadata=None) -> torch.Tensor:
        metadata = self.metadata(step) if metadata is None else metadata
        output = torch.full((step.tokens + 3, KV_HEADS * GROUP, HEAD_DIM), float("nan"), device=DEVICE)
        padded = (torch.cat([x, x[:3] * 0]) for x in (step.query, step.key, step.value))
        self.impl.forward(self.layer, *padded, self.batch.kv_cache, metadata, output)
        return output[: step.tokens]


@pytest.fixture
def stock(monkeypatch, request):
    """Calls of the stock Triton kernel as (rows, tokens); on CPU it is a float64 stand-in, else None.

    None also for the "core" driver and where vLLM is not installed: only the "impl" driver calls the
    stock kernel, and it skips without vLLM (`bench/cuda_check --dry-run` runs the "core" tests so, as
    on a GPU machine without vLLM, and without paying vLLM's import)."""
    kind = getattr(request.node, "callspec", None) and request.node.callspec.params.get("kind")
    if DEVICE == "cuda" or kind == "core" or importlib.util.find_spec("vllm") is None:
        yield None
        return
    from vllm.v1.attention.backends import triton_attn

    calls = []

    def unified_attention(*, q, k, v, out, cu_seqlens_q, seqused_k, softmax_scale, block_table, causal, **_):
        assert causal is True
        calls.append((len(seqused_k), q.shape[0]))
        bs = k.shape[1]
        for r in range(len(seqused_k)):
            s, e, n = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1]), int(seqused_k[r])
            pos = torch.arange(n)
            blocks = block_table[r].long()[pos // bs]
            keys = k[blocks, pos % bs].double().repeat_interleave(q.shape[1] // k.shape[2], dim=1)
            values = v[blocks, pos % bs].double().repeat_interleave(q.shape[1] // k.shape[2], dim=1)
            logits = torch.einsum("thd,lhd->thl", q[s:e].double(), keys) * softmax_scale
            visible = pos[None, :] <= (n - (e - s) + torch.arange(e - s))[:, None]
            probs = logits.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
            out[s:e] = torch.einsum("thl,lhd->thd", probs, values).to(out.dtype)

    monkeypatch.setattr(triton_attn, "unified_attention", unified_attention)
    yield calls


def make_driver(kind: str, batch: PagedBatch, layer: int, schedule: Schedule | None):
    if kind == "impl":
        pytest.importorskip("vllm")
        return ImplDriver(batch, layer, schedule)
    return CoreDriver(batch, layer, schedule)


DRIVERS = ["core", "impl"]


@dataclass
class Ran:
    step: Step
    batch: PagedBatch
    driver: CoreDriver | ImplDriver
    decoded: torch.Tensor | None  # output of the decode rows
    prefilled: torch.Tensor | None  # output of the other rows' tokens ("impl" only)
    stock_calls: list | None  # (rows, tokens) of each stock kernel call in this step (CPU, "impl" only)


def run_steps(kind: str, layer: int, schedule: Schedule | None, stock):
    """Run every step of `steps()` through a driver of `kind`, yielding what each step produced."""
    batch = PagedBatch(len(PROMPTS) + 1, max(PROMPTS) + sum(CHUNKS) + 8)
    driver = make_driver(kind, batch, layer, schedule)
    for q_lens in steps():
        step = batch.step(q_lens)
        seen = len(stock) if stock is not None else 0
        out = driver.run(step)
        nd = step.num_decodes  # one token per decode row
        if kind == "core":
            yield Ran(step, batch, driver, out, None, None)
        else:
            calls = stock[seen:] if stock is not None else None
            yield Ran(step, batch, driver, out[:nd] if nd else None, out[nd:], calls)


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRIVERS)
def test_a_budget_covering_every_page_is_dense_attention(kind, stock):
    for ran in run_steps(kind, SPARSE_LAYER, FULL, stock):
        step = ran.step
        want = dense_reference(ran.batch, step)
        nd, rows = step.num_decodes, len(step.q_lens)
        if nd:
            torch.testing.assert_close(ran.decoded.double().cpu(), want[:nd], **TOL)
        if ran.prefilled is not None:
            torch.testing.assert_close(ran.prefilled.double().cpu(), want[nd:], **STOCK_TOL)
        if ran.stock_calls is not None:
            # The stock kernel gets exactly the rows that are not decoding, and nothing in a pure decode step.
            assert ran.stock_calls == ([(rows - nd, step.tokens - nd)] if nd < rows else [])


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRIVERS)
def test_small_budgets_match_the_oracle_page_for_page_and_centroids_stay_current(kind, stock, monkeypatch):
    selected = []
    real = scheduled_decode.block_sparse_decode

    def spy(*args, **kwargs):
        out, pages = real(*args, **kwargs)
        selected.append(pages.cpu())
        return out, pages

    monkeypatch.setattr(scheduled_decode, "block_sparse_decode", spy)
    sparse_rows = 0
    for ran in run_steps(kind, SPARSE_LAYER, SMALL, stock):
        step, batch, decoded = ran.step, ran.batch, ran.decoded
        # (c) centroids kept up to date from the written slots equal centroids recomputed from scratch.
        torch.testing.assert_close(ran.driver.centroids, scratch_centroids(batch), atol=1e-6, rtol=1e-6)
        nd = step.num_decodes
        if not nd:
            continue
        lens = step.seq_lens[:nd].cpu()
        budgets = SMALL.budget_pages(lens)
        want, want_pages = oracle_decode(step.query, batch, lens, budgets, SMALL)
        assert oracle.as_index_lists(selected[-1]) == want_pages
        torch.testing.assert_close(decoded.double().cpu(), want, **TOL)
        pages = oracle.pages_of
        sparse_rows += sum(pages(int(n)) > int(b) for n, b in zip(lens, budgets, strict=True))
        short = [r for r in range(nd) if pages(int(lens[r])) <= int(budgets[r])]
        assert all(want_pages[r][h] == list(range(pages(int(lens[r])))) for r in short for h in range(KV_HEADS))
    assert sparse_rows >= 3 * len(steps()[1:])  # selection really happened, in most rows of every step


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRIVERS)
@pytest.mark.parametrize("schedule", [SMALL, None], ids=["dense-layer", "no-schedule"])
def test_dense_layers_and_no_schedule_stay_dense(kind, schedule, stock):
    for ran in run_steps(kind, 0, schedule, stock):
        step = ran.step
        want = dense_reference(ran.batch, step)
        nd = step.num_decodes
        # The impl hands such steps whole to the stock kernel, whose tolerance then applies.
        tol = STOCK_TOL if kind == "impl" else TOL
        if nd:
            torch.testing.assert_close(ran.decoded.double().cpu(), want[:nd], **tol)
        if ran.prefilled is not None:
            torch.testing.assert_close(ran.prefilled.double().cpu(), want[nd:], **tol)
        if ran.stock_calls is not None:
            assert ran.stock_calls == [(len(step.q_lens), step.tokens)]


# Calls that bring a tensor's values to the host: each is a host sync when the tensor is on a GPU.
HOST_READS = {
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__int__,
    torch.Tensor.cpu,
    torch.Tensor.item,
    torch.Tensor.nonzero,
    torch.Tensor.numpy,
    torch.Tensor.tolist,
    torch.masked_select,
    torch.nonzero,
}
PROJECT = Path(__file__).resolve().parents[3]
TORCH = Path(torch.__file__).resolve().parent


class HostReads(TorchFunctionMode):
    """Records every read of tensor values on the host made by the project's own code, but of `allowed`.

    A CPU has no host syncs to count, so this catches what would be one on a GPU by the calls that
    cause them: scalar conversions, `tolist`/`cpu`/`numpy`, and outputs shaped by the data (nonzero,
    masked_select, indexing by a boolean mask). On a GPU the test also turns torch's sync check to
    "error", which sees every sync, whoever makes it."""

    def __init__(self, allowed: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.allowed = allowed
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and not any(tensor is a for a in self.allowed) and self._reads(func, args):
            where = self._project_caller()
            if where is not None:
                self.reads.append(f"{getattr(func, '__name__', func)} at {where}")
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _reads(func, args) -> bool:
        if func in HOST_READS:
            return True
        if func is torch.Tensor.__getitem__:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        return False

    @staticmethod
    def _project_caller() -> str | None:
        """`file:line` of the first caller outside torch when it is the project's code (not a test's)."""
        frame = sys._getframe(2)
        while frame is not None and Path(frame.f_code.co_filename).resolve().is_relative_to(TORCH):
            frame = frame.f_back
        if frame is None:
            return None
        path = Path(frame.f_code.co_filename).resolve()
        if not path.is_relative_to(PROJECT) or path.relative_to(PROJECT).parts[0] not in ("kernels", "services"):
            return None
        return f"{path.relative_to(PROJECT)}:{frame.f_lineno}"


@contextlib.contextmanager
def no_host_syncs():
    """On a GPU, any host sync inside raises (torch's sync debug mode); on a CPU there are none."""
    if DEVICE != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.slow
@pytest.mark.parametrize("kind", DRIVERS)
@pytest.mark.parametrize("layer", [SPARSE_LAYER, 0], ids=["sparse-layer", "dense-layer"])
def test_a_step_of_decodes_reads_nothing_back_from_the_device(kind, layer, stock):
    # Attention runs eagerly between vLLM's CUDA-graph pieces, so a host sync there would stall the
    # CPU once per layer and step. The step's sizes come from the host lengths in the metadata.
    decode_steps = 0
    batch = PagedBatch(len(PROMPTS) + 1, max(PROMPTS) + sum(CHUNKS) + 8)
    driver = make_driver(kind, batch, layer, SMALL)
    for q_lens in steps():
        step = batch.step(q_lens)
        prepared = driver.prepare(step)  # vLLM's builder, once per step
        if step.num_decodes < len(q_lens):
            driver.run(step, prepared)
            continue
        host_lens = prepared if kind == "core" else prepared.decode_seq_lens_cpu
        with HostReads(allowed=(host_lens,)) as seen, no_host_syncs():
            out = driver.run(step, prepared)
        assert seen.reads == []
        want = dense_reference(batch, step) if layer == 0 else None
        if want is not None:  # the step still computed what it should
            torch.testing.assert_close(out.double().cpu(), want, **(STOCK_TOL if kind == "impl" else TOL))
        decode_steps += 1
    assert decode_steps == 3


def test_host_reads_are_caught():
    # The check above can fail: the kernels' own length checks read the device when no bounds are given.
    from kernels import block_sparse_decode

    batch = PagedBatch(2, 80, seed=5)
    batch.step([40, 70])
    step = batch.step([1, 1])
    cents = PageCentroids(batch.k_cache)
    cents.refresh(batch.k_cache, torch.arange(0, 16 * 40, device=DEVICE)[:0])
    budgets = torch.tensor([3, 3], device=DEVICE)
    with HostReads() as seen:
        block_sparse_decode(
            step.query, batch.k_cache, batch.v_cache, cents.table, batch.block_table, step.seq_lens, budgets
        )
    assert any(r.startswith("__int__ at kernels/layout.py") for r in seen.reads), seen.reads
    with HostReads() as seen:
        page_ends(step.slots)
    assert any(r.startswith("__getitem__ at services/generator/plugin/page_centroids.py") for r in seen.reads)


def test_layers_of_a_mixed_step_find_the_written_pages_once(monkeypatch, stock):
    # Finding each page's last token in a step with prefill chunks costs a host sync; the layers share
    # the step's metadata, so the first layer finds them and the others reuse its answer.
    pytest.importorskip("vllm")
    from services.generator.plugin import cuda_backend

    found = []
    real = cuda_backend.page_ends
    monkeypatch.setattr(cuda_backend, "page_ends", lambda slots: found.append(1) or real(slots))
    batch = PagedBatch(len(PROMPTS) + 1, 400)
    layers = [ImplDriver(batch, layer, None) for layer in (2, 3)]
    for q_lens, finds in (([*PROMPTS, CHUNKS[0]], 1), ([1, 1, 1, 1, CHUNKS[1]], 1), ([1] * 5, 0)):
        step = batch.step(q_lens)
        metadata, found[:] = layers[0].metadata(step), []
        for layer in layers:
            layer.run(step, metadata)
            torch.testing.assert_close(layer.centroids, scratch_centroids(batch), atol=1e-6, rtol=1e-6)
        assert len(found) == finds


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_page_centroids_refresh_only_the_pages_written(backend):
    batch = PagedBatch(2, 80, seed=3)
    cents = PageCentroids(batch.k_cache, backend)
    assert cents.triton == (backend == "triton")
    for q_lens in ([21, 5], [1, 30], [1, 1], [11, 1]):
        step = batch.step(q_lens)
        before = cents.table.clone()
        cents.refresh(batch.k_cache, step.slots, one_token_per_page=max(q_lens) == 1)
        fresh = scratch_centroids(batch)
        torch.testing.assert_close(cents.table, fresh, atol=1e-6, rtol=1e-6)
        written = torch.zeros(cents.table.shape[:3], dtype=torch.bool, device=DEVICE)
        slots = step.slots[step.slots >= 0]
        written[slots // BLOCK, :, (slots % BLOCK) // PAGE_SIZE] = True
        assert torch.equal(cents.table[~written], before[~written])  # nothing else was touched


def test_page_ends_keep_one_writer_per_page():
    # Two requests' chunks (one ending mid-page, one crossing two page edges), a decode, padding.
    slots = torch.tensor([*range(37, 50), *range(160, 200), 500, -1, -1])
    ends = [47, 49, 175, 191, 199, 500]
    assert page_ends(slots).tolist() == ends
    assert page_ends(slots[:-2]).tolist() == ends  # without the padding


def test_budget_pages_are_the_schedules():
    decoder = ScheduledDecode()
    decoder.set_schedule(SMALL)
    lens = torch.tensor([1, 63, 64, 127, 128, 191, 192, 10_000], dtype=torch.int32)
    assert torch.equal(decoder.budget_pages(lens), SMALL.budget_pages(lens))
    other = SMALL.with_budgets((48, 48, 48, 160))
    decoder.set_schedule(other)  # a new schedule takes effect at once, not the cached table
    assert torch.equal(decoder.budget_pages(lens), other.budget_pages(lens))


def test_metadata_split_and_prefill_slice():
    pytest.importorskip("vllm")
    from services.generator.plugin.cuda_backend import prefill_rows

    batch = PagedBatch(len(PROMPTS) + 1, 400)
    batch.step([*PROMPTS, CHUNKS[0]])
    step = batch.step([1, 1, 1, 1, CHUNKS[1]])
    md = ImplDriver(batch, 1, None).metadata(step)
    assert (md.num_decodes, md.num_decode_tokens) == (4, 4)
    rest = prefill_rows(md)
    assert rest.num_actual_tokens == CHUNKS[1] and rest.query_start_loc.tolist() == [0, CHUNKS[1]]
    assert rest.seq_lens.tolist() == [CHUNKS[0] + CHUNKS[1]]
    assert torch.equal(rest.block_table, batch.block_table[4:5]) and torch.equal(rest.slot_mapping, step.slots[4:])
    assert ImplDriver(batch, 1, None).metadata(batch.step([1] * 5)).num_decodes == 5


def test_backend_claims_only_what_it_computes():
    pytest.importorskip("vllm")
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionCGSupport

    from services.generator.plugin.cuda_backend import (
        SparrowTritonAttentionBackend,
        SparrowTritonAttentionImpl,
        SparrowTritonMetadataBuilder,
    )
    from services.generator.plugin.sparse_impl import SparrowAttentionImpl

    b = SparrowTritonAttentionBackend
    assert b.get_name() == "TRITON_ATTN" and b.get_impl_cls() is SparrowTritonAttentionImpl
    assert SparrowTritonMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    common = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0),
        attn_type="decoder",
    )
    assert b.validate_configuration(**common) == []
    assert b.validate_configuration(**{**common, "kv_cache_dtype": "fp8"}) == ["kv_cache_dtype not supported"]
    assert b.validate_configuration(**common, has_sliding_window=True) == ["sliding window not supported"]
    assert b.validate_configuration(**{**common, "has_sink": True}) == ["attention sinks not supported"]
    with pytest.raises(NotImplementedError, match="sliding-window attention; run this model with"):
        SparrowTritonAttentionImpl(4, 128, 0.1, 2, None, 4096, "auto")
    # The worker extension finds both impls through the shared base.
    assert issubclass(SparrowTritonAttentionImpl, ScheduledDecode) and issubclass(SparrowAttentionImpl, ScheduledDecode)
    assert math.isclose(SparrowTritonAttentionImpl(4, 128, 0.25, 2, None, None, "auto").scale, 0.25)


def test_register_overrides_triton_attn_on_cuda_and_refuses_other_platforms(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from services.generator import plugin
    from services.generator.plugin import patches

    patches.apply_all()  # imports vLLM's model code now: on a pretend-CUDA platform it would reach for CUDA
    was_overridden = AttentionBackendEnum.TRITON_ATTN.is_overridden()
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    try:
        plugin.register()
        plugin.register()  # twice is fine
        assert AttentionBackendEnum.TRITON_ATTN.get_path() == plugin.CUDA_BACKEND
        assert plugin.engine_attention_backend() == "TRITON_ATTN"
        monkeypatch.setenv("SPARROW_ATTENTION", "stock")
        assert plugin.engine_attention_backend() is None
        monkeypatch.delenv("SPARROW_ATTENTION")
        monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
        assert plugin.engine_attention_backend() is None
        with pytest.raises(plugin.UnsupportedVllmError, match="supports CPU and CUDA"):
            plugin.register()
    finally:
        if not was_overridden:
            AttentionBackendEnum.TRITON_ATTN.clear_override()
