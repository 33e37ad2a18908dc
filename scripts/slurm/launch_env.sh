# Environment defaults shared by scripts/train_local.sh and scripts/slurm/torchrun_node.sh
# (and the PYTHON that train.sbatch runs its preflight with).
#
# Sourced, not executed. Every setting is a default: a value already in the environment
# wins, so a user can always override one for a run. Defines:
#   PYTHON                  the repo's .venv python when present, else python3
#   count_visible_gpus      prints how many GPUs this process may use (0 on CPU-only machines)
#   apply_env_defaults N    exports thread and NCCL defaults for N local processes
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
    # CUDA_VISIBLE_DEVICES (set by SLURM's gres plugin or by the user) is the truth when
    # present; an empty value means "no GPU". Otherwise ask the driver.
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        if [[ -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == "-1" ]]; then
            echo 0
        else
            tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
        fi
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
    else
        echo 0
    fi
}

apply_env_defaults() {
    local num_procs=$1 num_cores
    num_cores=$(nproc)
    # One OpenMP pool per process, splitting the node's cores between the local processes
    # (torchrun would otherwise force 1 and warn).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((num_cores / num_procs > 0 ? num_cores / num_procs : 1))}
    if [[ "$(count_visible_gpus)" -gt 0 ]]; then
        # Tear a process down on a NCCL error or timeout instead of hanging in a dead
        # collective (3 = abort without communicator cleanup, which can itself hang);
        # torchrun then sees the failure and the restart budget decides what comes next.
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
        # Warnings only; NCCL_DEBUG=INFO shows the chosen transport (IB/socket) and rings.
        export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
        # torchtitan's recommendation: fewer fragmentation OOMs with FSDP's varying sizes.
        export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
    fi
}
