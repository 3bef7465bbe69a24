"""bench/rss.py: a child's peak resident memory is its own, not its parent's (which fork and exec carry over)."""

import multiprocessing
import resource

import numpy as np
import pytest

from bench import rss

GIB = 2**30


def _child(out) -> None:
    could = rss.reset_peak()
    small = np.ones(64 * 2**20 // 8)  # 64 MiB of its own
    out.send((could, rss.peak_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, small.sum() > 0))


def test_a_child_of_a_large_parent_reports_its_own_peak():
    big = np.ones(GIB // 8)  # 1 GiB resident in this process when the child starts
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send,))
    child.start()
    could, peak, inherited, _ = recv.recv()
    child.join(30)
    assert big.sum() == GIB // 8
    if not could:
        pytest.skip("this kernel cannot reset a process's peak (no /proc/self/clear_refs)")
    assert inherited >= GIB  # what getrusage alone would have reported: the parent's mark
    assert 64 * 2**20 <= peak < GIB / 2
