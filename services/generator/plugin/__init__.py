"""vLLM plugin: the project's block-sparse decode attention inside a stock vLLM, without a fork.

vLLM calls `register()` (entry point `vllm.general_plugins` -> `sparrow`) in every process it
starts, the spawned workers included, which is why registering from the parent alone is not
enough. `register()` re-points the platform's attention backend at our subclass through vLLM's
backend registry, by import path, so workers import it lazily. It is safe to call twice.

On CPU that is `CPU_ATTN` (vLLM's only CPU backend, `cpu_backend`); on CUDA it is `TRITON_ATTN`
(`cuda_backend`), which vLLM would not pick by itself there: an engine asks for it by name
(`engine_attention_backend`). Other platforms (ROCm, TPU, XPU, ...) are refused with a clear error.

`SPARROW_ATTENTION=stock` in the environment keeps vLLM's own attention (stock runs in the same
installation, e.g. for parity tests); the model fixes in `patches` apply either way.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32.",)
CPU_BACKEND = "services.generator.plugin.cpu_backend.SparrowCPUAttentionBackend"
CUDA_BACKEND = "services.generator.plugin.cuda_backend.SparrowTritonAttentionBackend"
CUDA_BACKEND_NAME = "TRITON_ATTN"
WORKER_EXTENSION = "services.generator.plugin.worker_ext.SparrowWorkerExtension"
# The `additional_config` key of a CUDA engine whose steps of pure decodes run as full CUDA graphs
# (static decode, `cuda_backend`).
STATIC_DECODE = "sparrow_static_decode"


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


def engine_attention_backend() -> str | None:
    """The `attention_backend` an engine must ask vLLM for so that the plugin's attention runs.

    TRITON_ATTN on CUDA (vLLM would otherwise pick another backend there); None on CPU, where
    CPU_ATTN is vLLM's only choice, and in stock mode, which keeps vLLM's own choice.
    """
    if not enabled():
        return None
    from vllm.platforms import current_platform

    return CUDA_BACKEND_NAME if current_platform.is_cuda() else None


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
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum[CUDA_BACKEND_NAME], CUDA_BACKEND)
        log.debug("sparrow: %s -> %s", CUDA_BACKEND_NAME, CUDA_BACKEND)
    else:
        # Say so instead of silently running dense.
        raise UnsupportedVllmError(
            f"sparrow's vLLM plugin has no attention backend for platform {current_platform.device_name!r} "
            "(it supports CPU and CUDA); set SPARROW_ATTENTION=stock to run dense"
        )
