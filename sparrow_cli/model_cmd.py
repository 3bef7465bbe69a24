"""`sparrow model build|eval`: train the project's own Qwen3-architecture policy on the chain task, and measure it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from sparrow_cli.errors import CliError, require_output_folder


def _difficulty(text: str) -> tuple[int, int]:
    try:
        pairs, hops = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"difficulty must be PAIRS:HOPS, got {text!r}") from None
    return pairs, hops


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow model build` and `sparrow model eval`."""
    p = subparsers.add_parser("model", help="build (train) or evaluate the project's own small policy model")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION")
    sub.required = True

    b = sub.add_parser("build", help="train a Qwen3-architecture model from scratch on the chain task")
    b.add_argument(
        "--size",
        required=True,
        choices=["tiny", "small", "long"],
        help="tiny (fast tests), small (policy), long (9K tokens)",
    )
    b.add_argument("--out", required=True, help="output folder (HF format + build.json)")
    b.add_argument("--seed", type=int, default=0, help="seed of weights, data and evaluation (default 0)")
    b.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the size's budget)")
    b.add_argument("--minutes", type=float, default=None, help="wall-clock cap; if it binds, not deterministic")
    b.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda (default cpu)")
    b.add_argument("--eval-samples", type=int, default=None, help="held-out prompts per difficulty after training")
    b.add_argument(
        "--init-from",
        metavar="DIR",
        help="train on from this build's weights (same size), at the curriculum's last stage: a longer build in pieces",
    )
    b.add_argument(
        "--min-hops",
        type=int,
        default=None,
        help="fewest hops of the last stage (default 1): with --init-from, more steps on the longest solutions",
    )
    b.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3; lower to train on)")
    b.add_argument(
        "--head-share",
        type=float,
        default=None,
        help="share of the last stage's batches cut to solution heads of 384 tokens (default 0): the copy of the "
        "query's hop count, once per solution, is then trained many times a step",
    )
    b.add_argument(
        "--fp32",
        action="store_true",
        help="train in float32, not bf16 autocast: on CPU the backward of 8K-token sequences runs about 5x faster",
    )
    b.add_argument("--json", action="store_true", help="print build.json's content as JSON (progress goes to stderr)")
    b.set_defaults(handler=run)

    e = sub.add_parser(
        "eval", help="held-out accuracy: chain difficulties (own models) or a dataset (--data, any model)"
    )
    e.add_argument("--model", required=True, help="an HF-format model folder")
    e.add_argument(
        "--difficulty",
        type=_difficulty,
        action="append",
        help="PAIRS:HOPS of the chain task, repeatable (the project's own models only)",
    )
    e.add_argument(
        "--filler",
        type=int,
        default=None,
        help="countdown tokens per hop of the chain task (default: the one the model was built on, per build.json)",
    )
    e.add_argument("--data", metavar="FILE", help="a JSONL/Parquet dataset (verl's or plain rows): avg@k and pass@k")
    e.add_argument("--k", type=int, default=4, help="samples per prompt with --data (default 4)")
    e.add_argument("--max-new-tokens", type=int, default=512, help="longest response with --data (default 512)")
    e.add_argument("--reward", default="", help="reward of every source with --data (default: by data_source)")
    e.add_argument("--prompt-key", default="prompt", help="prompt column of plain rows (default prompt)")
    e.add_argument("--answer-key", default="answer", help="answer column of plain rows (default answer)")
    e.add_argument("--samples", type=int, default=64, help="held-out prompts per difficulty (default 64)")
    e.add_argument("--seed", type=int, default=0, help="seed of the held-out draw and of sampling (default 0)")
    e.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda (default cpu)")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(handler=run)


def _check_common(args: argparse.Namespace) -> None:
    if args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CliError("--device cuda: no CUDA GPU is visible")


def run(args: argparse.Namespace) -> int:
    """Dispatch to build or eval."""
    _check_common(args)
    return _build(args) if args.model_command == "build" else _eval(args)


def _build(args: argparse.Namespace) -> int:
    from offline.model_build import BuildConfig, BuildError, build, default_steps

    steps = default_steps(args.size) if args.steps is None else args.steps
    if steps < 1:
        raise CliError(f"--steps must be >= 1, got {steps}")
    if args.minutes is not None and args.minutes <= 0:
        raise CliError(f"--minutes must be > 0, got {args.minutes}")
    overrides = {}
    if args.lr is not None:
        if not 0 < args.lr < 1:
            raise CliError(f"--lr must be in (0, 1), got {args.lr}")
        overrides["lr"] = args.lr
    if args.fp32:
        overrides["bf16"] = False
    if args.init_from is not None:
        if not (Path(args.init_from) / "config.json").is_file():
            raise CliError(f"--init-from {args.init_from}: no config.json there (give a folder `model build` wrote)")
        overrides["init_from"] = args.init_from
    cfg = BuildConfig.for_size(args.size, seed=args.seed, steps=steps, minutes=args.minutes, threads=args.threads,
                               device=args.device, **overrides)  # fmt: skip
    if args.min_hops is not None:
        if not 1 <= args.min_hops <= cfg.curriculum.final_hops:
            raise CliError(f"--min-hops must be in [1, {cfg.curriculum.final_hops}], got {args.min_hops}")
        cfg.curriculum = dataclasses.replace(cfg.curriculum, final_min_hops=args.min_hops)
    if args.head_share is not None:
        if not 0 <= args.head_share < 1:
            raise CliError(f"--head-share must be in [0, 1), got {args.head_share}")
        cfg.curriculum = dataclasses.replace(cfg.curriculum, head_share=args.head_share)
    if args.eval_samples is not None:
        if args.eval_samples < 1:
            raise CliError(f"--eval-samples must be >= 1, got {args.eval_samples}")
        cfg.eval_samples = args.eval_samples
    require_output_folder("--out", args.out)
    command = ["sparrow", *sys.argv[1:]] if sys.argv[1:2] == ["model"] else None
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    try:
        info = build(cfg, Path(args.out), command=command, log=log)
    except BuildError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json({"model": args.out, **info})
        return 0
    print(f"saved {args.out} ({info['parameters']} parameters, {info['steps_done']} steps, {info['train_seconds']}s)")
    return 0


def _eval(args: argparse.Namespace) -> int:
    import torch

    if (args.data is None) == (args.difficulty is None):
        raise CliError("give --difficulty PAIRS:HOPS (the chain task) or --data FILE (a dataset), one of them")
    if args.data is not None:
        return _eval_data(args)

    from offline.evaluate import evaluate
    from sparrow.tasks import ChainTask, TaskError
    from trainer.model_io import ModelLoadError, load_model

    if args.samples < 1:
        raise CliError(f"--samples must be >= 1, got {args.samples}")
    torch.set_num_threads(args.threads)
    try:
        filler = built_filler(args.model) if args.filler is None else args.filler
        tasks = [ChainTask(p, h, min_hops=h, filler=filler) for p, h in args.difficulty]
        model = load_model(args.model, device=args.device)
        _require_own_vocabulary(args.model)
    except (TaskError, ModelLoadError) as exc:
        raise CliError(str(exc)) from None
    quiet = args.json
    with torch.no_grad():
        rows = evaluate(model, tasks, samples=args.samples, seed=args.seed, log=(lambda *_: None) if quiet else print)
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json({"model": args.model, "seed": args.seed, "results": rows})
    return 0


def built_filler(model_dir: str) -> int:
    """The chain task's filler the own model in `model_dir` was trained on (build.json), 0 when it says none."""
    import json

    try:
        info = json.loads((Path(model_dir) / "build.json").read_text())
        return int(info["config"]["curriculum"].get("filler", 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def _require_own_vocabulary(model_dir: str) -> None:
    """The chain difficulties are written in the project's word vocabulary; another tokenizer cannot read them."""
    from sparrow.tasks.vocab import VOCAB
    from trainer.model_io import load_tokenizer

    tok = load_tokenizer(model_dir)
    if len(tok) != len(VOCAB) or tok.convert_ids_to_tokens(len(VOCAB) - 1) != VOCAB[-1]:
        raise CliError(
            f"{model_dir} has its own tokenizer ({len(tok)} tokens): --difficulty evaluates the project's own models "
            "on the chain task; evaluate this model on a dataset with --data FILE"
        )


def evaluate_dataset(
    model_dir: str,
    data_file: str,
    k: int,
    max_new_tokens: int,
    reward: str = "",
    samples: int = 64,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    device: str = "cpu",
) -> dict:
    """avg@k and pass@k per source of a model (its own tokenizer and chat template) on a dataset's first
    `samples` prompts, scored by the dataset's rewards in the reward pool; CliError (one line) on bad input."""
    from pathlib import Path

    import torch

    from offline.evaluate_data import evaluate_prompts
    from services.trainer.config import TrainerServiceConfig
    from services.trainer.reward_pool import RewardPool
    from services.trainer.rewarding import reward_input
    from services.trainer.training_data import DataInputError, build_training_data
    from trainer.model_io import ModelLoadError, load_model, load_tokenizer

    if k < 1 or max_new_tokens < 1:
        raise CliError("--k and --max-new-tokens must be at least 1")
    data_file = str(Path(data_file).resolve())
    config = TrainerServiceConfig(
        model_dir=model_dir,
        data={"train_files": [data_file], "eval_files": [data_file], "prompt_key": prompt_key,
              "answer_key": answer_key},
        reward={"name": reward},
    )  # fmt: skip
    try:
        tokenizer = load_tokenizer(model_dir)
        data = build_training_data(config, tokenizer)
        model = load_model(model_dir, device=device)
    except (DataInputError, ModelLoadError) as exc:
        raise CliError(str(exc)) from None
    prompts = data.eval[0].prompts[:samples]
    pool = RewardPool(workers=2, timeout_s=config.reward.timeout_s, timeouts=config.reward.timeouts)

    def score(prompt, texts):
        s = prompt.sample
        reward = data.rewards[s.data_source]
        prompt_as_row = s.prompt if isinstance(s.prompt, str) else list(s.prompt)
        inputs = [reward_input(t, s.ground_truth, s.data_source, s.extras, s.columns, prompt_as_row, {}) for t in texts]
        if pool.signature(reward).batched:  # TRL's and verl's batch form score the prompt's samples in one call
            return [r.score for r in pool.submit_inputs(reward, inputs).result()]
        futures = [pool.submit_inputs(reward, [i]) for i in inputs]
        return [f.result()[0].score for f in futures]

    try:
        with torch.no_grad():
            sources = evaluate_prompts(model, tokenizer, prompts, k, max_new_tokens, data.stop_ids, score, seed)
    finally:
        pool.close()
    return {"model": model_dir, "data": data_file, "k": k, "rewards": data.rewards, "sources": sources}


def _eval_data(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    report = evaluate_dataset(
        args.model, args.data, args.k, args.max_new_tokens, args.reward, args.samples, args.seed,
        args.prompt_key, args.answer_key, args.device,
    )  # fmt: skip
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(report)
    else:
        for src, fig in report["sources"].items():
            figures = " ".join(f"{key} {value:.3f}" for key, value in fig.items() if "@" in key)
            print(f"{src}: {fig['prompts']} prompts x {args.k} samples: {figures}")
    return 0
