"""`python -m train --config configs/NAME.toml [--section.key VALUE | --set section.key=VALUE]...`

Modelled on torchtitan's own `torchtitan/train.py:main()`: build the Trainer from a
config, train, close, tear down the process group (`train.runtime`). Before that it checks
the inputs a user most often gets wrong (`train.preflight`: world size vs parallel
degrees, the check `--dry-run` makes too; tokenizer vs model vocab, data prepared with
another tokenizer; then --fresh over existing checkpoints, and GPUs this torch cannot
use), fills torch's version gaps and applies the CPU accommodations
(`train.runtime.prepare_runtime`) and writes `RUN/config.toml`.

`--dry-run` plans the run (`train.plan.dry_run`) and prints the time budgets derived from the
plan; with `--write-budgets` it stores the predicted times in `RUN/budgets.json`, which
`--check` and every start read (`train.reliability.budgets`).
`--dry-run --suggest` ranks every layout the launch rules admit for `--world-size` GPUs
by predicted tokens/s/GPU instead (`train.plan.suggest`).

`--check` runs only the torch-free checks (`train.preflight`) for `--world-size` ranks,
and refuses a run folder that a live run holds (`RUN/lease.json`, common/run_lease.py),
then exits: the launchers run it before torchrun starts. A launch checks the lease again
when rank 0 takes it, before anything is written in RUN.

Every start applies the launchers' environment defaults (common/launch_env.py), so a bare
`python -m train` runs with what `scripts/train_local.sh` would give it; a value already in
the environment wins. A torchrun worker ends with its launcher
(`common.process.follow_launcher`).

User errors (any `ValueError`, including torchtitan's config checks) end the run with one
line `error: ...` on stderr (printed by rank 0 only under torchrun) and exit code 2 on every
rank; set TRAIN_DEBUG=1 for the traceback. A preemption signal ends it with exit code 0
after a checkpoint and `RUN/preempted.json`. Too many consecutive non-finite steps
(`train.reliability.health`) end it with one line `error: step N: ... Last good checkpoint: ...` and
exit code 4 (a hang the watchdog detects exits 3; the table of codes: `common.exit_codes`);
`RUN/diverged.json` tells `train.sbatch` not to requeue.
"""

from __future__ import annotations

import argparse
import sys

from common.io import ArgumentParser, cli_error
from common.noise import filter_known_noise
from common.process import follow_launcher
from train.config import load_config
from train.console import quiet_console
from train.launch_rules import check_launch
from train.preflight import preflight
from train.runtime import (
    apply_launch_env,
    check_fresh,
    check_run_dir_free,
    hold_run_dir,
    prepare_run_dir,
    prepare_runtime,
    rank,
    set_single_process_env,
    train,
    user_error,
    world_size,
)

# At import, not in main(): the async checkpoint daemon is a spawned process, which re-imports
# this module (as __mp_main__) and then torchtitan and torchao to unpickle its entry point,
# without running main(); this line is what keeps their import-time noise off its console.
filter_known_noise()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(
        prog="python -m train",
        description="Train a Llama-style model with torchtitan from a TOML run config.",
        epilog="Any other --section.key VALUE or --set section.key=VALUE overrides the config.",
    )
    parser.add_argument("--config", required=True, help="run config TOML (see configs/)")
    parser.add_argument("--world-size", type=int, help="--dry-run / --check: number of ranks")
    parser.add_argument(
        "--gpu",
        default="h100",
        help="--dry-run: GPU kind (h100, h200, mi300x, ...; with --suggest, several "
        "separated by commas compare them)",
    )
    parser.add_argument(
        "--network",
        help="--dry-run: the network between nodes, a preset (ndr-ib, roce, aws-p5-efa, "
        "ethernet, ...); default: the GPU's usual one, printed with the plan",
    )
    for flag, text in (
        ("--fresh", "start from scratch; refuses if RUN has checkpoints"),
        ("--overwrite", "with --fresh: delete RUN's checkpoints"),
        ("--dry-run", "plan memory/throughput, do not train"),
        (
            "--check",
            "check the config, world size and data without torch, then exit (the "
            "launchers' preflight)",
        ),
        (
            "--write-budgets",
            "--dry-run: store the predicted times in RUN/budgets.json, which --check and "
            "every launch read (train/reliability/budgets.py)",
        ),
        ("--suggest", "--dry-run: rank every layout (dp_shard, tp, cp, AC, local batch) that fits"),
    ):
        parser.add_argument(flag, action="store_true", help=text)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    follow_launcher()  # a torchrun worker ends with its launcher
    try:
        apply_launch_env()  # before torch is imported
    except ValueError as e:  # a bad RANK: not yet safe to ask which rank prints
        return cli_error(e)
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        quiet_console(rank(), world_size())
        if args.world_size is not None and args.world_size < 1:
            raise ValueError(
                f"--world-size {args.world_size}: the number of ranks to plan or check for "
                "must be at least 1 (leave it out for this launch's WORLD_SIZE)"
            )
        run = load_config(args.config, rest)
        if args.check and args.dry_run or (args.suggest or args.write_budgets) and not args.dry_run:
            raise ValueError(  # else one of them was silently ignored
                "--suggest and --write-budgets go with --dry-run, and --dry-run not with "
                "--check: python -m train --dry-run [--suggest | --write-budgets]"
            )
        if args.check:
            preflight(run, args.world_size or world_size())
            check_run_dir_free(run)
            return 0
        if args.suggest:
            from train.plan.suggest import run_suggest

            prepare_runtime()
            return run_suggest(run, args.world_size or world_size(), args.gpu, args.network)
        if args.dry_run:
            planned = args.world_size or world_size()
            check_launch(run, planned)  # what a launch refuses, refused before torch loads
            from train.plan.dry_run import run_dry

            if run.replica_groups.groups:  # a run of replica groups: one group is planned
                from train.replica_groups.build import one_group

                run, line = one_group(run)
                print(line)
            prepare_runtime()
            return run_dry(run, planned, args.gpu, args.write_budgets, args.network)

        set_single_process_env()
        preflight(run, world_size())
        with hold_run_dir(run):  # one live run per run folder; before torch is imported
            from train.compat.cpu_compat import check_gpus_usable

            check_gpus_usable()
            check_fresh(run, args.fresh, args.overwrite)
            prepare_runtime()  # before torchtitan's trainer is imported
            prepare_run_dir(run)
            return train(run, fresh=args.fresh)
    except ValueError as e:
        return user_error(e)


if __name__ == "__main__":
    sys.exit(main())
