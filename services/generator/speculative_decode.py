"""Lossless sparse decoding for the reference engine: the block-sparse model drafts, the same model verifies densely.

One cycle per batch: k draft steps through the block-sparse path (the schedule's budgets) over the
group's own paged KV cache, then one dense pass over the k + 1 positions (the last emitted token
and the k drafts) that rewrites those slots with dense keys and values, and exact
rejection sampling (`sparrow.speculative`). Rows advance by what each accepted, so the cache runs
with per-row lengths. Every emitted token is the dense policy's: its logprob and top list come from
the verify pass, its reported budget is 0 (dense).
"""

from __future__ import annotations

import time

import torch

from services.generator.engine import CycleTime
from sparrow.speculative import nucleus, verify_drafts
from sparrow.work import Sampling
from trainer.reference_generate import PagedDecodeCache
from trainer.scoring import scaled_logprobs


class DecodedRow:
    """What one sample accumulates, position by position (and, when speculative, per drafted position)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []
        self.budgets: list[int] = []
        self.drafted = 0
        self.accepted = 0
        self.alphas: list[float] = []  # sum_x min(p, q) of every drafted position
        self.draft_accepted: list[bool] = []
        self.alpha_kv_lens: list[int] = []  # KV length of the draft step that produced it

    def add(self, token: int, logprob: float, top_ids: list[int], top_logprobs: list[float], budget: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.top_ids.append(top_ids)
        self.top_logprobs.append(top_logprobs)
        self.budgets.append(budget)


class SpeculativeDecoder:
    """Decodes one group's rows speculatively after its dense prefill; `run` returns the rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedDecodeCache,
        sampling: Sampling,
        k: int,
        max_new: int,
        stops: torch.Tensor,
        rng: torch.Generator,
    ) -> None:
        self.model, self.cache, self.s, self.k = model, cache, sampling, k
        self.max_new, self.stops, self.rng = max_new, stops, rng
        self.cycle_times: list[CycleTime] = []  # every cycle, timed: its drafts apart from the rest

    @torch.no_grad()
    def run(self, logits: torch.Tensor, lens: torch.Tensor) -> list[DecodedRow]:
        """`logits` [n, vocab] of the prefill's last position; `lens` [n] tokens cached (the prompt)."""
        n = lens.shape[0]
        rows = [DecodedRow() for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool, device=lens.device)
        dense = scaled_logprobs(logits, self.s.temperature)[:, None]
        pending = torch.multinomial(nucleus(dense[:, 0].exp(), self.s.top_p), 1, generator=self.rng)[:, 0]
        self._record(rows, done, pending[:, None], torch.ones_like(lens), dense)
        while not bool(done.all()):
            alive = ~done
            active = alive.nonzero()[:, 0].tolist()
            kv = int(lens[alive].float().mean()) + 1  # the first draft step's KV length, over the rows that go on
            t0 = time.perf_counter()
            q, drafts = self._draft(pending, lens)
            t1 = time.perf_counter()
            dense = self._verify(pending, drafts, lens)
            verdict = verify_drafts(nucleus(dense.exp(), self.s.top_p), q, drafts, self.rng)
            emitted = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
            emitted[torch.arange(n, device=lens.device), verdict.accepted] = verdict.next_token
            alpha = verdict.alpha.tolist()
            for i in active:
                row, start = rows[i], int(lens[i])
                row.drafted += self.k
                kept = int(verdict.accepted[i])
                row.accepted += kept
                row.alphas.extend(alpha[i])
                row.draft_accepted.extend(j < kept for j in range(self.k))
                row.alpha_kv_lens.extend(range(start + 1, start + self.k + 1))
            self._record(rows, done, emitted, verdict.accepted + 1, dense)
            lens = lens + torch.where(alive, verdict.accepted + 1, 0)  # finished rows stay where they are
            self.cycle_times.append(CycleTime(n, kv, t1 - t0, time.perf_counter() - t1))
            pending = verdict.next_token
        return rows

    def _draft(self, pending: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k block-sparse steps from `pending` at position `lens`: draft distributions [n, k, vocab], drafts [n, k]."""
        qs, drafts, tok = [], [], pending
        for j in range(self.k):
            kv = lens + j + 1
            self.cache.start_step(kv)  # the schedule's budgets at each row's own KV length
            out = self.model(
                input_ids=tok[:, None], position_ids=(kv - 1)[:, None], use_cache=False, sparrow_cache=self.cache
            )
            q = nucleus(scaled_logprobs(out.logits[:, 0], self.s.temperature).exp(), self.s.top_p)
            tok = torch.multinomial(q, 1, generator=self.rng)[:, 0]
            qs.append(q)
            drafts.append(tok)
        return torch.stack(qs, dim=1), torch.stack(drafts, dim=1)

    def _verify(self, pending: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """The dense pass over [pending, drafts] from position `lens`: log-probs [n, k + 1, vocab] (temperature)."""
        ids = torch.cat([pending[:, None], drafts], dim=1)
        positions = lens[:, None] + torch.arange(self.k + 1, device=lens.device)[None, :]
        self.cache.start_verify(lens)
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False, sparrow_cache=self.cache)
        return scaled_logprobs(out.logits, self.s.temperature)

    def _record(
        self,
        rows: list[DecodedRow],
        done: torch.Tensor,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        dense: torch.Tensor,
    ) -> None:
        """Append each unfinished row's first `counts` tokens with their dense scores; mark rows that stop."""
        top = torch.topk(dense, min(self.s.top_logprobs, dense.shape[-1]), dim=-1)
        sampled = dense.gather(-1, tokens[..., None])[..., 0]
        stops = set(self.stops.tolist())
        for i in (~done).nonzero()[:, 0].tolist():
            row = rows[i]
            for j in range(int(counts[i])):
                tok = int(tokens[i, j])
                row.add(tok, float(sampled[i, j]), top.indices[i, j].tolist(), top.values[i, j].tolist(), 0)
                if tok in stops or len(row.tokens) >= self.max_new:
                    done[i] = True
                    break
