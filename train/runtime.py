"""The runtime of one training process: environment, patches, run folder, the training.

`python -m train` (train/__main__.py) applies the launchers' environment defaults
(`apply_launch_env`), parses arguments, runs the torch-free checks (`train.preflight`)
and calls these in order: `set_single_process_env` (a plain `python -m train` is a world
of one), then, holding the run folder's lease (`hold_run_dir`: one live run per folder),
`check_fresh`, `prepare_runtime` (torch's version gaps and the CPU accommodations, before
torchtitan's trainer is imported; the dry run, the benchmarks and in-process tests call
it too), `prepare_run_dir` and `train`. `--check` ends with `check_run_dir_free`.
torch is imported inside the functions, so importing this module stays cheap
(`python -m train --help` and `--check` import no torch).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

from common import run_layout
from common.exit_codes import ExitCode
from common.io import free_port, write_json_atomic
from common.launch_env import apply_env_defaults, env_int
from common.run_lease import LEASE_TOKEN_ENV, Holder, RunLease
from train.config import ConfigError, RunConfig, save_config


def rank() -> int:
    return env_int("RANK", 0)


def world_size() -> int:
    return env_int("WORLD_SIZE", 1)


def user_error(err: ValueError) -> int:
    """A user error's exit: one line `error: ...` per message on rank 0 (`lines`: several
    independent ones, e.g. each mismatch of a Hugging Face folder with the config,
    train/components/hf_import.py) and exit code 2 on every rank. TRAIN_DEBUG=1 raises it
    again, for the traceback. Call from the `except` clause."""
    if os.environ.get("TRAIN_DEBUG") == "1":
        raise err
    if rank() == 0:
        for line in getattr(err, "lines", None) or [str(err)]:
            print(f"error: {' '.join(line.split())}", file=sys.stderr, flush=True)
    elif world_size() > 1:
        # Every rank meets the same user error; torchrun kills the others as soon as
        # one exits, so let rank 0 print its line and exit first.
        time.sleep(3)
    return ExitCode.USER_ERROR


def set_single_process_env() -> None:
    """Let `python -m train` run as one process without torchrun.

    torchtitan reads the rendezvous from the environment torchrun sets; a plain
    `python -m train` is a world of one, so give it that environment (a free loopback
    port, so two single-process runs on one machine do not collide).
    """
    if "LOCAL_RANK" in os.environ:
        return
    port = free_port(host="")  # the store listens on every address: checked free on all
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    defaults |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def apply_launch_env() -> None:
    """The launchers' environment defaults (common/launch_env.py: threads, NCCL error
    handling, the allocator, gloo's interface), for a `python -m train` that no launcher
    started; under one they are set already and a set value always wins. Before torch is
    imported: it reads some of them when it starts. A rendezvous variable that is not an
    integer is refused here, in one line naming it, before torch reads it."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env_int(name, 0)
    apply_env_defaults(env_int("LOCAL_WORLD_SIZE", 1))


def check_run_dir_free(run: RunConfig) -> None:
    """Refuse (ValueError, one line naming the live run's host and PID) when a live run
    holds RUN's lease; takes nothing (the launchers' preflight, `--check`)."""
    RunLease(run.run_dir).check()


@contextlib.contextmanager
def hold_run_dir(run: RunConfig) -> Iterator[None]:
    """Rank 0 holds RUN's lease (common/run_lease.py) while the body runs, from before
    anything is written in RUN to the end: a live run there is refused (ValueError, one
    line), a stale lease is taken over with a warning. The other ranks write nothing
    before their first collective with rank 0, so they wait for it there."""
    if rank() != 0:
        yield
        return
    lease = RunLease(run.run_dir)
    if run.replica_groups.groups:  # the groups' launcher holds it (common/run_lease.py)
        lease.admit(os.environ.get(LEASE_TOKEN_ENV, ""))
        yield
        return

    def lost(holder: Holder | None) -> None:
        by = holder.describe(time.time()) if holder is not None else "another launch"
        print(
            f"error: {lease.path}: this run's lease was taken over by {by}, after this "
            "run's beats had stopped for longer than the stale timeout (a stopped process, "
            "a filesystem out of reach); this run stops so that two runs never write "
            f"{run.run_dir} at once",
            file=sys.stderr,
            flush=True,
        )
        os._exit(ExitCode.USER_ERROR)

    with lease.held(on_lost=lost):
        yield


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
    from train.compat import cpu_compat, version_compat

    version_compat.apply()
    cpu_compat.apply(accelerator)


def prepare_run_dir(run: RunConfig) -> None:
    """Rank 0: RUN/config.toml (resolved) and no stale preempted.json / diverged.json.
    Replica groups: their launcher did it once for all (scripts/replica_groups.py)."""
    if rank() != 0 or os.environ.get("TRAIN_REPLICA_GROUP") is not None:
        return
    run.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (run_layout.PREEMPTED, run_layout.DIVERGED):
        (run.run_dir / stale).unlink(missing_ok=True)
    save_config(run, run.run_dir / run_layout.CONFIG)


def write_preempted(run: RunConfig, step: int, signum: int, reason: str) -> None:
    """RUN/preempted.json: the step saved, the signal (None when the run ended itself before
    SLURM's end time: train/reliability/time_limit.py) and why; train.sbatch requeues."""
    import signal

    from train.reliability.time_limit import END_TIME_FLAG

    name = None if signum == END_TIME_FLAG else signal.Signals(signum).name
    record = {"step": step, "signal": name, "reason": reason, "time": time.time()}
    write_json_atomic(run.run_dir / run_layout.PREEMPTED, record)


def train(run: RunConfig, fresh: bool) -> int:
    """Build torchtitan's Trainer from `run`, train, close; the process's exit code."""
    import torch
    from torchtitan.tools.logging import logger

    from train.build import to_trainer_config
    from train.console import configure_console
    from train.reliability import watchdog
    from train.reliability.budgets import load_budgets
    from train.reliability.time_limit import install_preemption_handlers
    from train.trainer import RunTrainer

    configure_console(rank(), world_size())
    install_preemption_handlers()
    budgets = load_budgets(run, world_size())  # the plan's, or the configured keys
    if rank() == 0:
        source = "the plan's RUN/budgets.json" if budgets.planned else "the configured keys"
        logger.info(f"time budgets from {source}: " + "; ".join(budgets.describe()[1:]))
    watchdog.start(run.run_dir, budgets)
    config = to_trainer_config(run, budgets=budgets, fresh=fresh)
    trainer: RunTrainer | None = None
    try:
        trainer = config.build()
        trainer.train()
    finally:
        watchdog.stop()  # closing and the process-group teardown are not steps
        if trainer is not None:
            trainer.close()
    if trainer.diverged:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if rank() == 0:
            # a diverged run stays stopped: train.sbatch reads this and does not requeue
            write_json_atomic(
                run.run_dir / run_layout.DIVERGED,
                {"step": trainer.step, "reason": trainer.diverged, "time": time.time()},
            )
            print(f"error: {trainer.diverged}", file=sys.stderr, flush=True)
        return ExitCode.DIVERGED
    preempted = trainer.preempted_signal
    if preempted and rank() == 0:
        write_preempted(run, trainer.step, preempted, trainer.stop_reason)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Preempted: checkpoint saved, exiting" if preempted else "Training finished")
    return 0
