"""The runtime of one training process: environment, patches, run folder, the training.

`python -m train` (train/__main__.py) parses arguments, runs the torch-free checks
(`train.preflight`) and calls these in order: `set_single_process_env` (a plain
`python -m train` is a world of one), `check_fresh`, `prepare_runtime` (torch's version
gaps and the CPU accommodations, before torchtitan's trainer is imported; the dry run,
the benchmarks and in-process tests call it too), `prepare_run_dir` and `train`.
torch is imported inside the functions, so importing this module stays cheap
(`python -m train --help` and `--check` import no torch).
"""

from __future__ import annotations

import os
import sys
import time

from common import run_layout
from common.exit_codes import ExitCode
from common.io import free_port, write_json_atomic
from train.config import ConfigError, RunConfig, save_config


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def set_single_process_env() -> None:
    """Let `python -m train` run as one process without torchrun.

    torchtitan reads the rendezvous from the environment torchrun sets; a plain
    `python -m train` is a world of one, so give it that environment (a free loopback
    port, so two single-process runs on one machine do not collide).
    """
    if "LOCAL_RANK" in os.environ:
        return
    port = free_port()
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    defaults |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def check_fresh(run: RunConfig, fresh: bool, overwrite: bool) -> None:
    if overwrite and not fresh:
        raise ConfigError(
            "--overwrite only applies with --fresh (delete RUN's checkpoints and start over)"
        )
    folder = run.run_dir / run_layout.CHECKPOINT_DIR
    complete, incomplete = run_layout.list_checkpoints(folder)
    if fresh and (complete or incomplete) and not overwrite:
        raise ConfigError(
            f"--fresh: {folder} already holds checkpoints (steps {(complete + incomplete)}); "
            "add --overwrite to delete them, or drop --fresh to resume"
        )


def prepare_runtime(accelerator: bool | None = None) -> None:
    """Version gaps on every device, then the CPU accommodations where there is no
    accelerator (`accelerator` defaults to this machine's). Once per process, before
    torchtitan's trainer is imported, by entry points only (`python -m train`, `--dry-run`,
    the benchmarks and in-process tests): building a config or a model spec never patches."""
    from train import cpu_compat, version_compat

    version_compat.apply()
    cpu_compat.apply(accelerator)


def prepare_run_dir(run: RunConfig) -> None:
    """Rank 0: RUN/config.toml (resolved) and no stale preempted.json / diverged.json."""
    if rank() != 0:
        return
    run.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (run_layout.PREEMPTED, run_layout.DIVERGED):
        (run.run_dir / stale).unlink(missing_ok=True)
    save_config(run, run.run_dir / run_layout.CONFIG)


def write_preempted(run: RunConfig, step: int, signum: int) -> None:
    import signal

    record = {"step": step, "signal": signal.Signals(signum).name, "time": time.time()}
    write_json_atomic(run.run_dir / run_layout.PREEMPTED, record)


def train(run: RunConfig, fresh: bool) -> int:
    """Build torchtitan's Trainer from `run`, train, close; the process's exit code."""
    import torch
    from torchtitan.tools.logging import logger

    from train import watchdog
    from train.build import to_trainer_config
    from train.console import configure_console
    from train.trainer import RunTrainer, install_preemption_handlers

    configure_console(rank(), world_size())
    install_preemption_handlers()
    watchdog.start(run.run_dir, run.fault_tolerance.hang_timeout_s, run.comm.init_timeout_seconds)
    config = to_trainer_config(run)
    config.checkpoint.fresh = fresh
    trainer: RunTrainer | None = None
    try:
        trainer = config.build()
        trainer.train()
    finally:
        watchdog.stop()  # closing and the process-group teardown are not steps
        if trainer is not None:
            trainer.close()
    if trainer.health.stop:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if rank() == 0:
            # a diverged run stays stopped: train.sbatch reads this and does not requeue
            write_json_atomic(
                run.run_dir / run_layout.DIVERGED,
                {"step": trainer.step, "reason": trainer.health.stop, "time": time.time()},
            )
            print(f"error: {trainer.health.stop}", file=sys.stderr, flush=True)
        return ExitCode.DIVERGED
    preempted = trainer.preempted_signal
    if preempted and rank() == 0:
        write_preempted(run, trainer.step, preempted)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Preempted: checkpoint saved, exiting" if preempted else "Training finished")
    return 0
