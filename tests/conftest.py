"""Test-wide set-up.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the interpreter
switch must be set before any `kernels` module is imported: on machines without a CUDA GPU every
Triton kernel runs in the interpreter (float32 only; bf16 is broken there).

One OpenMP thread for the test process and every process it starts, set before torch loads OpenMP:
`torch.set_num_threads(1)` holds only for the thread that calls it, and a service running in a thread
of a test (a trainer, a stand-in generator) would otherwise use a pool as wide as the machine, whose
threads spin at every barrier; on a busy 2-core machine that made a stand-in generator's 4 samples of
40 tokens take more than 240 s (it took 30 s with one thread on the same load). Tests measure
behaviour, not speed: `sparrow bench` sets its own threads.

Every test gets back the environment it started with. A vLLM engine built in the test process writes
to `os.environ` (its CPU platform sets LD_PRELOAD to torch's OpenMP library and LOCAL_WORLD_SIZE), and
every process a later test starts would inherit that: a trainer launcher or torchrun ranks that no
user runs.
"""

import os
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Figures kept between processes (a CPU's measured speed, sparrow.disk_cache) go to a folder of the tests' own,
# shared by the suite's workers and the services they start, never to the user's cache.
os.environ.setdefault("SPARROW_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"sparrow-tests-cache-{os.getuid()}"))

import torch  # noqa: E402

torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _own_environment():
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# `scripts/test` runs the suite on two xdist workers (`--dist loadfile`): a test file goes to one worker
# whole, so its module-scoped servers and engines start once. The files that run programs in the code
# sandbox's jail go to one worker together, one after another: test_hostile_programs.py checks that no
# jailed process (uid 65534) outlives a run, machine-wide, so no other jail may run beside it.
_JAIL_FILES = (
    "tests/integration/sandbox/",
    "tests/unit/sandbox/",
    "tests/integration/launcher/test_up_code_sandbox.py",
    "tests/unit/bench/test_bench_sandbox.py",
    "tests/unit/launcher/test_up_sandbox.py",
    "tests/unit/core/test_reward_shapes.py",
)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndOneJail(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "jail" if path.startswith(_JAIL_FILES) else path

    return FilesAndOneJail(config, log)
