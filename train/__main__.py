"""`python -m train --config configs/NAME.toml [--section.key VALUE | --set section.key=VALUE]...`

Modelled on torchtitan's own `torchtitan/train.py:main()`: build the Trainer from a
config, train, close, tear down the process group. Before that it fills torch's version
gaps (`train.version_compat`, every device), applies the CPU accommodations
(`train.cpu_compat`, a no-op on GPU), checks the inputs a user most often
gets wrong (world size vs parallel degrees with `train.config.check_launch`, the check
`--dry-run` makes too; tokenizer vs model vocab, data prepared with another tokenizer,
--fresh over existing checkpoints) and writes `RUN/config.toml`. The torchtitan config
comes from `train.build.to_trainer_config`.

User errors (any `ValueError`, including torchtitan's config checks) end the run with one
line `error: ...` on stderr (printed by rank 0 only under torchrun) and exit code 2 on every
rank; set TRAIN_DEBUG=1 for the traceback. A preemption signal ends it with exit code 0
after a checkpoint and `RUN/preempted.json`. Too many consecutive non-finite steps
(`train.health`) end it with one line `error: step N: ... Last good checkpoint: ...` and
exit code 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dataloader.common import write_json_atomic
from train.config import ConfigError, RunConfig, check_launch, load_config, save_config
from train.console import quiet_unshown_rank

EXIT_USER_ERROR = 2


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a Llama-style model with torchtitan from a TOML run config.",
        epilog="Any other --section.key VALUE or --set section.key=VALUE overrides the config.",
    )
    parser.add_argument("--config", required=True, help="run config TOML (see configs/)")
    parser.add_argument(
        "--fresh", action="store_true", help="start from scratch; refuses if RUN has checkpoints"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="with --fresh: delete RUN's checkpoints"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="plan memory/throughput, do not train"
    )
    parser.add_argument("--world-size", type=int, default=None, help="--dry-run: number of GPUs")
    parser.add_argument("--gpu", default="h100", help="--dry-run: GPU kind")
    return parser.parse_known_args(argv)


def check_data(run: RunConfig) -> None:
    """Tokenizer vs model vocab, and each dataset vs the configured tokenizer."""
    from tokenizers import Tokenizer

    from dataloader import Manifest

    tokenizer_json = Path(run.dataloader.tokenizer) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ConfigError(
            f"dataloader.tokenizer: {tokenizer_json} not found; point it at DATA/tokenizer "
            "written by dataloader.prepare"
        )
    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    if vocab > run.model.vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_json} has {vocab} tokens but model.vocab_size is "
            f"{run.model.vocab_size}; set model.vocab_size >= {vocab}"
        )
    entries = list(run.dataloader.mix) + (list(run.validation.mix) if run.validation.enable else [])
    for entry in entries:
        manifest = Manifest.load(entry.path)
        manifest.check_vocab(run.model.vocab_size)
        manifest.check_tokenizer(tokenizer_json)


def check_fresh(run: RunConfig, fresh: bool, overwrite: bool) -> None:
    from train.checkpoint import list_checkpoints

    if overwrite and not fresh:
        raise ConfigError(
            "--overwrite only applies with --fresh (delete RUN's checkpoints and start over)"
        )
    folder = run.run_dir / "checkpoint"
    complete, incomplete = list_checkpoints(folder)
    if fresh and (complete or incomplete) and not overwrite:
        raise ConfigError(
            f"--fresh: {folder} already holds checkpoints (steps {(complete + incomplete)}); "
            "add --overwrite to delete them, or drop --fresh to resume"
        )


def prepare_run_dir(run: RunConfig) -> None:
    """Rank 0: RUN/config.toml (resolved) and no stale preempted.json / diverged.json."""
    if _rank() != 0:
        return
    run.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("preempted.json", "diverged.json"):
        (run.run_dir / stale).unlink(missing_ok=True)
    save_config(run, run.run_dir / "config.toml")


def write_preempted(run: RunConfig, step: int, signum: int) -> None:
    import signal

    record = {"step": step, "signal": signal.Signals(signum).name, "time": time.time()}
    write_json_atomic(run.run_dir / "preempted.json", record)


def train(run: RunConfig, fresh: bool) -> int:
    import torch
    from torchtitan.tools.logging import logger

    from train import watchdog
    from train.build import to_trainer_config
    from train.console import configure_console
    from train.health import EXIT_NONFINITE
    from train.trainer import RunTrainer, install_preemption_handlers

    configure_console(_rank(), _world_size())
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
        if _rank() == 0:
            # a diverged run stays stopped: train.sbatch reads this and does not requeue
            write_json_atomic(
                run.run_dir / "diverged.json",
                {"step": trainer.step, "reason": trainer.health.stop, "time": time.time()},
            )
            print(f"error: {trainer.health.stop}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    preempted = trainer.preempted_signal
    if preempted and _rank() == 0:
        write_preempted(run, trainer.step, preempted)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Preempted: checkpoint saved, exiting" if preempted else "Training finished")
    return 0


def set_single_process_env() -> None:
    """Let `python -m train` run as one process without torchrun.

    torchtitan reads the rendezvous from the environment torchrun sets; a plain
    `python -m train` is a world of one, so give it that environment (a free loopback
    port, so two single-process runs on one machine do not collide).
    """
    if "LOCAL_RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    defaults |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def prepare_runtime(accelerator: bool | None = None) -> None:
    """Version gaps on every device, then the CPU accommodations where there is no
    accelerator (`accelerator` defaults to this machine's). Once per process, before
    torchtitan's trainer is imported, by entry points only (this one, `--dry-run`, the
    benchmarks and in-process tests): building a config or a model spec never patches."""
    from train import cpu_compat, version_compat

    version_compat.apply()
    cpu_compat.apply(accelerator)


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        quiet_unshown_rank(_rank(), _world_size())
        run = load_config(args.config, rest)
        if args.dry_run:
            world_size = args.world_size or _world_size()
            check_launch(run, world_size)  # what a launch refuses, refused before torch loads
            from train.dry_run import run_dry

            prepare_runtime()
            return run_dry(run, world_size, args.gpu)

        set_single_process_env()
        check_launch(run, _world_size())
        check_fresh(run, args.fresh, args.overwrite)
        check_data(run)
        prepare_runtime()  # before torchtitan's trainer is imported
        prepare_run_dir(run)
        return train(run, fresh=args.fresh)
    except ValueError as e:
        if os.environ.get("TRAIN_DEBUG") == "1":
            raise
        if _rank() == 0:
            message = " ".join(str(e).split())
            print(f"error: {message}", file=sys.stderr, flush=True)
        elif _world_size() > 1:
            # Every rank meets the same user error; torchrun kills the others as soon as
            # one exits, so let rank 0 print its line and exit first.
            time.sleep(3)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
