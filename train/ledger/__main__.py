"""`python -m train.ledger verify|which|coverage RUN`: the data ledger's command and its
printing (the ledger itself: the package's docstring). Torch-free: it imports the
verifier's rooms and `train.config`, never the recorder or the trainer.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import train.ledger
from common.io import ArgumentParser, run_cli
from train.ledger.readers import coverage, which
from train.ledger.replicas import run_replay


# ------------------------------------------------------------------------ verify
def verify(run_dir: str | Path, out=sys.stdout) -> int:
    """Print one line per finding; 0 when every step verified, 1 at a mismatch or gap."""
    replay, merge = run_replay(run_dir)  # replica groups: their ledgers merged first
    for finding in merge + replay.findings:
        print(finding.line(), file=out)
    steps = sorted(replay.final)
    bad = next((f for f in merge if f.bad), None) or replay.first_bad
    if bad is not None:
        where = f"step {bad.step}" if bad.step is not None else "the ledger"
        print(f"FAILED: first bad step: {where}: {bad.text}", file=out)
        return 1
    if not steps:
        print("FAILED: the ledger has no step records", file=out)
        return 1
    print(
        f"OK: steps 1-{steps[-1]} verified ({len(steps)} in the final lineage, "
        f"{len(replay.superseded)} superseded record(s), {len(replay.segments)} segment(s), "
        f"{len(replay.incidents.spikes)} rollback(s))",
        file=out,
    )
    return 0


def _print_which(run_dir: str, step: int, as_json: bool) -> None:
    record, rows = which(run_dir, step)
    if as_json:
        print(
            json.dumps(
                {"step": step, "applied": record.get("applied"), "rows": [asdict(r) for r in rows]}
            )
        )
        return
    print(
        f"step {step}: {len(rows)} rows of {rows[0].seq_len if rows else 0} tokens"
        + ("" if record.get("applied", True) else " (update not applied)")
    )
    for row in rows:
        docs = ", ".join(
            (f"{d.source} record {d.record}" if d.source is not None else f"document {d.document}")
            + f" [{d.window_start}:{d.window_end}] of {d.end - d.start}"
            for d in row.documents
        )
        print(
            f"sequence {row.sequence} {row.dataset_path} epoch {row.epoch} tokens "
            f"[{row.start}, {row.start + row.seq_len}): {docs}"
        )
    if rows and rows[0].documents and rows[0].documents[0].source is None:
        print(
            "provenance unavailable: the data was prepared before manifest format 2; "
            "re-prepare it to name source files and records"
        )


def _print_coverage(run_dir: str, as_json: bool) -> int:
    result = coverage(run_dir)
    if as_json:
        print(json.dumps(result))
    else:
        for d in result["datasets"]:
            print(
                f"{d['path']}: {d['input_tokens_per_epoch']} input tokens an epoch, "
                f"{d['epochs']} epoch(s) drawn from"
            )
            print(f"  trained once          {d['trained_once']}")
            print(f"  trained twice         {d['trained_twice']}  (within an epoch: must be 0)")
            print(
                f"  skipped               "
                f"{d['skipped_ranges'] + d['skipped_cuts_and_tails'] + d['skipped_unapplied']}"
                f"  (skip ranges {d['skipped_ranges']} in {d['skipped_sequences']} sequences; "
                f"group cuts, block tails and quarantined windows {d['skipped_cuts_and_tails']}; "
                f"updates not applied {d['skipped_unapplied']})"
            )
            print(f"  not reached           {d['not_reached']}")
        loader = result["loader"]
        print(
            f"loader counters after step {result['steps']}: skipped sequences "
            f"{loader['sequences']}, skipped tokens {loader['tokens']}; torn ledger lines "
            f"left out {result['torn_lines']}"
        )
    twice = sum(d["trained_twice"] for d in result["datasets"])
    if twice:
        print(f"FAILED: {twice} token(s) trained more than once within an epoch")
        return 1
    return 0


# ------------------------------------------------------------------------ the command
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m train.ledger", description=train.ledger.__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "verify", help="recompute every record; exit 1 at the first bad step"
    )
    check.add_argument("run", help="the run folder RUN (holds ledger.jsonl)")
    look = commands.add_parser("which", help="the documents (source file, record) of a step's rows")
    look.add_argument("run")
    look.add_argument(
        "--step", type=int, required=True, help="an optimizer step of the final lineage"
    )
    look.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    count = commands.add_parser(
        "coverage", help="per dataset: tokens trained once, twice, skipped, not reached"
    )
    count.add_argument("run")
    count.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)

    def body():
        if args.command == "verify":
            return verify(args.run)
        if args.command == "which":
            return _print_which(args.run, args.step, args.json)
        return _print_coverage(args.run, args.json)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
