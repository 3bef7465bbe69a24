"""Assembles a generator from its config (engine, queue, trainer stream, weights, schedule, servers) and runs it."""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
from pathlib import Path

from services.generator.config import GeneratorConfig
from services.generator.engine import EngineError, RolloutEngine

log = logging.getLogger("sparrow.generator")


class SetupError(ValueError):
    """The config names something unusable (a model folder, a schedule, a busy port); one line."""


def _cuda() -> bool:
    """Whether vLLM runs on CUDA here: CUDA graphs apply there only (a CPU engine runs eagerly)."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def cpu_auto_dtype() -> str:
    """What `engine.dtype = "auto"` means for a vLLM engine on CPU: bfloat16 where the CPU multiplies bf16 natively
    (AVX512-BF16 or AMX), float32 elsewhere.

    vLLM alone would take bf16 on any CPU. Without native bf16 its oneDNN linear layers cannot be built (it falls
    back to torch's emulated bf16 matmul) and every bf16 KV page is widened to float32 before use. On a 2-core AVX2
    machine, models/long at 8K, 4 groups of 4: dense rollouts ran at 393 tokens/s in bf16 against 462 in float32,
    speculative ones (whose verify multiplies k + 1 tokens a row) at 339 against 539: 0.86x dense against 1.17x."""
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "bfloat16" if amx or torch.cpu._is_avx512_bf16_supported() else "float32"


def build_engine(config: GeneratorConfig) -> RolloutEngine:
    """The engine the config asks for, loaded and ready."""
    e = config.engine
    if not Path(e.model_dir).is_dir():
        raise SetupError(f"engine.model_dir {e.model_dir}: no such folder")
    if e.kind == "reference":
        if e.tensor_parallel_size != 1:
            raise SetupError(
                f"the reference engine runs on one device; engine.tensor_parallel_size is {e.tensor_parallel_size}"
            )
        if e.dtype not in ("auto", "float32"):
            raise SetupError(f"the reference engine runs float32 only; engine.dtype is {e.dtype}")
        from services.generator.reference_engine import ReferenceEngine

        try:
            return ReferenceEngine(
                e.model_dir,
                e.device,
                e.kernel_backend,
                e.seed,
                e.max_model_len,
                e.max_lora_rank,
                e.policy_version,
                decode=e.decode,
                speculative_tokens=e.speculative_tokens,
            )
        except EngineError as exc:
            raise SetupError(str(exc)) from None
    try:
        from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    except ImportError as exc:
        hint = "engine.kind = 'reference' needs no vLLM"
        raise SetupError(f"the vllm engine cannot be imported here ({exc}); {hint}") from None
    cuda = _cuda()
    try:
        return VllmEngine(
            VllmEngineConfig(
                model=e.model_dir,
                dtype=cpu_auto_dtype() if e.dtype == "auto" and not cuda else e.dtype,
                max_model_len=e.max_model_len,
                max_num_seqs=e.max_num_seqs,
                gpu_memory_utilization=e.gpu_memory_utilization,
                enforce_eager=e.cuda_graphs == "off" if cuda else not e.cpu_compile,
                static_decode=e.cuda_graphs == "full" and cuda,
                # A DistillSparse adapter belongs to the drafts, which vLLM would apply to the verify too.
                enable_lora=e.enable_lora and e.decode != "speculative",
                max_lora_rank=e.max_lora_rank,
                seed=e.seed,
                tensor_parallel_size=e.tensor_parallel_size,
                speculative_tokens=e.speculative_tokens if e.decode == "speculative" else 0,
            )
        )
    except EngineError as exc:
        raise SetupError(str(exc)) from None


class Generator:
    """Every part of one generator process, wired; `run()` blocks in the engine loop until drained."""

    def __init__(self, config: GeneratorConfig, engine: RolloutEngine | None = None) -> None:
        import redis

        from services.generator.metrics import GeneratorMetrics
        from services.generator.schedule_watch import ScheduleWatch
        from services.generator.service import GeneratorService
        from services.generator.trajectory_stream import Backoff
        from services.generator.version_sync import VersionSync, VersionWatcher
        from services.generator.weight_fetch import WeightFetcher
        from services.generator.work_queue import WorkQueue
        from sparrow.presets import resolve_schedule
        from sparrow.schedule import ScheduleError

        self.config = config
        # Dense decode applies no schedule: neither the initial one nor the controller's from Redis.
        follows_schedule = config.engine.decode != "dense"
        try:
            initial = (
                resolve_schedule(config.schedule.initial) if config.schedule.initial and follows_schedule else None
            )
        except ScheduleError as exc:
            raise SetupError(f"schedule.initial: {exc}") from None
        self.engine = engine if engine is not None else build_engine(config)
        self.metrics = GeneratorMetrics()
        q = config.queue
        # A blocking XREADGROUP must not hit the socket timeout.
        timeout = max(q.socket_timeout_s, q.read_block_ms / 1000 + 2)
        self.redis = redis.Redis.from_url(
            config.redis.url, socket_timeout=timeout, socket_connect_timeout=q.socket_timeout_s
        )
        self.service = GeneratorService(
            config, self.engine, WorkQueue(self.redis, q, config.generator_id, self.metrics), self.metrics
        )
        try:
            self.service.apply_schedule(initial, swap=False)
        except (EngineError, ValueError) as exc:
            raise SetupError(f"schedule.initial: the engine refused it: {exc}") from None
        t, client = config.trainer, config.security.client()
        root = Path(t.weights_dir) if t.weights_dir else Path(tempfile.mkdtemp(prefix="sparrow-weights-"))
        fetcher = WeightFetcher(t.weights_target, client, root, t.fetch_chunk_bytes, t.fetch_timeout_s)
        self.relay, source = self._relay(config, fetcher, self.metrics)
        # Streamed loads need the engine's layout; a relay keeps versions on disk for its peers.
        layout = self.engine.policy_layout() if t.stream_policies and source is None else None
        self.sync = VersionSync(
            fetcher,
            self.service.load,
            lambda: self.service.serving,
            self.metrics,
            self.service.adapter_folders_in_use,
            source,
            self.service.load_tensors if layout is not None else None,
            layout,
        )
        self.service.sync = self.sync
        self.version_watch = (
            VersionWatcher(
                t.weights_target,
                client,
                config.generator_id,
                self.sync.offer,
                Backoff(t.reconnect_initial_s, t.reconnect_max_s),
            )
            if t.follow_versions
            else None
        )

        def refused(message: str) -> None:
            self.metrics.swaps.labels(kind="schedule", outcome="refused").inc()

        s = config.schedule
        self.schedule_watch = (
            ScheduleWatch(
                config.redis.url, self.service.set_schedule, s.poll_s, refused, on_probe=self.service.set_probe
            )
            if s.follow_redis and follows_schedule
            else None
        )
        self.control = None
        self.metrics_port = 0
        self._thread: threading.Thread | None = None

    @staticmethod
    def _relay(config: GeneratorConfig, fetcher, metrics):
        """The relay server and the source-aware policy fetch, when relaying is on (else None, None)."""
        import socket

        from services.generator.policy_relay import HeldPolicy, RelayServer
        from services.generator.policy_source import PolicySource

        r = config.relay
        if not r.enabled:
            return None, None
        held = HeldPolicy()
        try:
            relay = RelayServer(held, config.security.server(), f"{r.host}:{r.port}", r.wait_s)
        except (OSError, RuntimeError) as exc:
            raise SetupError(f"relay: cannot listen on {r.host}:{r.port}: {exc}") from None
        host = r.host if r.host not in ("", "0.0.0.0", "::") else socket.gethostname()  # a wildcard is no address
        advertise = r.advertise or f"{host}:{relay.port}"
        return relay, PolicySource(fetcher, config.generator_id, held, advertise, r.peer_timeout_s, metrics)

    def start(self) -> None:
        """Open the servers and the watchers (the engine loop is `run`)."""
        from services.generator.control import ControlServer

        try:
            self.metrics_port = self.metrics.serve(self.config.metrics.host, self.config.metrics.port)
            c = self.config.control
            security = self.config.security.server()
            self.control = ControlServer(self.service, security, c.host, c.port, self.metrics.registry).start()
        except OSError as exc:
            self.close()
            raise SetupError(f"cannot listen: {exc}") from None
        if self.relay is not None:
            self.relay.start()
        self.sync.start()
        for watcher in (self.version_watch, self.schedule_watch):
            if watcher is not None:
                watcher.start()
        log.info(
            "generator %s: metrics on port %d, control on port %d, trainer %s, queue %s",
            self.config.generator_id,
            self.metrics_port,
            self.control.port,
            self.config.trainer.address,
            self.config.queue.stream,
        )

    def run(self) -> None:
        """The engine loop, in this thread, until a drain that exits (SIGTERM) or `service.stop()`."""
        try:
            self.service.run()
        finally:
            self.close()

    def run_in_background(self) -> threading.Thread:
        """Start everything and the engine loop in a thread of its own (tests, embedding)."""
        self.start()
        self._thread = threading.Thread(target=self.run, name="generator-engine", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop the watchers and servers and free the engine (idempotent)."""
        for part in (self.schedule_watch, self.version_watch, self.sync):
            if part is not None:
                part.close()
        if self.control is not None:
            self.control.stop(1.0)
            self.control = None
        if self.relay is not None:
            self.relay.stop(1.0)
            self.relay = None
        self.metrics.close()
        self.redis.close()


def serve(config: GeneratorConfig) -> None:
    """Run a generator until SIGTERM (or SIGINT): drain, hand back what is unfinished, exit."""
    log.info("config %s", config.dump())
    generator = Generator(config)
    generator.start()
    previous = {sig: signal.signal(sig, generator.service.on_sigterm) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        generator.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        generator.engine.close()
        log.info("generator %s stopped", config.generator_id)
