"""What the phases share: the dry run's switch and tolerances, a phase's record, timing, random paged caches,
the plugin's decode path for one layer, and running a phase (or an engine) in a child process of its own."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRY = os.environ.get("CUDA_CHECK_DRY") == "1"  # set by --dry-run for the phase processes
DEVICE = "cpu" if DRY else "cuda"
DTYPES = ("float32",) if DRY else ("float32", "bfloat16")  # bf16 is broken in Triton's interpreter
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
# Attention outputs at 32K are means over thousands of values (about 1e-2 in size), so whole
# attentions are compared relative to the largest reference output, not by an absolute bound.
REL_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
PARITY_TOL = 2e-2
# Logits after 28 layers in bf16 (the dense and the full-budget step split the attention differently).
MODEL_REL_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


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


def vllm_version() -> str | None:
    """vLLM's version, None when it is not installed, "unusable: ..." when it does not import."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        import vllm

        return vllm.__version__
    except Exception as exc:
        return f"unusable: {type(exc).__name__}: {exc}"[:300]


def has_vllm() -> bool:
    if DRY:
        return False
    v = vllm_version()
    return v is not None and not v.startswith("unusable")


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, iters: int, warmup: int, flush=None) -> float:
    """Median wall time of `fn` in ms over `iters` calls after `warmup`, the device synced around each
    call; `flush` (a tensor bigger than the L2 cache) is written before each so no call finds it warm."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.add_(1)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 4)


def seconds_left(reserve: float = 5.0) -> float:
    """Time left to this phase (its runner sets the deadline), less a reserve for reporting."""
    return float(os.environ.get("CUDA_CHECK_DEADLINE", time.time() + 600)) - time.time() - reserve


def paged(lens, kv_heads, head_dim, block_size, dtype, nhd: bool, seed: int = 0):
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


def decoder(scale: float, layer: int, centroids):
    """The plugin's decode path for one layer, on our Triton kernels, as the CUDA backend sets it up."""
    from kernels import Workspace
    from services.generator.plugin.scheduled_decode import ScheduledDecode

    dec = ScheduledDecode()
    dec.scale, dec.layer_index, dec.backend = scale, layer, "triton"
    dec.workspace, dec.centroids = Workspace(), centroids
    return dec


def max_rel(out, reference) -> float:
    """Largest deviation of `out` from `reference` (same elements, any shape), over the largest |reference|."""
    deviation = (out.double().reshape(reference.shape) - reference).abs().max()
    return float(deviation / reference.abs().max())


def result_file() -> str:
    with tempfile.NamedTemporaryFile(prefix="cuda_check-", suffix=".json", delete=False) as f:
        return f.name


def run_child(args: list[str], result: str, limit: float, log=None, new_session: bool = True) -> dict:
    """Run `python -m bench.cuda_check ARGS` for at most `limit` seconds; its saved record plus status."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if os.environ.get("CUDA_CHECK_DRY") == "1":  # the runner's --dry-run, read when the child starts
        env["TRITON_INTERPRET"] = "1"
        env["OMP_NUM_THREADS"] = "1"  # tiny shapes: a second CPU thread only spins (and waits on a loaded machine)
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
