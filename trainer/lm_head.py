"""The LM head a chunk of positions at a time: logprobs of sampled tokens without a [tokens, vocab] tensor.

With Qwen3's 151,936-entry vocabulary the logits are the memory wall of the trainer, not the model:
a 40K-token response's fp32 logits take 24 GiB, and log-softmax and its gradient triple that. Here
the logits of at most `chunk` positions exist at any moment, in the forward and in the backward:

- `token_logprobs`: log p(target) at temperature T of every position, with a gradient w.r.t. the
  hidden states and the head's weight (a custom autograd function that keeps only its inputs and
  recomputes each chunk's logits in the backward: two [chunk, vocab] float32 tensors at most),
  plus the top-k lists and the entropy when asked for (no gradient), and each chunk's whole
  log-distribution handed to a callback (exact alpha, full KL) before it is dropped;
- `log_distributions`: the same chunks as a generator, for callers that pair two models' chunks;
- `chunked_kl`: KL(p || q) per position over the whole vocabulary with a gradient through p, each
  chunk recomputed in the backward (torch.utils.checkpoint), for DistillSparse's exact KL.

The matmul runs in `dtype` (the compute dtype: bf16 for a bf16 run), the softmax in float32, as
`trainer.scoring.scaled_logprobs` does for a full-logits caller: log_softmax(logits.float() / T).
The gradient of the weight is summed over chunks in float32 whatever `dtype` is, so a bf16 run
does not round it once per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

DEFAULT_CHUNK = 1024

ChunkCallback = Callable[[int, torch.Tensor], None]  # (first position of the chunk, its log-probs [c, vocab])


@dataclass
class HeadOutput:
    """What the head gives for N positions; only `logprobs` carries a gradient."""

    logprobs: torch.Tensor  # [N] float32: log p(target)
    top_ids: torch.Tensor | None = None  # [N, k] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [N, k] float32
    entropy: torch.Tensor | None = None  # [N] float32, in nats


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The weight [vocab, hidden] of a transformers causal LM's output head (the embedding when tied)."""
    return model.get_output_embeddings().weight


def hidden_states(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra
) -> torch.Tensor:
    """The last hidden states [b, T, hidden] of a transformers causal LM: its head's input, after the final norm.

    The model's own forward runs (so FSDP2's root hooks gather the root's parameters, the head's
    among them, and keep them for the backward) with `logits_to_keep=1`: the head itself is
    applied to one position only, and the final norm's output is taken by a hook. `extra` goes to
    the forward as the caller would pass it (e.g. `sparrow_plan`). Right-padded rows are attended
    causally, without their padding mask (`forward_mask`): only their positions before the padding
    are exact, the only ones the trainer reads.
    """
    captured: list[torch.Tensor] = []
    handle = model.get_decoder().norm.register_forward_hook(lambda _module, _args, out: captured.append(out))
    try:
        mask = forward_mask(attention_mask)
        model(input_ids=input_ids, attention_mask=mask, use_cache=False, logits_to_keep=1, **extra)
    finally:
        handle.remove()
    return captured[-1]


def forward_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The padding mask to give the model: None when every row is right-padded (its ones, then its zeros).

    Causal attention alone is then exact at every position before a row's padding, the only ones a
    caller reads, and SDPA runs its fused causal kernel. Given the padding mask, transformers builds a
    [T, T] mask per row and SDPA attends through it: at 8K tokens a row, several times slower.
    """
    lengths = attention_mask.sum(dim=1, keepdim=True)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None, :]
    return None if torch.equal(attention_mask.bool(), positions < lengths) else attention_mask


def _check(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, chunk: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")


def scaled_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T [c, vocab] float32 of hidden states `h` [c, H] under `w` [vocab, H], the matmul in w's dtype."""
    # `w` is already in the compute dtype (cast once per call, not per chunk). Autocast off: the
    # compute dtype is chosen by the caller, explicitly, the same in the forward and the backward.
    with torch.autocast(h.device.type, enabled=False):
        logits = (h.to(w.dtype) @ w.T).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def log_distributions(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first position, log_softmax(logits / T) [c, vocab] float32) for each chunk of `hidden` [N, H]; no gradient."""
    _check(hidden, weight, temperature, chunk)
    w = weight.detach().to(dtype or hidden.dtype)
    for start in range(0, hidden.shape[0], chunk):
        # no_grad around each chunk, not around the loop: a generator suspended inside the context would
        # leave gradients off in its caller (a paired consumer stops at its own last chunk, never closing it).
        with torch.no_grad():
            logp = torch.log_softmax(scaled_logits(hidden[start : start + chunk].detach(), w, temperature), dim=-1)
        yield start, logp


class _TokenLogprobs(torch.autograd.Function):
    """log p(target) per position; the backward recomputes one chunk's logits at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, dtype, top_k, entropy, on_chunk):
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        k = min(top_k, weight.shape[0])
        top_v = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
        top_i = torch.empty(n, k, dtype=torch.long, device=hidden.device)
        ent = torch.empty(n if entropy else 0, dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            # log_softmax in one fused pass (torch's logsumexp takes twice as long on CPU); two [c, vocab] at most.
            logp = torch.log_softmax(scaled_logits(hidden[start:end], w, temperature), dim=-1)
            out[start:end] = logp.gather(1, targets[start:end, None])[:, 0]
            if k:
                top = torch.topk(logp, k, dim=-1)
                top_v[start:end] = top.values
                top_i[start:end] = top.indices
            if on_chunk is not None:
                on_chunk(start, logp)
            if entropy:
                ent[start:end] = -(logp.exp() * logp).sum(-1)
            del logp
        del w
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(top_v, top_i, ent)
        return out, top_v, top_i, ent

    @staticmethod
    def backward(ctx, grad_out, *_unused):
        hidden, weight, targets = ctx.saved_tensors
        t, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            g = grad_out[start:end].float() / t
            # d log p(y) / d logit = (onehot(y) - softmax) / T, built in the softmax's buffer.
            grad_logits = torch.softmax(scaled_logits(h, w, t), dim=-1).mul_(-g[:, None])
            grad_logits.scatter_add_(1, targets[start:end, None], g[:, None])
            with torch.autocast(h.device.type, enabled=False):
                if want_h:
                    grad_h[start:end] = (grad_logits.to(dtype) @ w).to(hidden.dtype)
                if want_w:
                    grad_w.addmm_(grad_logits.T, h.float())
            del grad_logits
        return grad_h, (grad_w.to(weight.dtype) if want_w else None), None, None, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    *,
    top_k: int = 0,
    entropy: bool = False,
    on_chunk: ChunkCallback | None = None,
    dtype: torch.dtype | None = None,
) -> HeadOutput:
    """Scores of `targets` [N] under the head `weight` [V, H] applied to `hidden` [N, H] at `temperature`.

    `chunk` positions at a time, forward and backward; `dtype` is the matmul's (default: the hidden
    states'). `top_k` > 0 adds the top-k lists, `entropy` each position's entropy, and `on_chunk`
    receives every chunk's log-distribution [c, V] (float32, at T; valid only during the call).
    """
    _check(hidden, weight, temperature, chunk)
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"{hidden.shape[0]} positions but targets of shape {tuple(targets.shape)}")
    lp, top_v, top_i, ent = _TokenLogprobs.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk), dtype or hidden.dtype, int(top_k),
        bool(entropy), on_chunk,
    )  # fmt: skip
    return HeadOutput(
        logprobs=lp,
        top_ids=top_i if top_k else None,
        top_logprobs=top_v if top_k else None,
        entropy=ent if entropy else None,
    )


def chunked_kl(
    hidden_p: torch.Tensor,
    hidden_q: torch.Tensor,
    weight: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """KL(p || q) [N] over the whole vocabulary, p and q the head at T on `hidden_p` and `hidden_q` [N, H].

    The gradient flows through p only (q is a fixed reference); each chunk is recomputed in the
    backward, so no [N, vocab] tensor is kept between the two passes.
    """
    from torch.utils.checkpoint import checkpoint

    _check(hidden_p, weight, temperature, chunk)
    if hidden_q.shape != hidden_p.shape:
        raise ValueError(f"hidden states of two shapes: {tuple(hidden_p.shape)} and {tuple(hidden_q.shape)}")
    dtype = dtype or hidden_p.dtype
    q_all = hidden_q.detach()

    def piece(h_p: torch.Tensor, h_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = w.to(dtype)
        logp = torch.log_softmax(scaled_logits(h_p, w, temperature), dim=-1)
        with torch.no_grad():
            logq = torch.log_softmax(scaled_logits(h_q, w, temperature), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1)

    parts = [
        checkpoint(piece, hidden_p[s : s + chunk], q_all[s : s + chunk], weight, use_reentrant=False)
        for s in range(0, hidden_p.shape[0], chunk)
    ]
    return torch.cat(parts) if parts else hidden_p.new_zeros(0, dtype=torch.float32)
