#!/usr/bin/env bash
# One torchrun per node, started by `srun` from train.sbatch (not meant to be run by hand).
#
#   torchrun_node.sh CONFIG [train args...]
#
# Signals: SLURM delivers the preemption/time-limit signal (USR1 forwarded by the batch
# script, or SIGTERM from slurmctld) to EVERY process of the step, workers included. The
# workers checkpoint at the next step boundary and exit 0. torchrun must stay out of the
# way while they do:
#   - USR1 would kill torchrun (no handler), and the step would then end and take the
#     workers with it mid-save: torchrun gets USR1 ignored (SIG_IGN survives exec).
#   - On SIGTERM torchrun forwards SIGTERM and SIGKILLs the workers 30 s later, which can
#     be shorter than a large checkpoint save: `--signals-to-handle` leaves SIGTERM out,
#     so torchrun ignores it and waits for the workers like on a normal exit.
# The workers inherit both "ignore"s and replace them with their own handlers
# (train installs SIGUSR1/SIGTERM handlers). SLURM's KillWait SIGKILL remains the hard
# bound for a worker that never exits. torchrun.py is torchrun without its traceback for a
# worker's user error (exit 2, already reported in one line).
set -euo pipefail

: "${TRAIN_RDZV_ENDPOINT:?set by train.sbatch (first node:port)}"
: "${TRAIN_NPROC_PER_NODE:?set by train.sbatch}"
# shellcheck source=launch_env.sh
source "${TRAIN_REPO:?set by train.sbatch}/scripts/slurm/launch_env.sh"
apply_env_defaults "$TRAIN_NPROC_PER_NODE"

echo "[torchrun_node] $(hostname -s): node $SLURM_NODEID of $SLURM_NNODES, $TRAIN_NPROC_PER_NODE process(es), rendezvous $TRAIN_RDZV_ENDPOINT, OMP_NUM_THREADS=$OMP_NUM_THREADS"
trap '' USR1 TERM
# exec: the torchrun agent is this srun task itself, so SLURM ending the task ends the
# agent, and the workers (each in a session of its own) follow their agent
# (common/process.py follow_launcher), also where SLURM tracks processes by group.
exec "$PYTHON" "$TRAIN_REPO/scripts/slurm/torchrun.py" \
    --nnodes "$SLURM_NNODES" \
    --nproc_per_node "$TRAIN_NPROC_PER_NODE" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$TRAIN_RDZV_ENDPOINT" \
    --rdzv_id "$SLURM_JOB_ID" \
    --max_restarts 0 \
    --signals-to-handle SIGINT,SIGHUP,SIGQUIT \
    -m train --config "$@"
