"""Three training steps on fixed data, on one process or as one rank of several (run by torchrun).

Every rank samples the same rollouts from the tiny model (same seed, before any sharding), then
runs `trainer.rl_update.learn` on fixed groups and advantages, fp32. Under torchrun the model is
sharded by FSDP2 over gloo. Rank 0 writes the figures of each step and the full parameters
(gathered) to OUT. `worker OUT [FIRST LAST [CKPT_OUT] [CKPT_IN]]` runs steps FIRST..LAST - 1 only,
resuming model and optimizer from the DCP checkpoint CKPT_IN and saving one to CKPT_OUT after
(services/trainer/checkpoint.py, the trainer's own), so a run can stop under one world size and
continue under another.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from sparrow.acceptance import binned_stats
from sparrow.tasks import ChainTask, ExampleStream, encode_words
from sparrow.tasks.vocab import BOS, EOS, TOKEN_TO_ID
from trainer import distributed
from trainer.batch import Rollout
from trainer.model_io import load_model
from trainer.reference_generate import generate
from trainer.rl_update import UpdateConfig, learn
from trainer.scoring import Scorer

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny"
N = 4
TEMP = 2.0


def rollouts(model) -> list[Rollout]:
    examples = ExampleStream(ChainTask(4, 2), seed=3).take(3)
    prompts = [[TOKEN_TO_ID[BOS], *encode_words(ex.prompt)] for ex in examples for _ in range(N)]
    gens = generate(model, prompts, None, max_new_tokens=12, seed=1, eos_id=TOKEN_TO_ID[EOS], temperature=TEMP)
    return [
        Rollout(
            f"g{i // N}",
            i % N,
            tuple(p),
            tuple(g.tokens),
            tuple(g.scores.logprobs.tolist()),
            tuple(map(tuple, g.scores.top_ids.tolist())),
            tuple(map(tuple, g.scores.top_logprobs.tolist())),
        )  # fmt: skip
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]


def main(out: str, first: int = 0, last: int = 3, ckpt_out: str = "", ckpt_in: str = "") -> None:
    from services.trainer.checkpoint import CheckpointManager, TrainState

    torch.set_num_threads(1)
    model = load_model(TINY)
    batch = rollouts(model)  # before sharding: the same on every rank
    if distributed.launched_by_torchrun():
        distributed.init_from_env("cpu", timeout_s=120)
        distributed.shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if ckpt_in:
        resumed = CheckpointManager(Path(ckpt_in), 1).load_latest(model, optimizer)
        assert resumed is not None and resumed.step == first, resumed
    # micro-batches of 2 rows: ranks run unequal numbers of them on the 9-row batches (5 vs 4)
    config = UpdateConfig(temperature=TEMP, micro_batch_size=2, lm_head_chunk=8)
    scorer = Scorer(model, chunk=8)
    steps = []
    advantages = torch.linspace(-1.0, 1.0, len(batch))
    for step, rows in enumerate((range(0, 8), range(4, 12), range(0, 9))):
        if not first <= step < last:
            continue
        picked = [batch[i] for i in rows]
        _, acc, stats = learn(model, optimizer, scorer, picked, advantages[list(rows)], config)
        bins = binned_stats(acc.alpha, acc.kv_lens, 8, 0.05, 8)
        steps.append(
            {
                "step": step,
                "loss": stats["loss"],
                "tokens": stats["tokens"],
                "alpha_mean": float(acc.alpha.double().mean()),
                "p5": {b.index: b.quantile for b in bins},
                "grad_norm": stats["grad_norm"],
            }
        )
    if ckpt_out:
        CheckpointManager(Path(ckpt_out), 1).save(model, optimizer, TrainState(run_id="dist-test", step=last))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if distributed.rank() == 0:
        Path(out).write_text(json.dumps({"world_size": distributed.world_size(), "steps": steps}))
        torch.save({k: v.detach().clone() for k, v in state.items()}, out + ".pt")
    if distributed.active():
        torch.distributed.barrier()  # every rank done before any leaves (see publish_worker.py)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], *(int(a) for a in args[1:3]), *args[3:5])
