"""The GPU check: one prepared call that makes a short lease of a GPU machine count.

Why: a lease is short (15 minutes of device time, every start and idle wait included) on a
machine with its own image (torch 2.11, no package registry, at most 64 MiB carried, at most
8 files back). Nothing that makes this an FP8 GPU pipeline (float8 GEMMs, FlexAttention's
block tables, compile with activation checkpointing, the CUDA branch of every device check)
can run in CI. So the check is written, rehearsed and kept working on CPU, and a lease
spends its minutes measuring, not discovering.

How, in three commands (docs/testing.md, "The GPU check"):

    python scripts/gpu_check prepare             # here, on CPU: .gpu_check/ (git-ignored)
    device run, carry [".gpu_check"]:            # the one call, < 2,000 characters
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \\
            .gpu_check/wheels/*.whl && PYTHONPATH=/tmp/site python3 scripts/gpu_check run --out $OUT
    python scripts/gpu_check run --rehearse --out DIR   # CI: every part, tiny, on CPU

`prepare` downloads the wheels the device image lacks (`prepare.WHEELS`, the versions of
this project's venv, for Python 3.12 manylinux x86_64), prepares the Shakespeare data, runs
the planner for the `layers` part's runs, and copies vLLM's Triton attention kernels. `run`
runs the parts (`parts.PARTS`, `scaling.PARTS`) in `CAPS` order, each in its own process
under its own cap (time a part leaves unused passes to the next), records a failure with
its error and goes on, then writes `report.json`, `report.md` and `check.log` to `--out`,
the machine's paths written as `$WORK`, `$SITE` and `$REPO`. By default it runs the parts
that fit one device call (`FIRST_CALL`, `CALL_S`); the others take `--parts`. Commit a
real run's report under docs/bench/gpu/ (`report.markdown`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import parts as parts_module  # noqa: E402
import report as report_module  # noqa: E402
import scaling  # noqa: E402

# seconds per part on the GPU, in run order, issue 41's replica part first, then issue
# 43's (the 2026-11-26 H100 measured the others); unused time passes to the next part. One
# device call runs the parts that fit in CALL_S (the 600 s call less the wheels' install
# and the start; `layers` skips the runs its cap leaves no time for); the rest is
# `--parts flex,gemm,trainer,vllm` on another lease. The flex part runs before the
# trainer so that it finds the autotuned flex kernels cached.
CAPS = {"env": 15, "replica": 60, "tp_shapes": 45, "layers": 300, "parity": 120, "flex": 90,
        "gemm": 40, "trainer": 120, "vllm": 30}  # fmt: skip
CALL_S = 540
FIRST_CALL = [n for i, n in enumerate(CAPS) if sum(list(CAPS.values())[: i + 1]) <= CALL_S]
PARTS = parts_module.PARTS | scaling.PARTS
assert sorted(CAPS) == sorted(PARTS)
# the CPU rehearsal's caps: generous for 2 loaded cores, and no timing claims
REHEARSAL_CAPS = {"env": 60, "replica": 120, "tp_shapes": 60, "layers": 240, "parity": 180, "flex": 120,
                  "gemm": 60, "trainer": 240, "vllm": 120}  # fmt: skip


def run_part(name: str, rehearse: bool, work: Path, inputs: Path, budget_s: float) -> int:
    """The child: one part, its result (or its error) written to work/NAME.json."""
    ctx = parts_module.Context(
        rehearse=rehearse, work=work / name, inputs=inputs, deadline=time.monotonic() + budget_s
    )
    ctx.work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        result = {"ok": True, **PARTS[name](ctx)}
    except Exception as err:
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    result["seconds"] = round(time.monotonic() - t0, 1)
    (work / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def kill_child_groups(work: Path) -> None:
    """The trainers a part started run in process groups of their own (so that a part
    can stop one cleanly); whatever of them outlived the part goes now."""
    path = work / parts_module.CHILD_GROUPS
    if not path.exists():
        return
    for pid in path.read_text().split():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(pid), signal.SIGKILL)
    path.unlink()


def run_parts(
    names: list[str],
    rehearse: bool,
    work: Path,
    inputs: Path,
    log: Path,
    caps: dict[str, float],
    after_each=lambda results: None,
) -> dict:
    results: dict = {}
    banked = 0.0
    env = parts_module._env_with_repo()
    if rehearse:
        # no GPU: Triton kernels (vLLM's, in the vllm part) run under Triton's interpreter,
        # which must be on before anything imports triton (tests/conftest.py says why)
        env["TRITON_INTERPRET"] = "1"
    for name in names:
        budget = caps[name] + banked
        t0 = time.monotonic()
        cmd = [sys.executable, str(Path(__file__).resolve().parent), "part", name,
               "--work", str(work), "--inputs", str(inputs), "--budget", str(budget)]  # fmt: skip
        cmd += ["--rehearse"] if rehearse else []
        with open(log, "ab") as sink:
            sink.write(f"\n===== part {name} (cap {budget:.0f} s) =====\n".encode())
            sink.flush()
            proc = subprocess.Popen(
                cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
            try:
                proc.wait(timeout=budget + 5)  # the part stops its own children first
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
            kill_child_groups(work)
            # the trainers' own logs come back inside check.log (8 files at most come back)
            for child_log in sorted((work / name).glob("*.log")):
                sink.write(f"\n----- {child_log.name} -----\n".encode())
                sink.write(child_log.read_bytes()[-400_000:])
        took = time.monotonic() - t0
        path = work / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
        else:
            why = (
                f"timed out after {took:.0f} s (cap {budget:.0f} s)"
                if timed_out
                else (f"exited {proc.returncode} without a result")
            )
            results[name] = {"ok": False, "error": why, "seconds": round(took, 1)}
        banked = max(0.0, budget - took)
        print(f"[gpu_check] {name}: {'ok' if results[name].get('ok') else 'FAILED'} "
              f"in {took:.0f} s", flush=True)  # fmt: skip
        after_each(results)  # the report so far: a call cut off still brings back the parts done
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/gpu_check", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="on this machine: make .gpu_check/ for the device call")
    prep.add_argument("--inputs", type=Path, default=parts_module.REPO / ".gpu_check")
    prep.add_argument("--no-wheels", action="store_true", help="skip the wheel download")
    prep.add_argument("--plan-combos", type=int, help="plan the first N layer groups (tests)")
    run = sub.add_parser("run", help="run every part and write the report to --out")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--inputs", type=Path, default=parts_module.REPO / ".gpu_check")
    run.add_argument("--rehearse", action="store_true", help="tiny shapes on CPU (CI)")
    run.add_argument(
        "--parts",
        default=",".join(FIRST_CALL),
        help=f"comma-separated, of {','.join(CAPS)} (default: what fits one call)",
    )
    run.add_argument("--caps-scale", type=float, default=1.0, help="multiply every cap (tests)")
    one = sub.add_parser("part", help=argparse.SUPPRESS)
    one.add_argument("name", choices=sorted(CAPS))
    one.add_argument("--work", type=Path, required=True)
    one.add_argument("--inputs", type=Path, required=True)
    one.add_argument("--budget", type=float, required=True)
    one.add_argument("--rehearse", action="store_true")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        import prepare

        prepare.prepare(args.inputs, wheels=not args.no_wheels, combos=args.plan_combos)
        return 0
    if args.command == "part":
        return run_part(args.name, args.rehearse, args.work, args.inputs, args.budget)

    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CAPS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {', '.join(CAPS)}")
    if not args.rehearse and not (args.inputs / "plan.json").exists():
        print(f"note: {args.inputs}/plan.json missing: run `python scripts/gpu_check prepare` "
              "first; the layers part reports no prediction", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    # scratch: the parts' runs and results, never under --out (8 files come back at most)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=os.environ.get("GPU_CHECK_WORK")))
    log = args.out / "check.log"
    log.unlink(missing_ok=True)
    started = dt.datetime.now(dt.UTC)
    caps = {n: (REHEARSAL_CAPS if args.rehearse else CAPS)[n] * args.caps_scale for n in names}
    t0 = time.monotonic()

    def write_report(results: dict) -> dict:
        report = {
            "date": started.isoformat(timespec="seconds"),
            "commit": _commit(),
            "rehearsal": args.rehearse,
            "gpu": _gpu_name(),
            "wall_s": round(time.monotonic() - t0, 1),
            "caps_s": caps,
            "parts": results,
        }
        (args.out / "report.json").write_text(scrub(json.dumps(report, indent=1, default=str)))
        (args.out / "report.md").write_text(scrub(report_module.markdown(report)))
        log.write_text(scrub(log.read_text(errors="replace")))  # no part writes it now
        return report

    # a report fit for the repo: no path of this machine's in it
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    names_of = {str(work): "$WORK", **dict.fromkeys(site, "$SITE"), str(parts_module.REPO): "$REPO"}

    def scrub(text: str) -> str:
        for path in sorted(names_of, key=len, reverse=True):
            text = text.replace(path, names_of[path])
        return text

    results = run_parts(names, args.rehearse, work, args.inputs, log, caps, write_report)
    report = write_report(results)
    print(report_module.summary_table(report), flush=True)
    return 0


def _gpu_name() -> str:
    """The GPU's name, whichever parts ran (nvidia-smi: this process holds no CUDA context)."""
    try:
        return parts_module.nvidia_smi("name").splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "no GPU"


def _commit() -> str:
    # prepare records the checkout's commit (the device's copy of the tree may carry an
    # older .git, or none)
    marker = parts_module.REPO / ".gpu_check" / "commit"
    if marker.exists():
        return marker.read_text().strip()
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=parts_module.REPO, capture_output=True,
            text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
