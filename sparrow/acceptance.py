"""Per-token acceptance rate between the sparse actor and the dense policy, and its tail per length bin.

alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q), with q the sparse actor and p the dense policy at the
same position. From top-k lists it is summed over the ids present in both (a lower bound); from full
distributions it is exact. The stability statistic of a bin is a low quantile (p5) of alpha; beside it
every bin reports p1 and the share of tokens under 0.5, which see rare failing tokens p5 misses.

Quantiles everywhere use linear interpolation between order statistics (numpy's default `linear`
method, Hyndman and Fan type 7): for n sorted values, q sits at position q * (n - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.schedule import DEFAULT_BIN_WIDTH

DEFAULT_QUANTILE = 0.05
STRICT_QUANTILE = 0.01  # p1: the stricter tail, for tasks that hinge on rare tokens
LOW_ALPHA = 0.5  # `under_half`: the share of tokens whose alpha is below this


def alpha_topk(
    sparse_ids: torch.Tensor,
    sparse_logprobs: torch.Tensor,
    dense_ids: torch.Tensor,
    dense_logprobs: torch.Tensor,
) -> torch.Tensor:
    """Lower bound of alpha per token from two top-k lists, shape [tokens, k] each; returns [tokens].

    Ids within one row must be unique. A row shorter than k may be padded with any id and logprob
    -inf: a zero probability adds nothing. The two sides may report different k.
    """
    for ids, lps, side in ((sparse_ids, sparse_logprobs, "sparse"), (dense_ids, dense_logprobs, "dense")):
        if ids.dim() != 2 or ids.shape != lps.shape:
            raise ValueError(
                f"{side} ids and logprobs must both be [tokens, k], got {tuple(ids.shape)} and {tuple(lps.shape)}"
            )
    if sparse_ids.shape[0] != dense_ids.shape[0]:
        raise ValueError(f"token counts differ: sparse {sparse_ids.shape[0]}, dense {dense_ids.shape[0]}")
    q = sparse_logprobs.double().exp()
    p = dense_logprobs.double().exp()
    # [tokens, k_sparse, k_dense]: k is about 20, so the pairwise match stays small.
    same = sparse_ids.unsqueeze(2) == dense_ids.unsqueeze(1)
    overlap = torch.minimum(q.unsqueeze(2), p.unsqueeze(1)) * same
    return overlap.sum(dim=(1, 2)).clamp(0.0, 1.0).float()


def alpha_exact(sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Exact alpha per token from full distributions [tokens, vocab] (logits or logprobs); returns [tokens].

    Both inputs are renormalised with a log-softmax, so raw logits and logprobs are both accepted. Computed and
    returned in float64 whatever the input dtype.
    """
    if sparse.shape != dense.shape or sparse.dim() != 2:
        raise ValueError(
            f"expected two [tokens, vocab] tensors of one shape, got {tuple(sparse.shape)} and {tuple(dense.shape)}"
        )
    # float64 whatever the inputs: a float32 softmax normaliser summed over a 150K-token vocabulary is off by ~1e-5,
    # as large as the alpha differences the tail statistic is meant to resolve. min(p, q) = exp(min(log p, log q)).
    log_q = torch.log_softmax(sparse.to(torch.float64), dim=-1)
    log_p = torch.log_softmax(dense.to(torch.float64), dim=-1)
    return torch.minimum(log_p, log_q).exp().sum(dim=-1).clamp(0.0, 1.0)


def quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile of `values` by linear interpolation (numpy's default); any size, unlike torch.quantile."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    x = values.reshape(-1).double()
    if x.numel() == 0:
        raise ValueError("quantile of an empty set")
    x, _ = torch.sort(x)
    pos = q * (x.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, x.numel() - 1)
    return float(x[lo] + (x[hi] - x[lo]) * (pos - lo))


@dataclass(frozen=True)
class BinStats:
    """Acceptance statistics of one KV-length bin: tokens produced at KV lengths [kv_start, kv_end)."""

    index: int
    kv_start: int
    kv_end: int | None  # None for an open-ended last bin
    count: int
    q: float  # which quantile `quantile` is (0.05 for the paper's p5)
    quantile: float
    mean: float
    p1: float = float("nan")  # the STRICT_QUANTILE of the bin's alpha
    under_half: float = float("nan")  # share of the bin's tokens with alpha < LOW_ALPHA


def bin_index(kv_lens: torch.Tensor, bin_width: int = DEFAULT_BIN_WIDTH, num_bins: int | None = None) -> torch.Tensor:
    """Bin of each KV length; with `num_bins`, longer lengths fall into the last bin."""
    if bin_width <= 0:
        raise ValueError(f"bin width must be positive, got {bin_width}")
    kv = torch.as_tensor(kv_lens).long()
    if kv.numel() and int(kv.min()) < 0:
        raise ValueError("KV lengths must be >= 0")
    index = torch.div(kv, bin_width, rounding_mode="floor")
    return index if num_bins is None else index.clamp(max=num_bins - 1)


def binned_stats(
    alpha: torch.Tensor,
    kv_lens: torch.Tensor,
    bin_width: int = DEFAULT_BIN_WIDTH,
    q: float = DEFAULT_QUANTILE,
    num_bins: int | None = None,
) -> list[BinStats]:
    """Quantile and mean of alpha per bin of the KV length at which each token was produced.

    Only bins holding at least one token are returned, in bin order.
    """
    alpha = torch.as_tensor(alpha).reshape(-1)
    kv = torch.as_tensor(kv_lens).reshape(-1)
    if alpha.numel() != kv.numel():
        raise ValueError(f"{alpha.numel()} alpha values but {kv.numel()} KV lengths")
    index = bin_index(kv, bin_width, num_bins)
    return [_stats(i, alpha[index == i], bin_width, q, num_bins) for i in sorted(set(index.tolist()))]


def _stats(i: int, values: torch.Tensor, bin_width: int, q: float, num_bins: int | None) -> BinStats:
    last = num_bins is not None and i == num_bins - 1
    return BinStats(
        index=i,
        kv_start=i * bin_width,
        kv_end=None if last else (i + 1) * bin_width,
        count=values.numel(),
        q=q,
        quantile=quantile(values, q),
        mean=float(values.double().mean()),
        p1=quantile(values, STRICT_QUANTILE),
        under_half=float((values < LOW_ALPHA).double().mean()),
    )


class AlphaAccumulator:
    """Collects alpha values across batches, keyed by length bin, and reports per-bin statistics.

    Values are kept (float32, 4 bytes a token) because an exact quantile needs them all.
    """

    def __init__(self, bin_width: int = DEFAULT_BIN_WIDTH, num_bins: int | None = None) -> None:
        if num_bins is not None and num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        self.bin_width = bin_width
        self.num_bins = num_bins
        self._chunks: dict[int, list[torch.Tensor]] = {}

    def add(self, alpha: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """Add one batch of tokens: alpha per token and the KV length at which each was produced."""
        alpha = torch.as_tensor(alpha).detach().reshape(-1).float().cpu()
        kv = torch.as_tensor(kv_lens).reshape(-1).cpu()
        if alpha.numel() != kv.numel():
            raise ValueError(f"{alpha.numel()} alpha values but {kv.numel()} KV lengths")
        index = bin_index(kv, self.bin_width, self.num_bins)
        for i in set(index.tolist()):
            self._chunks.setdefault(i, []).append(alpha[index == i])

    @property
    def count(self) -> int:
        """Number of tokens collected so far."""
        return sum(c.numel() for chunks in self._chunks.values() for c in chunks)

    def stats(self, q: float = DEFAULT_QUANTILE) -> list[BinStats]:
        """Statistics of every non-empty bin, in bin order."""
        out = []
        for i in sorted(self._chunks):
            values = torch.cat(self._chunks[i])
            self._chunks[i] = [values]  # keep one tensor so repeated reports do not re-concatenate
            out.append(_stats(i, values, self.bin_width, q, self.num_bins))
        return out

    def reset(self) -> None:
        """Forget every collected token."""
        self._chunks.clear()
