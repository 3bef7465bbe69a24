"""Goodness-of-fit for sampling tests: Pearson's chi-square against known probabilities, torch only."""

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """P-value of observing `counts` [v] when drawing sum(counts) times from `probs` [v].

    Categories whose expected count is under `min_expected` are pooled into one (the chi-square
    approximation needs about five per cell); the p-value is the upper tail of chi-square with
    cells - 1 degrees of freedom (regularized incomplete gamma, float64).
    """
    counts, probs = counts.double(), probs.double() / probs.double().sum()
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if float(exp[-1]) < min_expected:  # the pool itself too small: fold it into the smallest cell
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        smallest = int(exp.argmin())
        obs[smallest] += counts[~big].sum()
        exp[smallest] += expected[~big].sum()
    if obs.numel() < 2:
        raise ValueError("chi-square needs at least two cells with enough expected counts")
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
