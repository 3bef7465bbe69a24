"""Phase `attention`: one layer's decode step at 32K, dense (ours, SDPA, vLLM's) vs the plugin's sparse decode."""

from __future__ import annotations

from bench.cuda_check.common import DEVICE, DRY, DTYPES, REL_TOL, Record, decoder, has_vllm, max_rel, median_ms, paged


def phase_attention(rec: Record) -> None:
    import warnings

    import torch

    from kernels import Workspace, sparse_decode_attention, update_centroids_ref
    from services.generator.plugin.page_centroids import PageCentroids
    from sparrow.schedule import Schedule

    batch, ctx, h, group, d, bs = (2, 1024, 2, 2, 32, 16) if DRY else (8, 32768, 8, 2, 128, 16)
    dtype = getattr(torch, DTYPES[-1])
    budgets = (128, 256) if DRY else (2048, 4096)
    rec["shape"] = {"batch": batch, "context": ctx, "kv_heads": h, "q_heads": h * group, "head_dim": d}
    k, v, table, lens, g = paged([ctx] * batch, h, d, bs, dtype, nhd=True)
    q = torch.randn(batch, h * group, d, device=DEVICE, generator=g).to(dtype)
    last = table.long()[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs  # the slot each row just wrote
    pc = PageCentroids(k, backend="triton")
    update_centroids_ref(k, pc.table, table, lens)
    dec = decoder(d**-0.5, 5, pc.table)
    flush = torch.empty(2**20 if DRY else 256 * 2**20, dtype=torch.uint8, device=DEVICE)  # > the 60 MB L2
    iters, warmup = (1, 0) if DRY else (20, 3)  # the dry run proves the code, its figures mean nothing

    def timed(fn) -> float:
        return median_ms(fn, iters, warmup, flush)

    lens_cpu = lens.cpu()  # what the engine takes from vLLM's metadata: the step reads nothing back

    def sparse():
        pc.refresh(k, last, one_token_per_page=True)
        return dec.decode_rows(q, k, v, table, lens, seq_lens_cpu=lens_cpu)

    ws = Workspace()
    dense = {"dense_ours_ms": lambda: sparse_decode_attention(q, k, v, table, lens, None, d**-0.5, ws, "triton")}
    order = table.long()
    kc = k[order].permute(0, 2, 1, 3, 4).reshape(batch, h, ctx, d).contiguous()
    vc = v[order].permute(0, 2, 1, 3, 4).reshape(batch, h, ctx, d).contiguous()
    qg = q.view(batch, h, group, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    dense["dense_sdpa_contiguous_ms"] = lambda: sdpa(qg, kc, vc, scale=d**-0.5)
    if has_vllm():
        try:
            dense["dense_vllm_triton_ms"] = vllm_decode(q, k, v, table, lens, d**-0.5)
        except Exception as exc:
            rec["dense_vllm_triton_error"] = f"{type(exc).__name__}: {exc}"[:300]
    reference = dense["dense_ours_ms"]().double()
    # Our dense kernel against torch's own attention (and vLLM's kernel where it is installed).
    rel_tol = REL_TOL[DTYPES[-1]]
    rec.check("dense_ours_vs_sdpa_max_rel", max_rel(dense["dense_sdpa_contiguous_ms"](), reference), rel_tol)
    if "dense_vllm_triton_ms" in dense:
        rec.check("dense_ours_vs_vllm_max_rel", max_rel(dense["dense_vllm_triton_ms"](), reference), rel_tol)
    for name, fn in dense.items():
        try:
            rec[name] = timed(fn)
        except Exception as exc:
            rec[name.replace("_ms", "_error")] = f"{type(exc).__name__}: {exc}"[:300]
    best = min(ms for n, ms in rec.data.items() if n.startswith("dense_") and n.endswith("_ms"))
    dec.set_schedule(Schedule(budgets=(ctx,), bin_width=ctx, dense_layers=()))
    rec.check("full_budget_vs_dense_max_rel", max_rel(sparse(), reference), rel_tol)
    elt = k.element_size()
    for budget in budgets:
        dec.set_schedule(Schedule(budgets=(budget,), bin_width=ctx, dense_layers=()))
        ms = timed(sparse)
        kv_dense = batch * h * ctx * d * elt * 2
        kv_sparse = batch * h * (budget * d * elt * 2 + ctx // 16 * d * 4)
        rec[f"sparse_{budget}"] = {"ms": ms, "speedup": round(best / ms, 3), "bound": round(kv_dense / kv_sparse, 2)}
    if DEVICE == "cuda":  # how many times one sparse decode call waits for the GPU (eager attention pays each)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sparse()
        torch.cuda.set_sync_debug_mode("default")
        rec.check("host_syncs_per_sparse_call", float(sum("synchroniz" in str(w.message) for w in caught)), 0.0)


def vllm_decode(q, k, v, table, lens, scale):
    """vLLM's own decode (the stock TRITON_ATTN kernel) over the same cache, as its backend calls it."""
    import torch
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    rows, hq, d = q.shape
    max_len = int(lens.max())  # vLLM's metadata carries it as a host int
    starts = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    segm = (rows, hq, 16)
    out = torch.empty_like(q)
    one = torch.ones(rows, k.shape[1], device="cuda")
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    buffers = [
        torch.empty(*segm, d, device="cuda"),
        torch.empty(*segm, device="cuda"),
        torch.empty(*segm, device="cuda"),
    ]

    def run():
        unified_attention(
            q=q, k=kt, v=vt, out=out, cu_seqlens_q=starts, max_seqlen_q=1, seqused_k=lens,
            max_seqlen_k=max_len, softmax_scale=scale, causal=True, window_size=(-1, -1),
            block_table=table, softcap=0, q_descale=None, k_descale=one, v_descale=one,
            seq_threshold_3D=rows, num_par_softmax_segments=16, softmax_segm_output=buffers[0],
            softmax_segm_max=buffers[1], softmax_segm_expsum=buffers[2],
        )  # fmt: skip
        return out

    return run
