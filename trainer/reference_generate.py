"""A reference generation loop with block-sparse decode attention, independent of the teacher-forced path.

Incremental decoding over a paged KV cache of our own (one cache block per sequence), the way an
engine runs: the prompt is prefilled densely, then every decode step writes the new token's keys
and values, refreshes the page centroids it touched and runs `kernels.block_sparse_decode` over the
cache, under the schedule's budget at the step's KV length (dense layers attend to every page).
It serves calibration before the production engine exists, and is the engine's oracle later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparrow.budget import PAGE_SIZE, num_pages, page_mismatch
from trainer import sparse_attention
from trainer.scoring import TOP_K, TokenScores, scaled_logprobs, token_scores

if TYPE_CHECKING:
    from sparrow.schedule import Schedule


@dataclass
class Generation:
    """One sampled response: its prompt length, tokens and the loop's own scores of them."""

    prompt_len: int
    tokens: list[int]
    scores: TokenScores
    budgets: torch.Tensor  # [n] KV budget in tokens of the step that produced each token (prefill: its length)
    finished: bool  # ended with EOS (else cut at max_new_tokens)


class PagedDecodeCache:
    """Every layer's KV cache in the kernels' paged layout, with centroids kept current as tokens arrive.

    Handed to the model as `sparrow_cache`; the registered attention function then calls `attention`.
    """

    def __init__(
        self, model: torch.nn.Module, prompt_lens: torch.Tensor, capacity: int, schedule: Schedule | None, backend: str
    ) -> None:
        from kernels import new_centroids

        cfg = model.config
        param = next(model.parameters())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rows = prompt_lens.shape[0]
        every_page = num_pages(capacity)
        shape = (rows, cfg.num_key_value_heads, every_page * PAGE_SIZE, head_dim)
        self.k = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.centroids = [new_centroids(k) for k in self.k]
        self.block_table = torch.arange(rows, dtype=torch.int32, device=param.device)[:, None]
        self.schedule = schedule
        self.backend = backend
        self.dense_layers = frozenset(schedule.dense_layers) if schedule is not None else frozenset()
        self.prefill = True
        self.verify_starts: torch.Tensor | None = None
        self.prompt_lens = prompt_lens.to(param.device)
        self.seq_lens = self.prompt_lens.clone()
        self.budgets = torch.full_like(self.seq_lens, every_page)

    def start_step(self, seq_lens: torch.Tensor) -> None:
        """Enter decode step whose rows hold `seq_lens` tokens once the new token is written (its KV length)."""
        self.prefill = False
        self.verify_starts = None
        self.seq_lens = seq_lens.to(self.seq_lens.device)
        if self.schedule is not None:
            self.budgets = self.schedule.budget_pages(self.seq_lens)

    def start_verify(self, starts: torch.Tensor) -> None:
        """Enter a dense pass over several new tokens per row, written from position `starts` (per row) on.

        Speculative decoding's verify: the tokens overwrite whatever the draft steps left in those slots,
        every layer attends densely and causally, and the row's KV length becomes start + tokens.
        """
        self.prefill = False
        self.verify_starts = starts.to(self.seq_lens.device).long()

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """Write this layer's new keys/values, then attend: [b, q_heads, t, d] -> [b, t, q_heads, d]."""
        from kernels import block_sparse_decode, sparse_decode_attention, update_centroids

        layer = module.layer_idx
        k_cache, v_cache, cents = self.k[layer], self.v[layer], self.centroids[layer]
        if self.prefill:
            t = query.shape[2]
            k_cache[:, :, :t] = key
            v_cache[:, :, :t] = value
            update_centroids(k_cache, cents, self.block_table, self.prompt_lens, backend=self.backend)
            # Right padding: every real query sees only real keys under the causal mask alone.
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scaling, enable_gqa=True
            )
            return out.transpose(1, 2).contiguous()
        if self.verify_starts is not None:
            return self._verify(k_cache, v_cache, cents, query, key, value, scaling)
        if query.shape[2] != 1:
            raise ValueError(f"a decode step takes one token per sequence, got {query.shape[2]}")
        rows = torch.arange(query.shape[0], device=query.device)
        pos = (self.seq_lens - 1).long()
        k_cache[rows, :, pos] = key[:, :, 0]
        v_cache[rows, :, pos] = value[:, :, 0]
        update_centroids(k_cache, cents, self.block_table, self.seq_lens, self.seq_lens - 1, backend=self.backend)
        q = query[:, :, 0].contiguous()
        if self.schedule is None or layer in self.dense_layers:
            out = sparse_decode_attention(
                q, k_cache, v_cache, self.block_table, self.seq_lens, None, scaling, backend=self.backend
            )
        else:
            out, _ = block_sparse_decode(
                q,
                k_cache,
                v_cache,
                cents,
                self.block_table,
                self.seq_lens,
                self.budgets,
                sink=self.schedule.sink_blocks,
                local=self.schedule.local_blocks,
                scale=scaling,
                backend=self.backend,
            )
        return out[:, None]

    def _verify(self, k_cache, v_cache, cents, query, key, value, scaling) -> torch.Tensor:
        from kernels import update_centroids

        b, _, t, _ = query.shape
        starts = self.verify_starts
        pos = starts[:, None] + torch.arange(t, device=query.device)[None, :]  # [b, t]
        rows = torch.arange(b, device=query.device)[:, None]
        k_cache[rows, :, pos] = key.transpose(1, 2)
        v_cache[rows, :, pos] = value.transpose(1, 2)
        self.seq_lens = starts + t
        update_centroids(k_cache, cents, self.block_table, self.seq_lens, starts, backend=self.backend)
        width = int(self.seq_lens.max())
        visible = torch.arange(width, device=query.device)[None, None, :] <= pos[:, :, None]  # [b, t, width]
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            k_cache[:, :, :width],
            v_cache[:, :, :width],
            attn_mask=visible[:, None],
            scale=scaling,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous()


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    schedule: Schedule | None,
    max_new_tokens: int,
    temperature: float = 1.0,
    greedy: bool = False,
    seed: int = 0,
    eos_id: int | None = None,
    backend: str = "auto",
    top_k: int = TOP_K,
    full: bool = False,
) -> list[Generation]:
    """Sample a response to each prompt (a batch of any lengths), decoding block-sparsely under `schedule`.

    `schedule` None decodes densely. Tokens are drawn from softmax(logits / temperature) with a
    torch.Generator seeded by `seed` (or argmax when `greedy`); each response stops after EOS or
    `max_new_tokens`. The scores are the loop's own (temperature applied as in `trainer.scoring`).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if schedule is not None and (mismatch := page_mismatch(schedule.page_size)):
        raise ValueError(mismatch)
    sparse_attention.install(model).eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    b = len(prompts)
    plens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    width = int(plens.max())
    ids = torch.zeros(b, width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    cache = PagedDecodeCache(model, plens, width + max_new_tokens, schedule, backend)

    positions = torch.arange(width, device=device)[None].expand(b, width)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False, sparrow_cache=cache).logits
    logits = logits[torch.arange(b, device=device), plens - 1]  # [b, vocab] at each prompt's last position
    lens = plens.clone()
    budgets = lens.clone()  # prefill attends densely to the whole prompt
    steps: list[tuple[TokenScores, torch.Tensor]] = []
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        logprobs = scaled_logprobs(logits, temperature)
        nxt = logprobs.argmax(-1) if greedy else torch.multinomial(logprobs.exp(), 1, generator=gen)[:, 0]
        steps.append((token_scores(logprobs, nxt, lens, top_k, full), budgets))
        if eos_id is not None:
            done |= nxt == eos_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        lens = lens + 1  # the token just sampled enters the cache at position lens - 1
        cache.start_step(lens)
        budgets = schedule.budget_tokens(lens) if schedule is not None else lens.clone()
        out = model(input_ids=nxt[:, None], position_ids=(lens - 1)[:, None], use_cache=False, sparrow_cache=cache)
        logits = out.logits[:, 0]
    return [_row(steps, i, int(plens[i]), eos_id) for i in range(b)]


def _row(steps: list[tuple[TokenScores, torch.Tensor]], i: int, prompt_len: int, eos_id: int | None) -> Generation:
    # Rows that finished keep decoding with the batch; everything after their EOS is dropped here.
    tokens = [int(s.token_ids[i]) for s, _ in steps]
    finished = eos_id is not None and eos_id in tokens
    n = tokens.index(eos_id) + 1 if finished else len(tokens)
    part = steps[:n]

    def stack(name: str) -> torch.Tensor:
        return torch.stack([getattr(s, name)[i] for s, _ in part])

    scores = TokenScores(
        token_ids=stack("token_ids"),
        logprobs=stack("logprobs"),
        top_ids=stack("top_ids"),
        top_logprobs=stack("top_logprobs"),
        kv_lens=stack("kv_lens"),
        full_logprobs=stack("full_logprobs") if part[0][0].full_logprobs is not None else None,
    )
    budgets = torch.stack([b[i] for _, b in part]).cpu()
    return Generation(prompt_len, tokens[:n], scores, budgets, finished)
