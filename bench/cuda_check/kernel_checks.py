"""Phase `kernels`: every Triton kernel against its torch reference on the device, both dtypes, both cache layouts."""

from __future__ import annotations

from bench.cuda_check.common import DEVICE, DRY, DTYPES, TOL, Record, max_rel, paged


def phase_kernels(rec: Record) -> None:
    import torch

    import kernels as K

    cases = [
        ("qwen3-1.7b-heads-nhd-block16", [5, 1000, 4099, 32768], 8, 2, 128, 16, True),
        ("gqa4-d64-block64", [17, 700, 3000], 2, 4, 64, 64, False),
    ]
    if DRY:
        cases = [
            ("tiny-nhd-block16", [5, 100, 300], 2, 2, 32, 16, True),
            ("tiny-block64", [17, 200], 2, 4, 32, 64, False),
        ]
    for name, lens_list, h, group, d, bs, nhd in cases:
        for dtype_name in DTYPES:
            dtype, tag, tol = getattr(torch, dtype_name), f"{name}/{dtype_name}", TOL[dtype_name]
            k, v, table, lens, g = paged(lens_list, h, d, bs, dtype, nhd)
            q = torch.randn(len(lens_list), h * group, d, device=DEVICE, generator=g).to(dtype)
            ref_c, tri_c = K.new_centroids(k), K.new_centroids(k)
            K.update_centroids_ref(k, ref_c, table, lens)
            prev = (lens - 37).clamp(min=1)
            K.update_centroids_triton(k, tri_c, table, prev)  # then incrementally to the end
            K.update_centroids_triton(k, tri_c, table, lens, prev)
            rec.check(f"{tag}/centroids_max_abs", float((tri_c - ref_c).abs().max()), 1e-5)
            s_ref = K.score_blocks_ref(q, ref_c, k, table, lens)
            s_tri = K.score_blocks_triton(q, ref_c, k, table, lens)
            live = torch.isfinite(s_ref)
            rec.check(f"{tag}/scores_max_rel", max_rel(s_tri[live], s_ref[live]), 1e-5)
            pages = K.num_pages(lens.long())
            budgets = torch.minimum(pages, torch.tensor([3, 16, 128, 256][: len(lens_list)], device=DEVICE))
            sel_ref = K.select_blocks_ref(s_tri, lens, budgets)
            sel_tri = K.select_blocks_triton(s_tri, lens, budgets)
            rec.check(f"{tag}/selection_equal", 0.0, 0.0, ok=torch.equal(sel_ref, sel_tri))
            d64 = [x.double() for x in (q, k, v)]
            for which, sel in (("sparse", sel_ref), ("dense", None)):
                want = K.sparse_decode_attention_ref(d64[0], d64[1], d64[2], table, lens, sel, d**-0.5)
                got = K.sparse_decode_attention_triton(q, k, v, table, lens, sel, d**-0.5)
                rec.check(f"{tag}/decode_{which}_max_abs", float((got.double() - want).abs().max()), tol)
            out_t, pages_t = K.block_sparse_decode(q, k, v, ref_c, table, lens, budgets, backend="triton")
            out_r, pages_r = K.block_sparse_decode(q, k, v, ref_c, table, lens, budgets, backend="torch")
            rec.check(f"{tag}/end_to_end_pages_equal", 0.0, 0.0, ok=torch.equal(pages_t, pages_r))
            rec.check(f"{tag}/end_to_end_max_abs", float((out_t.double() - out_r.double()).abs().max()), tol)
    # Teacher-forced (training-side) attention, both dtypes, every position under its own budget.
    for dtype_name in DTYPES:
        dtype, g = getattr(torch, dtype_name), torch.Generator(device=DEVICE).manual_seed(1)
        t, hk, grp, d = (100, 2, 2, 32) if DRY else (1200, 2, 4, 64)
        q = torch.randn(2, t, hk * grp, d, device=DEVICE, generator=g).to(dtype)
        kk, vv = (torch.randn(2, t, hk, d, device=DEVICE, generator=g).to(dtype) for _ in range(2))
        budgets = torch.randint(3, 40, (2, t), device=DEVICE, generator=g)
        want = K.teacher_forced_attention_ref(q.double(), kk.double(), vv.double(), budgets)
        got = K.teacher_forced_attention_triton(q, kk, vv, budgets)
        err = float((got.double() - want).abs().max())
        rec.check(f"teacher_forced/{dtype_name}_max_abs", err, 2 * TOL[dtype_name])
