#!/usr/bin/env bash
# Train on this machine: `torchrun --standalone` with one process per visible GPU.
#
#   scripts/train_local.sh CONFIG [--section.key value | --set section.key=value]... [--fresh [--overwrite]]
#   scripts/train_local.sh --replica-groups N CONFIG [...]   (torchft replica groups; NPROC per group, default 1)
#
# Processes: NPROC if set (at most one per visible GPU), else one per visible GPU (nvidia-smi,
# filtered by CUDA_VISIBLE_DEVICES), else 2 on a CPU-only machine (gloo). Everything
# after CONFIG goes to `python -m train` unchanged. The config, the world size and the data
# are checked first without torch (`python -m train --check`), so bad input is one line
# before any worker starts; so is a run folder that a live run holds (one live run per
# folder: RUN/lease.json). The exit status is the training's (2 for a user error, with
# no torchrun traceback: scripts/slurm/torchrun.py). Environment defaults (threads, NCCL)
# come from common/launch_env.py and can be overridden from the environment. The workers
# end with this launcher, however it ends (kill -9 included).
# Exit codes: common/exit_codes.py (this script's own: 2, bad input).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=slurm/launch_env.sh
source "$here/slurm/launch_env.sh"
num_gpus=$(count_visible_gpus)
if [[ -n "${NPROC:-}" ]]; then
    num_procs=$NPROC
elif [[ "$1" == --replica-groups ]]; then
    num_procs=1
elif [[ "$num_gpus" -gt 0 ]]; then
    num_procs=$num_gpus
else
    num_procs=2
fi
if ! [[ "$num_procs" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NPROC=$num_procs is not a positive integer" >&2
    exit 2
fi
if [[ "$num_gpus" -gt 0 && "$num_procs" -gt "$num_gpus" ]]; then  # a rank per GPU (LOCAL_RANK)
    echo "error: NPROC=$num_procs is more than the $num_gpus visible GPU(s): each training" \
        "process needs a GPU of its own; set NPROC=$num_gpus or less, or leave it out" >&2
    exit 2
fi
apply_env_defaults "$num_procs"
if [[ "$1" == --replica-groups ]]; then
    # torchft replica groups: the Lighthouse and N torchruns of NPROC processes each, every
    # group restarted when it dies (scripts/replica_groups.py; docs/reliability.md)
    if [[ $# -lt 3 ]]; then
        echo "error: --replica-groups N CONFIG: give the number of groups and the config" >&2
        exit 2
    fi
    groups=$2
    shift 2
    exec "$PYTHON" "$here/replica_groups.py" --groups "$groups" --nproc "$num_procs" "$@"
fi
config=$1
shift
if [[ ! -f "$config" ]]; then
    echo "error: config file $config not found (give a path like configs/debug.toml)" >&2
    exit 2
fi

"$PYTHON" -m train --check --world-size "$num_procs" --config "$config" "$@"
echo "[train_local] $num_procs process(es), $num_gpus GPU(s) visible, OMP_NUM_THREADS=$OMP_NUM_THREADS" >&2
# exec: the torchrun agent must be this very process. Its workers watch it and end when it
# dies (common/process.py follow_launcher); a shell left between would die alone. The
# --standalone rendezvous store binds port 0, so the kernel picks a port and holds it in
# one step: nothing can take it between the choice and the bind.
exec "$PYTHON" "$here/slurm/torchrun.py" --standalone --nnodes 1 --nproc_per_node "$num_procs" \
    -m train --config "$config" "$@"
