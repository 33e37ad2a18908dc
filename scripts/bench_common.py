"""What the benchmark scripts share: where a number was measured, how, and the report.

Why one module: a benchmark's number is only worth the machine, versions and command that
reproduce it, so every report opens with the same head (`report_head`, `report_header`)
and is written the same way (`write_report`: JSON for tools, markdown for docs/bench/).
A steady rate is taken one way everywhere (`rate`: one warm call, then as many calls as
fit a fixed window; `timed` for one call), multi-process runs are launched one way
(`torchrun`: the real `torchrun -m train` entry point, or a script's own ranks, with the
log kept for the error), and a previous design is measured from git itself (`source_at`),
never from a copy kept in the tree. The data most of them read is the embedded corpus
(`shakespeare`), in a folder kept only when the command names one (`work_dir`), through
the real loader (`token_loader`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


STACK = ("torch", "torchtitan", "torchao")  # the training stack's packages


def versions(packages: tuple[str, ...] = STACK) -> dict[str, str]:
    from importlib.metadata import version

    return {"python": platform.python_version()} | {p: version(p) for p in packages}


def versions_line(found: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in found.items())


def report_head(name: str, script: str, raw_argv: list[str], packages=STACK) -> dict:
    """The fields every report opens with: what ran, where, when (the versions of
    `packages`, by default the training stack's)."""
    return {
        "name": name,
        "device": device_name(),
        "versions": versions(packages),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["python", f"scripts/{script}", *raw_argv]),
    }


def report_header(report: dict, title: str) -> list[str]:
    """The markdown head of `report_head`'s reports (and the config they trained)."""
    lines = [
        f"# {title}",
        "",
        f"- device: {report['device']}",
        f"- versions: {versions_line(report['versions'])}",
        f"- date: {report['date']}",
    ]
    if "config" in report:
        lines.append(f"- config: `{report['config']}` + `{' '.join(report['overrides'])}`")
    return lines


def write_report(stem: Path, report: dict, markdown: str, data: Path | None = None) -> None:
    """STEM.json and STEM.md, atomically, the markdown printed too; `data`'s absolute path
    reads DATA in both (the report describes the command, not this machine's folders)."""
    from common.io import write_text_atomic

    text = json.dumps(report, indent=2) + "\n"
    if data is not None:
        text, markdown = (t.replace(str(data.resolve()), "DATA") for t in (text, markdown))
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(stem.with_name(stem.name + ".json"), text)
    write_text_atomic(stem.with_name(stem.name + ".md"), markdown)
    print(markdown, flush=True)


def parse_known(parser: argparse.ArgumentParser, argv: list[str]):
    """(args, the trailing run-config overrides), the `--` before them dropped."""
    args, extra = parser.parse_known_args(argv)
    return args, extra[1:] if extra[:1] == ["--"] else extra


def cli(parser: argparse.ArgumentParser, bench: Callable, argv: list[str] | None, overrides=True):
    """`bench(args, overrides, argv)` on `argv` parsed (with `overrides`, the run-config
    overrides after the known options: `parse_known`); a user error is one line and a
    non-zero exit."""
    from common.io import run_cli

    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse_known(parser, argv) if overrides else (parser.parse_args(argv), [])
    return run_cli(lambda: bench(args, extra, argv))


def data_overrides(data: Path) -> list[str]:
    """Point a config at a prepared DATA dir (dataloader.prepare output)."""
    data = data.resolve()
    for sub in ("tokenizer", "train"):
        if not (data / sub).is_dir():
            raise ValueError(f"--data {data}: no {sub}/ inside; give a dataloader.prepare output")
    return [
        "--dataloader.tokenizer",
        json.dumps(str(data / "tokenizer")),
        "--set",
        f"dataloader.mix=[{{path={json.dumps(str(data / 'train'))}}}]",
    ]


def measuring(steps: int, log_freq: int = 1) -> list[str]:
    """The run-config overrides of a measuring run: `steps` steps, metrics every `log_freq`,
    no checkpoint and no validation (not per-step costs)."""
    return [
        f"--training.steps={steps}",
        f"--metrics.log_freq={log_freq}",
        "--checkpoint.enable=false",
        "--validation.enable=false",
    ]


def torchrun(nproc: int, program: list[str], log: Path, timeout: float | None) -> str:
    """`torchrun PROGRAM` on this machine (`["-m", "train", ...]`: the training entry
    point), its output in `log`. A failed run raises with the log's tail. Returns the
    command as a report shows it: no machine paths (`python` for the interpreter, WORK
    for the log's folder, where the runs write)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", *program]
    print(f"[bench] {shlex.join(cmd)}", flush=True)
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"torchrun exited {proc.returncode}:\n{tail}")
    return shlex.join(["python", *cmd[1:]]).replace(str(log.parent), "WORK")


def rate(call: Callable[[], object], seconds: float, warm: bool = True) -> tuple[int, float]:
    """(calls, elapsed seconds) of `call` repeated for `seconds` after one warm call (the
    page cache, an epoch's permutation); a StopIteration (an epoch's end) ends it early."""
    if warm:
        call()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        try:
            call()
        except StopIteration:
            break
        count += 1
    return count, time.perf_counter() - start


def timed(call: Callable[..., object], *args, **kwargs) -> tuple[object, float]:
    """(what `call(*args, **kwargs)` returns, the seconds it took)."""
    start = time.perf_counter()
    result = call(*args, **kwargs)
    return result, time.perf_counter() - start


@contextlib.contextmanager
def work_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """`given` (created, kept: a later run reuses what is there), or a temporary folder
    removed after."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def shakespeare(out: Path, **config) -> Path:
    """`out`: the embedded Shakespeare corpus prepared with a freshly trained 2048-token BPE
    on one worker (`config`: other `PrepareConfig` fields); kept if already there."""
    from dataloader.prepare import PrepareConfig, prepare

    if not (out / "train" / "manifest.json").is_file():
        config = {"train_tokenizer": 2048, "num_workers": 1, "progress": False} | config
        prepare(PrepareConfig(inputs=["shakespeare"], out=out, **config))
    return out


def token_loader(
    path: Path,
    seq_len: int = 2048,
    batch: int = 8,
    world: int = 1,
    rank: int = 0,
    module: types.ModuleType | None = None,
    **config,
):
    """Our loader (`module`: another design's) over one prepared split (seed 0 unless
    `config` says otherwise)."""
    from dataloader import loader

    m = module or loader
    config = {"seed": 0} | config
    return m.TokenShardDataLoader.Config(mix=[m.MixEntry(str(path))], **config).build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=seq_len, local_batch_size=batch
    )


def source_at(rev: str, path: str) -> str:
    """`path` as it was at git revision `rev` (the design a benchmark compares against)."""
    cmd = ["git", "-C", str(REPO), "show", f"{rev}:{path}"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
