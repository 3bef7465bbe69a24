"""The GPU check of the CUDA path, in one run on a machine with one H200 (about 9 minutes at most).

    python -m bench.cuda_check [--deadline-s 540] [--phases kernels,decode,...] [--out FILE] [--dry-run]

Prints one JSON object with every figure and writes it to `$OUT/cuda_check.json` when OUT is set
(and to --out), with the phases' output beside it (`$OUT/cuda_check.log`, else the --out file's
name with `.log`, else in the temp folder). Each phase runs in a child process of its own under a
time limit (cut to what is left of the deadline): a crash, a hang or an out-of-memory is recorded
as that phase's status and the next phase still runs. A phase saves its figures as it goes, so one
stopped at its limit still reports what it measured. Phase status: "ok", "failed" (a check out of
tolerance), "error", "timeout" or "skipped" (with the reason).

  env         versions, the device, whether vLLM imports (the phases marked vLLM skip without it)
  kernels     every Triton kernel against its torch reference on CUDA, float32 and bfloat16, on a
              contiguous cache and on vLLM's NHD cache view (the kernel tests build CPU tensors, so
              they are not rerun here); float64 references; tolerances in `TOL`
  decode      pytest tests/unit/generator/test_cuda_backend.py and test_static_decode.py on CUDA:
              the plugin's decode path (page centroids from slot_mapping, decode under a schedule)
              against float64 oracles at 1e-5, and static decode captured once as a CUDA graph and
              replayed at later steps (other lengths, schedules, probes, dense); the impl's own
              tests run where vLLM imports, against vLLM's real kernel
  attention   one layer's decode step, batch 8 at 32K, Qwen3-1.7B heads, bf16, vLLM's cache layout:
              dense (our kernel, torch SDPA over a contiguous copy, vLLM's kernel if present) vs the
              plugin's sparse decode at 2048 and 4096 tokens (centroid refresh included), wall time
              per call, KV-bytes bound, host syncs per sparse call (must be none); our dense
              kernel checked against SDPA (and vLLM's kernel) and the sparse path at a full budget
              against ours, relative to the largest output (`REL_TOL`)
  model       a whole decode step of a Qwen3-1.7B-shaped model (random bf16 weights, torch linear
              layers, RMSNorm, RoPE, our kernels for attention), batch 8 at 32K over one paged
              cache per layer: dense (our dense kernel in every layer) vs the plugin's sparse
              decode (layers 0-1 dense, centroids refreshed in every layer) at 2048 and 4096
              tokens, eager and replayed as one CUDA graph (the step reads nothing back, so it
              captures whole; that graph serves only its own lengths and schedule); and static
              decode, sized for a 40K engine, whose one capture is replayed under the other
              budgets and a full one (checked against the eager steps and the dense one): what
              vLLM's full graphs would run with `cuda_graphs = "full"`. The sparse step at a full
              budget checked against the dense one. Without vLLM's step overhead; not vLLM's figure
  trainer_memory  two FSDP2 bf16 update steps of a Qwen3-0.6B-shaped model (8 layers, 151,936
              vocabulary) on four 4K rollouts: resident vs per-layer activation checkpointing vs
              checkpointing and CPU offload of the shards and AdamW state; gradients agree, the
              offloaded state is on the CPU, peak GPU memory falls at each; the resident and the
              offloaded model published a tensor at a time (cast on the GPU, or on the host) equal
              byte for byte a CPU publish of the same weights (bench/cuda_trainer_memory.py); then one
              step on a 16K-token rollout, chunked vs full LM head: peak GPU memory, tokens/s,
              logprobs and loss agree (bench/cuda_trainer_head.py)
  parity      (vLLM) stock vLLM (TRITON_ATTN) vs the plugin, float32, greedy, a random Qwen3 with
              head_dim 128: sampled-token logprobs over the common prefix within 2e-2 at a budget
              covering every page in every layer (vLLM's float32 kernel may use TF32; ours does not),
              exactly equal with no schedule; a small-budget run's drift is reported, not judged
  throughput  (vLLM) engine decode tokens/s, dense vs sparse, batch 8 at 32K, a random
              Qwen3-1.7B-shaped model in bf16, piecewise CUDA graphs

`--dry-run` rehearses the phases' code on a CPU (Triton interpreted, float32, tiny shapes; the
engine phases skip; the decode phase runs the first test of each of its files, which the suite runs
in full anyway): it proves the script runs, not the figures. The test suite runs the dry run
(`tests/unit/bench/test_cuda_check.py`), so the check cannot rot between the sessions lent a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRY = os.environ.get("CUDA_CHECK_DRY") == "1"  # set by --dry-run for the phase processes
DEVICE = "cpu" if DRY else "cuda"
DTYPES = ("float32",) if DRY else ("float32", "bfloat16")  # bf16 is broken in Triton's interpreter
# (phase, time limit in seconds), cheapest and most telling first.
PHASES = [
    ("env", 45),
    ("kernels", 110),
    ("decode", 130),
    ("attention", 75),
    ("model", 120),
    ("trainer_memory", 59),  # the steps, two publishes and a CPU one to compare, the 16K step with either head
    ("parity", 240),
    ("throughput", 330),
]
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
# Attention outputs at 32K are means over thousands of values (about 1e-2 in size), so whole
# attentions are compared relative to the largest reference output, not by an absolute bound.
REL_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
PARITY_TOL = 2e-2
# Logits after 28 layers in bf16 (the dense and the full-budget step split the attention differently).
MODEL_REL_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop starting phases after this (default 540)")
    p.add_argument("--phases", default=",".join(n for n, _ in PHASES), help="comma-separated phases to run")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--dry-run", action="store_true", help="rehearse on CPU: tiny shapes, interpreted Triton")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase in this process
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    unknown = set(a.phases.split(",")) - {n for n, _ in PHASES}
    if unknown:
        p.error(f"unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(n for n, _ in PHASES)}")
    return a


class Record:
    """A phase's figures and checks, saved to the result file after every change."""

    def __init__(self, path: str) -> None:
        self.path, self.data = path, {"status": "running", "checks": {}}

    def __setitem__(self, key, value) -> None:
        self.data[key] = value
        self.save()

    def check(self, name: str, value: float, tol: float, ok: bool | None = None) -> None:
        ok = value <= tol if ok is None else ok
        self.data["checks"][name] = {"value": value, "tol": tol, "ok": bool(ok)}
        self.save()

    def save(self) -> None:
        Path(self.path).write_text(json.dumps(self.data, default=str))


# -- phases (each runs in its own child process) --------------------------------------------------


def phase_env(rec: Record) -> None:
    import torch
    import triton

    rec["torch"], rec["triton"], rec["python"] = torch.__version__, triton.__version__, sys.version.split()[0]
    rec["vllm"] = _vllm_version()
    if DRY:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    rec["device"] = torch.cuda.get_device_name(0)
    rec["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count


def _vllm_version() -> str | None:
    """vLLM's version, None when it is not installed, "unusable: ..." when it does not import."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        import vllm

        return vllm.__version__
    except Exception as exc:
        return f"unusable: {type(exc).__name__}: {exc}"[:300]


def _has_vllm() -> bool:
    if DRY:
        return False
    v = _vllm_version()
    return v is not None and not v.startswith("unusable")


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, iters: int, warmup: int, flush=None) -> float:
    """Median wall time of `fn` in ms over `iters` calls after `warmup`, the device synced around each
    call; `flush` (a tensor bigger than the L2 cache) is written before each so no call finds it warm."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.add_(1)
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 4)


def _seconds_left(reserve: float = 5.0) -> float:
    """Time left to this phase (its runner sets the deadline), less a reserve for reporting."""
    return float(os.environ.get("CUDA_CHECK_DEADLINE", time.time() + 600)) - time.time() - reserve


def _paged(lens, kv_heads, head_dim, block_size, dtype, nhd: bool, seed: int = 0):
    """A random paged cache (K and V views, vLLM's NHD layout when `nhd`), shuffled block table, lengths."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    per_row = max(-(-n // block_size) for n in lens)
    blocks = len(lens) * per_row + 3
    if nhd:
        kv = torch.randn(blocks, block_size, kv_heads, 2 * head_dim, device=DEVICE, generator=g).transpose(1, 2)
    else:
        kv = torch.randn(blocks, kv_heads, block_size, 2 * head_dim, device=DEVICE, generator=g)
    kv = kv.to(dtype)
    table = torch.randperm(blocks, device=DEVICE, generator=g)[: len(lens) * per_row].view(len(lens), per_row)
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return kv[..., :head_dim], kv[..., head_dim:], table.to(torch.int32), lens, g


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
            k, v, table, lens, g = _paged(lens_list, h, d, bs, dtype, nhd)
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
            rec.check(f"{tag}/scores_max_rel", _max_rel(s_tri[live], s_ref[live]), 1e-5)
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


def phase_decode(rec: Record) -> None:
    import pytest

    outcomes: dict[str, str] = {}

    class Collect:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                outcomes[report.nodeid.split("::")[-1]] = report.outcome
                if report.outcome == "failed":
                    outcomes[report.nodeid.split("::")[-1] + ":error"] = str(report.longrepr)[-1500:]
            rec["tests"] = outcomes

    class FirstOfEachFile:
        # The dry run rehearses this harness on one test per file: the suite runs both files itself on
        # CPU, so running all of them again here only doubled their time (and timed out under load).
        def pytest_collection_modifyitems(self, items):
            seen: set[str] = set()
            items[:] = [i for i in items if i.path not in seen and not seen.add(i.path)]

    tests = ["tests/unit/generator/test_cuda_backend.py", "tests/unit/generator/test_static_decode.py"]
    plugins = [Collect(), *([FirstOfEachFile()] if DRY else [])]
    code = pytest.main(["-q", "-p", "no:cacheprovider", *tests], plugins=plugins)
    rec.check("failed_tests", float(sum(o == "failed" for o in outcomes.values())), 0.0)
    rec.check("pytest_exit_code", float(code), 0.0)  # collection errors and the like fail too


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
    k, v, table, lens, g = _paged([ctx] * batch, h, d, bs, dtype, nhd=True)
    q = torch.randn(batch, h * group, d, device=DEVICE, generator=g).to(dtype)
    last = table.long()[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs  # the slot each row just wrote
    pc = PageCentroids(k, backend="triton")
    update_centroids_ref(k, pc.table, table, lens)
    dec = _decoder(d**-0.5, 5, pc.table)
    flush = torch.empty(2**20 if DRY else 256 * 2**20, dtype=torch.uint8, device=DEVICE)  # > the 60 MB L2
    iters, warmup = (1, 0) if DRY else (20, 3)  # the dry run proves the code, its figures mean nothing

    def timed(fn) -> float:
        return _median_ms(fn, iters, warmup, flush)

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
    if _has_vllm():
        try:
            dense["dense_vllm_triton_ms"] = _vllm_decode(q, k, v, table, lens, d**-0.5)
        except Exception as exc:
            rec["dense_vllm_triton_error"] = f"{type(exc).__name__}: {exc}"[:300]
    reference = dense["dense_ours_ms"]().double()
    # Our dense kernel against torch's own attention (and vLLM's kernel where it is installed).
    rel_tol = REL_TOL[DTYPES[-1]]
    rec.check("dense_ours_vs_sdpa_max_rel", _max_rel(dense["dense_sdpa_contiguous_ms"](), reference), rel_tol)
    if "dense_vllm_triton_ms" in dense:
        rec.check("dense_ours_vs_vllm_max_rel", _max_rel(dense["dense_vllm_triton_ms"](), reference), rel_tol)
    for name, fn in dense.items():
        try:
            rec[name] = timed(fn)
        except Exception as exc:
            rec[name.replace("_ms", "_error")] = f"{type(exc).__name__}: {exc}"[:300]
    best = min(ms for n, ms in rec.data.items() if n.startswith("dense_") and n.endswith("_ms"))
    dec.set_schedule(Schedule(budgets=(ctx,), bin_width=ctx, dense_layers=()))
    rec.check("full_budget_vs_dense_max_rel", _max_rel(sparse(), reference), rel_tol)
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
    k0, v0, table, lens, _ = _paged([ctx] * batch, kv_heads, d, bs, dtype, nhd=True)
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

    decoders = [_decoder(scale, layer, pc.table) for layer, pc in enumerate(pages)]

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
        return _median_ms(fn, iters, warmup=warmup)

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
            "full_budget_logits_vs_dense_max_rel", _max_rel(model_step(sparse), reference), MODEL_REL_TOL[DTYPES[-1]]
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
        worst = max(worst, _max_rel(out["logits"], eager))
    rec.check("static_replay_vs_eager_max_rel", worst, MODEL_REL_TOL["float32"])
    set_schedule(schedules[-1])
    replay()
    rec.check(
        "static_replay_full_budget_vs_dense_max_rel", _max_rel(out["logits"], reference), MODEL_REL_TOL[DTYPES[-1]]
    )


def _decoder(scale: float, layer: int, centroids):
    """The plugin's decode path for one layer, on our Triton kernels, as the CUDA backend sets it up."""
    from kernels import Workspace
    from services.generator.plugin.scheduled_decode import ScheduledDecode

    dec = ScheduledDecode()
    dec.scale, dec.layer_index, dec.backend = scale, layer, "triton"
    dec.workspace, dec.centroids = Workspace(), centroids
    return dec


def _max_rel(out, reference) -> float:
    """Largest deviation of `out` from `reference` (same elements, any shape), over the largest |reference|."""
    deviation = (out.double().reshape(reference.shape) - reference).abs().max()
    return float(deviation / reference.abs().max())


def _vllm_decode(q, k, v, table, lens, scale):
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


def phase_trainer_memory(rec: Record) -> None:
    """FSDP2 CPU offload and activation checkpointing on the trainer's own update (bench/cuda_trainer_memory.py)."""
    from bench.cuda_trainer_memory import run

    run(rec, DEVICE, DRY)


def _random_qwen3(folder: Path, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def _engine_child(args: list[str], limit: float) -> dict:
    """One engine in a fresh process (vLLM picks the attention backend once per process).

    It stays in this phase's process group, so stopping the phase stops it too.
    """
    return _run_child(args, _result_file(), limit, new_session=False)


def _skip_engine_phase(rec: Record) -> bool:
    if _has_vllm():
        return False
    rec["status"] = "skipped"
    rec["reason"] = "dry run" if DRY else f"vLLM does not import here ({_vllm_version() or 'not installed'})"
    return True


def phase_parity(rec: Record) -> None:
    if _skip_engine_phase(rec):
        return
    import torch

    from sparrow.schedule import Schedule

    work = Path(tempfile.mkdtemp(prefix="sparrow-parity-"))
    model = _random_qwen3(work / "model", 4, 512, 8, 4, 1024, 2048, torch.float32)
    full = Schedule(budgets=(4096,), bin_width=4096, dense_layers=(), name="full-every-layer")
    small = Schedule(budgets=(64, 128, 256), bin_width=256, name="small")
    for name, s in (("full", full), ("small", small)):
        s.save(work / f"{name}.json")
    stock = _engine_child(["--phase", "engine_rollout", "--model", str(model), "--stock"], _seconds_left() / 2)
    schedules = f"none,{work}/full.json,{work}/small.json"
    ours = _engine_child(
        ["--phase", "engine_rollout", "--model", str(model), "--schedules", schedules], _seconds_left()
    )
    rec["stock_status"], rec["plugin_status"] = stock.get("status"), ours.get("status")
    if "runs" not in stock or "runs" not in ours:
        raise RuntimeError(
            f"engine runs failed: stock {stock.get('error', '')[-800:]} plugin {ours.get('error', '')[-800:]}"
        )
    base = stock["runs"]["stock"]
    for path, run in ours["runs"].items():
        label = Path(path).stem
        diffs, common, total = [], 0, 0
        for s, o in zip(base, run, strict=True):
            n = next(
                (i for i, (a, b) in enumerate(zip(s["tokens"], o["tokens"], strict=True)) if a != b), len(s["tokens"])
            )
            diffs += [abs(a - b) for a, b in zip(s["logprobs"][:n], o["logprobs"][:n], strict=True)]
            common, total = common + n, total + len(s["tokens"])
        stats = {"max_abs": max(diffs, default=0.0), "mean_abs": sum(diffs) / max(len(diffs), 1)}
        rec[label] = {**stats, "common_prefix_fraction": common / total}
        if label == "none":
            rec.check("no_schedule_max_abs", stats["max_abs"], 0.0)
        elif label == "full":
            rec.check("full_budget_max_abs", stats["max_abs"], PARITY_TOL)


def phase_engine_rollout(rec: Record, a: argparse.Namespace) -> None:
    """Child of `parity`: greedy samples of one engine, per schedule (stock: vLLM's own attention)."""
    if a.stock:
        os.environ["SPARROW_ATTENTION"] = "stock"
    import random

    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    from sparrow.schedule import Schedule
    from sparrow.work import PromptGroup, Sampling

    cfg = VllmEngineConfig(
        model=a.model, max_model_len=2048, max_num_seqs=8, attention_backend="TRITON_ATTN", ignore_eos=True
    )
    engine = VllmEngine(cfg)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 2048) for _ in range(600 + 37 * i)) for i in range(4)]
    runs = {}
    for label in ["stock"] if a.stock else a.schedules.split(","):
        engine.set_schedule(None if label in ("stock", "none") else Schedule.load(label))
        tag = Path(label).stem
        for i, p in enumerate(prompts):
            engine.submit(PromptGroup(f"{tag}-{i}", p, 1, 0, Sampling(temperature=0.0, max_new_tokens=64)))
        samples = []
        while engine.in_flight:
            samples.extend(engine.step())
        samples.sort(key=lambda s: int(s.group_id.rsplit("-", 1)[1]))
        runs[label] = [{"tokens": s.token_ids, "logprobs": s.logprobs} for s in samples]
        rec["runs"] = runs
    rec["sparse_layers"] = engine.sparse_layers
    engine.close()


def phase_throughput(rec: Record) -> None:
    if _skip_engine_phase(rec):
        return
    import random

    import torch

    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    from sparrow.presets import get_preset
    from sparrow.schedule import Schedule
    from sparrow.work import PromptGroup, Sampling

    batch, prompt_len, gen_len = 8, 32000, 96
    model = _random_qwen3(Path(tempfile.mkdtemp(prefix="sparrow-1p7b-")), 28, 2048, 16, 8, 6144, 151936, torch.bfloat16)
    rec["model"] = "random Qwen3-1.7B shape (28 layers, 16/8 heads, head_dim 128), bf16"
    engine = VllmEngine(
        VllmEngineConfig(
            model=str(model),
            dtype="bfloat16",
            max_model_len=prompt_len + gen_len + 16,
            max_num_seqs=batch,
            gpu_memory_utilization=0.6,
            enforce_eager=False,
            enable_prefix_caching=True,
            ignore_eos=True,
        )  # fmt: skip
    )
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 151_000) for _ in range(prompt_len)) for _ in range(batch)]
    schedules = {  # 4096 and 2048 tokens at 32K
        "dense": None,
        "qwen3-1.7b-0.86": get_preset("qwen3-1.7b-0.86"),
        "flat-2048": Schedule(budgets=(2048,), bin_width=2000, name="flat-2048"),
    }
    for label, schedule in schedules.items():  # the first run also fills the prefix cache for the others
        engine.set_schedule(schedule)
        for i, p in enumerate(prompts):
            engine.submit(PromptGroup(f"{label}-{i}", p, 1, 0, Sampling(max_new_tokens=gen_len)))
        decode_s, decode_tokens = 0.0, 0
        while engine.in_flight:
            # Bench-only peek at the engine's private table: a step where every sequence already has a
            # token is a pure decode step; only those are timed.
            pure = all(s.token_ids for s in engine._sequences.values())
            running = engine.in_flight
            start = time.perf_counter()
            engine.step()
            if pure:
                decode_s, decode_tokens = decode_s + time.perf_counter() - start, decode_tokens + running
        rec[label] = {"decode_tokens_per_s": round(decode_tokens / max(decode_s, 1e-9), 1), "tokens": decode_tokens}
    dense = rec.data["dense"]["decode_tokens_per_s"]
    rec["speedups"] = {k: round(v["decode_tokens_per_s"] / dense, 3) for k, v in rec.data.items() if k in schedules}
    engine.close()


# -- the runner ------------------------------------------------------------------------------------


def _result_file() -> str:
    with tempfile.NamedTemporaryFile(prefix="cuda_check-", suffix=".json", delete=False) as f:
        return f.name


def _run_child(args: list[str], result: str, limit: float, log=None, new_session: bool = True) -> dict:
    """Run `python -m bench.cuda_check ARGS` for at most `limit` seconds; its saved record plus status."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if DRY:
        env["TRITON_INTERPRET"] = "1"
    env["CUDA_CHECK_DEADLINE"] = str(time.time() + limit)
    cmd = [sys.executable, "-m", "bench.cuda_check", *args, "--result", result]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session
        )
        try:
            proc.wait(timeout=max(limit, 1.0))
            status = None
        except subprocess.TimeoutExpired:
            # A phase leads its own process group, engine children included: stop them all.
            os.killpg(proc.pid, signal.SIGKILL) if new_session else proc.kill()
            proc.wait()
            status = "timeout"
        out.seek(0)
        text = out.read()
    if log is not None:
        log.write(f"\n===== {' '.join(args)} (exit {proc.returncode}) =====\n{text[-200_000:]}")
    try:
        data = json.loads(Path(result).read_text())
    except (OSError, ValueError):
        data = {"checks": {}}
    finally:
        Path(result).unlink(missing_ok=True)
    if status or proc.returncode:
        data["status"] = status or "error"
        data["error"] = text[-3000:]
    elif data.get("status") == "running":
        data["status"] = "failed" if any(not c["ok"] for c in data.get("checks", {}).values()) else "ok"
    return data


def run_phase(a: argparse.Namespace) -> int:
    rec = Record(a.result)
    if a.phase == "engine_rollout":
        phase_engine_rollout(rec, a)
    else:
        globals()[f"phase_{a.phase}"](rec)
    rec.save()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--phase" in argv:  # internal: a phase (or an engine child of one) in this process
        p = argparse.ArgumentParser()
        for flag in ("--phase", "--result", "--model", "--schedules"):
            p.add_argument(flag)
        p.add_argument("--stock", action="store_true")
        return run_phase(p.parse_args(argv))
    a = parse_args(argv)
    if a.dry_run:
        os.environ["CUDA_CHECK_DRY"] = "1"  # for the phase processes
        globals()["DRY"] = True
    wanted = a.phases.split(",")
    began = time.monotonic()
    report = {"script": "bench/cuda_check.py", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "phases": {}}
    out_dir = os.environ.get("OUT")
    if out_dir:
        log_path = Path(out_dir) / "cuda_check.log"
    elif a.out:
        log_path = Path(a.out).with_suffix(".log")
        log_path = log_path if log_path != Path(a.out) else Path(a.out + ".log")
    else:
        log_path = Path(tempfile.gettempdir()) / "cuda_check.log"
    with open(log_path, "w") as log:
        for name, limit in PHASES:
            left = a.deadline_s - (time.monotonic() - began)
            if name not in wanted:
                continue
            if left < 20:
                report["phases"][name] = {"status": "skipped", "reason": "deadline reached"}
                continue
            print(f"[cuda_check] {name} (limit {min(limit, left):.0f} s)", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            data = _run_child(["--phase", name], _result_file(), min(limit, left), log)
            data["seconds"] = round(time.monotonic() - t0, 1)
            report["phases"][name] = data
            print(f"[cuda_check] {name}: {data.get('status')} in {data['seconds']} s", file=sys.stderr, flush=True)
    report["seconds"] = round(time.monotonic() - began, 1)
    report["summary"] = {name: p.get("status") for name, p in report["phases"].items()}
    text = json.dumps(report, indent=1, default=str)
    print(text)
    for target in filter(None, [a.out, out_dir and str(Path(out_dir) / "cuda_check.json")]):
        Path(target).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
