"""`sparrow trainer`: run the trainer service (trajectory intake, GRPO + TIS steps, policy publishing).

With `--nproc-per-node N` (or `--nnodes`) it starts its own ranks under torchrun's elastic agent
(services/trainer/launch.py); a process that torchrun started is one rank of them.
"""

from __future__ import annotations

import argparse
import os
import sys

from sparrow_cli.service_cmd import add_common_flags, resolve_service_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sparrow trainer`."""
    p = subparsers.add_parser("trainer", help="train the policy on streamed rollouts and publish it (gRPC, /metrics)")
    p.add_argument("--run-dir", help="store, checkpoints and published policies (run_dir)")
    p.add_argument("--model-dir", help="HF model folder the run starts from (model_dir)")
    p.add_argument("--redis-url", help="Redis holding the prompt stream (redis.url)")
    p.add_argument("--grpc-address", help="host:port of the gRPC server (grpc.address)")
    p.add_argument("--metrics-port", type=int, help="port of /metrics (metrics.port)")
    p.add_argument("--steps", type=int, help="steps to train, 0 for until stopped (steps)")
    ranks = p.add_argument_group("several processes (torchrun's names; ignored in a process torchrun started)")
    ranks.add_argument(
        "--nproc-per-node", type=int, metavar="N", help="processes to start on this node (distributed.procs_per_node)"
    )
    ranks.add_argument("--nnodes", type=int, metavar="N", help="nodes of the job (distributed.nodes)")
    ranks.add_argument("--node-rank", type=int, metavar="I", help="this node's index (distributed.node_rank)")
    ranks.add_argument("--master-addr", metavar="HOST", help="node 0's host name (distributed.master_addr)")
    ranks.add_argument(
        "--master-port", type=int, metavar="PORT", help="node 0's rendezvous port (distributed.master_port)"
    )
    ranks.add_argument(
        "--max-restarts", type=int, metavar="N", help="restarts of this node's processes (distributed.restarts)"
    )
    add_common_flags(p, "services/trainer/trainer.toml")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Resolve the config, then serve (one process or one rank) or start the ranks; the exit status."""
    from services.trainer.config import TrainerServiceConfig
    from sparrow_cli.errors import CliError

    flags = {
        "run_dir": args.run_dir,
        "model_dir": args.model_dir,
        "redis.url": args.redis_url,
        "grpc.address": args.grpc_address,
        "metrics.port": args.metrics_port,
        "steps": args.steps,
        "distributed.procs_per_node": args.nproc_per_node,
        "distributed.nodes": args.nnodes,
        "distributed.node_rank": args.node_rank,
        "distributed.master_addr": args.master_addr,
        "distributed.master_port": args.master_port,
        "distributed.restarts": args.max_restarts,
    }
    config = resolve_service_config(args, TrainerServiceConfig, flags)
    if config is None:
        return 0
    from services.trainer import launch, main

    try:
        return launch.start(config, args.argv)
    except main.SetupError as exc:
        if launch.started_as_rank():
            # A rank: its one line, then out without the interpreter's teardown, where the process group's and the
            # gRPC server's threads, still running, abort the process (SIGABRT, SIGBUS) and hide the exit 2. Its
            # note for the launcher is written; a rank that failed to set up has nothing to save.
            print(f"sparrow trainer: error: {exc}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(launch.SETUP_ERROR)
        raise CliError(str(exc)) from None
