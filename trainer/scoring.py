"""Teacher-forced scoring of sampled tokens: per-token logprobs and top-k lists, dense or block-sparse.

Both paths run the same transformers model (its attention switched to `trainer.sparse_attention`):
dense is stock SDPA, sparse is teacher-forced block-sparse attention under a schedule, each
position selecting the pages its decode step selected. Temperature is applied the same way on both
paths and in the reference decode loop: log_softmax(logits / T), in float32. The LM head runs on
the response positions only, a chunk of them at a time (`trainer.lm_head`): no [seq, vocab] logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer import lm_head, sparse_attention
from trainer.batch import MicroBatch

if TYPE_CHECKING:
    from sparrow.schedule import Schedule

TOP_K = 20


@dataclass
class TokenScores:
    """Scores of one sequence's response tokens; every tensor's first dimension is the response length n.

    `kv_lens[i]` is the KV length at which token i was produced (its position in the sequence: the
    step that produced it had the i-th token's predecessors, prompt included, in its cache).
    """

    token_ids: torch.Tensor  # [n] int64
    logprobs: torch.Tensor  # [n] float32, of the sampled token
    top_ids: torch.Tensor  # [n, k] int64
    top_logprobs: torch.Tensor  # [n, k] float32
    kv_lens: torch.Tensor  # [n] int64
    full_logprobs: torch.Tensor | None = None  # [n, vocab] float32 when asked for


def scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) in float32: the one place temperature is applied, on every path."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def token_scores(
    logprobs: torch.Tensor, tokens: torch.Tensor, kv_lens: torch.Tensor, top_k: int = TOP_K, full: bool = False
) -> TokenScores:
    """Scores of `tokens` [n] from the (temperature-scaled) log-probs [n, vocab] they were drawn from."""
    top = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)
    return TokenScores(
        token_ids=tokens.long(),
        logprobs=logprobs.gather(-1, tokens.long()[:, None])[:, 0],
        top_ids=top.indices,
        top_logprobs=top.values,
        kv_lens=kv_lens.long(),
        full_logprobs=logprobs if full else None,
    )


class Scorer:
    """Scores token sequences (prompt + response) with a transformers causal LM, dense or block-sparse.

    The model's attention is switched to `trainer.sparse_attention` in place (its dense path is
    stock SDPA). `backend` scores pages for the sparse path: use the engine's, so both select alike.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: str = "auto",
        top_k: int = TOP_K,
        chunk: int = lm_head.DEFAULT_CHUNK,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model = sparse_attention.install(model).eval()
        self.backend = backend
        self.top_k = top_k
        self.chunk = chunk  # positions per LM-head chunk
        self.dtype = dtype  # compute dtype (None: the model's own)

    @property
    def device(self) -> torch.device:
        """Where the model's forward runs (the GPU also when FSDP2 keeps its shards in host memory)."""
        from trainer.distributed import compute_device

        return compute_device(self.model)

    @torch.no_grad()
    def score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        schedule: Schedule | None = None,
        temperature: float = 1.0,
        full: bool = False,
        on_chunk: lm_head.ChunkCallback | None = None,
    ) -> list[TokenScores]:
        """Per sequence, the scores of its response tokens (those after its prompt).

        `schedule` None is dense attention; otherwise teacher-forced block-sparse attention under it
        (prompt positions dense, as prefill is). `full` also returns every position's log-probs;
        `on_chunk` receives each LM-head chunk's log-probs (`trainer.lm_head.token_logprobs`), the
        response positions of every sequence in order.
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        for i, (seq, plen) in enumerate(zip(sequences, prompt_lens, strict=True)):
            if not 1 <= plen <= len(seq):
                raise ValueError(f"sequence {i}: prompt length {plen} is outside [1, {len(seq)}]")
        if not sequences:
            return []
        lens = [len(s) for s in sequences]
        width = max(lens)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, : lens[i]] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[i, : lens[i]] = 1
        extra = {}
        if schedule is not None:
            plens = torch.as_tensor(list(prompt_lens), dtype=torch.long)
            extra["sparrow_plan"] = sparse_attention.teacher_forced_plan(schedule, plens, width, self.backend)
        with compute_dtype(self.device, self.dtype):
            hidden = lm_head.hidden_states(self.model, ids.to(self.device), mask.to(self.device), **extra)
        # Hidden states at position t predict token t + 1: the response's positions only, one row per token.
        rows = torch.cat(
            [hidden[i, plen - 1 : n - 1] for i, (n, plen) in enumerate(zip(lens, prompt_lens, strict=True))]
        )
        targets = torch.cat([ids[i, plen:n] for i, (n, plen) in enumerate(zip(lens, prompt_lens, strict=True))])
        full_rows: list[torch.Tensor] = []

        def chunk_seen(start: int, lp: torch.Tensor) -> None:
            if full:
                full_rows.append(lp.clone())
            if on_chunk is not None:
                on_chunk(start, lp)

        head = lm_head.token_logprobs(
            rows,
            lm_head.output_weight(self.model),
            targets.to(rows.device),
            temperature,
            self.chunk,
            top_k=self.top_k,
            on_chunk=chunk_seen if full or on_chunk is not None else None,
            dtype=self.dtype or rows.dtype,
        )
        full_lp = torch.cat(full_rows) if full else None
        out, at = [], 0
        for n, plen in zip(lens, prompt_lens, strict=True):
            span = slice(at, at + n - plen)
            at += n - plen
            out.append(
                TokenScores(
                    token_ids=targets[span].to(rows.device),
                    logprobs=head.logprobs[span],
                    top_ids=head.top_ids[span],
                    top_logprobs=head.top_logprobs[span],
                    kv_lens=torch.arange(plen, n, device=rows.device),
                    full_logprobs=full_lp[span] if full_lp is not None else None,
                )
            )
        return out


def compute_dtype(device: torch.device, dtype: torch.dtype | None):
    """The context a forward runs its matmuls in `dtype` under (autocast; fp32 master weights stay as they are).

    None or float32: no autocast. Under FSDP2 the mixed-precision policy casts the parameters
    instead and this is not needed.
    """
    import contextlib

    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def response_hidden(model: torch.nn.Module, mb: MicroBatch, dtype: torch.dtype | None = None, **extra) -> torch.Tensor:
    """The last hidden states [tokens, hidden] of the micro-batch's response positions (under `mb.mask`), in order.

    Position t's hidden state scores the token at t + 1; `extra` goes to the decoder (e.g.
    `sparrow_plan` for the sparse actor). Prompt and padding positions never reach the LM head.
    """
    with compute_dtype(mb.input_ids.device, dtype):
        hidden = lm_head.hidden_states(model, mb.input_ids, mb.attention_mask, **extra)[:, :-1]
    return hidden[mb.mask.bool()]


def place(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
    """Per-token values [tokens] of the response positions laid out as [b, T - 1] (0 elsewhere), differentiably."""
    keep = mb.mask.bool()
    return torch.zeros(mb.mask.shape, dtype=values.dtype, device=values.device).index_put((keep,), values)


def masked_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    chunk: int = lm_head.DEFAULT_CHUNK,
    dtype: torch.dtype | None = None,
    **extra,
) -> torch.Tensor:
    """Logprobs [b, T - 1] of the micro-batch's targets on its response positions (0 elsewhere), with gradients.

    Only the positions under `mb.mask` reach the LM head, `chunk` at a time.
    """
    rows = response_hidden(model, mb, dtype, **extra)
    targets = mb.targets[mb.mask.bool()]
    head = lm_head.token_logprobs(rows, lm_head.output_weight(model), targets, temperature, chunk, dtype=dtype)
    return place(mb, head.logprobs)
