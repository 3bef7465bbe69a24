"""The chunked LM head against full logits: values, top-k, entropy and gradients, at Qwen3's vocabulary."""

import pytest
import torch

from trainer.lm_head import chunked_kl, log_distributions, token_logprobs
from trainer.scoring import scaled_logprobs

VOCAB = 151_936  # Qwen3's: the size whose [tokens, vocab] logits the chunking exists to avoid
HIDDEN = 8


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64).float().requires_grad_(True)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.5).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    return hidden, weight, targets


def _full(hidden, weight, targets, temperature):
    logprobs = scaled_logprobs(hidden @ weight.T, temperature)
    return logprobs, logprobs.gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize(("chunk", "temperature"), [(16, 1.0), (7, 0.7), (64, 1.3)])
def test_values_top_k_entropy_and_gradients_equal_the_full_logits_path(chunk, temperature):
    hidden, weight, targets = _inputs(37)
    coef = torch.linspace(-1.0, 2.0, 37)  # a loss that weighs every position differently
    full, want = _full(hidden, weight, targets, temperature)
    (want * coef).sum().backward()
    full_gh, full_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    # Values: equal to the full fp32 path's (each chunk is the same log_softmax). Gradients: the
    # reference is the full path in float64, since the fp32 full path is itself off by up to 6e-4
    # in the hidden states' gradient at T = 0.7 (sums over 151,936 terms) and its values by 3e-5.
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    exact = torch.log_softmax(h64 @ w64.T / temperature, dim=-1)
    (exact.gather(1, targets[:, None])[:, 0] * coef.double()).sum().backward()
    exact = exact.detach()

    out = token_logprobs(hidden, weight, targets, temperature, chunk, top_k=20, entropy=True)
    (out.logprobs * coef).sum().backward()
    torch.testing.assert_close(out.logprobs, want.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.logprobs.double(), exact.gather(1, targets[:, None])[:, 0], atol=5e-5, rtol=0)
    top = torch.topk(full.detach(), 20, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values, atol=1e-6, rtol=1e-6)
    assert torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.entropy, -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=1e-6)
    # The gradients are as exact as the full fp32 path's, and equal to them.
    for got, fp32, fp64 in ((hidden.grad, full_gh, h64.grad), (weight.grad, full_gw, w64.grad)):
        err, full_err = (got.double() - fp64).abs().max(), (fp32.double() - fp64).abs().max()
        assert err <= 1.05 * full_err + 1e-6, (float(err), float(full_err))
        torch.testing.assert_close(got, fp32, atol=1e-4, rtol=1e-4)


def test_the_callback_sees_every_chunk_whole_and_the_generator_yields_the_same():
    hidden, weight, targets = _inputs(21)
    full, _ = _full(hidden.detach(), weight.detach(), targets, 0.8)
    seen = {}
    keep = lambda start, lp: seen.update({start: lp.clone()})  # noqa: E731
    token_logprobs(hidden.detach(), weight.detach(), targets, 0.8, 8, on_chunk=keep)
    assert sorted(seen) == [0, 8, 16] and [v.shape[0] for v in seen.values()] == [8, 8, 5]
    torch.testing.assert_close(torch.cat([seen[s] for s in sorted(seen)]), full, atol=1e-6, rtol=1e-6)
    chunks = list(log_distributions(hidden, weight, 0.8, 8))
    torch.testing.assert_close(torch.cat([c for _, c in chunks]), full, atol=1e-6, rtol=1e-6)
    assert not chunks[0][1].requires_grad


def test_no_tensor_of_vocab_size_is_kept_for_the_backward():
    hidden, weight, targets = _inputs(50)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(hidden, weight, targets, 1.0, 16).logprobs.sum()
    # hidden [50, 8], weight [V, 8] (the parameter itself, not a copy), targets [50]
    assert sorted(saved) == sorted([50 * HIDDEN, VOCAB * HIDDEN, 50])


def test_bf16_compute_is_close_to_fp32_and_the_weight_gradient_stays_in_its_dtype():
    hidden, weight, targets = _inputs(19)
    want = token_logprobs(hidden, weight, targets, 1.0, 8).logprobs
    w16 = weight.detach().bfloat16().requires_grad_(True)
    out = token_logprobs(hidden, w16, targets, 1.0, 8, dtype=torch.bfloat16)
    out.logprobs.sum().backward()
    assert out.logprobs.dtype == torch.float32 and w16.grad.dtype == torch.bfloat16
    # bf16 rounds logits of size ~5 by ~0.02; the log-probs follow.
    torch.testing.assert_close(out.logprobs, want.detach(), atol=0.1, rtol=0.02)


def test_the_exact_kl_and_its_gradient_equal_the_full_path():
    hidden, weight, _ = _inputs(23)
    ref = torch.randn(23, HIDDEN)
    logp = scaled_logprobs(hidden @ weight.T, 0.9)
    logq = scaled_logprobs(ref @ weight.detach().T, 0.9)
    want = (logp.exp() * (logp - logq)).sum(-1)
    want.sum().backward()
    want_gh = hidden.grad.clone()
    hidden.grad = weight.grad = None
    kl = chunked_kl(hidden, ref, weight, 0.9, 10)
    kl.sum().backward()
    torch.testing.assert_close(kl, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, want_gh, atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_clear():
    hidden, weight, targets = _inputs(4)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        token_logprobs(hidden, weight, targets, 1.0, 0)
    with pytest.raises(ValueError, match="targets of shape"):
        token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="expected hidden"):
        token_logprobs(hidden[:, :4], weight, targets)
