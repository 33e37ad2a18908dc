"""`python -m train.forensics RUN --incident K`: the command and its driver (what it does
and why: the package's docstring). `--help` imports no torch: the replay is imported
when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from common.io import ArgumentParser, append_jsonl, read_jsonl, write_json_atomic
from common.run_layout import (
    CHECKPOINT_DIR,
    CONFIG,
    INCIDENTS,
    METRICS,
    RANK_TIMES,
    checkpoint_dir,
    forensics_replay_dir,
    forensics_report,
    is_complete_checkpoint,
    read_metrics,
)
from dataloader.provenance import Provenance
from train.config import load_config, parse_override_args
from train.console import quiet_console
from train.forensics.report import (
    format_report,
    fp8_statistics,
    original_losses,
    quarantine_records,
    rank_documents,
    read_incident,
    select_for_quarantine,
    spiking_steps,
)
from train.ledger.readers import window_documents
from train.preflight import preflight
from train.runtime import (
    prepare_runtime,
    rank,
    set_single_process_env,
    user_error,
    world_size,
)

# what may differ from the run in a replay: how it is laid out, never what it computes
LAYOUT_SECTIONS = ("parallelism", "activation_checkpoint", "compile", "comm")


# ============================================================================== the command
def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(
        prog="python -m train.forensics",
        description="Replay a loss spike from the checkpoint before it and rank the spiking "
        "step's documents by loss (docs/reliability.md, 'Spike forensics').",
        epilog="Layout overrides (--parallelism.*, --activation_checkpoint.*, --compile.*, "
        "--comm.*) fit the replay to fewer ranks; under torchrun it runs on that many.",
    )
    parser.add_argument(
        "run", help="the run folder (RUN/config.toml, incidents.jsonl, checkpoint/)"
    )
    parser.add_argument(
        "--incident", type=int, required=True, help="which loss spike: 1 for the first one"
    )
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=8,
        help="rank a document only with at least this many tokens in the spiking step(s)",
    )
    parser.add_argument("--show", type=int, default=10, help="documents shown in the table")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument(
        "--quarantine-top",
        type=int,
        metavar="N",
        help="quarantine the N worst ranked documents (a resume never trains them again)",
    )
    chosen.add_argument(
        "--quarantine-above",
        type=float,
        metavar="LOSS",
        help="quarantine every ranked document with a mean per-token loss above LOSS",
    )
    return parser.parse_known_args(argv)


def check_overrides(rest: list[str]) -> None:
    for key, _ in parse_override_args(rest):
        if key.split(".", 1)[0] not in LAYOUT_SECTIONS:
            raise ValueError(
                f"override {key}: a replay may change only the layout ({', '.join(LAYOUT_SECTIONS)}); "
                "anything else would change the numbers it must reproduce"
            )


def replay_config(run, run_dir: Path, incident: dict, world: int):
    """The run's trainer config for the replay: its own folder, no saves, no validation,
    no spike rule, a metrics line every step; everything that computes, the run's."""
    from train.build import to_trainer_config
    from train.forensics.replay import ForensicsTrainer, ReplayConfig

    run.health.spike_rollback = False  # it trains into the spike on purpose
    run.validation.enable = False
    run.metrics.log_freq, run.metrics.tensorboard = 1, False
    run.fp8.stats_freq = 0  # the run's own statistics are read from RUN/fp8_stats.jsonl
    base = to_trainer_config(run, world)
    config = ForensicsTrainer.Config(
        **{f.name: getattr(base, f.name) for f in fields(base)},
        replay=ReplayConfig(last_step=int(incident["step"]), scored_steps=spiking_steps(incident)),
    )
    checkpoint = config.checkpoint
    # absolute: not under RUN/forensics, the replay's job folder (`forensics` sets it)
    checkpoint.folder = str((run_dir / CHECKPOINT_DIR).resolve())
    checkpoint.load_step = int(incident["rolled_back_to"])
    checkpoint.load_only, checkpoint.keep_latest_k = True, 0  # never writes into RUN/checkpoint
    return config


def prepare_replay_dir(replay_dir: Path, before: list[dict]) -> None:
    """The replay's folder: no stale metrics of an earlier replay (rank 0), and the
    incidents in force before the spike, which its trainer reads at start as a resume would.
    No collective orders the ranks before the trainer starts, so every rank writes the file
    itself before it reads it: the same bytes, through a temp file of its own, renamed."""
    replay_dir.mkdir(parents=True, exist_ok=True)
    if rank() == 0:
        for stale in (METRICS, RANK_TIMES):
            (replay_dir / stale).unlink(missing_ok=True)
    path = replay_dir / INCIDENTS
    if not before:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f"{path.name}.rank{rank()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in before))
    os.replace(tmp, path)


def forensics(args: argparse.Namespace, rest: list[str]) -> int:
    run_dir = Path(args.run)
    config_path = run_dir / CONFIG
    if not config_path.is_file():
        raise ValueError(f"{config_path} does not exist: give the folder of a training run")
    if args.quarantine_top is not None and args.quarantine_top < 1:
        raise ValueError(f"--quarantine-top {args.quarantine_top}: give N >= 1 documents")
    check_overrides(rest)
    run = load_config(config_path, rest)
    if run.parallelism.cp > 1:
        raise ValueError(
            f"parallelism.cp = {run.parallelism.cp}: train.forensics scores whole rows on one "
            "rank; pass --parallelism.cp 1 (the replay's losses stay within fp32 tolerance; "
            "docs/reliability.md, 'Spike forensics', gives the sizes that fit at cp 1)"
        )
    number = args.incident
    incident, before = read_incident(run_dir, number)
    target = int(incident["rolled_back_to"])
    if not is_complete_checkpoint(checkpoint_dir(run_dir, target)):
        raise ValueError(
            f"{checkpoint_dir(run_dir, target)}: incident {number} rolled back to this "
            "checkpoint and the replay starts from it, but it is gone or incomplete "
            "(keep_last spares it until this incident's report exists: it was deleted by "
            "hand, or purged by a run from before that rule)"
        )
    replay_dir = forensics_replay_dir(run_dir, number)
    run.job.folder = str(replay_dir)  # the replay's own folder: nothing of RUN is its job's
    run.checkpoint.async_mode = "disabled"  # it loads and never saves: the host stages nothing
    set_single_process_env()
    world = world_size()
    # world size vs batch and degrees, tokenizer vs data; never RUN/budgets.json, the
    # training run's plan for its own layout (train/forensics/plan.py)
    preflight(run, world, budgets=False)
    prepare_runtime()  # before torchtitan's trainer is imported
    import torch.distributed as dist

    from train.console import configure_console

    planned = None
    if rank() == 0:  # the replay's own memory plan, before anything is loaded
        from train.forensics.plan import check_replay_fits, replay_run, seq_len_at

        replayed = list(range(target + 1, int(incident["step"]) + 1))
        planned = check_replay_fits(replay_run(run, seq_len_at(run, replayed)), world)
    configure_console(rank(), world)
    prepare_replay_dir(replay_dir, before)
    trainer = replay_config(run, run_dir, incident, world).build()
    try:
        trainer.train()
        rows = trainer.gather_scores()
    finally:
        trainer.close()
    if rank() == 0:
        report = build_report(args, run, run_dir, replay_dir, incident, rows, trainer, planned)
        print(format_report(report, args.show), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def build_report(args, run, run_dir, replay_dir, incident, rows, trainer, planned) -> dict:
    """Rank 0: rank the documents, compare the losses, find the FP8 statistics, write the
    JSON report and any quarantine records; the report as a dict."""
    loader = trainer.dataloader
    datasets = [
        {"path": entry.path, "content_sha256": part["content_sha256"]}
        for entry, part in zip(run.dataloader.mix, loader.fingerprint_parts, strict=True)
    ]
    # the seam: each row's documents, named as `python -m train.ledger which` names them
    provenances = [Provenance.of(stream.manifest) for stream in loader.datasets]
    ranked = rank_documents(
        rows,
        datasets,
        lambda d, first, stop: window_documents(loader.datasets[d], provenances[d], first, stop),
        args.min_tokens,
    )
    target, spike_step = int(incident["rolled_back_to"]), int(incident["step"])
    replayed = list(range(target + 1, spike_step + 1))
    original = original_losses(run_dir, incident, replayed)
    replay_lines, _ = read_metrics(replay_dir)
    replay = {r["step"]: r["loss"] for r in replay_lines if "loss" in r}
    losses = []
    for step in replayed:
        mine = [r for r in rows if r.step == step]
        logged = original.get(step, {})
        entry = {"step": step, "run": logged.get("loss"), "replay": replay.get(step)}
        entry["from"] = logged.get("from")
        if mine:  # a spiking step: the model's loss, and what the trainer logs (with faults)
            tokens = sum(len(r.losses) for r in mine)
            sums = [float(r.losses.sum(dtype=np.float64)) for r in mine]
            entry["model"] = sum(sums) / tokens
            entry["model_with_faults"] = (
                sum(r.factor * x for r, x in zip(mine, sums, strict=True)) / tokens
            )
        losses.append(entry)
    fp8_records, fp8_note = fp8_statistics(run_dir, incident)
    path = forensics_report(run_dir, args.incident)
    report = {
        "run": str(run_dir),
        "argv": list(args.argv),  # the command that made it
        "number": args.incident,
        "incident": incident,
        "checkpoint_step": target,
        "replayed_steps": replayed,
        "spiking_steps": spiking_steps(incident),
        "world_size": world_size(),
        "plan": planned.to_json(),
        "losses": losses,
        "min_tokens": args.min_tokens,
        "documents": [e.to_json() for e in ranked],
        "fp8": {"records": fp8_records, "note": fp8_note},
        "report_path": str(path),
    }
    if args.quarantine_top is not None or args.quarantine_above is not None:
        selected = select_for_quarantine(ranked, args.quarantine_top, args.quarantine_above)
        everything, _ = read_jsonl(run_dir / INCIDENTS)
        records = quarantine_records(selected, incident, args.incident, everything, time.time())
        for record in records:
            append_jsonl(run_dir / INCIDENTS, record)
        report["quarantined"] = records
        report["quarantined_lines"] = [
            "",
            f"quarantined {len(records)} document(s) in {run_dir / INCIDENTS} "
            f"({len(selected) - len(records)} already were): a resume passes over their "
            "windows in every epoch",
        ]
    write_json_atomic(path, report)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parse_args(argv)
    args.argv = argv
    quiet_console(rank(), world_size())
    try:
        return forensics(args, rest)
    except ValueError as e:
        return user_error(e)


if __name__ == "__main__":
    sys.exit(main())
