"""The trainer service assembled: model, store, ledger, feeder, servers, and the step loop.

Start: load the model, resume the newest checkpoint (or start fresh), make sure the policy the run
continues from is published under a version above every one published before (steps published
after the checkpoint died with the crash), rebuild the store and ledger, start gRPC and /metrics.
Loop: feed, wait for a batch, train, publish the next version, checkpoint when due (`checkpoint.every`
steps, or paced by the time checkpoints take), then compact the store and ledger down to what the
oldest kept checkpoint has not trained.
Stop (the steps are done, or `stop` is set by SIGTERM): checkpoint, end the watch streams, stop
the server gracefully.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.common.aio_server import AioServer
from services.trainer.checkpoint import CheckpointManager, CheckpointPacing, TrainState
from services.trainer.config import TrainerServiceConfig
from services.trainer.ledger import TRAINED, GroupLedger
from services.trainer.metrics import TrainerMetrics
from services.trainer.policy_sources import SourcePlanner
from services.trainer.policy_sync import PolicySyncStore, publish_policy
from services.trainer.ranks import CHECKPOINT, PUBLISH, STOP
from services.trainer.store import TrajectoryStore, replace_text
from services.trainer.validate import Limits
from services.trainer.weights import POLICY, WeightStore, save_hf_policy
from sparrow import metrics_contract as mc
from sparrow.timing import PhaseTimer
from sparrow.weight_delta import checkpoint_dtype

if TYPE_CHECKING:
    from services.api.sparrow.v1 import rollout_pb2
    from services.trainer.ledger import GroupRecord

log = logging.getLogger("sparrow.trainer")

RUN_FILE = "run.json"
ENDPOINTS_FILE = "endpoints.json"
STEPS_FILE = "steps.jsonl"
WAIT_LOG_S = 30.0  # a step that waits longer says what for, in the log, every this many seconds


class RunDirError(RuntimeError):
    """A file of the run dir that the start needs does not read back; one line naming it."""


class TrainerService:
    """One trainer process; `run` serves and trains until done or stopped."""

    def __init__(self, config: TrainerServiceConfig) -> None:
        from services.trainer.feeder import Feeder, FeedSettings
        from services.trainer.http_reward import HttpRewards, is_http_reward
        from services.trainer.ranks import (
            Leader,
            apply_optim_settings,
            build_distill,
            build_exact_alpha,
            build_policy,
            update_config,
        )
        from services.trainer.reward_pool import RewardPool
        from services.trainer.rewarding import RewardScorer
        from services.trainer.step import StepRunner
        from services.trainer.training_data import build_training_data
        from sparrow.work import Sampling
        from trainer import distributed
        from trainer.model_io import load_tokenizer

        self.config = config
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(config.threads)
        self.metrics = TrainerMetrics(config.metrics.bin_width, config.metrics.num_bins)
        self.compute_dtype = getattr(torch, config.dtype)
        # Under torchrun this is rank 0: it serves, and orders the other ranks (services/trainer/ranks.py).
        self.leader = Leader(config.distributed.timeout_s)
        self.metrics.world_size.set(distributed.world_size())
        self.model, self.optimizer = build_policy(config)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.data = build_training_data(config, self.tokenizer)
        s = config.sampling
        self.rule = self._step_rule() if config.distill.enabled or config.alpha == "exact" else None
        self.distill = None
        if config.distill.enabled:
            self.distill = build_distill(config, self.model, self.metrics.registry, self.rule)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.checkpoint.keep)
        self.checkpoints.remove_unfinished()
        resumed = self.checkpoints.load_latest(self.model, self.optimizer, self._checkpoint_parts())
        apply_optim_settings(self.config, self.optimizer)  # the config's settings win over the checkpoint's
        self.state = resumed or TrainState(run_id=self._run_id())
        self.weights = WeightStore(self.run_dir, config.weights.keep)
        self.sync = PolicySyncStore(self.run_dir, config.weights.deltas)
        w = config.weights
        self.serving_dtype = checkpoint_dtype(config.model_dir) if w.dtype == "auto" else w.dtype
        self.planner = SourcePlanner(w.trainer_fanout, w.peer_fanout, keep=w.keep + 1)
        self._publish_start()
        if self.distill is not None:
            self.distill.publish_start(self.weights, self.state.policy_version, self.state.step)
        self.store = TrajectoryStore(self.run_dir)
        self.ledger = GroupLedger(self.run_dir, finished=self.state.finished)
        r = config.reward
        self.reward_pool = RewardPool(
            r.workers,
            r.timeout_s,
            self.metrics.reward_errors,
            r.timeouts,
            preload=tuple(sorted(n for n in set(self.data.rewards.values()) if not is_http_reward(n))),
        )
        self.http_rewards = None
        if any(is_http_reward(n) for n in self.data.rewards.values()):
            self.http_rewards = HttpRewards(r.http, self.reward_pool)
        self.rewards = RewardScorer(self.reward_pool, self.tokenizer, self.ledger, r.options, self.http_rewards)
        self.sampling = Sampling(s.temperature, s.top_p, s.max_new_tokens, s.top_logprobs, self.data.stop_ids)
        self.feeder = Feeder(
            self._redis(),
            self.ledger,
            self.store,
            FeedSettings(
                run_id=self.state.run_id,
                data=self.data,
                seed=config.data.seed,
                n=s.n,
                sampling=self.sampling,
                outstanding=config.outstanding_groups,
                requeue_after_s=config.requeue_after_s,
                shuffle=config.data.shuffle,
            ),
            lambda: self.state.policy_version,
            self.metrics,
        )
        self.feeder.restore(self.state.feeder)
        from services.trainer.evaluation import Evaluator

        self.evaluator = Evaluator(
            config.eval, self.data, self.state.run_id, self.feeder, self.ledger, self.store, self.rewards,
            self.metrics, self.run_dir, self.sampling,
        )  # fmt: skip
        self.runner = StepRunner(
            self.model,
            self.optimizer,
            self.rewards,
            self.store,
            self.ledger,
            self.metrics,
            update_config(config),
            config.groups_per_step,
            config.max_staleness,
            self.distill,
            self.data.stop_ids,
            build_exact_alpha(config, self.model, self.rule, self.distill) if config.alpha == "exact" else None,
            self.leader,
            self.rule,
        )
        self.metrics.policy_version.set(self.state.policy_version)
        self._server = self._http = None
        self.generators_seen: set[str] = set()  # added to by the gRPC thread, read by the step loop
        self.grpc_port = self.metrics_port = 0
        self._last_checkpoint_step = self.state.step if resumed else -1
        ck = config.checkpoint
        self.pacing = CheckpointPacing(ck.every, ck.max_overhead, ck.max_interval_s)
        self._checkpoint_on_stop = True
        self.phases = PhaseTimer(mc.TRAINER_PHASES)  # made anew by `run`, in the thread that trains

    def _step_rule(self):
        from services.trainer.distill_step import StepRule, fallback_rule, read_block_rule

        fallback = fallback_rule(self.config.distill)
        # The generators' schedule lives in Redis; the feeder's client exists once __init__ is through.
        return StepRule(lambda: read_block_rule(self.feeder.client, fallback))

    def _checkpoint_parts(self) -> dict:
        from services.trainer.distill_step import CHECKPOINT_PART

        return {CHECKPOINT_PART: self.distill} if self.distill is not None else {}

    def _run_id(self) -> str:
        from services.trainer.feeder import new_run_id

        path = self.run_dir / RUN_FILE
        if path.is_file():
            try:
                return str(json.loads(path.read_text())["run_id"])
            except (ValueError, KeyError, TypeError) as exc:
                raise RunDirError(
                    f"{path}: unreadable ({type(exc).__name__}: {exc}); it holds the run id its group ids carry"
                ) from None
        run_id = new_run_id()
        replace_text(path, json.dumps({"run_id": run_id}) + "\n")  # a torn one would stop every later start
        return run_id

    def _redis(self):
        import redis

        return redis.Redis.from_url(self.config.redis.url, socket_timeout=5, socket_connect_timeout=5)

    def _publish_start(self) -> None:
        latest = self.weights.latest(POLICY)
        if latest and latest == self.state.policy_version:
            return
        # Fresh run: the starting model is version 1 (0 means "latest" on the wire). After a crash that
        # outlived its checkpoint, the checkpoint's policy goes out under a version above every published one.
        version = max(latest + 1, self.state.policy_version, 1)
        if latest > self.state.policy_version:
            log.warning("versions up to %d were published after the checkpoint; continuing as %d", latest, version)
        self.publish(version)

    def publish(self, version: int) -> None:
        """Publish the current policy as `version`: every rank gathers each tensor in turn, this one writes it."""
        dtype, shard_bytes = self.serving_dtype, self.config.weights.max_shard_bytes
        self.leader.order(PUBLISH, (dtype, shard_bytes))  # the other ranks walk the same layout
        publish_policy(
            self.weights,
            self.sync,
            version,
            lambda out: save_hf_policy(self.model, out, self.config.model_dir, dtype, shard_bytes),
            dtype,
        )
        self.state.policy_version = version
        self.metrics.policy_version.set(version)

    # -- serving ----------------------------------------------------------------------------------

    def start_servers(self) -> None:
        """gRPC (RolloutService, WeightService, health, reflection) and /metrics."""
        c = self.config
        limits = Limits(self.model.config.vocab_size, c.sampling.top_logprobs, c.logprob_tolerance)
        self._server = build_grpc_server(
            c,
            self.store,
            self.ledger,
            self.weights,
            limits,
            self.metrics,
            self.rewards.on_trajectory,
            sync=self.sync,
            planner=self.planner,
            on_hello=self.generators_seen.add,
        )
        self.grpc_port = self._server.bind(c.grpc.address)
        self._server.start()
        self._http, self.metrics_port = self.metrics.serve(c.metrics.host, c.metrics.port)
        host = c.grpc.address.rsplit(":", 1)[0]
        endpoints = {"grpc": f"{host}:{self.grpc_port}", "metrics": f"{c.metrics.host}:{self.metrics_port}"}
        (self.run_dir / ENDPOINTS_FILE).write_text(json.dumps(endpoints) + "\n")
        log.info("serving gRPC on %s, /metrics on %s", endpoints["grpc"], endpoints["metrics"])

    def run(self, stop: threading.Event) -> TrainState:
        """Serve and train until `config.steps` are done or `stop` is set; checkpoint and stop cleanly."""
        self.start_servers()
        # Step 1's time runs from here; each later step's from the end of the one before (`train`).
        self.phases = PhaseTimer(mc.TRAINER_PHASES)
        try:
            if self.state.step == 0:
                with self.phases.phase("wait_groups"):
                    self._wait_for_generators(stop)
            if self.state.step == 0 and self.evaluator.due(0, self.config.steps):
                self.feeder.tick()  # the consumer group exists before the first round goes on the stream
                self.evaluator.start(0, self.state.policy_version)
            waiting_since = last_told = time.monotonic()
            while not stop.is_set() and not self._done():
                self.feeder.tick()
                self.evaluator.poll()
                batch, stale = self.runner.collect(self.state.policy_version)
                self.state.dropped += stale
                if batch is None:
                    if time.monotonic() - last_told >= WAIT_LOG_S:
                        last_told = time.monotonic()
                        log.info("%s (for %.0f s)", self.waiting_for(), last_told - waiting_since)
                    with self.phases.phase("wait_groups"):
                        self.store.wait(self.config.poll_s)
                    continue
                self.train(batch)
                waiting_since = last_told = time.monotonic()
            # The last rounds report before the trainer stops (each bounded by eval.timeout_s).
            while self.evaluator.pending and not stop.is_set():
                self.feeder.tick()
                self.evaluator.poll()
                self.store.wait(self.config.poll_s)
        except BaseException:
            # The model may be part-way through an update: the last checkpoint is the state to resume.
            self._checkpoint_on_stop = False
            raise
        finally:
            self.shutdown()
        return self.state

    def _wait_for_generators(self, stop: threading.Event) -> None:
        """Hold a fresh run's first prompts until `wait_for_generators` generators have connected (or the
        deadline): the first to come up would otherwise take them all and the first steps' throughput
        would be one generator's."""
        want, limit = self.config.wait_for_generators, self.config.wait_for_generators_s
        if want <= 0:
            return
        deadline = time.monotonic() + limit
        while len(self.generators_seen) < want and time.monotonic() < deadline and not stop.is_set():
            stop.wait(0.1)
        seen = sorted(self.generators_seen)
        if len(seen) < want and not stop.is_set():
            log.warning("%d of %d generators connected in %.0f s (%s); feeding anyway", len(seen), want, limit, seen)
        else:
            log.info("%d generator(s) connected (%s); feeding", len(seen), ", ".join(seen))

    def waiting_for(self) -> str:
        """What the next step waits for, in one line (logged every WAIT_LOG_S while it waits)."""
        seen = ", ".join(sorted(self.generators_seen)) or "none"
        return f"step {self.state.step + 1} waits: {self.runner.waiting_for()}; generators seen: {seen}"

    def _done(self) -> bool:
        return self.config.steps > 0 and self.state.step >= self.config.steps

    def train(self, batch: list[str]) -> None:
        """One step on `batch`: update, publish, record, checkpoint when due."""
        start = time.monotonic()
        self.ledger.take(batch)
        self.feeder.tick()  # top the queue up now, so generators keep busy while this step trains
        try:
            report = self.runner.run(self.state.step + 1, self.state.policy_version, batch, self.phases)
        except BaseException:
            self.ledger.release(batch)
            raise
        self.state.step += 1
        self.state.history.append(list(batch))
        self.ledger.finish(batch, TRAINED)
        with self.phases.phase("publish"):
            self.publish(self.state.policy_version + 1)
            if self.distill is not None:  # trained against the policy just published
                self.distill.publish(self.weights, self.state.policy_version, self.state.step)
        if self.pacing.due(self.state.step):
            with self.phases.phase("checkpoint"):
                self.checkpoint()
        if self.evaluator.due(self.state.step, self.config.steps):
            self.evaluator.start(self.state.step, self.state.policy_version)
        report.seconds = time.monotonic() - start
        # The step ends here: what follows (writing its record) is the next step's `other`.
        split = self.phases.take_ns()
        report.timing = {name: ns / 1e9 for name, ns in split.items()}
        report.wall_seconds = sum(split.values()) / 1e9
        for name, seconds in report.timing.items():
            self.metrics.phase_seconds.labels(**{mc.PHASE_LABEL: name}).inc(seconds)
        self.metrics.step_seconds.observe(report.seconds)
        self.metrics.steps.inc()
        self.metrics.last_step.set(time.time())
        with (self.run_dir / STEPS_FILE).open("a") as f:
            f.write(json.dumps({**report.to_dict(), "published_version": self.state.policy_version}) + "\n")
        p5 = " ".join(f"{b['bin']}:{b['p5']:.3f}" for b in report.alpha_bins)
        log.info(
            "step %d: reward %.3f acc %.2f len %.1f alpha mean %.4f p5 [%s] tis-clip %.3f kl %.4f stale %.2f "
            "-> policy v%d (%.2f s)",
            report.step, report.reward_mean, report.accuracy, report.response_length, report.alpha_mean, p5,
            report.tis_clip_fraction, report.kl_rollout_dense, report.staleness, self.state.policy_version,
            report.seconds,
        )  # fmt: skip

    def checkpoint(self) -> None:
        """Save a checkpoint, then compact what every kept checkpoint records as finished."""
        started = self.pacing.clock()
        self.state.feeder = self.feeder.state()
        self.leader.order(CHECKPOINT, self.state.step)
        self.checkpoints.save(self.model, self.optimizer, self.state, self._checkpoint_parts())
        self._last_checkpoint_step = self.state.step
        self.pacing.taken(started)
        oldest = self.checkpoints.oldest_state()
        done = oldest.finished if oldest is not None else {}
        dead = self.ledger.dead_ids()

        evaluated = self.ledger.evaluated_ids()

        def keep(gid: str) -> bool:
            # Evaluation groups are scored and reported once; no checkpoint needs them back.
            return gid not in done and gid not in dead and gid not in evaluated

        dropped = self.store.compact(keep)
        self.ledger.compact(keep)
        if dropped:
            log.info("compacted %d trained trajectories out of the store", dropped)

    def shutdown(self) -> None:
        """Checkpoint (unless the last step's is current), end streams, stop servers, close files."""
        try:
            if self._checkpoint_on_stop and self._last_checkpoint_step != self.state.step:
                self.checkpoint()
            if self._checkpoint_on_stop:  # a clean stop; after a failure torchrun ends the other ranks
                self.leader.order(STOP)
        finally:
            self.weights.close()
            if self._server is not None:
                self._server.stop(self.config.grpc.grace_s)
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()
            self.reward_pool.close()
            if self.http_rewards is not None:
                self.http_rewards.close()
            self.store.close()
            self.ledger.close()
            self.feeder.client.close()
            log.info("trainer stopped at step %d, policy v%d", self.state.step, self.state.policy_version)


def build_grpc_server(
    config: TrainerServiceConfig,
    store: TrajectoryStore,
    ledger: GroupLedger,
    weights: WeightStore,
    limits: Limits,
    metrics: TrainerMetrics,
    on_stored: Callable[[rollout_pb2.Trajectory, GroupRecord], None] | None = None,
    sync: PolicySyncStore | None = None,
    planner: SourcePlanner | None = None,
    on_hello: Callable[[str], None] | None = None,
) -> AioServer:
    """The trainer's gRPC server (RolloutService, WeightService, health, reflection), not yet bound or started.

    One asyncio server: open trajectory streams and version watches hold no thread; past `grpc.max_calls`
    open calls a new one is refused with RESOURCE_EXHAUSTED, and health is always answered. The
    WeightService serves policy deltas from `sync` and policy sources from `planner` (by default the run
    dir's sync store and a planner with the config's fan-outs).
    """
    from services.api.sparrow.v1 import rollout_pb2_grpc, weights_pb2_grpc
    from services.trainer.rollout_servicer import RolloutServicer
    from services.trainer.sync_servicer import TrainerWeightServicer

    c, w = config.grpc, config.weights
    sync = sync if sync is not None else PolicySyncStore(config.run_dir, w.deltas)
    planner = planner if planner is not None else SourcePlanner(w.trainer_fanout, w.peer_fanout, keep=w.keep + 1)
    weight_servicer = TrainerWeightServicer(weights, w.default_chunk_bytes, w.max_chunk_bytes, sync, planner)
    rollouts = RolloutServicer(store, ledger, weight_servicer, limits, metrics, on_stored, on_hello)
    server = AioServer(
        config.security.grpc(),
        max_calls=c.max_calls,
        max_message_bytes=c.max_message_bytes,
        blocking_threads=c.blocking_threads,
        registry=metrics.registry,
        component="trainer",
        name="trainer-grpc",
    )
    try:
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(rollouts, server.server)
        weights_pb2_grpc.add_WeightServiceServicer_to_server(weight_servicer, server.server)
        server.add_health_and_reflection(["sparrow.v1.RolloutService", "sparrow.v1.WeightService"])
    except BaseException:
        server.stop(0)
        raise
    return server
