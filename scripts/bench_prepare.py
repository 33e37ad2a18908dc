#!/usr/bin/env python3
"""Benchmark `dataloader.prepare`: one process vs N array-style tasks, tokens/s per core.

Why: the distributed prepare (`--num-tasks/--task-index`, then `--merge`) is only worth
having if a task tokenizes as fast per core as the single-process run, and the merge
(which reads no tokens) stays small next to the tasks. This script measures, on jsonl
files built from the embedded Shakespeare corpus, at two corpus sizes:

- `single`: `python -m dataloader.prepare` in one process (`--num-workers 1`);
- `baseline` (with `--baseline-rev REV`): the same with the prepare.py of git revision
  REV (the design before work units), in the same run;
- `tasks=N`: N separate `--task-index` processes started together (what N array
  elements do, here sharing this machine's cores), then `--merge`; wall time, tokens/s,
  tokens/s per busy core (min(N, cores)), and the merge's own time.

Every multi-task result is checked to have the single-process `content_sha256`.
Writes a markdown table to stdout (and `--out FILE`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_common import device_name, shakespeare, source_at, versions, versions_line  # noqa: E402


def make_corpus(root: Path, num_files: int, copies: int) -> list[Path]:
    """num_files jsonl files, each holding `copies` passes over a slice of the scenes."""
    from dataloader.corpus import iter_documents

    scenes = [d.text for d in iter_documents(["shakespeare"]) if d.text.strip()]
    root.mkdir(parents=True, exist_ok=True)
    per_file = len(scenes) // num_files
    files = [root / f"part{i:03d}.jsonl" for i in range(num_files)]
    for i, path in enumerate(files):
        part = scenes[i * per_file : (i + 1) * per_file]
        texts = (f"[{c}] {t}" for c in range(copies) for t in part)
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return files


def run(cmds: list[list[str]]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of `cmds` started together; a failure
    exits with its stderr."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    start, cpu = time.perf_counter(), usage.ru_utime + usage.ru_stime
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    pipes = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(cmd, env=env, **pipes) for cmd in cmds]
    for cmd, proc in zip(cmds, procs, strict=True):
        err = proc.communicate()[1]
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime - cpu


def prepare_cmd(files, out, tokenizer, shard_chars, *extra) -> list[str]:
    args = [a for f in files for a in ("--input", f)]
    args += ["--out", out, "--tokenizer", tokenizer, "--shard-chars", shard_chars]
    args += ["--val-fraction", 0.01, "--num-workers", 1, "--no-progress", *extra]
    return [sys.executable, "-m", "dataloader.prepare", *map(str, args)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="1,2,4", help="task counts to run")
    parser.add_argument(
        "--copies", default="2,8", help="corpus sizes, in passes over Shakespeare (~1.9M tokens)"
    )
    parser.add_argument("--files", type=int, default=16, help="input files per corpus")
    parser.add_argument("--baseline-rev", help="also time dataloader/prepare.py of this git rev")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    from dataloader.manifest import Manifest

    data = shakespeare(work / "tokdata", train_tokenizer=8192, shard_chars=1 << 30)
    tokenizer = data / "tokenizer"
    baseline = work / "baseline_prepare.py"
    if args.baseline_rev:
        baseline.write_text(source_at(args.baseline_rev, "dataloader/prepare.py"))
    cores = os.cpu_count() or 1
    rows = []
    for copies in map(int, args.copies.split(",")):
        files = make_corpus(work / f"raw{copies}", args.files, copies)
        num_bytes = sum(f.stat().st_size for f in files)
        shard_chars = num_bytes // (2 * args.files)  # one unit per file, 2 shards each
        ref = work / f"single{copies}"
        measured = run([prepare_cmd(files, ref, tokenizer, shard_chars)])
        tokens = sum(Manifest.load(ref / s).num_tokens for s in ("train", "val"))
        ref_hash = Manifest.load(ref / "train").content_sha256
        rows.append((copies, tokens, "single process", 1, *measured, None))
        if args.baseline_rev:
            cmd = prepare_cmd(files, work / f"baseline{copies}", tokenizer, shard_chars)
            cmd[1:3] = [str(baseline)]
            rows.append((copies, tokens, f"baseline ({args.baseline_rev})", 1, *run([cmd]), None))
        for num_tasks in map(int, args.tasks.split(",")):
            out = work / f"tasks{copies}-{num_tasks}"
            cmd = prepare_cmd(files, out, tokenizer, shard_chars, "--num-tasks", num_tasks)
            wall, cpu = run([[*cmd, "--task-index", str(i)] for i in range(num_tasks)])
            merge_wall, merge_cpu = run([[*cmd, "--merge"]])
            assert Manifest.load(out / "train").content_sha256 == ref_hash, "differs from single"
            name, busy = f"{num_tasks} tasks + merge", min(num_tasks, cores)
            rows.append(
                (copies, tokens, name, busy, wall + merge_wall, cpu + merge_cpu, merge_wall)
            )

    lines = [
        f"machine: {device_name()}, {versions_line(versions(('tokenizers',)))}, "
        f"date {time.strftime('%Y-%m-%d')}",
        "",
        "| corpus tokens | run | busy cores | wall s | tokens/s | tokens/s per core (wall) "
        "| CPU s | tokens per CPU-s | merge wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for copies, tokens, name, busy, wall, cpu, merge_s in rows:
        lines.append(
            f"| {tokens / 1e6:.1f}M ({copies}x) | {name} | {busy} | {wall:.1f} | "
            f"{tokens / wall / 1e6:.3f}M | {tokens / wall / busy / 1e6:.3f}M | {cpu:.1f} | "
            f"{tokens / cpu / 1e6:.3f}M | {'' if merge_s is None else f'{merge_s:.2f}'} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
