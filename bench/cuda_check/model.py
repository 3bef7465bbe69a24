"""Phase `model`: a whole Qwen3-1.7B-shaped decode step, dense vs sparse vs static decode, eager and as CUDA graphs."""

from __future__ import annotations

from bench.cuda_check.common import DEVICE, DRY, DTYPES, MODEL_REL_TOL, Record, decoder, max_rel, median_ms, paged


def phase_model(rec: Record) -> None:
    import torch

    from kernels import DecodeBounds, Workspace, sparse_decode_attention, update_centroids_ref
    from services.generator.plugin.page_centroids import PageCentroids
    from services.generator.plugin.scheduled_decode import ProbeRows
    from sparrow.schedule import Schedule

    if DRY:
        layers, hidden, heads, kv_heads, d, ffn, vocab, batch, ctx, budgets = 3, 64, 4, 2, 16, 128, 256, 2, 512, (64,)
        max_len = 640
    else:
        layers, hidden, heads, kv_heads, d, ffn, vocab = 28, 2048, 16, 8, 128, 6144, 151936
        batch, ctx, budgets, max_len = 8, 32768, (2048, 4096), 40960
    rec["static_max_seq_len"] = max_len  # the engine's longest sequence: static decode's sizes
    dtype, bs = getattr(torch, DTYPES[-1]), 16
    rec["shape"] = {"layers": layers, "hidden": hidden, "heads": f"{heads}/{kv_heads}", "head_dim": d,
                    "batch": batch, "context": ctx, "dtype": DTYPES[-1]}  # fmt: skip
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def weight(rows, cols):
        return (torch.randn(rows, cols, device=DEVICE, generator=g) * rows**-0.5).to(dtype)

    embed = weight(vocab, hidden) * hidden**0.5  # rows of about unit size, tied to the output layer
    w = [
        {"qkv": weight(hidden, (heads + 2 * kv_heads) * d), "o": weight(heads * d, hidden),
         "gate_up": weight(hidden, 2 * ffn), "down": weight(ffn, hidden)}
        for _ in range(layers)
    ]  # fmt: skip
    # One paged cache per layer (vLLM's NHD layout, random keys and values), one block table for all.
    k0, v0, table, lens, _ = paged([ctx] * batch, kv_heads, d, bs, dtype, nhd=True)
    # Room for the engine's longest sequence, as vLLM's block table has (the rest points at block 0).
    table = torch.cat((table, table.new_zeros(batch, -(-max_len // bs) - table.shape[1])), dim=1)
    caches = [(k0, v0)]
    for _ in range(layers - 1):
        kv = torch.randn(k0.shape[0], bs, kv_heads, 2 * d, device=DEVICE, generator=g).to(dtype).transpose(1, 2)
        caches.append((kv[..., :d], kv[..., d:]))
    pages = []
    for k, _ in caches:
        pc = PageCentroids(k, backend="triton")
        update_centroids_ref(k, pc.table, table, lens)
        pages.append(pc)
    lens_cpu = lens.cpu()
    pos = ctx - 1  # every row decodes the token at this position (its K/V written first, as vLLM does)
    slot = table.long()[:, pos // bs] * bs + pos % bs
    block, offset = slot // bs, slot % bs
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d))
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    tokens = torch.randint(0, vocab, (batch,), device=DEVICE, generator=g)
    scale = d**-0.5

    def rms(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    def rope(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)

    def model_step(attend) -> torch.Tensor:
        x = embed[tokens]
        for layer, (lw, (k_cache, v_cache)) in enumerate(zip(w, caches, strict=True)):
            q, k, v = (rms(x) @ lw["qkv"]).split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
            q, k = rope(rms(q.view(batch, heads, d))), rope(rms(k.view(batch, kv_heads, d)))
            k_cache[block, :, offset] = k
            v_cache[block, :, offset] = v.view(batch, kv_heads, d)
            x = x + attend(layer, q, k_cache, v_cache).reshape(batch, heads * d) @ lw["o"]
            gate, up = (rms(x) @ lw["gate_up"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ lw["down"]
        return rms(x) @ embed.T

    ws = Workspace()
    whole = DecodeBounds(ctx, 0)  # the lengths as the host knows them: no host sync in the dense step

    def dense(layer, q, k_cache, v_cache):
        return sparse_decode_attention(q, k_cache, v_cache, table, lens, None, scale, ws, "triton", bounds=whole)

    decoders = [decoder(scale, layer, pc.table) for layer, pc in enumerate(pages)]

    def sparse(layer, q, k_cache, v_cache):
        pages[layer].refresh(k_cache, slot, one_token_per_page=True)
        return decoders[layer].decode_rows(q, k_cache, v_cache, table, lens, seq_lens_cpu=lens_cpu)

    probe_rows = ProbeRows(batch, torch.device(DEVICE)).mask  # no probes: all False

    def static(layer, q, k_cache, v_cache):
        pages[layer].refresh(k_cache, slot, one_token_per_page=True)
        return decoders[layer].static_decode_rows(q, k_cache, v_cache, table, lens, max_len, probe_rows)

    def set_schedule(schedule):
        for dec in decoders:
            dec.set_schedule(schedule)

    iters, warmup = (1, 0) if DRY else (20, 2)  # the dry run's figures mean nothing: one call proves the code

    def timed(fn) -> float:
        return median_ms(fn, iters, warmup=warmup)

    def graphed(fn):
        """`fn` captured as one CUDA graph (after warm-up on a side stream), replayed by the result."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    with torch.no_grad():
        reference = model_step(dense).double()
        set_schedule(Schedule(budgets=(ctx,), bin_width=ctx, dense_layers=()))
        rec.check(
            "full_budget_logits_vs_dense_max_rel", max_rel(model_step(sparse), reference), MODEL_REL_TOL[DTYPES[-1]]
        )
        runs = {"dense": (None, dense)}
        runs.update({f"sparse_{b}": (Schedule(budgets=(b,), bin_width=ctx), sparse) for b in budgets})
        runs.update({f"static_{b}": (Schedule(budgets=(b,), bin_width=ctx), static) for b in budgets})
        for name, (schedule, attend) in runs.items():
            set_schedule(schedule)
            step = lambda attend=attend: model_step(attend)  # noqa: E731
            figures = {"eager_ms": timed(step)}
            if DEVICE == "cuda":
                try:
                    figures["graph_ms"] = timed(graphed(step))
                except Exception as exc:
                    figures["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            dense_ms = rec.data.get("dense", {})  # dense runs first
            for mode in ("eager", "graph"):
                if name != "dense" and f"{mode}_ms" in figures and f"{mode}_ms" in dense_ms:
                    figures[f"{mode}_speedup"] = round(dense_ms[f"{mode}_ms"] / figures[f"{mode}_ms"], 3)
            rec[name] = figures
        rec["tokens_per_s"] = {
            n: round(batch * 1e3 / rec.data[n].get("graph_ms", rec.data[n]["eager_ms"]), 1) for n in runs
        }
        # On a CPU (the dry run) "replays" run eagerly: the code is rehearsed, the figures mean nothing.
        capture = graphed if DEVICE == "cuda" else (lambda fn: fn)
        _static_replays(rec, model_step, static, set_schedule, capture, reference, budgets, ctx)


def _static_replays(rec, model_step, static, set_schedule, graphed, reference, budgets, ctx) -> None:
    """Static decode's one capture, replayed under each other schedule: it must give what the eager
    steps give, and the dense step's logits at a full budget (what a full-graph engine relies on)."""
    from sparrow.schedule import Schedule

    schedules = [Schedule(budgets=(b,), bin_width=ctx) for b in budgets]
    schedules.append(Schedule(budgets=(ctx,), bin_width=ctx, dense_layers=()))
    set_schedule(schedules[0])
    out = {}
    replay = graphed(lambda: out.__setitem__("logits", model_step(static)))
    worst = 0.0
    for schedule in schedules[1:] + schedules[:1]:
        set_schedule(schedule)
        eager = model_step(static).double()
        replay()
        worst = max(worst, max_rel(out["logits"], eager))
    rec.check("static_replay_vs_eager_max_rel", worst, MODEL_REL_TOL["float32"])
    set_schedule(schedules[-1])
    replay()
    rec.check(
        "static_replay_full_budget_vs_dense_max_rel", max_rel(out["logits"], reference), MODEL_REL_TOL[DTYPES[-1]]
    )
