"""Accelerator figures the cost model needs: peak FLOP/s and memory bandwidth, hence FLOPs per byte."""

from __future__ import annotations

import difflib
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


class HardwareError(ValueError):
    """An unknown hardware name."""


@dataclass(frozen=True)
class Hardware:
    """Peak dense FLOP/s at one element type, and memory bandwidth."""

    name: str
    peak_flops: float  # FLOP/s
    mem_bandwidth: float  # bytes/s
    bytes_per_element: int  # size of the element type `peak_flops` is quoted for; the KV cache uses it too
    source: str = ""

    @property
    def flops_per_byte(self) -> float:
        """I: FLOPs the chip can do in the time it moves one byte."""
        return self.peak_flops / self.mem_bandwidth


# NVIDIA datasheets (H200 Tensor Core GPU datasheet; H100 Tensor Core GPU datasheet, SXM column):
# BF16 tensor-core peak is listed as 1,979 TFLOPS "with sparsity", i.e. 989 TFLOPS dense, for both.
_PRESETS: dict[str, Hardware] = {
    "h200": Hardware("h200", 989e12, 4.8e12, 2, "NVIDIA H200 datasheet: 989 TFLOPS dense BF16, 4.8 TB/s HBM3e"),
    "h100": Hardware("h100", 989e12, 3.35e12, 2, "NVIDIA H100 SXM datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3"),
}


# Names resolved on the machine itself, when first needed: `cpu` measures this CPU, `auto` the machine's
# accelerator preset or, with none visible, this CPU (what a local run's generators run on).
MEASURED = ("cpu", "auto")


def list_hardware() -> list[str]:
    """Names of the hardware presets (`cpu` and `auto` are measured, see `probe_cpu` and `detect_hardware`)."""
    return list(_PRESETS)


def detect_hardware() -> Hardware:
    """This machine's hardware: the preset of the first visible CUDA GPU, by its name, or this CPU measured.

    HardwareError for a GPU without a preset (its figures would be guesses; name h200, h100 or cpu instead).
    A machine with no GPU device node at all is a CPU without asking torch, so a process that prices a run
    there (the controller) need not import torch when the CPU's figures are kept (`probe_cpu`)."""
    if "torch" not in sys.modules and not _accelerator_nodes():
        return probe_cpu()
    import torch

    if not torch.cuda.is_available():
        return probe_cpu()
    device = torch.cuda.get_device_name(0)
    for key, hw in _PRESETS.items():
        if key in device.lower().replace(" ", ""):
            return hw
    raise HardwareError(f"no preset for the GPU {device!r}; name one of {', '.join([*_PRESETS, 'cpu'])}")


def get_hardware(name: str) -> Hardware:
    """The hardware preset `name`; `cpu` runs `probe_cpu()`, `auto` runs `detect_hardware()`."""
    key = name.lower()
    if key == "cpu":
        return probe_cpu()
    if key == "auto":
        return detect_hardware()
    if key == "h100-sxm":
        key = "h100"
    hw = _PRESETS.get(key)
    if hw is None:
        known = [*_PRESETS, *MEASURED]
        close = difflib.get_close_matches(key, known, n=2, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
        raise HardwareError(f"unknown hardware {name!r}; {hint}")
    return hw


PROBE_MAX_AGE_S = 24 * 3600.0
"""how long a CPU's measured figures are reused (`sparrow.disk_cache`) before it is measured again"""


def probe_cpu(seconds: float = 1.0, reuse: bool = True) -> Hardware:
    """This CPU's fp32 matmul FLOP/s and copy bandwidth, measured with torch in about `seconds`.

    Achieved rates, not peaks: the best of several timed repetitions at torch's current thread count.
    With `reuse`, a measurement of the same CPU model, cores, thread count and torch taken in the last
    PROBE_MAX_AGE_S is returned instead: every process of a run prices the same figures, and a run's
    start does not lose a second of both cores to each process's own measurement.
    """
    from sparrow import disk_cache

    if reuse and "torch" not in sys.modules:  # the kept figures may be found without importing torch (2 s of CPU)
        kept = _kept_probe(_probe_key_without_torch())
        if kept is not None:
            return kept
    import torch  # lazily: the presets above need no torch

    key = {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    if reuse:
        kept = _kept_probe(key)
        if kept is not None:
            return kept
    hw = _measure_cpu(seconds)
    disk_cache.store("cpu-probe", key, asdict(hw))
    return hw


def _kept_probe(key: dict | None) -> Hardware | None:
    from sparrow import disk_cache

    kept = disk_cache.load("cpu-probe", key, PROBE_MAX_AGE_S) if key is not None else None
    if kept is None:
        return None
    try:
        return Hardware(**kept)
    except TypeError:  # written by another layout of Hardware: measure again
        return None


def _probe_key_without_torch() -> dict | None:
    """`probe_cpu`'s cache key as torch would make it in this process, where the environment fixes its thread count
    (OMP_NUM_THREADS, as every process `sparrow up` starts has it); None where only torch can tell."""
    from importlib import metadata

    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
        version = metadata.version("torch")
    except (ValueError, metadata.PackageNotFoundError):
        return None
    if threads < 1:
        return None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "threads": threads, "torch": version}


def _accelerator_nodes() -> bool:
    """Whether this machine shows a GPU's device node: NVIDIA's /dev/nvidia*, AMD's /dev/kfd (what CUDA and ROCm
    builds of torch open); a container given a GPU has them."""
    dev = Path("/dev")
    try:
        return (dev / "kfd").exists() or any(p.name.startswith("nvidia") for p in dev.iterdir())
    except OSError:
        return True  # cannot tell: let torch decide


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _measure_cpu(seconds: float) -> Hardware:
    import torch

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    flops = _best_rate(lambda: torch.mm(a, b, out=out), 2.0 * n**3, seconds / 2)

    # 64 MiB, well beyond the last-level cache, so the copy runs at memory speed.
    src = torch.ones(16 * 1024 * 1024)
    dst = torch.empty_like(src)
    moved = 2.0 * src.numel() * src.element_size()  # read once, written once
    bandwidth = _best_rate(lambda: dst.copy_(src), moved, seconds / 2)
    threads = torch.get_num_threads()
    return Hardware("cpu", flops, bandwidth, 4, f"measured on this CPU, fp32, {threads} thread(s)")


def _best_rate(step, work: float, budget_s: float) -> float:
    step()  # warm-up: first-touch page faults and kernel selection are not the steady rate
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    repeats = 0
    while repeats < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
        repeats += 1
    return work / max(best, 1e-9)
