"""The page: the 16-token unit the kernels select, score and count, and the one place its size is set.

Plain Python (no torch, no Triton), so that the core's schedules and budget rule can name the page
without loading the kernels.
"""

from __future__ import annotations

PAGE_SIZE = 16


def num_pages(tokens):
    """Pages that hold `tokens` tokens, the last one possibly partial (an int or an integer tensor)."""
    return (tokens + PAGE_SIZE - 1) // PAGE_SIZE
