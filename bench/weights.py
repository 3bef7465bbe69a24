"""`sparrow bench weights`: policy versions published to a fleet of generator processes on loopback, per mode.

A Qwen3-0.6B-shaped model (random weights; `layers` may be cut to fit the machine, the rest of the shape
stays) in fp32 master weights; each new version is one Adam-like step of `lr` on every element (the
size of Adam's first steps: |update| = lr), published through the trainer's real weight path
(WeightStore, digests, deltas, its WeightService) to `generators` processes, each the real generator
weight path (VersionWatcher, VersionSync, WeightFetcher, PolicySource, relay server) over an engine
stand-in that loads into torch tensors. Modes:

    fp32-trainer      today: fp32 versions, every generator fetches from the trainer
    bf16-trainer      the serving dtype, every generator from the trainer
    bf16-relay        + peer relay (digest-checked, deltas off)
    bf16-relay-delta  + deltas

Per mode: bytes that left the trainer per version (first version, and the mean of the later ones), as
a share of one bf16 copy; seconds from a version becoming visible until every generator serves it,
all with the trainer's digest; the peak resident memory of a generator process.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.weight_fleet import PublishingTrainer
from sparrow.weight_delta import cast_state

MODES = {
    # dtype, relay (digest-checked source plan), deltas, streamed loads (into memory as the bytes arrive, no disk)
    "fp32-trainer": ("float32", False, False, False),
    "bf16-trainer": ("bfloat16", False, False, False),
    "bf16-streamed": ("bfloat16", False, False, True),
    "bf16-relay": ("bfloat16", True, False, False),
    "bf16-relay-delta": ("bfloat16", True, True, False),
}
# What the generator processes import once, in the fork server they are forked from (not gRPC: it is not fork-safe).
PRELOAD = ["torch", "safetensors.torch"]


@dataclass(frozen=True)
class Shape:
    """A Qwen3 shape (Qwen3-0.6B's by default)."""

    vocab: int = 151936
    hidden: int = 1024
    intermediate: int = 3072
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape, as a tied-embedding Qwen3 checkpoint holds them."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h), "model.norm.weight": (h,)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (self.head_dim,),
                p + "self_attn.k_norm.weight": (self.head_dim,),
                p + "mlp.gate_proj.weight": (self.intermediate, h),
                p + "mlp.up_proj.weight": (self.intermediate, h),
                p + "mlp.down_proj.weight": (h, self.intermediate),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        return out

    def params(self) -> int:
        return sum(torch.Size(s).numel() for s in self.tensors().values())

    def config_json(self) -> str:
        return json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "vocab_size": self.vocab,
                "hidden_size": self.hidden,
                "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "tie_word_embeddings": True,
                "dtype": "bfloat16",
            }
        )


class _Master:
    """fp32 master weights of `shape` and Adam-like steps: every element moves by lr (sign of fresh noise)."""

    def __init__(self, shape: Shape, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.state = {}
        for name, s in shape.tensors().items():
            norm = len(s) == 1
            self.state[name] = torch.ones(s) if norm else torch.randn(s, generator=self.g).mul_(0.02)

    def step(self, lr: float) -> None:
        for t in self.state.values():
            noise = torch.randn(t.shape, generator=self.g)
            t.add_(torch.sign(noise).mul_(-lr))


class _Fleet:
    """`n` stand-in generator processes, forked from a server that imported torch once; collects their lines."""

    def __init__(self, trainer: str, root: Path, n: int, relay: bool, stream: bool = False) -> None:
        ctx = multiprocessing.get_context("forkserver")  # not fork: this process holds gRPC threads
        ctx.set_forkserver_preload(PRELOAD)
        self.procs, self.conns, self.lines, self._lock = [], [], [], threading.Lock()
        self.ready = threading.Semaphore(0)
        for i in range(n):
            conn, child = ctx.Pipe()
            args = (trainer, str(root / f"g{i}"), f"g{i}", relay, relay, stream, child)
            p = ctx.Process(target=_generator, args=args, daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()
        for _ in range(n):
            if not self.ready.acquire(timeout=120):
                raise RuntimeError("a generator process did not start")

    def _read(self, conn) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                d = conn.recv()
                if d.get("ready"):
                    self.ready.release()
                    continue
                with self._lock:
                    self.lines.append(d)

    def served(self, version: int) -> list[dict]:
        with self._lock:
            return [d for d in self.lines if d["version"] == version]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def _generator(*args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # before the first parallel region starts OpenMP's threads
    from bench.weight_fleet import run_process

    run_process(*args)


def _run_mode(mode: str, shape: Shape, generators: int, versions: int, lr: float, timeout_s: float) -> dict:
    dtype, relay, deltas, stream = MODES[mode]
    bf16_copy = 2 * shape.params()
    with tempfile.TemporaryDirectory(prefix="sparrow-bench-weights-") as tmp:
        root = Path(tmp)
        trainer = PublishingTrainer(root / "trainer", deltas=deltas)
        master = _Master(shape, seed=0)
        side = {"config.json": shape.config_json()}
        fleet = _Fleet(trainer.address, root, generators, relay, stream)
        rows = []
        try:
            for v in range(1, versions + 1):
                if v > 1:
                    master.step(lr)
                before = dict(trainer.sent)
                t0 = time.monotonic()
                digest = trainer.publish(v, cast_state(master.state, getattr(torch, dtype)), dtype, side)
                visible = time.time()
                publish_s = time.monotonic() - t0
                deadline = time.monotonic() + timeout_s
                while len(fleet.served(v)) < generators and time.monotonic() < deadline:
                    time.sleep(0.05)
                served = fleet.served(v)
                print(
                    f"bench weights: {mode}, version {v} of {versions}: {len(served)} of {generators} generators "
                    f"serve it, {time.monotonic() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
                rec = trainer.sync.record(v)
                sent = {k: trainer.sent[k] - before[k] for k in trainer.sent}
                rows.append(
                    {
                        "version": v,
                        "publish_seconds": round(publish_s, 2),
                        "seconds_until_all_serve": round(max(d["t"] for d in served) - visible, 2) if served else None,
                        "generators_serving": len(served),
                        "all_identical_to_trainer": len(served) == generators
                        and all(d["digest"] == digest for d in served),
                        "bytes_left_trainer": sent["full"] + sent["delta"],
                        "bytes_left_trainer_per_bf16_copy": round((sent["full"] + sent["delta"]) / bf16_copy, 4),
                        "full_bytes_left_trainer": sent["full"],
                        "delta_bytes_left_trainer": sent["delta"],
                        "delta_bytes": rec.delta_bytes,
                        "version_bytes": rec.full_bytes,
                    }
                )
                time.sleep(0.5)  # let reports to the trainer land before the next version
        finally:
            fleet.close()
            trainer.close()
        peaks = [max((d["peak_rss_bytes"] for d in fleet.lines if d["generator"] == f"g{i}"), default=0) for i in
                 range(generators)]  # fmt: skip
    later = rows[1:] or rows
    return {
        "mode": mode,
        "dtype": dtype,
        "relay": relay,
        "deltas": deltas,
        "streamed": stream,
        "versions": rows,
        "steady_bytes_left_trainer_per_version": int(sum(r["bytes_left_trainer"] for r in later) / len(later)),
        "steady_bytes_per_bf16_copy": round(sum(r["bytes_left_trainer_per_bf16_copy"] for r in later) / len(later), 4),
        "steady_seconds_until_all_serve": _mean(r["seconds_until_all_serve"] for r in later),
        "all_identical": all(r["all_identical_to_trainer"] for r in rows),
        "peak_rss_bytes_per_generator_max": max(peaks),
    }


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 2) if vals else None


def run(
    layers: int = 2,
    generators: int = 8,
    versions: int = 3,
    lr: float = 1e-6,
    modes=tuple(MODES),
    timeout_s: float = 600.0,
    vocab: int = 32768,
) -> dict:
    """Run every mode in `modes`; returns the JSON report."""
    torch.set_num_threads(1)
    shape = Shape(layers=layers, vocab=vocab)
    started = time.monotonic()
    results = [_run_mode(m, shape, generators, versions, lr, timeout_s) for m in modes]
    return {
        "bench": "weights",
        "shape": {**asdict(shape), "params": shape.params(), "qwen3_0_6b_layers": 28},
        "bf16_copy_bytes": 2 * shape.params(),
        "generators": generators,
        "versions": versions,
        "update": f"Adam-like: every fp32 master element moves by lr={lr} per version (sign of fresh noise)",
        "engine": "stand-in: each generator process loads every version into torch tensors after the host checks "
        "(names, shapes, finiteness); transfers, relays, deltas and digests are the real services' code",
        "machine": {"cpus": os.cpu_count()},
        "modes": results,
        "seconds": round(time.monotonic() - started, 1),
    }
