# The launchers' environment, shared by scripts/train_local.sh, scripts/slurm/torchrun_node.sh
# and the preflight of scripts/slurm/train.sbatch.
#
# Sourced, not executed. The rules themselves live in common/launch_env.py, their one home:
# `python -m train` applies the same ones at start-up, so a bare run gets what a launched one
# gets. Every setting is a default: a value already in the environment wins. Defines:
#   PYTHON                  the repo's .venv python when present, else python3
#   count_visible_gpus      prints how many GPUs this process may use (0 on CPU-only machines)
#   apply_env_defaults N    exports the thread, NCCL, allocator and gloo-interface defaults
#                           for N local processes
# shellcheck shell=bash

LAUNCH_REPO=${LAUNCH_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
if [[ -x "$LAUNCH_REPO/.venv/bin/python" ]]; then
    PYTHON=${PYTHON:-$LAUNCH_REPO/.venv/bin/python}
else
    PYTHON=${PYTHON:-python3}
fi
# `python -m train` must find the package even when the venv has no editable install.
export PYTHONPATH="$LAUNCH_REPO${PYTHONPATH:+:$PYTHONPATH}"

count_visible_gpus() {
    "$PYTHON" -m common.launch_env gpus
}

apply_env_defaults() {
    local exports
    exports=$("$PYTHON" -m common.launch_env exports "$1") || return
    eval "$exports"
}
