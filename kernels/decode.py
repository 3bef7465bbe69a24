"""Block-sparse decode attention over a paged KV cache.

One query token per row attends to the pages `page_indices` selects for its KV head (or to every
page when `page_indices` is None: dense), tokens past the row's length masked out. Query head i
reads KV head i // (q_heads // kv_heads).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import check_same_device, check_unit_stride, resolve_backend, triton_interpreted
from .inputs import DecodeBounds, check_decode_inputs
from .layout import check_budgets, check_centroids, check_paged_cache, flat_page_index
from .pages import PAGE_SIZE, num_pages
from .select import score_blocks, select_blocks
from .workspace import Workspace

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634


def sparse_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_indices: torch.Tensor | None = None,
    scale: float | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Attention output [rows, q_heads, head_dim] (dtype of q) of one query token per row.

    Vectorised torch: gathers the selected pages of every row and head with one index_select per
    tensor (into `workspace` buffers when given; pass none when gradients must flow) and attends.
    """
    check_paged_cache(k_cache, v_cache, block_table, seq_lens)
    check_decode_inputs(q, k_cache, page_indices, seq_lens)
    rows, hq, d = q.shape
    nb, h, bs, _ = k_cache.shape
    g = hq // h
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    seq_lens = seq_lens.long()
    if page_indices is None:
        n = int(num_pages(seq_lens).max()) if rows else 0
        page_indices = torch.arange(n, device=q.device).expand(rows, h, n)
    pages = page_indices.long()
    n = pages.shape[2]
    present = pages >= 0
    index = flat_page_index(block_table, pages.clamp(min=0), bs, h).reshape(-1)
    k_pages = k_cache.reshape(-1, PAGE_SIZE * d)
    v_pages = v_cache.reshape(-1, PAGE_SIZE * d)
    if workspace is not None:
        kg = workspace.get("k", (index.numel(), PAGE_SIZE * d), k_cache.dtype, k_cache.device)
        vg = workspace.get("v", (index.numel(), PAGE_SIZE * d), v_cache.dtype, v_cache.device)
        torch.index_select(k_pages, 0, index, out=kg)
        torch.index_select(v_pages, 0, index, out=vg)
    else:
        kg = k_pages.index_select(0, index)
        vg = v_pages.index_select(0, index)
    kg = kg.view(rows * h, n * PAGE_SIZE, d)
    vg = vg.view(rows * h, n * PAGE_SIZE, d)

    pos = pages[..., None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=q.device)  # [rows, h, n, PAGE]
    visible = (present[..., None] & (pos < seq_lens[:, None, None, None])).view(rows * h, 1, n * PAGE_SIZE)
    qg = q.view(rows * h, g, d).to(kg.dtype)
    logits = torch.baddbmm(
        torch.zeros((), dtype=kg.dtype, device=q.device), qg, kg.transpose(1, 2), beta=0.0, alpha=scale
    )
    logits = logits.float().masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(vg.dtype)
    return torch.bmm(probs, vg).view(rows, hq, d).to(q.dtype)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    seq_lens_ptr,
    pages_ptr,
    budgets_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qr,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_tr,
    stride_tb,
    stride_pr,
    stride_ph,
    stride_pn,
    stride_or,
    stride_oh,
    stride_od,
    stride_por,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_lr,
    stride_lh,
    stride_ls,
    num_slots,
    num_splits,
    block_size,
    head_dim,
    group,
    qk_scale,
    DENSE: tl.constexpr,
    ROW_SLOTS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (row, kv head, split): the GQA group's query heads as one [BLOCK_G, BLOCK_D] tile
    # against its share of the row's page slots, BLOCK_N tokens (BLOCK_N / PAGE pages) at a time.
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    PAGES_PER_TILE: tl.constexpr = BLOCK_N // PAGE

    seq_len = tl.load(seq_lens_ptr + row).to(tl.int64)
    if DENSE:
        num_slots = (seq_len + PAGE - 1) // PAGE
    elif ROW_SLOTS:
        # The selection fills a row's first min(pages, budget) slots: the rest are padding, left unread.
        row_slots = tl.minimum((seq_len + PAGE - 1) // PAGE, tl.load(budgets_ptr + row).to(tl.int64))
        num_slots = tl.minimum(row_slots, num_slots)
    num_tiles = tl.cdiv(num_slots, PAGES_PER_TILE)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < head_dim
    q_heads = head * group + offs_g
    q_ptrs = q_ptr + row * stride_qr + q_heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_g[:, None] < group) & d_mask[None, :], other=0.0).to(k_ptr.dtype.element_ty)

    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for tile in range(tile_begin, tile_end):
        slot = tile * PAGES_PER_TILE + offs_n // PAGE
        if DENSE:
            page = slot.to(tl.int64)
        else:
            page = tl.load(
                pages_ptr + row * stride_pr + head * stride_ph + slot * stride_pn, mask=slot < num_slots, other=-1
            )
            page = page.to(tl.int64)
        pos = page * PAGE + offs_n % PAGE
        live = (slot < num_slots) & (page >= 0) & (pos < seq_len)
        block = tl.load(table_ptr + row * stride_tr + (pos // block_size) * stride_tb, mask=live, other=0)
        block = block.to(tl.int64)
        in_block = pos % block_size
        kv_mask = live[:, None] & d_mask[None, :]
        k_ptrs = k_ptr + block[:, None] * stride_kb + head * stride_kh + in_block[:, None] * stride_kt
        k = tl.load(k_ptrs + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        # Logits in the log2 domain: exp2 is the native instruction.
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        logits = tl.where(live[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        # Until a head has seen a visible token its maximum is -inf; shift by 0 then so no inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        p = tl.exp2(logits - m_shift[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v_ptrs = v_ptr + block[:, None] * stride_vb + head * stride_vh + in_block[:, None] * stride_vt
        v = tl.load(v_ptrs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
    head_mask = (offs_g[:, None] < group) & d_mask[None, :]
    if SINGLE_SPLIT:
        o_ptrs = out_ptr + row * stride_or + q_heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:
        po_ptrs = (
            part_out_ptr
            + row * stride_por
            + q_heads[:, None] * stride_poh
            + split * stride_pos
            + offs_d[None, :] * stride_pod
        )
        tl.store(po_ptrs, out, mask=head_mask)
        lse = tl.where(row_sum > 0.0, m + tl.log2(tl.where(row_sum > 0.0, row_sum, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row * stride_lr + q_heads * stride_lh + split * stride_ls, lse, mask=offs_g < group)


@triton.jit
def _decode_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_por,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_lr,
    stride_lh,
    stride_ls,
    stride_or,
    stride_oh,
    stride_od,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (row, query head): merge the splits' normalised outputs weighted by their log2-sum-exp.
    row = tl.program_id(0)
    qh = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(
        part_lse_ptr + row * stride_lr + qh * stride_lh + offs_s * stride_ls,
        mask=offs_s < num_splits,
        other=float("-inf"),
    )
    top = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o_ptrs = (
        part_out_ptr + row * stride_por + qh * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :] * stride_pod
    )
    o = tl.load(o_ptrs, mask=(offs_s[:, None] < num_splits) & (offs_d[None, :] < head_dim), other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(o * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + row * stride_or + qh * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < head_dim,
    )


def _default_num_splits(programs: int, max_tiles: int, device: torch.device) -> int:
    """Splits enough to give the GPU about two waves of programs; one when the grid is already full."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    return max(1, min(16, max_tiles, triton.cdiv(target, max(programs, 1))))


def sparse_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_indices: torch.Tensor | None = None,
    scale: float | None = None,
    workspace: Workspace | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    bounds: DecodeBounds | None = None,
    budgets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of `sparse_decode_attention_ref`: flash-decoding with split-K over the selected pages.

    Grid (rows, kv_heads, num_splits); each program runs an online softmax in float32 over its share
    of the page slots for the whole GQA group, and a second kernel merges the splits (skipped when
    there is one). `page_indices` None attends to every page (dense); -1 entries are skipped.
    `num_splits` defaults to what fills the device; `block_n` (tokens per inner step) to 64, or 16
    for a float32 cache on a GPU, where the FMA-based float32 dot would spill registers at 64.
    With `bounds` (lengths known on the host) the checks read nothing from the device: no host sync.
    With `budgets` (in pages, those `page_indices` was selected under) each row reads only its
    min(pages, budget) selected slots, not the batch's widest selection's (rows of other lengths or
    budgets then cost what they select, and wider `bounds` cost nothing more).
    """
    check_paged_cache(k_cache, v_cache, block_table, seq_lens, None if bounds is None else bounds.max_seq_len)
    check_decode_inputs(q, k_cache, page_indices, seq_lens)
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k/v caches must share one dtype of {CACHE_DTYPES}, got {k_cache.dtype} and {v_cache.dtype}")
    if q.dtype not in CACHE_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if page_indices is not None and page_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_indices must be int32 or int64, got {page_indices.dtype}")
    if seq_lens.is_floating_point():
        raise ValueError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}")
    check_budgets(budgets, seq_lens)
    fp32_on_gpu = k_cache.dtype == torch.float32 and not triton_interpreted()
    block_n = (16 if fp32_on_gpu else 64) if block_n is None else block_n
    if block_n < PAGE_SIZE or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {PAGE_SIZE}, got {block_n}")
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        page_indices=page_indices,
        budgets=budgets,
    )
    check_unit_stride(q=q, k_cache=k_cache, v_cache=v_cache)
    rows, hq, d = q.shape
    _, h, bs, _ = k_cache.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dense = page_indices is None
    # Without a host sync the dense width is bounded by the block table, not the longest row.
    slots = block_table.shape[1] * bs // PAGE_SIZE if dense else page_indices.shape[2]
    if num_splits is None:
        num_splits = _default_num_splits(rows * h, triton.cdiv(max(slots, 1), block_n // PAGE_SIZE), q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    shape = (rows, hq, num_splits)
    if workspace is not None:
        part_out = workspace.get("decode_part_out", (*shape, d), torch.float32, q.device)
        part_lse = workspace.get("decode_part_lse", shape, torch.float32, q.device)
    else:
        part_out = torch.empty((*shape, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    pages = block_table if dense else page_indices  # any valid pointer when dense: never read
    block_d = max(16, triton.next_power_of_2(d))
    _decode_split_kernel[(rows, h, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        pages,
        seq_lens if budgets is None else budgets,  # any valid pointer when unused
        out,
        part_out,
        part_lse,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_table.stride(),
        *((0, 0, 0) if dense else page_indices.stride()),
        *out.stride(),
        *part_out.stride(),
        *part_lse.stride(),
        0 if dense else slots,
        num_splits,
        bs,
        d,
        hq // h,
        scale * LOG2E,
        DENSE=dense,
        ROW_SLOTS=budgets is not None and not dense,
        SINGLE_SPLIT=num_splits == 1,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        PAGE=PAGE_SIZE,
        BLOCK_G=max(16, triton.next_power_of_2(hq // h)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        num_warps=8 if fp32_on_gpu else 4,
        num_stages=1 if triton_interpreted() else 2,
    )
    if num_splits > 1:
        _decode_combine_kernel[(rows, hq)](
            part_out,
            part_lse,
            out,
            *part_out.stride(),
            *part_lse.stride(),
            *out.stride(),
            num_splits,
            d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d,
        )
    return out


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_indices: torch.Tensor | None = None,
    scale: float | None = None,
    workspace: Workspace | None = None,
    backend: str = "auto",
    bounds: DecodeBounds | None = None,
    budgets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [rows, q_heads, head_dim] of one query token per row over the selected pages.

    `page_indices` None is dense. `backend`: see `kernels.backend.resolve_backend`; the CPU
    extension computes no gradients, so with gradients wanted the torch reference runs instead.
    `bounds` and `budgets` reach the Triton kernel only (see `DecodeBounds` and
    `sparse_decode_attention_triton`).
    """
    which = _decode_backend(backend, q, k_cache, v_cache)
    if which == "cpu":
        from .cpu import sparse_decode_attention_cpu

        return sparse_decode_attention_cpu(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale)
    if which == "triton":
        return sparse_decode_attention_triton(
            q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, workspace, bounds=bounds, budgets=budgets
        )
    return sparse_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, page_indices, scale, workspace)


def _decode_backend(backend: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    which = resolve_backend(backend, q)
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k_cache, v_cache))
    return "torch" if which == "cpu" and wants_grad else which


def block_sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    centroids: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    sink: int = 1,
    local: int = 2,
    scale: float | None = None,
    workspace: Workspace | None = None,
    backend: str = "auto",
    bounds: DecodeBounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block-sparse decode step: score the pages, select per row and KV head, attend.

    `budgets` [rows] are in pages (sink and local included); a budget of at least the row's page
    count is dense. `centroids` must be current (see `update_centroids`). Returns the output
    [rows, q_heads, head_dim] and the selected page indices int32 [rows, kv_heads, width] (-1 padded).
    On the Triton path, `bounds` (`decode_bounds` of the rows' lengths and budgets as the host
    knows them) make the step free of host syncs: without them each kernel's checks and output
    sizes read the longest row from the device. There each row costs what it selects, whatever the
    batch's widest selection: rows the budget covers whole are not scored, and each row attends
    over its own selected slots only.
    """
    check_centroids(centroids, k_cache)
    which = resolve_backend(backend, q)
    scores = score_blocks(q, centroids, k_cache, block_table, seq_lens, backend=which, bounds=bounds, budgets=budgets)
    pages = select_blocks(scores, seq_lens, budgets, sink, local, backend=which, bounds=bounds)
    out = sparse_decode_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        pages,
        scale,
        workspace,
        backend=which,
        bounds=bounds,
        budgets=budgets,
    )
    return out, pages
