"""`sparrow bench ...`: benchmarks that measure ratios in one run and print them (JSON with --json)."""

from __future__ import annotations

import argparse

from sparrow_cli.errors import CliError, require_output_file, require_positive


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow bench` and its benchmarks."""
    p = subparsers.add_parser("bench", help="benchmarks: dense vs sparse, measured in one run")
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    a = sub.add_parser("attention", help="dense vs block-sparse decode attention on this machine")
    a.add_argument("--context", type=int, default=32768, help="KV length of every sequence (default 32768)")
    a.add_argument("--budget", type=int, default=2048, help="sparse KV budget in tokens, a multiple of 16 (2048)")
    a.add_argument("--batch", type=int, default=8, help="sequences decoded together (default 8)")
    a.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    a.add_argument("--q-heads", type=int, default=16, help="query heads, a multiple of --kv-heads (default 16)")
    a.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    a.add_argument("--block-size", type=int, default=16, help="engine KV-cache block size, a multiple of 16 (16)")
    a.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="KV-cache dtype (float32)")
    a.add_argument("--iters", type=int, default=10, help="timed iterations of each side (default 10)")
    a.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for both sides (default 1: reproducible on a shared machine; 0 = torch's choice)",
    )
    a.add_argument(
        "--backend", choices=("auto", "torch", "cpu", "triton"), default="auto", help="sparse kernels to run (auto)"
    )
    a.add_argument(
        "--verify-tokens",
        type=int,
        default=0,
        help="instead: a speculative verify of this many query tokens a row (k + 1), copy + SDPA vs in place",
    )
    a.add_argument("--json", action="store_true", help="print JSON")
    r = sub.add_parser("rollout", help="the generator's vLLM engine: dense then sparse rollouts of the same batch")
    r.add_argument("--model", default="models/long", help="HF model folder (default models/long)")
    r.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per sequence (default 256)")
    r.add_argument("--gen-len", type=int, default=4096, help="generated tokens per sequence (default 4096)")
    r.add_argument("--batch", type=int, default=8, help="sequences generated together (default 8)")
    r.add_argument(
        "--schedule",
        default=None,
        help="schedule: a preset name or a JSON file (default: models/long's calibrated one; needed with --model)",
    )
    r.add_argument("--check-alpha", action="store_true", help="also score the sparse tokens densely: p5 per bin")
    r.add_argument("--compile", action="store_true", help="let vLLM compile the model (default: eager)")
    r.add_argument(
        "--static-decode",
        action="store_true",
        help="CUDA, with --compile: whole steps of pure decodes as full CUDA graphs (default: piecewise)",
    )
    r.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    r.add_argument(
        "--decode",
        choices=("sparse", "speculative"),
        default="sparse",
        help="sparse: dense then sparse (default); speculative: also lossless speculative decoding of the same "
        "prompts, and greedy output compared with dense",
    )
    r.add_argument(
        "--engine",
        choices=("vllm", "reference"),
        default="vllm",
        help="vllm: the generator's engine, random prompts (default); reference, with --decode speculative: the "
        "project's torch engine on the model's chain task",
    )
    r.add_argument("--speculative-tokens", type=int, default=6, help="--decode speculative: drafts per cycle, k (6)")
    r.add_argument("--greedy-check", type=int, default=128, help="--decode speculative: greedy tokens compared (128)")
    r.add_argument(
        "--task",
        action="store_true",
        help="vllm: --batch prompts of the model's chain task (--task-* flags), each response to its EOS, instead of "
        "random prompts generating --gen-len tokens",
    )
    r.add_argument("--prompts", type=int, default=1, help="--engine reference: held-out task prompts (default 1)")
    r.add_argument("--samples", type=int, default=1, help="--engine reference: samples per prompt at T=1 (1)")
    r.add_argument("--task-pairs", type=int, default=64, help="--task or --engine reference: chain task pairs (64)")
    r.add_argument("--task-min-hops", type=int, default=96, help="--task or --engine reference: fewest hops (96)")
    r.add_argument("--task-hops", type=int, default=128, help="--task or --engine reference: most hops (128)")
    r.add_argument("--json", action="store_true", help="print JSON")
    q = sub.add_parser("parity", help="the generator's sparse logprobs vs the trainer's teacher-forced sparse scoring")
    q.add_argument("--model", default="models/small", help="HF model folder (default models/small)")
    q.add_argument("--schedule", default=None, help="schedule (default: small budgets so that selection happens)")
    q.add_argument("--prompts", type=int, default=8, help="sequences (default 8)")
    q.add_argument("--prompt-len", type=int, default=400, help="prompt tokens (default 400)")
    q.add_argument("--gen-len", type=int, default=400, help="generated tokens per sequence (default 400)")
    q.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    q.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="engine workers (default 1; on CPU one per core)"
    )
    q.add_argument("--json", action="store_true", help="print JSON")
    d = sub.add_parser("distill", help="DistillSparse on a small model: p5 per bin before/after training the adapter")
    d.add_argument("--model", default="models/small", help="HF model folder (default models/small)")
    d.add_argument("--budgets", default="64,112,160,224", help="fixed schedule, tokens per bin, all layers sparse")
    d.add_argument("--bin-width", type=int, default=128, help="KV-length bin of the schedule and the report (128)")
    d.add_argument("--pairs", type=int, default=64, help="chain-task pairs per prompt (default 64)")
    d.add_argument("--hops", type=int, default=60, help="hops per query: the generation length (default 60)")
    d.add_argument("--steps", type=int, default=30, help="adapter training steps (default 30)")
    d.add_argument("--groups", type=int, default=4, help="prompts per step (default 4)")
    d.add_argument("--group-size", type=int, default=4, help="samples per prompt, GRPO's group (default 4)")
    d.add_argument("--heldout", type=int, default=16, help="held-out prompts measured before and after (16)")
    d.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    d.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (default 16)")
    d.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA target modules (q,k,v,o proj)")
    d.add_argument("--lr", type=float, default=1e-4, help="adapter learning rate (default 1e-4)")
    d.add_argument("--kl-coef", type=float, default=1.0, help="lambda of the k3 KL term (default 1.0)")
    d.add_argument(
        "--kl-estimator", choices=("k3", "full"), default="k3", help="k3 on sampled tokens (the paper's) or exact"
    )
    d.add_argument(
        "--selection-coef", type=float, default=0.0, help="weight of the selection loss (default 0: the paper's loss)"
    )
    d.add_argument("--epochs", type=int, default=2, help="adapter optimizer steps per batch (default 2)")
    d.add_argument("--seed", type=int, default=0, help="prompts, sampling and adapter initialisation (0)")
    d.add_argument("--plot", default=None, help="write the figure here (PNG)")
    d.add_argument("--out", default=None, help="write the whole report here (JSON)")
    d.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    d.add_argument("--json", action="store_true", help="print JSON")
    t = sub.add_parser(
        "trainer", help="the trainer's LM head at Qwen3's vocabulary: memory and tokens/s, chunked vs full logits"
    )
    t.add_argument(
        "--lengths", default="2048,8192", help="sequence lengths in tokens (2048,8192; the full run adds 16384)"
    )
    t.add_argument("--chunk", type=int, default=1024, help="positions per LM-head chunk (default 1024)")
    t.add_argument("--hidden", type=int, default=128, help="hidden size of the Qwen3-shaped model (default 128)")
    t.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    t.add_argument(
        "--full-limit-gib", type=float, default=6.0, help="skip the full head where its logits need more (6 GiB)"
    )
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    t.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    t.add_argument("--out", default=None, help="also write the JSON to this file")
    t.add_argument("--json", action="store_true", help="print JSON")
    h = sub.add_parser("heldout", help="held-out accuracy of a `sparrow up` run's published policies, step by step")
    h.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="`sparrow up` run folders (a --compare one gives both)"
    )
    h.add_argument(
        "--difficulty", action="append", default=None, help="PAIRS:HOPS of the held-out prompts, repeatable (64:200)"
    )
    h.add_argument("--every", type=int, default=5, help="every N-th published version, and the last (default 5)")
    h.add_argument("--samples", type=int, default=64, help="held-out prompts per difficulty and version (64)")
    h.add_argument("--seed", type=int, default=0, help="seed of the held-out draw and of sampling (0)")
    h.add_argument("--plot", default=None, help="write the figure here (PNG)")
    h.add_argument("--out", default=None, help="write the whole result here (JSON)")
    h.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    h.add_argument("--data", metavar="FILE", help="a dataset instead of the chain task (any model): pass@k per version")
    h.add_argument("--k", type=int, default=4, help="samples per prompt with --data (default 4)")
    h.add_argument("--max-new-tokens", type=int, default=512, help="longest response with --data (default 512)")
    h.add_argument("--json", action="store_true", help="print JSON")
    s = sub.add_parser(
        "trainer-streams", help="many generators' streams and watches held open on one trainer: health, acks"
    )
    s.add_argument("--generators", type=int, default=512, help="generators, each a stream and a watch (512)")
    s.add_argument("--trajectories", type=int, default=4, help="trajectories each generator sends (4)")
    s.add_argument("--channels", type=int, default=16, help="client connections the generators share (16)")
    s.add_argument("--hold", type=float, default=5.0, help="seconds every call stays open and idle (5)")
    s.add_argument("--max-calls", type=int, default=None, help="the server's grpc.max_calls (2 x generators + 64)")
    s.add_argument("--json", action="store_true", help="print JSON (the figures are JSON either way)")
    from sparrow_cli.bench_sandbox_cmd import add_sandbox_parser

    add_sandbox_parser(sub)
    from sparrow_cli.bench_weights_cmd import add_parser as add_weights

    add_weights(sub)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark and print its figures."""
    if args.bench == "attention":
        return _attention(args)
    if args.bench in ("rollout", "parity"):
        from sparrow_cli.bench_engine_cmd import run_engine_bench

        return run_engine_bench(args)
    if args.bench == "distill":
        from sparrow_cli.bench_distill_cmd import run_distill

        return run_distill(args)
    if args.bench == "heldout":
        return _heldout(args)
    if args.bench == "trainer-streams":
        return _trainer_streams(args)
    if args.bench == "sandbox":
        from sparrow_cli.bench_sandbox_cmd import run_sandbox_bench

        return run_sandbox_bench(args)
    if args.bench == "trainer":
        return _trainer(args)
    if args.bench == "weights":
        from sparrow_cli.bench_weights_cmd import run_weights

        return run_weights(args)
    raise CliError(f"unknown benchmark {args.bench!r}")


def _trainer_streams(args: argparse.Namespace) -> int:
    import json

    from bench.trainer_streams import run as run_streams

    require_positive(args, "generators", "trajectories", "channels")
    if args.hold < 0:
        raise CliError("--hold must be >= 0")
    if args.max_calls is not None and args.max_calls < 1:
        raise CliError("--max-calls must be >= 1")
    result = run_streams(args.generators, args.trajectories, args.channels, args.hold, max_calls=args.max_calls)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0 if result["goal_met"] else 1


def _trainer(args: argparse.Namespace) -> int:
    import json
    import sys
    from pathlib import Path

    from bench.trainer import Shape, run_trainer_bench

    require_positive(args, "chunk", "hidden", "layers", "threads")
    require_output_file("--out", args.out)
    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        raise CliError(f"--lengths: comma-separated token counts, got {args.lengths!r}") from None
    if not lengths or min(lengths) <= 256:
        raise CliError(f"--lengths: every length must be above 256 tokens (the warm-up's), got {args.lengths!r}")
    if args.hidden % 64:
        raise CliError(f"--hidden must be a multiple of 64 (heads of 64), got {args.hidden}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CliError("--device cuda: no CUDA device is visible")
    shape = Shape(hidden=args.hidden, layers=args.layers, heads=args.hidden // 64, kv_heads=max(1, args.hidden // 128),
                  intermediate=3 * args.hidden)  # fmt: skip
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    result = run_trainer_bench(lengths, args.chunk, shape, args.threads, args.device, args.full_limit_gib, log=say)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    for row in result["rows"]:
        c = row["chunked"]
        line = (
            f"{row['op']:6} {row['tokens']:6} tokens: chunked {c['tokens_per_s']:8.0f} tok/s, head extra "
            f"{c['head_extra_gib']:.2f} GiB ({row['chunked_extra_over_three_chunk_tensors']:.2f} of 3 chunks)"
        )
        if "full" in row:
            f = row["full"]
            line += f"; full {f['tokens_per_s']:8.0f} tok/s, head extra {f['head_extra_gib']:.2f} GiB"
            line += f"; time chunked/full {row['chunked_time_over_full']:.2f}"
        else:
            line += f"; full head skipped (about {row['full_logits_estimate_gib']:.0f} GiB of logits)"
        print(line)
    print(f"goals: {result['goals']}")
    return 0


def _heldout(args: argparse.Namespace) -> int:
    import json
    import sys
    from pathlib import Path

    from bench.heldout import HeldoutError, heldout_curve, plot
    from sparrow.tasks import TaskError
    from sparrow_cli.model_cmd import _difficulty
    from trainer.model_io import ModelLoadError

    require_positive(args, "every", "samples", "threads")
    require_output_file("--out", args.out)
    require_output_file("--plot", args.plot)
    try:
        difficulties = [_difficulty(d) for d in (args.difficulty or ["64:200"])]
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"--difficulty: {exc}") from None
    import torch

    torch.set_num_threads(args.threads)
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    if args.data is not None:
        result = _heldout_data(args, say)
        print(json.dumps(result) if args.json else "\n".join(
            f"{name}: {run['change']}" for name, run in result["runs"].items()))  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    _refuse_other_vocabularies(args.run_dirs)
    try:
        result = heldout_curve(
            [Path(d) for d in args.run_dirs], difficulties, args.every, args.samples, args.seed, log=say
        )
    except (HeldoutError, TaskError, ModelLoadError) as exc:
        raise CliError(str(exc)) from None
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for name, run in result["runs"].items():
            print(f"{name}: change in held-out accuracy over the run: {run['change']}")
    return 0


def _refuse_other_vocabularies(run_dirs: list[str]) -> None:
    """The chain task is written in the project's vocabulary: a run of another model needs --data."""
    from pathlib import Path

    from bench.heldout import HeldoutError, policy_versions, runs_in
    from sparrow_cli.model_cmd import _require_own_vocabulary

    for folder in run_dirs:
        try:
            for path in runs_in(Path(folder)).values():
                versions = policy_versions(path)
                _require_own_vocabulary(str(versions[min(versions)]))
        except HeldoutError:
            continue  # heldout_curve reports it in its own words


def _heldout_data(args: argparse.Namespace, say) -> dict:
    """pass@k and avg@k per source of every N-th published version of each run, on a dataset."""
    from pathlib import Path

    from bench.heldout import HeldoutError, pick, policy_versions, runs_in
    from sparrow_cli.model_cmd import evaluate_dataset

    out: dict = {"data": args.data, "k": args.k, "samples": args.samples, "runs": {}}
    for folder in args.run_dirs:
        try:
            runs = runs_in(Path(folder))
        except HeldoutError as exc:
            raise CliError(str(exc)) from None
        for name, path in runs.items():
            try:
                versions = policy_versions(path)
            except HeldoutError as exc:
                raise CliError(str(exc)) from None
            points = []
            for v in pick(list(versions), args.every):
                r = evaluate_dataset(str(versions[v]), args.data, args.k, args.max_new_tokens, samples=args.samples,
                                     seed=args.seed)  # fmt: skip
                points.append({"version": v, "after_step": v - 1, "sources": r["sources"]})
                say(f"{name} v{v}: " + ", ".join(f"{s} pass@{args.k} {f.get(f'pass@{args.k}', 0):.3f}"
                                              for s, f in r["sources"].items()))  # fmt: skip
            first, last = points[0]["sources"], points[-1]["sources"]
            change = {s: round(last[s][f"pass@{args.k}"] - first[s][f"pass@{args.k}"], 4) for s in first if s in last}
            out["runs"][name] = {"path": str(path), "points": points, "change": change}
    return out


def _verify(args: argparse.Namespace) -> int:
    import torch

    from bench.verify_attention import run_verify_bench
    from kernels.cpu import cpu_extension

    if cpu_extension() is None:
        raise CliError("--verify-tokens measures the CPU extension, which could not be built here")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        r = run_verify_bench(args.context, args.batch, args.verify_tokens, args.kv_heads, args.q_heads, args.head_dim,
                             args.iters)  # fmt: skip
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(r.to_dict())
        return 0
    print(
        f"verify attention, {r.batch} rows x {r.query_tokens} query tokens over {r.context} cached tokens, "
        f"{r.kv_heads} KV / {r.q_heads} query heads, head dim {r.head_dim}, {r.threads} threads"
    )
    print(f"  copy + SDPA {r.copy_sdpa_ms:9.2f} ms")
    print(f"  in place    {r.in_place_ms:9.2f} ms   {r.speedup:.2f}x   (max abs diff {r.max_abs_diff:.1e})")
    return 0


def _attention(args: argparse.Namespace) -> int:
    require_positive(args, "context", "budget", "batch", "kv_heads", "q_heads", "head_dim", "block_size", "iters")
    import torch

    if args.verify_tokens:
        return _verify(args)

    from bench.attention import run_attention_bench

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        result = run_attention_bench(
            context=args.context,
            budget=args.budget,
            batch=args.batch,
            kv_heads=args.kv_heads,
            q_heads=args.q_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            dtype=getattr(torch, args.dtype),
            iters=args.iters,
            backend=args.backend,
        )
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    if args.json:
        from sparrow_cli.output import emit_json

        emit_json(result.to_dict())
        return 0
    r = result
    print(
        f"decode attention, {r.batch} x {r.context} tokens, {r.kv_heads} KV / {r.q_heads} query heads, "
        f"head dim {r.head_dim}, {r.dtype}, {r.threads} threads, sparse backend {r.backend}"
    )
    print(
        f"  dense  {r.dense_ms:9.2f} ms   (reads {r.kv_bytes_dense / 2**20:,.0f} MiB of KV; the faster of SDPA on a "
        f"contiguous copy {r.dense_sdpa_ms:.1f} ms and the paged kernel {r.dense_paged_ms:.1f} ms)"
    )
    print(
        f"  sparse {r.sparse_ms:9.2f} ms   (budget {r.budget} tokens; reads {r.kv_bytes_sparse / 2**20:,.0f} MiB "
        "of KV and centroids)"
    )
    print(f"  speedup {r.speedup:.2f}x of a {r.bound:.2f}x KV-bytes bound ({r.fraction_of_bound:.0%} of it)")
    print(f"  full-budget sparse and paged dense vs SDPA: max abs diff {r.max_abs_diff_full_budget:.2e}")
    return 0
