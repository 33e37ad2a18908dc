"""What FP8 telemetry (`fp8.stats_freq`, train/components/fp8_stats.py) costs: step time
with it off vs on.

Why one run and not two: the telemetry does nothing on a step that is not a stats step
(no hooks are installed), so the steps between stats steps of one run are the run
without it, measured on the same process, data and machine load. Two separate runs on a
shared 2-core machine differ by more than the thing measured. So this trains once
(`torchrun -m train`, metrics every step) with `fp8.stats_freq = F` and compares, from
`RUN/metrics.jsonl`'s per-step `step_time_s`:
- off: the median step that is neither a stats step nor the one after it (the stats
  reduction and the RUN/fp8_stats.jsonl write run while the stats step is logged, which
  torchtitan's timer books on the next step),
- on: a stats step plus the step after it, minus two "off" steps: the extra seconds one
  stats step costs (median over the stats steps after warm-up),
- the ratio of the whole run's time with stats every F steps to without:
  (F x off + extra) / (F x off).

    python scripts/bench_fp8_stats.py --data DATA --steps 42 --warmup 5 --stats-freq 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common.run_layout import read_metrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import bench_common  # noqa: E402


def step_times(run_dir: Path) -> dict[int, float]:
    """step -> step_time_s, the last record of each step (a validation row has none)."""
    rows, _ = read_metrics(run_dir)
    return {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}


def cost(times: dict[int, float], freq: int, warmup: int) -> dict:
    """Step time off, the extra seconds of one stats step, and the run-time ratio at `freq`
    (see the module docstring)."""
    stats_steps = [s for s in times if s > warmup and s % freq == 0 and s + 1 in times]
    plain = [t for s, t in times.items() if s > warmup and s % freq != 0 and (s - 1) % freq != 0]
    if not stats_steps or len(plain) < 3:
        raise ValueError(
            f"{len(stats_steps)} stats steps and {len(plain)} plain steps after warm-up "
            f"{warmup}: raise --steps (at least warmup + 2 x stats_freq + 2)"
        )
    off = statistics.median(plain)
    extra = statistics.median(times[s] + times[s + 1] - 2 * off for s in stats_steps)
    return {
        "stats_freq": freq,
        "stats_steps": stats_steps,
        "num_plain_steps": len(plain),
        "step_s_off": off,
        "stats_step_extra_s": extra,
        "stats_step_over_plain": (off + extra) / off,
        "run_time_ratio": (freq * off + extra) / (freq * off),
    }


def to_markdown(report: dict) -> str:
    c = report["cost"]
    ratio_100 = (100 * c["step_s_off"] + c["stats_step_extra_s"]) / (100 * c["step_s_off"])
    lines = [
        *bench_common.report_header(report, f"FP8 telemetry cost: {report['name']}"),
        f"- {report['nproc']} rank(s), {report['steps']} steps, first {report['warmup']} "
        f"left out; stats steps measured: {c['stats_steps']}",
        f"- command: `{report['command']}`",
        f"- training command: `{report['train_command']}`",
        "",
        "| | seconds |",
        "| --- | ---: |",
        f"| step, stats off (median of {c['num_plain_steps']} steps) | {c['step_s_off']:.3f} |",
        f"| extra per stats step (median) | {c['stats_step_extra_s']:.3f} |",
        f"| a stats step / a plain step | {c['stats_step_over_plain']:.2f}x |",
        "",
        f"Run time with `fp8.stats_freq = {c['stats_freq']}` over run time without: "
        f"**{c['run_time_ratio']:.3f}x**; at `stats_freq = 100`: {ratio_100:.4f}x "
        "(computed from the same numbers).",
    ]
    return "\n".join(lines) + "\n"


def bench(args: argparse.Namespace, extra: list[str], raw_argv: list[str]) -> int:
    if args.stats_freq < 2:
        raise ValueError(f"--stats-freq {args.stats_freq}: give 2 or more (plain steps between)")
    overrides = [*bench_common.data_overrides(args.data), *extra]
    with bench_common.work_dir(None, "bench_fp8_stats_") as work:
        folder = work / "run"
        cmd = ["-m", "train", "--config", args.config, *overrides]
        cmd += [*bench_common.measuring(args.steps), "--fresh", "--fp8.enable=true"]
        cmd += [f"--fp8.stats_freq={args.stats_freq}", "--job.folder", json.dumps(str(folder))]
        train_command = bench_common.torchrun(args.nproc, cmd, work / "train.log", args.timeout)
        result = cost(step_times(folder), args.stats_freq, args.warmup)
    report = {
        **bench_common.report_head(args.name, "bench_fp8_stats.py", raw_argv),
        "train_command": train_command,
        "config": args.config,
        "overrides": overrides,
        "nproc": args.nproc,
        "steps": args.steps,
        "warmup": args.warmup,
        "cost": result,
    }
    bench_common.write_report(args.out / args.name, report, to_markdown(report), data=args.data)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/debug.toml")
    parser.add_argument("--data", type=Path, required=True, help="prepared DATA dir")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=42)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out")
    parser.add_argument("--stats-freq", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench")
    parser.add_argument("--name", default="fp8_stats")
    parser.add_argument("--timeout", type=float, default=1800)
    return bench_common.cli(parser, bench, argv)


if __name__ == "__main__":
    sys.exit(main())
