"""Each child's config: service defaults < the launcher's local-run defaults < the user's table < the wiring.

The wiring (ports, addresses, run folders, model, steps, schedule source) is the launcher's: a user
table that sets it is refused with the field to use instead. Child configs are validated here,
without the launcher's environment (SPARROW_STEPS means `sparrow up --steps`, not the trainer's
field of the same name), and written whole as TOML files the children read back.
"""

from __future__ import annotations

import functools
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from services.controller.config import ControllerConfig
from services.generator.config import GeneratorConfig
from services.launcher.config import UpConfig
from services.launcher.ports import HOST, Ports
from services.launcher.toml_text import to_toml
from services.sandbox.config import SandboxConfig
from services.trainer.config import TrainerServiceConfig
from sparrow.config import ConfigError, SparrowConfig, rename_keys
from sparrow.schedule import Schedule
from sparrow.tasks.chain import LONG_FILLER

# Fields the launcher sets; a user table naming one gets this hint.
WIRED: dict[str, dict[str, str]] = {
    "trainer": {
        "run_dir": "run_dir / --run-dir",
        "model_dir": "model_dir / --model",
        "redis.url": "redis_url",
        "steps": "steps / --steps",
        "grpc.address": "ports.trainer_grpc",
        "metrics.port": "ports.trainer_metrics",
        "security.token": "token (SPARROW_TOKEN)",
        "distributed.procs_per_node": "trainer_procs / --trainer-procs",
        "distributed.restarts": "trainer_restarts",
        "distributed.nodes": "nothing (sparrow up runs the trainer on this machine)",
        "distributed.node_rank": "nothing (sparrow up runs the trainer on this machine)",
        "distributed.master_addr": "nothing (sparrow up runs the trainer on this machine)",
    },
    "generator": {
        "generator_id": "generators (gen-0, gen-1, ...)",
        "redis.url": "redis_url",
        "trainer.address": "ports.trainer_grpc",
        "trainer.weights_address": "ports.trainer_grpc",
        "trainer.weights_dir": "run_dir",
        "engine.kind": "engine / --engine",
        "engine.model_dir": "model_dir / --model",
        "metrics.port": "ports.generator_metrics",
        "control.port": "ports.generator_control",
        "schedule.initial": "schedule / --dense",
        "schedule.follow_redis": "dense / --dense",
        "security.token": "token (SPARROW_TOKEN)",
    },
    "controller": {
        "initial_schedule": "schedule",
        "redis.url": "redis_url",
        "prometheus.url": "prometheus_url",
        "api.port": "ports.controller",
        "security.token": "SPARROW_SECURITY__TOKEN in sparrow up's environment",
        "retune.tau": "tau",
    },
    "sandbox": {
        "api.host": "nothing (the launcher's sandbox listens on loopback)",
        "api.port": "ports.sandbox",
        "security.token": "nothing (a random one per run, handed to the trainer)",
    },
}

# A secret never goes into a config file; the child gets it from its environment.
SECRET_FIELDS = {
    "trainer": ("security", "token"),
    "generator": ("security", "token"),
    "controller": ("security", "token"),
    "sandbox": ("security", "token"),
}


@dataclass(frozen=True)
class ChildConfigs:
    """The resolved config of every child service."""

    trainer: TrainerServiceConfig
    generators: tuple[GeneratorConfig, ...]
    controller: ControllerConfig | None
    sandbox: SandboxConfig | None = None  # set once the run's rewards are known (services/launcher/sandbox.py)


def prompt_tokens(trainer: TrainerServiceConfig) -> int:
    """The longest prompt: a dataset's max_prompt_tokens, or the chain task's (BOS, 3 tokens per pair, the query)."""
    if trainer.data.train_files or trainer.data.eval_files:
        return trainer.data.max_prompt_tokens
    return trainer.task.chain().prompt_tokens()


def _task_defaults(up: UpConfig) -> dict:
    """The task of the own model's run: the long task for `long` (whose lookups read evidence 2K+ tokens back;
    96-128 hops are 3.5K-4.5K tokens of KV), otherwise a chain whose KV reaches ~500 tokens, long enough for the
    schedule to matter; `small` solves about all of it with dense rollouts and about half under the calibrated
    schedule (docs/results.md)."""
    if up.model_size == "long" and not up.model_dir:
        return {
            "task": {"pairs": 64, "min_hops": 96, "max_hops": 128, "filler": LONG_FILLER},
            "sampling": {"max_new_tokens": 128 * (4 + LONG_FILLER) + 8},
        }
    return {"task": {"pairs": 64, "min_hops": 16, "max_hops": 64}, "sampling": {"max_new_tokens": 300}}


def resolve(
    up: UpConfig, run_dir: Path, model_dir: Path, schedule: Schedule, schedule_file: Path | None, ports: Ports
) -> ChildConfigs:
    """Every child's config, validated; ConfigError (one line naming the key) on any problem."""
    trainer = _resolve(
        TrainerServiceConfig,
        "trainer",
        {
            "poll_s": 0.2,
            "groups_per_step": 4,
            "grpc": {"grace_s": 2.0},
            "metrics": {"host": HOST, "bin_width": schedule.bin_width, "num_bins": schedule.num_bins},
            # Long enough for the schedule to matter (KV up to ~500 tokens); `small` solves about all
            # of it with dense rollouts and about half under the calibrated schedule (docs/results.md).
            **_task_defaults(up),
            "checkpoint": {"keep": 2},
            # Several processes checkpoint on SIGTERM before this run's stop kills the trainer's process group.
            "distributed": {"stop_grace_s": max(1.0, up.timeouts.stop_grace_s - 5)},
        },
        up.trainer,
        {
            "run_dir": str(run_dir / "trainer"),
            "model_dir": str(model_dir),
            "redis": {"url": _redis_url(up, ports)},
            "steps": up.steps,
            "wait_for_generators": up.generators,  # they start with the trainer: none gets a head start
            "grpc": {"address": f"{HOST}:{ports.trainer_grpc}"},
            "metrics": {"port": ports.trainer_metrics},
            # `sparrow trainer` starts its ranks itself; one process is restarted by this run instead.
            "distributed": {
                "procs_per_node": up.trainer_procs,
                "restarts": up.trainer_restarts if up.trainer_procs > 1 else 0,
                "nodes": 1,
                "node_rank": 0,
                "master_addr": "",
            },
        },
    )
    max_len = prompt_tokens(trainer) + trainer.sampling.max_new_tokens
    generators = tuple(
        _resolve(
            GeneratorConfig,
            "generator",
            {
                "drain_grace_s": 2.0,
                "queue": {"claim_idle_s": 15.0},
                "trainer": {"reconnect_max_s": 2.0},
                "engine": {
                    "max_model_len": max(256, 1 << (max_len - 1).bit_length()),
                    "max_num_seqs": 64,
                    # LoRA support costs engine memory and time: on only when the trainer trains an adapter.
                    "enable_lora": trainer.distill.enabled,
                    "max_lora_rank": max(8, trainer.distill.rank),
                    # N engines share one accelerator (on CPU vLLM sizes its KV cache by itself).
                    "gpu_memory_utilization": round(0.85 / up.generators, 3),
                },
                "schedule": {"poll_s": 2.0},
                "metrics": {"host": HOST},
                "control": {"host": HOST},
            },
            up.generator,
            {
                "generator_id": f"gen-{i}",
                "redis": {"url": _redis_url(up, ports)},
                "trainer": {
                    "address": f"{HOST}:{ports.trainer_grpc}",
                    "weights_address": "",
                    "weights_dir": str(run_dir / "generators" / f"gen-{i}" / "weights"),
                },
                "engine": {"kind": up.engine, "model_dir": str(model_dir)},
                "metrics": {"port": ports.generator_metrics[i]},
                "control": {"port": ports.generator_control[i]},
                "schedule": {
                    "initial": "" if up.dense else str(schedule_file or schedule.name),
                    "follow_redis": not up.dense,
                },
            },
        )
        for i in range(up.generators)
    )
    if trainer.distill.enabled:
        for g in generators:
            if g.engine.decode == "speculative":
                raise ConfigError(
                    "trainer.distill.enabled trains a sparse-actor adapter, which generator.engine.decode "
                    "speculative cannot take yet (it would change the dense verify too); drop one of them"
                )
            if g.engine.kind == "vllm" and not g.engine.enable_lora:
                raise ConfigError(
                    "trainer.distill.enabled trains adapters for the generators, but generator.engine.enable_lora "
                    "is false; drop one of them"
                )
            if g.engine.kind == "vllm" and g.engine.max_lora_rank < trainer.distill.rank:
                raise ConfigError(
                    f"generator.engine.max_lora_rank {g.engine.max_lora_rank} is below trainer.distill.rank "
                    f"{trainer.distill.rank}"
                )
    for g in generators:
        if g.engine.kind == "vllm" and g.engine.decode == "speculative" and trainer.sampling.top_p < 1:
            raise ConfigError(
                f"trainer.sampling.top_p {trainer.sampling.top_p}: vLLM's speculative decoding samples its drafts "
                "at the temperature only, so it verifies top_p 1 alone; set top_p = 1 or decode sparse"
            )
    controller = None
    if up.uses_controller:
        s = trainer.sampling
        controller = _resolve(
            ControllerConfig,
            "controller",
            {
                # The trainer's p5 gauge holds only the last step's reading and steps here take seconds:
                # a tick per second (Prometheus scrapes every second) sees each step, a 5 s tick missed half.
                "interval_s": 1.0,
                # Budgets of the own small models are tens of tokens: a fine grid and few tokens per reading.
                # Steps of a few seconds: hold a lowering for several steps, not the service's 2 minutes.
                "retune": {
                    "min_budget": 48,
                    "max_budget": 4096,
                    "budget_quantum": 16,
                    "min_tokens": 200,
                    "lower_hold_s": 30.0,
                },
                "prometheus": {"window_s": 30.0, "max_age_s": 60.0},
                "api": {"host": HOST},
                "cost": {
                    "model": str(model_dir),
                    "hardware": up.cost_hardware,
                    "prompt_len": prompt_tokens(trainer),
                    "gen_len": s.max_new_tokens,
                    "samples": s.n,
                },
            },
            up.controller,
            {
                "initial_schedule": str(schedule_file or schedule.name),
                "redis": {"url": _redis_url(up, ports)},
                "prometheus": {"url": prometheus_url(up, ports)},
                "api": {"port": ports.controller},
                "retune": {"tau": up.tau},
                **_lossless(up, generators),
            },
        )
    return ChildConfigs(trainer, generators, controller)


def _lossless(up: UpConfig, generators) -> dict[str, Any]:
    """A speculative run's controller serves throughput (lossless mode) with the generators' k."""
    if up.decode != "speculative":
        return {}
    k = generators[0].engine.speculative_tokens
    return {"mode": "lossless", "lossless": {"speculative_tokens": k}}


def resolve_sandbox(up: UpConfig, port: int) -> SandboxConfig:
    """The started sandbox's config: its defaults < `[sandbox]` < the wiring (loopback, the run's port)."""
    # One log line per request in the run folder's sandbox.log: which rewards ran, and how they went.
    local = {"api": {"access_log": True}}
    return _resolve(SandboxConfig, "sandbox", local, up.sandbox, {"api": {"host": HOST, "port": port}})


def _redis_url(up: UpConfig, ports: Ports) -> str:
    return up.redis_url or f"redis://{HOST}:{ports.redis}/0"


def prometheus_url(up: UpConfig, ports: Ports) -> str:
    """The Prometheus the run uses."""
    return up.prometheus_url or f"http://{HOST}:{ports.prometheus}"


def _resolve(cls: type[SparrowConfig], section: str, local: dict, user: dict, wired: dict) -> Any:
    user = rename_keys(cls, user, f"in [{section}]")
    _check_user_keys(cls, user, section)
    for dotted, use in WIRED[section].items():
        if _lookup(user, dotted) is not None:
            raise ConfigError(f"{section}.{dotted} is set by sparrow up; use {use} instead")
    merged = _merge(_merge(local, user), wired)
    try:
        return _without_environment(cls)(**merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise ConfigError(f"invalid config value for '{section}.{loc}': {first['msg']}") from None


def _without_environment(cls: type[SparrowConfig]) -> type[SparrowConfig]:
    """`cls` reading only the values given to it (already such a class: itself)."""
    return _shadow(getattr(cls, "__launcher_base__", cls))


@functools.cache
def _shadow(cls: type[SparrowConfig]) -> type[SparrowConfig]:
    # pydantic-settings' documented hook: only the constructor's values count, no environment.
    def sources(_cls, settings_cls, init_settings, **_others):
        return (init_settings,)

    namespace = {
        "__module__": cls.__module__,
        "__doc__": cls.__doc__,
        "__launcher_base__": cls,
        "settings_customise_sources": classmethod(sources),
    }
    return type(cls.__name__, (cls,), namespace)


def _check_user_keys(model: type[BaseModel], data: dict, prefix: str) -> None:
    for key, value in data.items():
        info = model.model_fields.get(key)
        if info is None:
            raise ConfigError(f"unknown config key '{prefix}.{key}' (known here: {', '.join(model.model_fields)})")
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and isinstance(value, dict):
            _check_user_keys(sub, value, f"{prefix}.{key}")


def _lookup(data: dict, dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _merge(low: dict, high: dict) -> dict:
    out = dict(low)
    for key, value in high.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_text(config: SparrowConfig, section: str, header: str) -> str:
    """`config` as TOML without its secret, checked to read back as the same config (ConfigError if not)."""
    table, field = SECRET_FIELDS[section]
    data = config.model_dump(mode="json")
    data[table].pop(field, None)
    text = to_toml(data, header)
    back = _without_environment(type(config))(**tomllib.loads(text)).model_dump(mode="json")
    back[table].pop(field, None)
    if back != data:
        changed = sorted(k for k in data if data[k] != back.get(k))
        raise ConfigError(f"{section}: the config does not survive TOML (no null in TOML?): {', '.join(changed)}")
    return text


def child_environment(base: dict[str, str], cls: type[SparrowConfig], secrets: dict[str, str]) -> dict[str, str]:
    """`base` without the SPARROW_* variables `cls` would read as config (its file is the whole config), plus
    `secrets` (the service tokens), one torch thread unless the user chose, and unbuffered output for the logs."""
    fields = set(cls.model_fields) | {old.split(".")[0] for old in cls.renamed}  # old spellings are read too
    env = {}
    for key, value in base.items():
        if key.startswith("SPARROW_") and key[len("SPARROW_") :].lower().split("__")[0] in fields:
            continue
        env[key] = value
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("VLLM_HOST_IP", HOST)
    env.update(secrets)
    return env


def launcher_pythonpath(base: dict[str, str]) -> str:
    """PYTHONPATH for children: the folder holding this code first, so they run the same code as the launcher."""
    root = str(Path(__file__).resolve().parents[2])
    rest = base.get("PYTHONPATH", "")
    return os.pathsep.join([root, rest]) if rest else root
