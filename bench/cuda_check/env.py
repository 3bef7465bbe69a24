"""Phase `env`: versions, the device, whether vLLM imports."""

from __future__ import annotations

import sys

from bench.cuda_check.common import DRY, Record, vllm_version


def phase_env(rec: Record) -> None:
    import torch
    import triton

    rec["torch"], rec["triton"], rec["python"] = torch.__version__, triton.__version__, sys.version.split()[0]
    rec["vllm"] = vllm_version()
    if DRY:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    rec["device"] = torch.cuda.get_device_name(0)
    rec["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
