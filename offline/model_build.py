"""`sparrow model build`: train a small Qwen3-architecture causal LM from scratch on the chain task.

Deterministic for a given seed, thread count and device when the step budget (not the minutes cap)
ends training. Saves HF format (model.safetensors, config.json, generation_config.json, tokenizer
files) and build.json with the command, seed, steps, time and the held-out accuracy measured.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from offline.curriculum import Curriculum, CurriculumConfig
from sparrow.tasks.chain import LONG_FILLER, LONG_HOPS

SIZES: dict[str, dict] = {
    # for fast tests: builds in minutes; it learns short lookups only
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    # the delivered policy: tiny's shape, which formed lookup in 214 steps; hidden 192 (6 heads of 32)
    # needed 1246 steps and then stalled at 5 pairs (trainer/EXPERIMENTS.md). >= 4 layers so that
    # sparse decode (layers >= 2) matters; a longer curriculum than tiny's.
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    # the long-context policy: small's width (it forms lookup fastest), 8 layers so that sparse decode
    # (layers >= 2) covers most of the attention, positions and a RoPE base for the long task's 9K tokens
    "long": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=16384, rope_theta=1e6),
}  # fmt: skip


@dataclass
class BuildConfig:
    """Everything that decides a build's result."""

    size: str = "small"
    seed: int = 0
    steps: int = 3000
    minutes: float | None = None
    """wall-clock cap; if it ends training first the build is no longer deterministic"""
    threads: int = 1
    device: str = "cpu"
    lr: float = 2e-3
    warmup: int = 50
    decay_fraction: float = 0.15
    """final share of the steps over which the learning rate decays to 10% (cosine)"""
    bf16: bool = True
    lookup_weight: float = 0.0
    """extra loss on the looked-up names, mean over them: the long task's countdown is most of its tokens,
    and a plain mean leaves the few decisions too little gradient for lookup to form"""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    eval_difficulties: tuple[tuple[int, int], ...] | None = None
    """(pairs, hops) to measure after training; None: the last stage reached, at 1/4, 1/2 and all of its hops"""
    eval_samples: int = 64
    init_from: str | None = None
    """a build of the same size to train on from its weights, at the curriculum's last stage (a longer build
    in pieces: its lookup exists, so the stages that form it are skipped)"""

    @classmethod
    def for_size(cls, size: str, **overrides) -> BuildConfig:
        """The tuned defaults of a size (tiny stops at short contexts and evaluates briefly)."""
        if size == "tiny":
            overrides.setdefault("curriculum", CurriculumConfig(final_pairs=16, final_hops=16, batch_tokens=2048))
            overrides.setdefault("eval_samples", 16)
        if size == "long":
            overrides.setdefault(
                "curriculum",
                CurriculumConfig(final_hops=LONG_HOPS, filler=LONG_FILLER, batch_tokens=4096),
            )
            overrides.setdefault("eval_difficulties", ((64, 64), (64, 128), (64, LONG_HOPS)))
            overrides.setdefault("eval_samples", 32)
            overrides.setdefault("lookup_weight", 1.0)
        overrides.setdefault("curriculum", CurriculumConfig(batch_tokens=2048))
        return cls(size=size, **overrides)


# the step budget of each size: tiny in a few minutes on one CPU thread, small in about half an hour
DEFAULT_STEPS = {"tiny": 400, "small": 2200, "long": 2400}


def default_steps(size: str) -> int:
    """The optimizer steps a build of `size` takes unless told otherwise."""
    return DEFAULT_STEPS[size]


def qwen3_config(size: str):
    """The Qwen3Config of a size, over the task vocabulary."""
    from transformers import Qwen3Config

    from offline.tokenizer import vocab_size
    from sparrow.tasks.vocab import BOS, EOS, PAD, TOKEN_TO_ID

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    shape = {"max_position_embeddings": 4096, "rope_theta": 10000.0, **SIZES[size]}
    return Qwen3Config(
        vocab_size=vocab_size(),
        attention_bias=True,  # helped lookup form (DESIGN.md section 3)
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=TOKEN_TO_ID[BOS],
        eos_token_id=TOKEN_TO_ID[EOS],
        pad_token_id=TOKEN_TO_ID[PAD],
        **shape,
    )


class BuildError(ValueError):
    """A build that cannot start (one line for the command)."""


def check_same_shape(found, wanted, folder: str) -> None:
    """A continued build trains the weights of its own size: same layers, widths, positions and vocabulary."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "vocab_size")  # fmt: skip
    differ = [f"{k} {getattr(found, k, None)} != {getattr(wanted, k)}" for k in keys
              if getattr(found, k, None) != getattr(wanted, k)]  # fmt: skip
    if differ:
        raise BuildError(f"{folder} is not a build of this size: {', '.join(differ)}")


def _lr_factor(cfg: BuildConfig, progress: float, step: int) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    start = 1.0 - cfg.decay_fraction
    if progress <= start:
        return 1.0
    t = min(1.0, (progress - start) / cfg.decay_fraction)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def train(cfg: BuildConfig, log=print):
    """Train a model by `cfg`; returns (model, summary dict)."""
    import torch
    from tqdm import tqdm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(cfg.device)
    if cfg.init_from:
        check_same_shape(Qwen3Config.from_pretrained(cfg.init_from), qwen3_config(cfg.size), cfg.init_from)
        model = Qwen3ForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32).to(device)
    else:
        model = Qwen3ForCausalLM(qwen3_config(cfg.size)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    cur = Curriculum(cfg.curriculum, cfg.seed, start_at_last=cfg.init_from is not None)
    amp_dtype = torch.bfloat16 if cfg.bf16 else None
    t0 = time.monotonic()
    stopped_by = "steps"
    bar = tqdm(range(cfg.steps), desc=f"build {cfg.size}", unit="step", dynamic_ncols=True)
    step = 0
    for step in bar:
        elapsed = time.monotonic() - t0
        progress = step / cfg.steps
        if cfg.minutes:
            if elapsed >= cfg.minutes * 60:
                stopped_by = "minutes"
                break
            progress = max(progress, elapsed / (cfg.minutes * 60))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * _lr_factor(cfg, progress, step)
        batch = cur.next_batch()
        ids = batch.input_ids.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(input_ids=ids).logits
        logits = logits[:, :-1].float()
        targets = ids[:, 1:]
        mask = batch.loss_mask[:, 1:].to(device)
        loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        lk = batch.lookup_mask[:, 1:].to(device)
        if cfg.lookup_weight:
            loss = loss + cfg.lookup_weight * torch.nn.functional.cross_entropy(logits[lk], targets[lk])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            acc = (logits[lk].argmax(-1) == targets[lk]).float().mean().item()
        if cur.update(step, batch, acc):
            log(f"step {step}: stage {cur.stage} -> {cur.tasks[cur.stage].name} ({time.monotonic() - t0:.0f}s)")
        bar.set_postfix(loss=f"{loss.item():.3f}", lookup=f"{cur.ema:.3f}", stage=cur.tasks[cur.stage].name)
    else:
        step = cfg.steps
    bar.close()
    summary = {
        "parameters": n_params,
        "steps_done": step,
        "stopped_by": stopped_by,
        "train_seconds": round(time.monotonic() - t0, 1),
        "final_stage": cur.tasks[cur.stage].name,
        "final_stage_difficulty": [cur.tasks[cur.stage].pairs, cur.tasks[cur.stage].max_hops],
        "final_stage_lookup_ema": round(cur.ema, 4),
        "stages": cur.history,
    }
    return model, summary


def _parent(folder: str | None) -> dict:
    """What a continued build started from: the parent build's record, without its own parents' detail."""
    if not folder:
        return {}
    try:
        parent = json.loads((Path(folder) / "build.json").read_text())
    except (OSError, ValueError):
        return {"init_from_build": None}
    keep = ("command", "parameters", "steps_done", "train_seconds", "final_stage", "heldout", "init_from_build")
    return {"init_from_build": {k: parent[k] for k in keep if k in parent}}


def build(cfg: BuildConfig, out_dir: str | Path, command: list[str] | None = None, log=print) -> dict:
    """Train, evaluate on held-out tasks, and save everything to `out_dir`; returns build.json's content."""
    import torch
    from transformers import GenerationConfig

    from offline.evaluate import evaluate
    from offline.tokenizer import save_tokenizer
    from sparrow.tasks import ChainTask

    out = Path(out_dir)
    model, summary = train(cfg, log=log)
    model.eval()
    # saved before the evaluation, so a slow or interrupted evaluation never loses the weights
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=model.config.max_position_embeddings // 2,
    )
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    difficulties = cfg.eval_difficulties
    if difficulties is None:
        pairs, hops = summary["final_stage_difficulty"]
        difficulties = tuple((pairs, h) for h in sorted({max(1, hops // 4), max(1, hops // 2), hops}))
    tasks = [ChainTask(p, h, min_hops=h, filler=cfg.curriculum.filler) for p, h in difficulties]
    t_eval = time.monotonic()
    with torch.no_grad():
        results = evaluate(model, tasks, samples=cfg.eval_samples, seed=cfg.seed, log=log)
    info = {
        "command": command,
        "config": asdict(cfg),
        **summary,
        **_parent(cfg.init_from),
        "eval_seconds": round(time.monotonic() - t_eval, 1),
        "heldout": results,
        "torch_version": torch.__version__,
    }
    (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
