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
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_common import source_at  # noqa: E402


def make_corpus(root: Path, num_files: int, copies: int) -> list[Path]:
    """num_files jsonl files, each holding `copies` passes over a slice of the scenes."""
    from dataloader.corpus import iter_documents

    scenes = [d.text for d in iter_documents(["shakespeare"]) if d.text.strip()]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    per_file = len(scenes) // num_files
    for i in range(num_files):
        path = root / f"part{i:03d}.jsonl"
        with open(path, "w") as fh:
            for c in range(copies):
                for t in scenes[i * per_file : (i + 1) * per_file]:
                    fh.write(json.dumps({"text": f"[{c}] {t}"}) + "\n")
        files.append(path)
    return files


def children_cpu_s() -> float:
    """User + system CPU seconds of all waited-for child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")


def prepare_cmd(files, out, tokenizer, shard_chars, *extra) -> list[str]:
    args = [a for f in files for a in ("--input", str(f))]
    return [
        sys.executable,
        "-m",
        "dataloader.prepare",
        *args,
        "--out",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--shard-chars",
        str(shard_chars),
        "--val-fraction",
        "0.01",
        "--num-workers",
        "1",
        "--no-progress",
        *map(str, extra),
    ]


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
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    from dataloader.manifest import Manifest
    from dataloader.prepare import PrepareConfig, prepare

    tokenizer = work / "tok"
    if not (tokenizer / "tokenizer.json").is_file():
        prepare(
            PrepareConfig(
                inputs=["shakespeare"],
                out=work / "tokdata",
                train_tokenizer=8192,
                num_workers=1,
                progress=False,
                shard_chars=1 << 30,
            )
        )
        tokenizer = work / "tokdata" / "tokenizer"
    baseline = None
    if args.baseline_rev:
        baseline = work / "baseline_prepare.py"
        baseline.write_text(source_at(args.baseline_rev, "dataloader/prepare.py"))
    cores = os.cpu_count() or 1
    rows = []
    for copies in map(int, args.copies.split(",")):
        files = make_corpus(work / f"raw{copies}", args.files, copies)
        num_bytes = sum(f.stat().st_size for f in files)
        shard_chars = num_bytes // (2 * args.files)  # one unit per file, 2 shards each
        ref = work / f"single{copies}"
        start, cpu = time.perf_counter(), children_cpu_s()
        run(prepare_cmd(files, ref, tokenizer, shard_chars), env)
        wall, cpu = time.perf_counter() - start, children_cpu_s() - cpu
        tokens = sum(Manifest.load(ref / s).num_tokens for s in ("train", "val"))
        ref_hash = Manifest.load(ref / "train").content_sha256
        rows.append((copies, tokens, "single process", 1, wall, cpu, None))
        if baseline is not None:
            out = work / f"baseline{copies}"
            cmd = prepare_cmd(files, out, tokenizer, shard_chars)
            cmd[1:3] = [str(baseline)]
            start, cpu = time.perf_counter(), children_cpu_s()
            run(cmd, env)
            rows.append(
                (
                    copies,
                    tokens,
                    f"baseline ({args.baseline_rev})",
                    1,
                    time.perf_counter() - start,
                    children_cpu_s() - cpu,
                    None,
                )
            )
        for num_tasks in map(int, args.tasks.split(",")):
            out = work / f"tasks{copies}-{num_tasks}"
            start, cpu = time.perf_counter(), children_cpu_s()
            procs = [
                subprocess.Popen(
                    prepare_cmd(
                        files,
                        out,
                        tokenizer,
                        shard_chars,
                        "--num-tasks",
                        num_tasks,
                        "--task-index",
                        i,
                    ),
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for i in range(num_tasks)
            ]
            assert all(p.wait() == 0 for p in procs), "a task failed"
            merge_start = time.perf_counter()
            run(
                prepare_cmd(
                    files, out, tokenizer, shard_chars, "--num-tasks", num_tasks, "--merge"
                ),
                env,
            )
            end = time.perf_counter()
            assert Manifest.load(out / "train").content_sha256 == ref_hash, "differs from single"
            rows.append(
                (
                    copies,
                    tokens,
                    f"{num_tasks} tasks + merge",
                    min(num_tasks, cores),
                    end - start,
                    children_cpu_s() - cpu,
                    end - merge_start,
                )
            )

    lines = [
        f"machine: {platform.machine()} {cores} cores ({platform.processor() or 'cpu'}), "
        f"python {platform.python_version()}, date {time.strftime('%Y-%m-%d')}",
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
