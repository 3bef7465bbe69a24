"""Activation checkpointing per decoder layer: peak memory and time of one forward and backward, with it and without.

    python -m bench.activation_checkpoint [--tokens 2048] [--layers 8] [--hidden 512] [--chunk 128] [--out FILE]

A random Qwen3-shaped model (Qwen3's 151,936-entry vocabulary, tied head, GQA; small elsewhere so
that it runs on a CPU) loaded as the trainer loads it (`trainer.model_io.load_model`) runs the
update's path on one sequence: the last hidden states, then the chunked LM head's logprobs of the
sequence's next tokens and a loss on them, backward. `off` keeps every layer's activations, `on`
checkpoints each decoder layer (`trainer.activation_checkpoint`, what `[trainer.memory]
activation_checkpointing` turns on). Each mode runs in a fresh process: one warm-up step first (the
gradients exist before the measured one, as in training), then the process's peak resident memory
is reset (Linux /proc/self/clear_refs), and the measured step gives two figures above the memory
before it: what the forward holds for the backward (resident memory after the forward: the
activations), and the step's peak (those plus the backward's own temporaries: the recomputed
layer's, the LM head's chunks). Prints one JSON object with both modes and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

VOCAB = 151_936


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _case(folder: str, mode: str, tokens: int, chunk: int, result) -> None:
    import torch

    from trainer import lm_head
    from trainer.activation_checkpoint import checkpoint_layers
    from trainer.model_io import load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_model(folder)
    if mode == "on":
        checkpoint_layers(model)
    ids = torch.randint(3, VOCAB, (1, tokens))

    def forward() -> torch.Tensor:
        hidden = lm_head.hidden_states(model, ids, torch.ones_like(ids))[0, :-1]
        out = lm_head.token_logprobs(hidden, lm_head.output_weight(model), ids[0, 1:], 1.0, chunk=chunk)
        return -out.logprobs.mean()

    forward().backward()  # the gradients (and every lazily made buffer) exist before the measured step
    gc.collect()
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    start = time.perf_counter()
    loss = forward()
    held = _rss_kib("VmRSS")  # what the forward keeps for the backward
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _rss_kib("VmHWM")
    result.put(
        {
            "mode": mode,
            "loss": float(loss.detach()),
            "seconds": seconds,
            "held_for_backward_mib": (held - before) / 1024,
            "peak_above_start_mib": (peak - before) / 1024,
        }
    )


def _run(folder: str, mode: str, tokens: int, chunk: int) -> dict:
    # glibc raises its mmap threshold as large blocks are freed, then keeps freed tensors' pages in its
    # heap: resident memory would stop following what is live. A fixed threshold maps every tensor
    # above 64 KiB and unmaps it when freed.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=_case, args=(folder, mode, tokens, chunk, result))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"the {mode} case exited with {proc.exitcode}")
    return result.get(timeout=10)


def main(argv: list[str] | None = None) -> dict:
    """Run both modes and print (and return) the JSON report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="length of the one sequence (default 2048)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512; 8 heads of 64, GQA 2)")
    p.add_argument("--chunk", type=int, default=128, help="LM-head chunk in positions (default 128)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(1, a.hidden // 64)
    shape = dict(
        vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
        max_position_embeddings=max(40960, a.tokens), tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3ForCausalLM(Qwen3Config(**shape)).save_pretrained(tmp)
        cases = {mode: _run(tmp, mode, a.tokens, a.chunk) for mode in ("off", "on")}
    off, on = cases["off"], cases["on"]
    report = {
        "bench": "activation_checkpoint",
        "device": "cpu",
        "model": {k: shape[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")},
        "tokens": a.tokens,
        "lm_head_chunk": a.chunk,
        "cases": cases,
        "same_loss": off["loss"] == on["loss"],
        "held_for_backward_ratio_on_vs_off": on["held_for_backward_mib"] / off["held_for_backward_mib"],
        "peak_ratio_on_vs_off": on["peak_above_start_mib"] / off["peak_above_start_mib"],
        "time_ratio_on_vs_off": on["seconds"] / off["seconds"],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
