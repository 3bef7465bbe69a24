"""vLLM plugin: the project's block-sparse decode attention inside a stock vLLM, without a fork.

vLLM calls `register()` (entry point `vllm.general_plugins` -> `sparrow`) in every process it
starts, the spawned workers included, which is why registering from the parent alone is not
enough. `register()` re-points the platform's attention backend at our subclass through vLLM's
backend registry, by import path, so workers import it lazily. It is safe to call twice.

`SPARROW_ATTENTION=stock` in the environment keeps vLLM's own attention (stock runs in the same
installation, e.g. for parity tests); the model fixes in `patches` apply either way.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32.",)
CPU_BACKEND = "services.generator.plugin.cpu_backend.SparrowCPUAttentionBackend"
WORKER_EXTENSION = "services.generator.plugin.worker_ext.SparrowWorkerExtension"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not a release this plugin was written and tested against."""


def check_vllm_version(version: str) -> None:
    """Raise `UnsupportedVllmError` naming the supported line unless `version` is on it."""
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVllmError(
            f"sparrow's vLLM plugin supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"found {version}. Install the pinned release (pyproject.toml) or set SPARROW_ATTENTION=stock."
        )


def enabled() -> bool:
    return os.environ.get("SPARROW_ATTENTION", "sparse").lower() != "stock"


def register() -> None:
    """Apply the model patches and point vLLM's attention backend at the block-sparse one (idempotent)."""
    import vllm

    check_vllm_version(vllm.__version__)
    from services.generator.plugin import patches

    # Model fixes apply in stock mode too: they make vLLM compute what the trainer computes.
    patches.apply_all()
    if not enabled():
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        log.debug("sparrow: CPU_ATTN -> %s", CPU_BACKEND)
    else:
        # The CUDA path (Triton kernels behind the TRITON_ATTN backend) is not built yet; say so
        # instead of silently running dense.
        raise UnsupportedVllmError(
            f"sparrow's vLLM plugin has no attention backend for platform {current_platform.device_name!r} yet; "
            "set SPARROW_ATTENTION=stock to run dense"
        )
