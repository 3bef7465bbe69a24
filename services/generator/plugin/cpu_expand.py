"""vLLM's `expand_kernel` in torch, for its CPU path (`patches.cpu_expand_kernel`): each request's value over
the positions of its tokens, in the dtype of the tensors given (vLLM's C++ fallback handles integers only)."""

from __future__ import annotations

import torch


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803
    """Request r's value (`replace_from` read as `replace_to`) into output[cu[r-1]:cu[r]] (the kernel's arguments)."""
    ends = [int(e) for e in cu_num_tokens.tolist()]
    counts = torch.tensor([e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)])
    values = input_val[: len(ends)]
    values = torch.where(values == replace_from, torch.as_tensor(replace_to, dtype=values.dtype), values)
    output[: int(counts.sum())] = torch.repeat_interleave(values, counts).to(output.dtype)
