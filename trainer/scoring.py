"""Teacher-forced scoring of sampled tokens: per-token logprobs and top-k lists, dense or block-sparse.

Both paths run the same transformers model (its attention switched to `trainer.sparse_attention`):
dense is stock SDPA, sparse is teacher-forced block-sparse attention under a schedule, each
position selecting the pages its decode step selected. Temperature is applied the same way on both
paths and in the reference decode loop: log_softmax(logits / T), in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer import sparse_attention

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

    def __init__(self, model: torch.nn.Module, backend: str = "auto", top_k: int = TOP_K) -> None:
        self.model = sparse_attention.install(model).eval()
        self.backend = backend
        self.top_k = top_k

    @property
    def device(self) -> torch.device:
        """Where the model's weights live."""
        return next(self.model.parameters()).device

    @torch.no_grad()
    def score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        schedule: Schedule | None = None,
        temperature: float = 1.0,
        full: bool = False,
    ) -> list[TokenScores]:
        """Per sequence, the scores of its response tokens (those after its prompt).

        `schedule` None is dense attention; otherwise teacher-forced block-sparse attention under it
        (prompt positions dense, as prefill is). `full` also returns every position's log-probs.
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
        logits = self.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False, **extra
        ).logits
        out = []
        for i, (n, plen) in enumerate(zip(lens, prompt_lens, strict=True)):
            # logits at position t predict token t + 1
            tokens = ids[i, plen:n].to(logits.device)
            kv = torch.arange(plen, n, device=logits.device)
            logprobs = scaled_logprobs(logits[i, plen - 1 : n - 1], temperature)
            out.append(token_scores(logprobs, tokens, kv, self.top_k, full))
        return out
